"""Qwen3-MoE (HF `qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B. q/k norms, GQA, no shared experts."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import dense_mlp, embeddings, fp8_policy, gqa_attention, moe

QWEN3_MOE = register(Converter(
    model_type="qwen3_moe",
    spec="mcore2hf.model_specs.qwen3_moe",
    # dense_mlp: layers listed in mlp_only_layers / skipped by decoder_sparse_step
    rules=embeddings() + gqa_attention() + moe() + dense_mlp(),
    fp8=fp8_policy(source="Qwen3-*-FP8 checkpoints (modules_to_not_convert: lm_head, router gates)"),
))
