"""Built-in converters: importing this package registers every architecture."""

from . import deepseek_v3, glm4_moe, gpt_oss, llama, qwen2, qwen3, qwen3_moe  # noqa: F401
