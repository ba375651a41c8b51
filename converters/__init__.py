"""Built-in converters: importing this package registers every architecture."""

from . import deepseek_v3, glm4_moe, llama, minimax_m2, olmoe, qwen2, qwen3, qwen3_moe  # noqa: F401
