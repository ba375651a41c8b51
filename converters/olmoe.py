"""OLMoE (HF `olmoe`): full-width q/k norms split by heads over TP, every layer MoE with softmax top-k routing
(Qwen2-MoE-style names: mlp.gate, mlp.experts.{E}.gate_proj / up_proj / down_proj, as transformers 5.23.0 saves)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register
from mcore2hf.layouts.ops import Column

from .common import embeddings, fp8_policy, gqa_attention, moe

OLMOE = register(Converter(
    model_type="olmoe",
    spec="mcore2hf.model_specs.olmoe",
    rules=embeddings() + gqa_attention(qk_norm=Column) + moe(),
    fp8=fp8_policy(source="no published block-FP8 checkpoint: the Qwen3-FP8 table (router gates, lm_head bf16)"),
))
