"""MiniMax-M2 (HF `minimax_m2`): full-width q/k norms split by heads over TP, partial rotary, Mixtral-style MoE
names (block_sparse_moe, w1/w3/w2) with e_score_correction_bias, no shared experts.

Names: what transformers 5.23.0 saves (conversion_mapping.py "minimax_m2": mixtral's w1/w2/w3 + block_sparse_moe,
and block_sparse_moe.e_score_correction_bias), the published MiniMaxAI/MiniMax-M2 checkpoint's names. The
published checkpoint also holds MTP modules (use_mtp, num_mtp_modules=3) that transformers does not build: not mapped."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register
from mcore2hf.layouts.ops import Column

from .common import block_sparse_moe, embeddings, fp8_policy, gqa_attention

MINIMAX_M2 = register(Converter(
    model_type="minimax_m2",
    spec="mcore2hf.model_specs.minimax_m2",
    rules=embeddings() + gqa_attention(qk_norm=Column) + block_sparse_moe(expert_bias=True),
    # MiniMax-M2's published config.json: quantization_config fp8, weight_block_size [128, 128],
    # modules_to_not_convert ["gate", "e_score_correction_bias", "lm_head"] (router gates and lm_head stay bf16)
    fp8=fp8_policy(block_sparse_moe=True,
                   source="MiniMax-M2 published FP8 checkpoint (gate, e_score_correction_bias, lm_head unquantized)"),
))
