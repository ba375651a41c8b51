"""DeepSeek-V3 / R1 (HF `deepseek_v3`; Kimi-K2 and Moonlight use the same format): multi-latent attention, dense first layers,
shared experts, expert bias, MTP layers (with the embedding and head copies the published checkpoints keep)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import deepseek_v3 as spec

from .common import SEVEN_WORLDS, dense_mlp, embeddings, fp8_policy, mla_attention, moe, mtp

DEEPSEEK_V3 = Converter(
    model_type="deepseek_v3",
    spec=spec.SPEC,
    # Kimi-K2's config.json says model_type "kimi_k2" (which transformers does not know) with an auto_map to
    # remote code: it is read as a DeepseekV3Config, never by running that code
    aliases=("kimi_k2",),
    rules=embeddings(mtp_copies=True) + mla_attention() + dense_mlp()
    + moe(shared_experts=True, expert_bias=True) + mtp(),
    # deepseek-ai/DeepSeek-V3 README_WEIGHTS.md: quantization_config has exactly activation_scheme, fmt,
    # quant_method, weight_block_size (no modules_to_not_convert)
    fp8=fp8_policy(mtp=True, list_not_converted=False, source="DeepSeek-V3 / Kimi-K2 FP8 checkpoints"),
)

TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, num_nextn_predict_layers=1, max_position_embeddings=256, rms_norm_eps=1e-6,
    rope_scaling=None, tie_word_embeddings=False,
)
register(Architecture(DEEPSEEK_V3, tiny=TINY, verified=SEVEN_WORLDS))
