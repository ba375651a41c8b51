"""Built-in converters: importing this package registers every architecture."""

from . import (  # noqa: F401
    deepseek_v2,
    deepseek_v3,
    deepseek_v32,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    gpt_oss,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    olmoe,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
