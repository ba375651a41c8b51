"""GLM-4.7-Flash (HF `glm4_moe_lite`): DeepSeek-V3's tensor format (multi-latent attention, dense first layers,
shared experts, expert bias, MTP layers with the embedding and head copies)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import fp8_policy
from .deepseek_v3 import DEEPSEEK_V3

GLM4_MOE_LITE = register(Converter(
    model_type="glm4_moe_lite",
    spec="mcore2hf.model_specs.glm4_moe_lite",
    rules=DEEPSEEK_V3.rules,
    fp8=fp8_policy(mtp=True, source="no published block-FP8 checkpoint: the DeepSeek-V3 table"),
))
