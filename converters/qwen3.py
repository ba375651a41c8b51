"""Qwen3 (HF `qwen3`): q/k norms, no biases."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import qwen3 as spec

from .common import SEVEN_WORLDS, fp8_policy, llama_like

QWEN3 = Converter(model_type="qwen3", spec=spec.SPEC, rules=llama_like(),
                           fp8=fp8_policy(source="Qwen3-*-FP8 checkpoints"))

TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
register(Architecture(QWEN3, tiny=TINY, verified=SEVEN_WORLDS))
