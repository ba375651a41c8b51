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
from .common import TextOf
from .qwen3_vl_vision import vision_dims, wrap_native


class _MoeTextConfig:
    """A Qwen3.5-MoE text config as Qwen3-Next's spec reads it (every other field is the config's own)."""

    norm_topk_prob = True

    def __init__(self, cfg):
        self._cfg = cfg
        self.intermediate_size = cfg.moe_intermediate_size

    def __getattr__(self, name: str):
        return getattr(self._cfg, name)


class Qwen35(TextOf):
    """Qwen3-Next's spec on the text config (a Qwen3.5-MoE one as `_MoeTextConfig`), with the vision tower's heads,
    head dim and merger width in its dims (a native tower's ops need them)."""

    hf_architecture = "Qwen3_5ForConditionalGeneration"
    #: `build_model(..., vision_tower="native")`: Bridge 0.6.2's Qwen3.5-VL tower (qwen35_vl_provider.py:504-520
    #: builds the same Qwen3VLVisionModel, without deepstack mergers) around the language model
    native_vision_tower = staticmethod(wrap_native)

    def view(self, cfg):
        text = text_config(cfg)
        return _MoeTextConfig(text) if self.text.experts(text) else text

    def dims(self, cfg):
        base = super().dims(cfg)
        vision = getattr(cfg, "vision_config", None)
        return base if vision is None else dataclasses.replace(base, **vision_dims(vision))


SPEC = Qwen35(qwen3_next.SPEC)
