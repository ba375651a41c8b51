"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (HF `glm4_moe`): dense first layers, shared experts, expert bias, q/k/v bias,
q/k norms, MTP layers (with the embedding and head copies the published checkpoints keep in layer N)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import glm4_moe as spec

from .common import SEVEN_WORLDS, dense_mlp, embeddings, fp8_policy, gqa_attention, moe, mtp

GLM4_MOE = Converter(
    model_type="glm4_moe",
    spec=spec.SPEC,
    rules=embeddings(mtp_copies=True) + gqa_attention() + dense_mlp()
    + moe(shared_experts=True, expert_bias=True) + mtp(),
    fp8=fp8_policy(mtp=True, source="GLM-4.5-FP8's unquantized tensors (that checkpoint is per-channel "
                   "compressed-tensors) but shared_head.head, bf16 as in DeepSeek-V3; router gates listed for vLLM"),
)

# dense first layer, shared expert, sigmoid routing over 2 groups (top-2 per group), q/k/v bias, q/k norm,
# partial rotary, one MTP layer
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
    num_nextn_predict_layers=1, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
register(Architecture(GLM4_MOE, tiny=TINY, verified=SEVEN_WORLDS))
