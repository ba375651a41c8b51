"""Llama (HF `llama`): Llama 2/3 family, optional tied embeddings."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import llama as spec

from .common import SEVEN_WORLDS, fp8_policy, llama_like

LLAMA = Converter(model_type="llama", spec=spec.SPEC, rules=llama_like(),
                           fp8=fp8_policy(source="no published block-FP8 checkpoint: the Qwen3-FP8 table"))

# tied embeddings, as in Llama 3.2 1B/3B
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
register(Architecture(LLAMA, tiny=TINY, verified=SEVEN_WORLDS))
