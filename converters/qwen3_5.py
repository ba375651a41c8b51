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
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.layouts.gdn import ColumnParts, GatedQKV
from mcore2hf.model_specs import qwen3_5 as spec

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


QWEN3_5 = Converter(
    model_type="qwen3_5",
    spec=spec.SPEC,
    rules=language_model(embeddings() + gqa_attention(qkv=GatedQKV) + gated_delta_net() + dense_mlp())
    + native_vision_tower(deepstack=False) + hf_tower("vision_model", "model.visual"),
    not_held=NOT_HELD,
)

# Qwen3.5 (Qwen/Qwen3.5-27B, -35B-A3B config.json layout): a multimodal config whose text_config is the language
# model mcore2hf converts; the small vision tower makes the tiny checkpoint a real base for `save_pretrained(base=)`.
# 4 layers, full attention every 2nd (published: every 4th), so PP2 stages both hold both layer kinds.
TINY_TEXT = dict(
    vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, full_attention_interval=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   num_position_embeddings=16, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)

TINY = dict(text_config=dict(TINY_TEXT, intermediate_size=96), vision_config=TINY_VISION,
            tie_word_embeddings=False)
VERIFIED = ("its own worlds (TP2 x EP2, PP2, TP1 x DP2); logits (and fp32 round-off) = transformers' at "
            'each, completed from the multimodal checkpoint, offline export, engine shards, demo; the '
            'native Megatron tower (TP2 x PP2): bit-identical with the tower, transformers loads it, text + '
            "image logits = transformers'")
register(Architecture(QWEN3_5, tiny=TINY, verified=VERIFIED))
