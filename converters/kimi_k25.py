"""Kimi-K2.5 (HF `kimi_k25`): DeepSeek-V3's language model (Kimi-K2) under the published checkpoints' names,
`language_model.model.*` and `language_model.lm_head.weight`, beside the vision tower `vision_tower.*` and its
projector `mm_projector.*` (transformers 5.24 conversion_mapping.py "kimi_k25": the published names it renames on
load, `language_model.model` -> `model.language_model`, `language_model.lm_head` -> `lm_head`, `vision_tower.*`,
`mm_projector.proj.{0,2}`). Exports use the published names, which transformers' Kimi_K25ForConditionalGeneration
and the engines load. No MTP layers (Kimi-K2's num_nextn_predict_layers is 0).

An HF tower embedded in the Megatron model keeps the published names under `vision_tower` / `mm_projector` (passed
through); without one, both are declared not held (docs/vlm.md)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import (
    VLM_FP8_SOURCE,
    dense_mlp,
    embeddings,
    fp8_policy,
    hf_tower,
    language_model,
    mla_attention,
    moe,
)

KIMI_K25 = register(Converter(
    model_type="kimi_k25",
    spec="mcore2hf.model_specs.kimi_k25",
    rules=language_model(embeddings() + mla_attention() + dense_mlp() + moe(shared_experts=True, expert_bias=True),
                         model="language_model.model.", lm_head="language_model.lm_head.weight")
    + hf_tower("vision_tower", "vision_tower") + hf_tower("mm_projector", "mm_projector"),
    not_held=(r"vision_tower\..*", r"mm_projector\..*"),
    # DeepSeek-V3 / Kimi-K2's block-FP8 format (no modules_to_not_convert), the tower kept
    fp8=fp8_policy(list_not_converted=False, source=VLM_FP8_SOURCE, tower=("vision_tower.", "mm_projector.")),
))
