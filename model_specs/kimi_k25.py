"""Kimi-K2.5 (HF `kimi_k25`: Kimi_K25ForConditionalGeneration), the language model: the config's `text_config`, a
DeepseekV3Config (transformers 5.24 models/kimi_k25/configuration_kimi_k25.py) <-> DeepSeek-V3's
MLATransformerConfig (model_specs/deepseek_v3.py)."""

from __future__ import annotations

from . import deepseek_v3
from .common import multimodal, spec_builder

HF_ARCHITECTURE = "Kimi_K25ForConditionalGeneration"

_TEXT = multimodal(deepseek_v3)
dims, is_moe_layer, transformer_config = _TEXT["dims"], _TEXT["is_moe_layer"], _TEXT["transformer_config"]
structural_fields, gpt_kwargs, layer_spec = _TEXT["structural_fields"], _TEXT["gpt_kwargs"], _TEXT["layer_spec"]
build_model = spec_builder(__name__)
