"""GLM-4.7-Flash (HF `glm4_moe_lite`): DeepSeek-V3's tensor format (multi-latent attention, dense first layers,
shared experts, expert bias, MTP layers with the embedding and head copies)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import glm4_moe_lite as spec

from .common import THREE_WORLDS, fp8_policy
from .deepseek_v3 import DEEPSEEK_V3

GLM4_MOE_LITE = Converter(
    model_type="glm4_moe_lite",
    spec=spec.SPEC,
    rules=DEEPSEEK_V3.rules,
    fp8=fp8_policy(mtp=True, source="no published block-FP8 checkpoint: the DeepSeek-V3 table"),
)

# GLM-4.7-Flash scaled down (its values are transformers 5.23's Glm4MoeLiteConfig defaults: MLA with
# v_head_dim > qk_nope_head_dim, rms_norm_eps 1e-5, n_group 1, routed_scaling_factor 1.8, the first layer
# dense via mlp_layer_types), with one MTP layer as published (num_nextn_predict_layers 1)
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32,
    # kv_b_proj has 4 x (12 + 20) = 128 rows: transformers' FP8 loader dequantizes only weights of whole
    # 128-blocks or smaller than 128 (see README), and the FP8 test loads this model
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_nextn_predict_layers=1, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    max_position_embeddings=256, attention_bias=False, tie_word_embeddings=False,
)
register(Architecture(GLM4_MOE_LITE, tiny=TINY, verified=THREE_WORLDS))
