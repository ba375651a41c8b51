"""DeepSeek-V2 / V2-Lite (HF `deepseek_v2`): multi-latent attention (V2-Lite: q_proj, no q_lora_rank), dense
first layers, shared experts; no expert bias, no MTP layers."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import deepseek_v2 as spec

from .common import THREE_WORLDS, dense_mlp, embeddings, fp8_policy, mla_attention, moe

DEEPSEEK_V2 = Converter(
    model_type="deepseek_v2",
    spec=spec.SPEC,
    rules=embeddings() + mla_attention() + dense_mlp() + moe(shared_experts=True),
    fp8=fp8_policy(source="no published block-FP8 checkpoint: the DeepSeek-V3 table"),
)

# DeepSeek-V2-Lite scaled down (its published config.json: q_lora_rank null, softmax "greedy" routing without
# renormalization, 2 shared experts, yarn rope factor 40, mscale 0.707); routed_scaling_factor 2.5 (published 1.0;
# DeepSeek-V2 16.0) so the parity test sees the factor
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
    first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0},
)
register(Architecture(DEEPSEEK_V2, tiny=TINY, verified=THREE_WORLDS))
