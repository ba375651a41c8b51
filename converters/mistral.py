"""Mistral (HF `mistral`): the Llama tensor layout."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import mistral as spec

from .common import THREE_WORLDS, fp8_policy, llama_like

MISTRAL = Converter(model_type="mistral", spec=spec.SPEC, rules=llama_like(),
                             fp8=fp8_policy(source="no published block-FP8 checkpoint: the Qwen3-FP8 table"))

# Mistral-7B-v0.3 scaled down: rms_norm_eps 1e-5, rope_theta 1e6, no sliding window
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    sliding_window=None, max_position_embeddings=256, tie_word_embeddings=False,
)
register(Architecture(MISTRAL, tiny=TINY, verified=THREE_WORLDS))
