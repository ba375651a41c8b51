"""gpt-oss's stacked experts as layout ops: each op against an independent reference written with loops over
transformers 5.23's definition (gate = gate_up[..., ::2], up = gate_up[..., 1::2]; x @ gate_up_proj[e],
x @ down_proj[e]), and its exact inverse, at every expert-TP shard count; Stacked items into one output."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore2hf.errors import ShapeMismatchError
from mcore2hf.layouts.ops import GatedInterleaved, GatedTransposed, Replicated, RowTransposed
from mcore2hf.layouts.stacked import Stacked

g = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=g)


def interleave_ref(gate, up):
    """HF gate_up_proj[e] ([hidden, 2f]) from Megatron's gate [f, hidden] and up [f, hidden], column by column."""
    f, h = gate.shape
    out = torch.empty(h, 2 * f)
    for r in range(f):
        out[:, 2 * r] = gate[r]
        out[:, 2 * r + 1] = up[r]
    return out


def glu_shards(gate, up, etp):
    """Megatron's fc1 split over expert-TP: shard i = [gate_i; up_i]."""
    return [torch.cat([gc, uc]) for gc, uc in zip(gate.chunk(etp, 0), up.chunk(etp, 0))]


def roundtrip(op, shards, hf):
    full = list(shards[0].shape)
    if op.tp_dim is not None and len(shards) > 1:
        full[op.tp_dim] *= len(shards)
    (out,) = op.hf_tensors(shards)
    assert out.shape == hf.shape and torch.equal(out, hf)
    for i, s in enumerate(shards):
        assert torch.equal(op.shard_from_hf([hf], i, len(shards), tuple(full)), s)


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_gated_interleaved_weight_gate8_up8_h6_to_6x16(etp):
    gate, up = rand(8, 6), rand(8, 6)
    roundtrip(GatedInterleaved(), glu_shards(gate, up, etp), interleave_ref(gate, up))


def chunked_ref(gate, up):
    """Qwen3-VL-MoE's published gate_up_proj[e] ([hidden, 2f]: gate columns then up columns; transformers 4.57
    Qwen3VLMoeTextExperts `gate, up = (x @ gate_up_proj[e]).chunk(2, dim=-1)`), with loops."""
    f, h = gate.shape
    out = torch.empty(h, 2 * f)
    for r in range(f):
        out[:, r] = gate[r]
        out[:, f + r] = up[r]
    return out


@pytest.mark.parametrize("etp", [1, 3])
def test_gated_transposed_weight_gate9_up9_h7_to_7x18(etp):
    gate, up = rand(9, 7), rand(9, 7)
    roundtrip(GatedTransposed(), glu_shards(gate, up, etp), chunked_ref(gate, up))
    with pytest.raises(ShapeMismatchError):
        GatedTransposed().hf_shapes((9, 7))


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_gated_interleaved_bias_gate8_up8_to_16(etp):
    gate, up = rand(8), rand(8)
    ref = torch.stack([gate, up], dim=1).reshape(16)  # [g0, u0, g1, u1, ...]
    roundtrip(GatedInterleaved(), glu_shards(gate, up, etp), ref)


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_row_transposed_down_h6_f8_to_8x6(etp):
    w = rand(6, 8)  # Megatron fc2 [hidden, ffn]
    ref = torch.empty(8, 6)
    for i in range(8):
        for j in range(6):
            ref[i, j] = w[j, i]
    roundtrip(RowTransposed(), list(w.chunk(etp, 1)), ref)


def test_gated_interleaved_matches_the_hf_forward_x_at_gate_up_h6_f8():
    """x @ gate_up_proj[e] split as HF splits it equals Megatron's gate and up projections."""
    gate, up, x = rand(8, 6), rand(8, 6), rand(3, 6)
    (hf,) = GatedInterleaved().hf_tensors(glu_shards(gate, up, 2))
    y = x @ hf
    assert torch.allclose(y[..., ::2], x @ gate.t()) and torch.allclose(y[..., 1::2], x @ up.t())


CASES = [(GatedInterleaved(), (16, 6), 0, 1), (GatedInterleaved(), (16, 6), 0, 2), (RowTransposed(), (6, 8), 1, 1),
         (RowTransposed(), (6, 8), 1, 2), (Replicated(), (6,), None, 1)]


@pytest.mark.parametrize("inner,shape,shard_dim,etp", CASES,
                         ids=["fc1_16x6_etp1", "fc1_16x6_etp2", "fc2_6x8_etp1", "fc2_6x8_etp2", "bias_6"])
def test_stacked_items_E3_write_one_output_and_read_back(inner, shape, shard_dim, etp):
    """Three pieces each write item e of one [3, ...] output (what the planner does with a layer's experts), and
    each piece's shards are read back from the stacked tensor."""
    experts = [rand(*shape) for _ in range(3)]
    if isinstance(inner, GatedInterleaved):
        shards = [glu_shards(w[:8], w[8:], etp) for w in experts]
    else:
        shards = [list(w.chunk(etp, shard_dim)) if shard_dim is not None else [w] for w in experts]
    items = [inner.hf_tensors(s)[0] for s in shards]
    out = torch.full((3, *items[0].shape), float("nan"))
    for e, s in enumerate(shards):
        Stacked(inner, e, 3).to_hf(s, [out])
    assert torch.equal(out, torch.stack(items))
    assert Stacked(inner, 0, 3).hf_shapes(shape) == [(3, *items[0].shape)]
    for e, s in enumerate(shards):
        for i, shard in enumerate(s):
            assert torch.equal(Stacked(inner, e, 3).shard_from_hf([out], i, len(s), shape), shard)


def test_stacked_reads_only_its_item_from_safetensors_slices_E4_fc1_16x6_etp2(tmp_path):
    gate_up = rand(4, 6, 16)
    save_file({"w": gate_up}, tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        sl = f.get_slice("w")
        for e in range(4):
            for i in range(2):
                shard = Stacked(GatedInterleaved(), e, 4).shard_from_hf([sl], i, 2, (16, 6))
                ref = GatedInterleaved().shard_from_hf([gate_up[e]], i, 2, (16, 6))
                assert torch.equal(shard, ref)


def test_stacked_rejects_an_item_outside_the_stack():
    with pytest.raises(ShapeMismatchError, match="expected 0 <= index < 4"):
        Stacked(Replicated(), 4, 4)


def test_gated_interleaved_rejects_odd_rows():
    with pytest.raises(ShapeMismatchError, match="even"):
        GatedInterleaved().hf_shapes((15, 6))


@pytest.mark.parametrize("etp", [1, 2])
def test_peft_stacked_lora_factors_E3_r2(etp):
    """PEFT's 3-D expert LoRA factors (peft 0.21.2 tuners/lora/layer.py:2534-2535): A rows expert-major
    (`StackedRows`), B columns rank-major / expert-minor (`StackedCols`), fc1's B [gate; up] as one (`Fused`),
    against a reference written with PEFT's own reshapes, from expert-TP shards; and each inverse."""
    from mcore2hf.layouts.ops import Column, GatedColumn, Row
    from mcore2hf.layouts.stacked import Fused, StackedCols, StackedRows

    E, r, hidden, inter = 3, 2, 4, 6
    n = inter // etp
    gates, ups, a_fc1 = [rand(inter, r) for _ in range(E)], [rand(inter, r) for _ in range(E)], [rand(r, hidden) for _ in range(E)]
    down_a, down_b = [rand(r, inter) for _ in range(E)], [rand(hidden, r) for _ in range(E)]
    cases = [  # (op of item e, Megatron shards of item e, item full shape, PEFT's stacked tensor)
        (lambda e: StackedCols(Fused(GatedColumn()), e, E),
         lambda e: [torch.cat([gates[e][i * n:(i + 1) * n], ups[e][i * n:(i + 1) * n]]) for i in range(etp)],
         (2 * inter, r), torch.stack([torch.cat([gates[e], ups[e]]) for e in range(E)], dim=-1).flatten(1)),
        (lambda e: StackedRows(Column(), e, E), lambda e: [a_fc1[e]], (r, hidden), torch.cat(a_fc1)),
        (lambda e: StackedRows(Row(), e, E), lambda e: [down_a[e][:, i * n:(i + 1) * n] for i in range(etp)],
         (r, inter), torch.cat(down_a)),
        (lambda e: StackedCols(Column(), e, E), lambda e: [down_b[e]], (hidden, r),
         torch.stack(down_b, dim=-1).flatten(1)),
    ]
    for op, shards, full, want in cases:
        # PEFT's reading of them: A (experts, rank, in) = reshape; B (experts, out, rank) = reshape + permute
        assert op(0).hf_shapes(full) == [tuple(want.shape)] and op(0).full_shape([tuple(want.shape)]) == full
        out = torch.full(want.shape, float("nan"))
        for e in range(E):
            op(e).to_hf(shards(e), [out])
        assert torch.equal(out, want)
        for e in range(E):
            for i, shard in enumerate(shards(e)):
                assert torch.equal(op(e).shard_from_hf([out], i, len(shards(e)), full), shard)
    b = torch.stack([torch.cat([gates[e], ups[e]]) for e in range(E)], dim=-1).flatten(1)
    assert torch.equal(b.reshape(2 * inter, -1, E).permute(2, 0, 1)[1], torch.cat([gates[1], ups[1]]))
