"""Qwen3-Next (HF `qwen3_next`: Qwen3-Next-80B-A3B): per layer a gated DeltaNet (`linear_attn.*`) or gated
attention (`self_attn.*`, q_proj packs [q_h; gate_h] per head), MoE with a shared expert and its sigmoid gate.

Names: what transformers 5.23.0 saves (models/qwen3_next/modeling_qwen3_next.py; experts in checkpoint format
`mlp.experts.{E}.{gate,up,down}_proj`). Megatron: megatron-core 0.16.1 GatedDeltaNet (`self_attention.in_proj`,
`conv1d`, `A_log`, `dt_bias`, `out_norm`, `out_proj`) and SharedExpertMLP's `gate_weight`. Every norm but
`linear_attn.norm` is zero-centred on both sides (the same values); `linear_attn.norm` is `ZeroCentered` (+1).
The published checkpoints' MTP tensors (`mtp.*`, which transformers ignores) are not mapped. No FP8 table: the
published FP8 checkpoint's list of unquantized modules was not available to check against."""

from mcore2hf.arch.mapping import Converter, Rule
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.layouts.gdn import ColumnParts, GatedQKV, GDNInProj
from mcore2hf.layouts.ops import Column, Replicated, Row, ZeroCentered
from mcore2hf.model_specs import qwen3_next as spec

from .common import HL, L, dense_mlp, embeddings, glu_mlp, gqa_attention, moe


def gated_delta_net() -> list[Rule]:
    """A gated DeltaNet layer's own tensors (the input / post-attention norms are gqa_attention's rules)."""
    a, h = f"{L}.self_attention", f"{HL}.linear_attn"
    return [
        Rule(f"{a}.in_proj.weight", [f"{h}.in_proj_qkvz.weight", f"{h}.in_proj_ba.weight"], GDNInProj),
        Rule(f"{a}.conv1d.weight", f"{h}.conv1d.weight", ColumnParts.gdn_conv),
        Rule(f"{a}.A_log", f"{h}.A_log", Column),
        Rule(f"{a}.dt_bias", f"{h}.dt_bias", Column),
        Rule(f"{a}.out_norm.weight", f"{h}.norm.weight", ZeroCentered),
        Rule(f"{a}.out_proj.weight", f"{h}.out_proj.weight", Row),
    ]


def gated_shared_expert() -> list[Rule]:
    """Qwen2-MoE-style shared expert (`mlp.shared_expert`, singular) and its sigmoid gate [1, hidden]."""
    return glu_mlp(f"{L}.mlp.shared_experts", f"{HL}.mlp.shared_expert") + [
        Rule(f"{L}.mlp.shared_experts.gate_weight", f"{HL}.mlp.shared_expert_gate.weight", Replicated)]


QWEN3_NEXT = Converter(
    model_type="qwen3_next",
    spec=spec.SPEC,
    # dense_mlp: layers listed in mlp_only_layers / skipped by decoder_sparse_step
    rules=embeddings() + gqa_attention(qkv=GatedQKV) + gated_delta_net() + moe() + gated_shared_expert()
    + dense_mlp(),
    # the published checkpoints' MTP layer (vLLM's qwen3_next_mtp.py loads it): not built by the Megatron spec
    not_held=(r"mtp\..*",),
)

# Qwen3-Next-80B-A3B scaled down: 3 gated DeltaNet layers then 1 gated attention layer (PP2 puts the boundary
# between stages), more value heads than key heads (r = 2) and key / value head dims that differ, so TP2
# splits both head counts and a mix-up of the grouping shows; partial rotary 0.25, gated shared expert
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
VERIFIED = ('its own layout world (TP2 x PP2 x VPP2 x EP2, bf16); logits (and fp32 round-off) = '
            "transformers' at TP1 and TP2 x EP2, import loaded by Megatron, offline export, engine shards, "
            'demo')
register(Architecture(QWEN3_NEXT, tiny=TINY, verified=VERIFIED))
