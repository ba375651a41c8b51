"""Qwen3 (HF `qwen3`): q/k norms, no biases."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import fp8_policy, llama_like

QWEN3 = register(Converter(model_type="qwen3", spec="mcore2hf.model_specs.qwen3", rules=llama_like(),
                           fp8=fp8_policy(source="Qwen3-*-FP8 checkpoints")))
