"""The architecture layer: what is true of a model whatever its parallel layout. The declarative rule tables
(`mapping`: Megatron name pattern -> HF names + layout op), the registry of architectures, canonical Megatron names
(`naming`), HF configs (`hf_config`), the Megatron model of an architecture (`build`, with the shims megatron-core
needs on a CPU, `cpu_shims`), LoRA adapter tables (`lora`) and `mcore2hf list`'s snapshot of the registry
(`catalog`). The per-architecture tables and specs (`converters/`, `model_specs/`, installed as `mcore2hf.converters`
/ `mcore2hf.model_specs`) belong to this layer too. Imports only the layers below it (layouts, quantize, base);
tests/guards.py checks the order."""
