"""GLM-5 (HF `glm_moe_dsa`): DeepSeek-V3.2's table (GLM-5.2's IndexShare layers simply lack the indexer rows)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import fp8_policy
from .deepseek_v32 import DEEPSEEK_V32

GLM_MOE_DSA = register(Converter(
    model_type="glm_moe_dsa",
    spec="mcore2hf.model_specs.glm_moe_dsa",
    rules=DEEPSEEK_V32.rules,
    fp8=fp8_policy(mtp=True, dsa_indexer=True, source="GLM-5-FP8 checkpoints"),
))
