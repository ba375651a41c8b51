"""DeepSeek-V3 / R1 (HF `deepseek_v3`; Kimi-K2 uses the same format): multi-latent attention, dense first layers,
shared experts, expert bias, MTP layers (with the embedding and head copies the published checkpoints keep)."""

from mcore2hf.mapping import Converter
from mcore2hf.registry import register

from .common import dense_mlp, embeddings, mla_attention, moe, mtp

DEEPSEEK_V3 = register(Converter(
    model_type="deepseek_v3",
    spec="mcore2hf.model_specs.deepseek_v3",
    rules=embeddings(mtp_copies=True) + mla_attention() + dense_mlp()
    + moe(shared_experts=True, expert_bias=True) + mtp(),
))
