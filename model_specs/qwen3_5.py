"""Qwen3.5 and Qwen3.5-MoE (HF `qwen3_5`, `qwen3_5_moe`), the text model: HF Qwen3_5Config / Qwen3_5MoeConfig
<-> Megatron TransformerConfig + Qwen3-Next's hybrid layer spec (model_specs/qwen3_next.py), built from the nested
`text_config` (transformers 5.23.0 models/qwen3_5{,_moe}/configuration_*.py: Qwen3_5TextConfig has Qwen3-Next's
fields; the vision tower's `vision_config` is not part of the Megatron model).

Differences from Qwen3-Next, read in the 5.23.0 modeling files:
* Qwen3.5-MoE routes every layer through MoE and always renormalizes the top-k probabilities
  (Qwen3_5MoeTopKRouter: `router_top_value /= sum`); its config has no norm_topk_prob / decoder_sparse_step /
  mlp_only_layers, so the text config is read with norm_topk_prob=True, and with no dense layer it has no
  intermediate_size: Megatron's (unused) ffn_hidden_size is read as moe_intermediate_size;
* rope is multimodal (`mrope_section`), which on text tokens (equal t/h/w positions) is the plain partial rope
  Megatron computes."""

from __future__ import annotations

import dataclasses

from mcore2hf.arch.hf_config import text_config

from . import qwen3_next
from .common import spec_builder
from .qwen3_vl_vision import vision_dims, wrap_native

HF_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"


class _MoeTextConfig:
    """A Qwen3.5-MoE text config as Qwen3-Next's spec reads it (every other field is the config's own)."""

    norm_topk_prob = True

    def __init__(self, cfg):
        self._cfg = cfg
        self.intermediate_size = cfg.moe_intermediate_size

    def __getattr__(self, name: str):
        return getattr(self._cfg, name)


def _text(cfg):
    text = text_config(cfg)
    return _MoeTextConfig(text) if qwen3_next.num_experts(text) else text


def dims(cfg):
    """Qwen3-Next's, with the vision tower's heads, head dim and merger width (a native tower's ops need them)."""
    base = qwen3_next.dims(_text(cfg))
    vision = getattr(cfg, "vision_config", None)
    return base if vision is None else dataclasses.replace(base, **vision_dims(vision))


def is_moe_layer(cfg, layer: int) -> bool:
    return qwen3_next.is_moe_layer(_text(cfg), layer)


def transformer_config(cfg, **overrides):
    return qwen3_next.transformer_config(_text(cfg), **overrides)


def structural_fields(cfg) -> dict:
    return qwen3_next.structural_fields(_text(cfg))


def gpt_kwargs(cfg) -> dict:
    return qwen3_next.gpt_kwargs(_text(cfg))


def layer_spec(config, cfg, *, vp_stage=None, use_te=False):
    return qwen3_next.layer_spec(config, _text(cfg), vp_stage=vp_stage, use_te=use_te)


build_model = spec_builder(__name__)
#: `build_model(..., vision_tower="native")`: Bridge 0.6.2's Qwen3.5-VL tower (qwen35_vl_provider.py:504-520 builds
#: the same Qwen3VLVisionModel, without deepstack mergers) around the language model
native_vision_tower = wrap_native
