"""Qwen3-VL-MoE (HF `qwen3_vl_moe`: Qwen3VLMoeForConditionalGeneration, Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-MoE's
language model under `model.language_model.` with its experts packed per layer, as the published checkpoints
store them: `mlp.experts.gate_up_proj` [E, hidden, 2 * ffn] ([gate | up] by column) and `mlp.experts.down_proj`
[E, ffn, hidden] (transformers 4.57 Qwen3VLMoeTextExperts; 5.24 keeps them transposed in memory and converts on
load, conversion_mapping.py "qwen3_vl_moe": Transpose(1, 2)). The tower as in Qwen3-VL (converters/qwen3_vl.py)."""

from mcore2hf.arch.mapping import Converter, Rule
from mcore2hf.arch.registry import register
from mcore2hf.layouts.ops import GatedTransposed, Replicated, RowTransposed

from .common import HL, L, embeddings, gqa_attention, hf_tower, language_model, native_vision_tower
from .qwen3_vl import VISUAL

_E, _HE = f"{L}.mlp.experts.{{E}}", f"{HL}.mlp.experts"

QWEN3_VL_MOE = register(Converter(
    model_type="qwen3_vl_moe",
    spec="mcore2hf.model_specs.qwen3_vl",
    rules=language_model(embeddings() + gqa_attention() + [
        Rule(f"{L}.mlp.router.weight", f"{HL}.mlp.gate.weight", Replicated),
        Rule(f"{_E}.linear_fc1.weight", f"{_HE}.gate_up_proj", GatedTransposed, stack="E"),
        Rule(f"{_E}.linear_fc2.weight", f"{_HE}.down_proj", RowTransposed, stack="E"),
    ]) + native_vision_tower() + hf_tower("vision_model", "model.visual"),
    not_held=VISUAL,
    # no fp8 policy: block-FP8 of the packed [E, hidden, 2 * ffn] experts is a format no engine loads (as gpt-oss)
))
