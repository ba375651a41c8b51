"""GLM-4.5V (HF `glm4v_moe`: Glm4vMoeForConditionalGeneration): GLM-4.5's language model (dense first layers,
shared experts, expert bias, q/k/v biases, no q/k norm) under `model.language_model.`, experts in checkpoint format
(`mlp.experts.{E}.gate_proj.weight`: transformers 5.24 conversion_mapping.py maps glm4v_moe to qwen2_moe's expert
fusion), `lm_head.weight` at the top, the vision tower under `model.visual.` (models/glm4v_moe/modeling_glm4v_moe.py).

Megatron-Bridge 0.3.1's GLM45VModel (models/glm_vl/modeling_glm_45v.py) embeds transformers' Glm4vVisionModel at
`visual` beside `language_model` (its bridge maps `visual.**` -> `model.visual.**`): passed through (`hf_tower`).
Without a tower in the Megatron model, `model.visual.*` is declared not held (docs/vlm.md)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import (
    VLM_FP8_SOURCE,
    dense_mlp,
    embeddings,
    fp8_policy,
    gqa_attention,
    hf_tower,
    language_model,
    moe,
)

GLM4V_MOE = register(Converter(
    model_type="glm4v_moe",
    spec="mcore2hf.model_specs.glm4v_moe",
    rules=language_model(embeddings() + gqa_attention() + dense_mlp() + moe(shared_experts=True, expert_bias=True))
    + hf_tower("visual", "model.visual"),
    not_held=(r"model\.visual\..*",),
    fp8=fp8_policy(source=VLM_FP8_SOURCE, tower=("model.visual.",)),
))
