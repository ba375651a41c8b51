"""Qwen3.5 (HF `qwen3_5`: Qwen3.5-27B and the other dense sizes), the text model: Qwen3-Next's blocks (gated
DeltaNet `linear_attn.*` or gated attention `self_attn.*`, zero-centred norms) with the DeltaNet input projection
as four tensors, `in_proj_qkv` = [q; k; v] (all heads), `in_proj_z`, `in_proj_b`, `in_proj_a`, and every
language-model name under `model.language_model.` (`lm_head.weight` stays at the top).

Names: what transformers 5.23.0 saves for Qwen3_5ForConditionalGeneration, the published checkpoints' class
(models/qwen3_5/modeling_qwen3_5.py: Qwen3_5GatedDeltaNet, Qwen3_5Model.language_model / .visual). The published
checkpoints also hold the vision tower (`model.visual.*`) and MTP weights (`mtp.*`), which a text-only Megatron
model does not have: declared `not_held`, so loading skips them and `save_pretrained(base=...)` copies them from
the base checkpoint. A tower embedded in the Megatron model as transformers' module at `vision_model` (as
Megatron-Bridge 0.3.1 embeds Qwen3-VL's) passes through under `model.visual.` (docs/vlm.md). A native Megatron tower
(Megatron-Bridge 0.6.2's Qwen3.5-VL: qwen35_vl_bridge.py:72-130, Qwen3-VL's tower without deepstack mergers)
exports and loads through `native_vision_tower(deepstack=False)`, ahead of the pass-through. No FP8 table (as
Qwen3-Next)."""

from mcore2hf.arch.mapping import Converter, Rule
from mcore2hf.arch.registry import register
from mcore2hf.layouts.gdn import ColumnParts, GatedQKV

from . import qwen3_next
from .common import HL, L, dense_mlp, embeddings, gqa_attention, hf_tower, language_model, native_vision_tower

#: the vision tower and the MTP module of the published (multimodal) checkpoints
NOT_HELD = (r"model\.visual\..*", r"mtp\..*")


def gated_delta_net() -> list[Rule]:
    """Qwen3-Next's gated DeltaNet rules, with Qwen3.5's separate input projections."""
    a, h = f"{L}.self_attention", f"{HL}.linear_attn"
    in_proj = Rule(f"{a}.in_proj.weight", [f"{h}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")],
                   ColumnParts.gdn_in_proj)
    return [in_proj] + [r for r in qwen3_next.gated_delta_net() if r.megatron != in_proj.megatron]


QWEN3_5 = register(Converter(
    model_type="qwen3_5",
    spec="mcore2hf.model_specs.qwen3_5",
    rules=language_model(embeddings() + gqa_attention(qkv=GatedQKV) + gated_delta_net() + dense_mlp())
    + native_vision_tower(deepstack=False) + hf_tower("vision_model", "model.visual"),
    not_held=NOT_HELD,
))
