"""Kimi-K2.5 (HF `kimi_k25`: Kimi_K25ForConditionalGeneration), the language model: the config's `text_config`, a
DeepseekV3Config (transformers 5.24 models/kimi_k25/configuration_kimi_k25.py) <-> DeepSeek-V3's
MLATransformerConfig (model_specs/deepseek_v3.py)."""

from __future__ import annotations

from . import deepseek_v3
from .common import TextOf


class KimiK25(TextOf):
    hf_architecture = "Kimi_K25ForConditionalGeneration"


SPEC = KimiK25(deepseek_v3.SPEC)
