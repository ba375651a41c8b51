"""Mixtral (HF `mixtral`): GQA attention, every layer MoE. Checkpoints name the MoE block `block_sparse_moe` and
the experts' gate / up / down projections w1 / w3 / w2 (transformers 5.23 conversion_mapping.py, "mixtral",
renames them only in memory; save_pretrained writes these names)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import mixtral as spec

from .common import THREE_WORLDS, block_sparse_moe, embeddings, fp8_policy, gqa_attention

MIXTRAL = Converter(
    model_type="mixtral",
    spec=spec.SPEC,
    rules=embeddings() + gqa_attention() + block_sparse_moe(),
    fp8=fp8_policy(block_sparse_moe=True,
                   source="no published block-FP8 checkpoint: the Qwen3-FP8 table, with Mixtral's router name"),
)

# Mixtral-8x7B scaled down: 8 experts, top-2, rms_norm_eps 1e-5, rope_theta 1e6, no sliding window
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None,
    max_position_embeddings=256, tie_word_embeddings=False,
)
register(Architecture(MIXTRAL, tiny=TINY, verified=THREE_WORLDS))
