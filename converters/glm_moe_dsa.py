"""GLM-5 (HF `glm_moe_dsa`): DeepSeek-V3.2's table (GLM-5.2's IndexShare layers simply lack the indexer rows)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import glm_moe_dsa as spec

from .common import THREE_WORLDS, fp8_policy
from .deepseek_v32 import DEEPSEEK_V32

GLM_MOE_DSA = Converter(
    model_type="glm_moe_dsa",
    spec=spec.SPEC,
    rules=DEEPSEEK_V32.rules,
    fp8=fp8_policy(mtp=True, dsa_indexer=True, source="GLM-5-FP8 checkpoints"),
)

# GLM-5 scaled down (transformers 5.24 GlmMoeDsaConfig defaults: v_head_dim > qk_nope_head_dim, rms_norm_eps 1e-5,
# n_group 1, the first layers dense): its indexer applies interleaved rope; 7 indexer heads, index_topk 5
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32,
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    index_n_heads=7, index_head_dim=16, index_topk=5, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=256,
    attention_bias=False, tie_word_embeddings=False,
)
register(Architecture(GLM_MOE_DSA, tiny=TINY, verified=THREE_WORLDS))
