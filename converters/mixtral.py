"""Mixtral (HF `mixtral`): GQA attention, every layer MoE. Checkpoints name the MoE block `block_sparse_moe` and
the experts' gate / up / down projections w1 / w3 / w2 (transformers 5.23 conversion_mapping.py, "mixtral",
renames them only in memory; save_pretrained writes these names)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import block_sparse_moe, embeddings, fp8_policy, gqa_attention

MIXTRAL = register(Converter(
    model_type="mixtral",
    spec="mcore2hf.model_specs.mixtral",
    rules=embeddings() + gqa_attention() + block_sparse_moe(),
    fp8=fp8_policy(block_sparse_moe=True,
                   source="no published block-FP8 checkpoint: the Qwen3-FP8 table, with Mixtral's router name"),
))
