"""DeepSeek-V2 / V2-Lite (HF `deepseek_v2`): multi-latent attention (V2-Lite: q_proj, no q_lora_rank), dense
first layers, shared experts; no expert bias, no MTP layers."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import dense_mlp, embeddings, fp8_policy, mla_attention, moe

DEEPSEEK_V2 = register(Converter(
    model_type="deepseek_v2",
    spec="mcore2hf.model_specs.deepseek_v2",
    rules=embeddings() + mla_attention() + dense_mlp() + moe(shared_experts=True),
    fp8=fp8_policy(source="no published block-FP8 checkpoint: the DeepSeek-V3 table"),
))
