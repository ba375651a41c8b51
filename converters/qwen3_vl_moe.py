"""Qwen3-VL-MoE (HF `qwen3_vl_moe`: Qwen3VLMoeForConditionalGeneration, Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-MoE's
language model under `model.language_model.` with its experts packed per layer, as the published checkpoints
store them: `mlp.experts.gate_up_proj` [E, hidden, 2 * ffn] ([gate | up] by column) and `mlp.experts.down_proj`
[E, ffn, hidden] (transformers 4.57 Qwen3VLMoeTextExperts; 5.24 keeps them transposed in memory and converts on
load, conversion_mapping.py "qwen3_vl_moe": Transpose(1, 2)). The tower as in Qwen3-VL (converters/qwen3_vl.py)."""

from mcore2hf.arch.mapping import Converter, Rule
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.layouts.ops import GatedTransposed, Replicated, RowTransposed
from mcore2hf.model_specs import qwen3_vl as spec

from .common import (
    HL,
    TINY_QWEN3_VL_VISION,
    TINY_VL_IDS,
    TINY_VL_MOE,
    TINY_VL_MROPE,
    TINY_VL_TEXT,
    L,
    embeddings,
    gqa_attention,
    hf_tower,
    language_model,
    native_vision_tower,
)
from .qwen3_vl import VISUAL

_E, _HE = f"{L}.mlp.experts.{{E}}", f"{HL}.mlp.experts"

QWEN3_VL_MOE = Converter(
    model_type="qwen3_vl_moe",
    spec=spec.SPEC,
    rules=language_model(embeddings() + gqa_attention() + [
        Rule(f"{L}.mlp.router.weight", f"{HL}.mlp.gate.weight", Replicated),
        Rule(f"{_E}.linear_fc1.weight", f"{_HE}.gate_up_proj", GatedTransposed, stack="E"),
        Rule(f"{_E}.linear_fc2.weight", f"{_HE}.down_proj", RowTransposed, stack="E"),
    ]) + native_vision_tower() + hf_tower("vision_model", "model.visual"),
    not_held=VISUAL,
    # no fp8 policy: block-FP8 of the packed [E, hidden, 2 * ffn] experts is a format no engine loads (as gpt-oss)
)

TINY = dict(text_config=dict(TINY_VL_TEXT, rope_parameters=TINY_VL_MROPE, num_experts=12, decoder_sparse_step=1,
                             mlp_only_layers=[], **TINY_VL_MOE),
            vision_config=TINY_QWEN3_VL_VISION, tie_word_embeddings=False, **TINY_VL_IDS)
VERIFIED = ('its own world (TP2 x PP2 x EP2, PP2 x VPP2 x EP2): the language model bit-identical, the tower '
            'completed from the multimodal checkpoint offline and live (once per sync or with the first), '
            'offline export and import, engine shards (its packed experts refused), the dry run, '
            "transformers loads every directory; logits (text tokens) = transformers' at both, demo; the "
            'native Megatron tower (TP2 x PP2): bit-identical with the tower, transformers loads it, text + '
            "image logits = transformers'")
# the published checkpoints' layout: packed experts as [E, hidden, 2 * ffn] / [E, ffn, hidden]; transformers 5.24
# saves them transposed (conversion_mapping.py "qwen3_vl_moe" transposes them on load, with check_dims, not
# back on save)
PUBLISHED_LAYOUT = ((r"\.mlp\.experts\.(gate_up_proj|down_proj)$", "transpose"),)
register(Architecture(QWEN3_VL_MOE, tiny=TINY, verified=VERIFIED, published_layout=PUBLISHED_LAYOUT))
