"""GLM-4.5V (HF `glm4v_moe`: Glm4vMoeForConditionalGeneration), the language model: the config's `text_config`
(transformers 5.24 models/glm4v_moe/configuration_glm4v_moe.py Glm4vMoeTextConfig: GLM-4.5's fields, q/k norm
off: it has no use_qk_norm) <-> GLM-4.5's TransformerConfig (model_specs/glm4_moe.py). Its rope is multimodal
(`mrope_section`, partial_rotary_factor 0.5), on text tokens the partial rope built here (see qwen3_vl.py)."""

from __future__ import annotations

from . import glm4_moe
from .common import multimodal, spec_builder

HF_ARCHITECTURE = "Glm4vMoeForConditionalGeneration"

_TEXT = multimodal(glm4_moe, use_qk_norm=False)
dims, is_moe_layer, transformer_config = _TEXT["dims"], _TEXT["is_moe_layer"], _TEXT["transformer_config"]
structural_fields, gpt_kwargs = _TEXT["structural_fields"], _TEXT["gpt_kwargs"]
build_model = spec_builder(__name__)
