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

import dataclasses

from . import qwen3
from .common import TextView, spec_builder
from .qwen3_vl_vision import vision_dims, wrap_native

HF_ARCHITECTURE = "Qwen3VLForConditionalGeneration"


def dims(cfg):
    """Qwen3's, with the vision tower's heads, head dim and merger width (its layout ops need them)."""
    base = qwen3.dims(TextView(cfg))
    vision = getattr(cfg, "vision_config", None)
    return base if vision is None else dataclasses.replace(base, **vision_dims(vision))


def is_moe_layer(cfg, layer: int) -> bool:
    return False


def transformer_config(cfg, **overrides):
    return qwen3.transformer_config(TextView(cfg), **overrides)


def structural_fields(cfg) -> dict:
    return qwen3.structural_fields(TextView(cfg))


def gpt_kwargs(cfg) -> dict:
    return qwen3.gpt_kwargs(TextView(cfg))


build_model = spec_builder(__name__)
#: `build_model(..., vision_tower="native")`: the language-model chunks wrapped with the native Megatron tower
native_vision_tower = wrap_native
