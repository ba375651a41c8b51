"""DeepSeek-V3 / R1 (HF `deepseek_v3`; Kimi-K2 and Moonlight use the same format): multi-latent attention, dense first layers,
shared experts, expert bias, MTP layers (with the embedding and head copies the published checkpoints keep)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import dense_mlp, embeddings, fp8_policy, mla_attention, moe, mtp

DEEPSEEK_V3 = register(Converter(
    model_type="deepseek_v3",
    spec="mcore2hf.model_specs.deepseek_v3",
    # Kimi-K2's config.json says model_type "kimi_k2" (which transformers does not know) with an auto_map to
    # remote code: it is read as a DeepseekV3Config, never by running that code
    aliases=("kimi_k2",),
    rules=embeddings(mtp_copies=True) + mla_attention() + dense_mlp()
    + moe(shared_experts=True, expert_bias=True) + mtp(),
    # deepseek-ai/DeepSeek-V3 README_WEIGHTS.md: quantization_config has exactly activation_scheme, fmt,
    # quant_method, weight_block_size (no modules_to_not_convert)
    fp8=fp8_policy(mtp=True, list_not_converted=False, source="DeepSeek-V3 / Kimi-K2 FP8 checkpoints"),
))
