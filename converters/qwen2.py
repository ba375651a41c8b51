"""Qwen2 (HF `qwen2`): q/k/v biases."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import fp8_policy, llama_like

QWEN2 = register(Converter(model_type="qwen2", spec="mcore2hf.model_specs.qwen2", rules=llama_like(),
                           fp8=fp8_policy(source="no published block-FP8 checkpoint: the Qwen3-FP8 table")))
