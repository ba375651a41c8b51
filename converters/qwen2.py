"""Qwen2 (HF `qwen2`): q/k/v biases."""

from mcore2hf.mapping import Converter
from mcore2hf.registry import register

from .common import llama_like

QWEN2 = register(Converter(model_type="qwen2", spec="mcore2hf.model_specs.qwen2", rules=llama_like()))
