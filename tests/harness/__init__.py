"""Test harnesses (not shipped): the engines' published code on CPU (sglang_real, vllm_real, their wheels), a fake
SGLang engine for GPU runs (bench/gpu_senders.py), megatron-core's Transformer Engine spec as a naming oracle."""
