"""GLM-4.5V (HF `glm4v_moe`: Glm4vMoeForConditionalGeneration), the language model: the config's `text_config`
(transformers 5.24 models/glm4v_moe/configuration_glm4v_moe.py Glm4vMoeTextConfig: GLM-4.5's fields, q/k norm
off: it has no use_qk_norm) <-> GLM-4.5's TransformerConfig (model_specs/glm4_moe.py). Its rope is multimodal
(`mrope_section`, partial_rotary_factor 0.5), on text tokens the partial rope built here (see qwen3_vl.py)."""

from __future__ import annotations

from . import glm4_moe
from .common import TextOf


class Glm4vMoe(TextOf):
    hf_architecture = "Glm4vMoeForConditionalGeneration"


SPEC = Glm4vMoe(glm4_moe.SPEC, use_qk_norm=False)
