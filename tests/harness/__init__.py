"""Test harnesses (not shipped): the engines' published code (sglang_real, vllm_real, their wheels) on CPU, and
on a GPU with real CUDA IPC (bench/gpu_ipc.py, bench/gpu_senders.py); megatron-core's Transformer Engine spec as a
naming oracle."""
