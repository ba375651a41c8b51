"""MiniMax-M2 (HF `minimax_m2`): full-width q/k norms split by heads over TP, partial rotary, Mixtral-style MoE
names (block_sparse_moe, w1/w3/w2) with e_score_correction_bias, no shared experts.

Names: what transformers 5.23.0 saves (conversion_mapping.py "minimax_m2": mixtral's w1/w2/w3 + block_sparse_moe,
and block_sparse_moe.e_score_correction_bias), the published MiniMaxAI/MiniMax-M2 checkpoint's names. The
published checkpoint also holds MTP modules (use_mtp, num_mtp_modules=3) that transformers does not build: not mapped."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.layouts.ops import Column
from mcore2hf.model_specs import minimax_m2 as spec

from .common import SEVEN_WORLDS, block_sparse_moe, embeddings, fp8_policy, gqa_attention

MINIMAX_M2 = Converter(
    model_type="minimax_m2",
    spec=spec.SPEC,
    rules=embeddings() + gqa_attention(qk_norm=Column) + block_sparse_moe(expert_bias=True),
    # MiniMax-M2's published config.json: quantization_config fp8, weight_block_size [128, 128],
    # modules_to_not_convert ["gate", "e_score_correction_bias", "lm_head"] (router gates and lm_head stay bf16)
    fp8=fp8_policy(block_sparse_moe=True,
                   source="MiniMax-M2 published FP8 checkpoint (gate, e_score_correction_bias, lm_head unquantized)"),
)

# MiniMax-M2's published config.json fields, scaled down: full-width q/k norm (q over 4 x 32 = 128 > hidden),
# rotary_dim = head_dim / 2, sigmoid routing with e_score_correction_bias, no shared experts, rope_theta 5e6
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rotary_dim=16, num_local_experts=8, num_experts_per_tok=2,
    rope_theta=5000000, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
    scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer",
    shared_intermediate_size=0, bos_token_id=None, eos_token_id=None,  # the published ids exceed vocab 100
)
register(Architecture(MINIMAX_M2, tiny=TINY, verified=SEVEN_WORLDS))
