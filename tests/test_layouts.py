"""Layout ops on their own: each op against an independent reference of Megatron's layout, and its inverse."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore2hf.errors import ShapeMismatchError
from mcore2hf.layouts import (
    QKV,
    Column,
    GatedColumn,
    GatedInterleaved,
    Replicated,
    Row,
    RowTransposed,
    Stacked,
    VocabRows,
)

g = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=g)


def roundtrip(op, shards, hf):
    """to_hf(shards) == hf exactly, and shard_from_hf(hf) == each shard exactly."""
    full = list(shards[0].shape)
    if op.tp_dim is not None and len(shards) > 1:
        full[op.tp_dim] *= len(shards)
    out = op.hf_tensors(shards)
    assert len(out) == len(hf)
    for a, b in zip(out, hf):
        assert torch.equal(a, b)
    for i, s in enumerate(shards):
        assert torch.equal(op.shard_from_hf(hf, i, len(shards), tuple(full)), s)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_weight_16x8(tp):
    w = rand(16, 8)
    roundtrip(Column(), list(w.chunk(tp, 0)), [w])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_weight_8x16(tp):
    w = rand(8, 16)
    roundtrip(Row(), list(w.chunk(tp, 1)), [w])


def test_replicated_norm_32():
    w = rand(32)
    roundtrip(Replicated(), [w], [w])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_rows_V100_padded128_h8(tp):
    real = rand(100, 8)
    padded = torch.cat([real, torch.zeros(28, 8)])
    roundtrip(VocabRows(100), list(padded.chunk(tp, 0)), [real])


def test_vocab_rows_trims_padding_that_is_not_zero_V100_padded128_tp2():
    padded = rand(128, 8)
    (out,) = VocabRows(100).hf_tensors(list(padded.chunk(2, 0)))
    assert torch.equal(out, padded[:100])


def megatron_glu_shards(gate, up, tp):
    """Megatron's GLU fc1 with partition_stride=2: shard i = [gate_i; up_i]."""
    return [torch.cat([gc, uc]) for gc, uc in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_column_glu_gate16_up16_h8(tp):
    gate, up = rand(16, 8), rand(16, 8)
    roundtrip(GatedColumn(), megatron_glu_shards(gate, up, tp), [gate, up])


def test_gated_column_glu_bias_gate16_up16_tp2():
    gate, up = rand(16), rand(16)
    roundtrip(GatedColumn(), megatron_glu_shards(gate, up, 2), [gate, up])


def megatron_qkv(q, k, v, heads, groups, d):
    """Megatron's fused QKV: for each query group g, [q heads of g; k_g; v_g] (loops, no reshapes)."""
    hpg = heads // groups
    rows = []
    for grp in range(groups):
        for h in range(hpg):
            rows.append(q[(grp * hpg + h) * d:(grp * hpg + h + 1) * d])
        rows.append(k[grp * d:(grp + 1) * d])
        rows.append(v[grp * d:(grp + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("heads,groups", [(8, 2), (4, 4), (4, 1)])
def test_qkv_weight_heads_groups_d4_h16(tp, heads, groups):
    d = 4
    if groups % tp:
        pytest.skip("TP must divide the query groups")
    q, k, v = rand(heads * d, 16), rand(groups * d, 16), rand(groups * d, 16)
    fused = megatron_qkv(q, k, v, heads, groups, d)
    roundtrip(QKV(heads, groups, d), list(fused.chunk(tp, 0)), [q, k, v])


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_bias_heads8_groups2_d4(tp):
    q, k, v = rand(32), rand(8), rand(8)
    fused = megatron_qkv(q, k, v, 8, 2, 4)
    roundtrip(QKV(8, 2, 4), list(fused.chunk(tp, 0)), [q, k, v])


def test_shard_from_hf_reads_safetensors_slices_qkv_heads8_groups2_d4_tp2(tmp_path):
    q, k, v = rand(32, 16), rand(8, 16), rand(8, 16)
    save_file({"q": q, "k": k, "v": v}, tmp_path / "x.safetensors")
    fused = megatron_qkv(q, k, v, 8, 2, 4)
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        slices = [f.get_slice(n) for n in "qkv"]
        for i, shard in enumerate(fused.chunk(2, 0)):
            assert torch.equal(QKV(8, 2, 4).shard_from_hf(slices, i, 2, tuple(fused.shape)), shard)


def test_row_shard_from_safetensors_slice_8x16_tp4(tmp_path):
    w = rand(8, 16)
    save_file({"w": w}, tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert torch.equal(Row().shard_from_hf([f.get_slice("w")], 3, 4, (8, 16)), w[:, 12:16])


def test_qkv_rejects_rows_that_do_not_match_heads_and_groups():
    with pytest.raises(ShapeMismatchError, match=r"linear_qkv rows .*expected 48, got 60"):
        QKV(8, 2, 4).hf_shapes((60, 16))


def test_vocab_rows_rejects_fewer_rows_than_vocab():
    with pytest.raises(ShapeMismatchError, match="expected >= 100, got 96"):
        VocabRows(100).hf_shapes((96, 8))


def test_gated_column_rejects_odd_rows():
    with pytest.raises(ShapeMismatchError, match="even"):
        GatedColumn().hf_shapes((15, 8))


def test_to_hf_writes_into_views_of_one_flat_buffer_qkv_tp2():
    """The engine's path: outputs are views of a byte buffer, written in place."""
    q, k, v = rand(32, 16), rand(8, 16), rand(8, 16)
    fused = megatron_qkv(q, k, v, 8, 2, 4)
    flat = torch.zeros(4 * (32 + 8 + 8) * 16, dtype=torch.uint8)
    outs, off = [], 0
    for t in (q, k, v):
        n = t.numel() * 4
        outs.append(flat[off:off + n].view(torch.float32).view(t.shape))
        off += n
    QKV(8, 2, 4).to_hf(list(fused.chunk(2, 0)), outs)
    assert torch.equal(flat.view(torch.float32), torch.cat([q.flatten(), k.flatten(), v.flatten()]))


@pytest.mark.parametrize("op,full", [
    (Replicated(), (16,)), (Column(), (12, 8)), (Row(), (8, 12)), (GatedColumn(), (16, 8)),
    (QKV(8, 2, 4), (48, 16)), (VocabRows(100), (100, 8)), (GatedInterleaved(), (16, 6)), (GatedInterleaved(), (16,)),
    (RowTransposed(), (6, 8)), (Stacked(GatedInterleaved(), 1, 3), (16, 6)), (Stacked(RowTransposed(), 2, 3), (6, 8)),
], ids=lambda x: type(x).__name__ if not isinstance(x, tuple) else "x".join(map(str, x)))
def test_full_shape_inverts_hf_shapes(op, full):
    """What the offline import rebuilds a Megatron tensor's shape with (unpadded vocab: VocabRows gives vocab_size)."""
    assert op.full_shape(op.hf_shapes(full)) == full
