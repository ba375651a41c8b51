"""OLMoE (HF `olmoe`): full-width q/k norms split by heads over TP, every layer MoE with softmax top-k routing
(Qwen2-MoE-style names: mlp.gate, mlp.experts.{E}.gate_proj / up_proj / down_proj, as transformers 5.23.0 saves)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.layouts.ops import Column
from mcore2hf.model_specs import olmoe as spec

from .common import THREE_WORLDS, embeddings, fp8_policy, gqa_attention, moe

OLMOE = Converter(
    model_type="olmoe",
    spec=spec.SPEC,
    rules=embeddings() + gqa_attention(qk_norm=Column) + moe(),
    fp8=fp8_policy(source="no published block-FP8 checkpoint: the Qwen3-FP8 table (router gates, lm_head bf16)"),
)

# OLMoE-1B-7B's fields, scaled down: full-width q/k norm, MHA, softmax top-k without renormalization
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
    eos_token_id=None,  # the published id exceeds vocab 100
)
register(Architecture(OLMOE, tiny=TINY, verified=THREE_WORLDS))
