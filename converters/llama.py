"""Llama (HF `llama`): Llama 2/3 family, optional tied embeddings."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import fp8_policy, llama_like

LLAMA = register(Converter(model_type="llama", spec="mcore2hf.model_specs.llama", rules=llama_like(),
                           fp8=fp8_policy(source="no published block-FP8 checkpoint: the Qwen3-FP8 table")))
