"""Qwen3-VL and Qwen3-VL-MoE (HF `qwen3_vl`, `qwen3_vl_moe`), the language model: the config's `text_config`
(transformers 5.24 models/qwen3_vl{,_moe}/configuration_*.py: Qwen3VLTextConfig has Qwen3's fields,
Qwen3VLMoeTextConfig Qwen3-MoE's; `tie_word_embeddings` on the outer config) <-> Qwen3's / Qwen3-MoE's
TransformerConfig. Qwen3-VL-MoE's router always renormalizes the top-k probabilities (modeling_qwen3_vl_moe.py
Qwen3VLMoeTextTopKRouter: `router_top_value /= sum`; its config has no norm_topk_prob): read with
norm_topk_prob=True.

Rope: Qwen3-VL's is interleaved multimodal rope (modeling_qwen3_vl.py Qwen3VLTextRotaryEmbedding,
`apply_interleaved_mrope` over `mrope_section`). megatron-core 0.16.1's `position_embedding_type="mrope"`
(models/common/embeddings/rotary_pos_embedding.py MultimodalRotaryEmbedding) takes contiguous sections, Qwen2-VL's
layout, which differs on image tokens; Megatron-Bridge builds Qwen3-VL's with its own Qwen3VLGPTModel
(tests/harness/bridge_vlm.py runs it). On text tokens (equal t/h/w positions) every variant is the plain rope built
here; rope has no weights, so the names and tensors are the same whichever the trainer uses."""

from __future__ import annotations

import dataclasses

from . import qwen3, qwen3_moe
from .common import ModelSpec, TextOf, TextView
from .qwen3_vl_vision import vision_dims, wrap_native


class Qwen3VL(TextOf):
    """Qwen3's spec (Qwen3-VL-MoE: Qwen3-MoE's, read with norm_topk_prob=True) on the text config, with the vision
    tower's heads, head dim and merger width in its dims (its layout ops need them)."""

    hf_architecture = "Qwen3VLForConditionalGeneration"
    #: `build_model(..., vision_tower="native")`: the language-model chunks wrapped with the native Megatron tower
    native_vision_tower = staticmethod(wrap_native)

    def text_spec(self, cfg) -> ModelSpec:
        return qwen3_moe.SPEC if cfg.model_type == "qwen3_vl_moe" else qwen3.SPEC

    def view(self, cfg):
        if cfg.model_type == "qwen3_vl_moe":
            return TextView(cfg, norm_topk_prob=True)
        return super().view(cfg)

    def dims(self, cfg):
        base = super().dims(cfg)
        vision = getattr(cfg, "vision_config", None)
        return base if vision is None else dataclasses.replace(base, **vision_dims(vision))


SPEC = Qwen3VL(qwen3.SPEC)
