"""The architecture layer: what is true of a model whatever its parallel layout. The declarative rule tables
(`mapping`: Megatron name pattern -> HF names + layout op), the registry of architectures, canonical Megatron names
(`naming`), HF configs (`hf_config`), the Megatron model of an architecture (`build`) and LoRA adapter tables
(`lora`). The per-architecture tables and specs (`converters/`, `model_specs/`, installed as
`mcore2hf.converters` / `mcore2hf.model_specs`) belong to this layer too. Imports only the layers below it
(layouts, quantize, base); tests/guards.py checks the order."""
