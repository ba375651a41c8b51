"""Qwen3-VL (HF `qwen3_vl`), the language model: HF Qwen3VLConfig.text_config (transformers 5.24
models/qwen3_vl/configuration_qwen3_vl.py Qwen3VLTextConfig: Qwen3's fields, `tie_word_embeddings` on the outer
config) <-> Qwen3's TransformerConfig (q/k norms, GQA).

Rope: Qwen3-VL's is interleaved multimodal rope (modeling_qwen3_vl.py Qwen3VLTextRotaryEmbedding,
`apply_interleaved_mrope` over `mrope_section`). megatron-core 0.16.1's `position_embedding_type="mrope"`
(models/common/embeddings/rotary_pos_embedding.py MultimodalRotaryEmbedding) takes contiguous sections, Qwen2-VL's
layout, which differs on image tokens; Megatron-Bridge builds Qwen3-VL's with its own Qwen3VLGPTModel. On text
tokens (equal t/h/w positions) every variant is the plain rope built here; rope has no weights, so the names and
tensors are the same whichever the trainer uses."""

from __future__ import annotations

from . import qwen3
from .common import TextView, spec_builder

HF_ARCHITECTURE = "Qwen3VLForConditionalGeneration"


def dims(cfg):
    return qwen3.dims(TextView(cfg))


def is_moe_layer(cfg, layer: int) -> bool:
    return False


def transformer_config(cfg, **overrides):
    return qwen3.transformer_config(TextView(cfg), **overrides)


def structural_fields(cfg) -> dict:
    return qwen3.structural_fields(TextView(cfg))


def gpt_kwargs(cfg) -> dict:
    return qwen3.gpt_kwargs(TextView(cfg))


build_model = spec_builder(__name__)
