"""What `mcore2hf demo` and `mcore2hf plan` run: real megatron-core models on CPU in gloo worker worlds (the world
runner, which applies `arch.cpu_shims`, tiny HF models from configs, the Megatron forward at any layout, Transformer
Engine's parameter names on a local-spec model). The test suite builds on the same modules (tests/harness holds what
only the tests need)."""
