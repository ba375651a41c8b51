"""Qwen3-MoE (HF `qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B. q/k norms, GQA, no shared experts."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import qwen3_moe as spec

from .common import SEVEN_WORLDS, dense_mlp, embeddings, fp8_policy, gqa_attention, moe

QWEN3_MOE = Converter(
    model_type="qwen3_moe",
    spec=spec.SPEC,
    # dense_mlp: layers listed in mlp_only_layers / skipped by decoder_sparse_step
    rules=embeddings() + gqa_attention() + moe() + dense_mlp(),
    fp8=fp8_policy(source="Qwen3-*-FP8 checkpoints (modules_to_not_convert: lm_head, router gates)"),
)

# vocab 100 (Megatron pads it), 4 layers so PP2 x VPP2 has a layer per chunk, 8 experts for EP4
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)
register(Architecture(QWEN3_MOE, tiny=TINY, verified=SEVEN_WORLDS))
