"""Mistral (HF `mistral`): the Llama tensor layout."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import fp8_policy, llama_like

MISTRAL = register(Converter(model_type="mistral", spec="mcore2hf.model_specs.mistral", rules=llama_like(),
                             fp8=fp8_policy(source="no published block-FP8 checkpoint: the Qwen3-FP8 table")))
