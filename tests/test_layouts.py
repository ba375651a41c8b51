"""Layout ops on their own: each op against an independent reference of Megatron's layout, and its inverse."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mcore2hf.errors import ShapeMismatchError
from mcore2hf.layouts.gdn import ColumnParts, GatedQKV, GDNInProj
from mcore2hf.layouts.ops import (
    QKV,
    Column,
    GatedColumn,
    GatedInterleaved,
    GatedTransposed,
    IndexerRope,
    Replicated,
    Row,
    RowTransposed,
    VocabRows,
    ZeroCentered,
)
from mcore2hf.layouts.stacked import Stacked

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


#: (heads, groups, tp): TP divides the query groups, as Megatron requires
HEADS_GROUPS_TP = [(8, 2, 1), (8, 2, 2), (4, 4, 1), (4, 4, 2), (4, 1, 1)]


@pytest.mark.parametrize("heads,groups,tp", HEADS_GROUPS_TP)
def test_qkv_weight_heads_groups_d4_h16(heads, groups, tp):
    d = 4
    q, k, v = rand(heads * d, 16), rand(groups * d, 16), rand(groups * d, 16)
    fused = megatron_qkv(q, k, v, heads, groups, d)
    roundtrip(QKV(heads, groups, d), list(fused.chunk(tp, 0)), [q, k, v])


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_bias_heads8_groups2_d4(tp):
    q, k, v = rand(32), rand(8), rand(8)
    fused = megatron_qkv(q, k, v, 8, 2, 4)
    roundtrip(QKV(8, 2, 4), list(fused.chunk(tp, 0)), [q, k, v])


@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_vision_tower_heads3_d5_h7(tp, bias):
    """Qwen3-VL's vision tower: Megatron's per-head [q_h; k_h; v_h] (groups == heads) <-> HF's one `attn.qkv`
    [q; k; v] (transformers 5.24 Qwen3VLVisionAttention: qkv(x).reshape(seq, 3, heads, -1)), also read lazily."""
    heads, d = 3, 5
    rest = () if bias else (7,)
    q, k, v = rand(heads * d, *rest), rand(heads * d, *rest), rand(heads * d, *rest)
    fused = megatron_qkv(q, k, v, heads, heads, d)
    qkv = torch.cat([q, k, v])
    op = QKV(heads, heads, d, fused=True)
    assert op.n_out == 1 and op.full_shape(op.hf_shapes(tuple(fused.shape))) == tuple(fused.shape)
    roundtrip(op, list(fused.chunk(tp, 0)), [qkv])
    # what the model computes: HF's split of the fused output equals Megatron's per-head split, head by head
    per_head = fused.view(heads, 3, d, *rest)
    hf = qkv.view(3, heads, d, *rest)
    assert all(torch.equal(per_head[:, j], hf[j]) for j in range(3))


def test_fused_qkv_reads_safetensors_slices_heads4_d3_tp2(tmp_path):
    q, k, v = rand(12, 5), rand(12, 5), rand(12, 5)
    save_file({"qkv": torch.cat([q, k, v])}, tmp_path / "x.safetensors")
    fused = megatron_qkv(q, k, v, 4, 4, 3)
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        for i, shard in enumerate(fused.chunk(2, 0)):
            assert torch.equal(QKV(4, 4, 3, fused=True).shard_from_hf([f.get_slice("qkv")], i, 2,
                                                                       tuple(fused.shape)), shard)


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
    (QKV(8, 2, 4), (48, 16)), (QKV(3, 3, 5, fused=True), (45, 7)), (VocabRows(100), (100, 8)), (GatedInterleaved(), (16, 6)), (GatedInterleaved(), (16,)),
    (RowTransposed(), (6, 8)), (GatedTransposed(), (18, 7)), (Stacked(GatedInterleaved(), 1, 3), (16, 6)), (Stacked(RowTransposed(), 2, 3), (6, 8)),
    (GatedQKV(8, 2, 4), (80, 16)), (GDNInProj(2, 4, 4, 3), (48, 8)), (ColumnParts((8, 8, 12)), (28, 1, 4)),
    (ZeroCentered(), (12,)), (IndexerRope(8, 4, True), (24, 6)), (IndexerRope(8, 4, False), (8,)),
], ids=lambda x: type(x).__name__ if not isinstance(x, tuple) else "x".join(map(str, x)))
def test_full_shape_inverts_hf_shapes(op, full):
    """What the offline import rebuilds a Megatron tensor's shape with (unpadded vocab: VocabRows gives vocab_size)."""
    assert op.full_shape(op.hf_shapes(full)) == full


# Qwen3-Next: gated attention, gated DeltaNet in_proj / conv1d, the zero-centred GDN output norm


def megatron_gated_qkv(q_proj, k, v, heads, groups, d):
    """Megatron's gated linear_qkv from HF's: per query group [q heads; gate heads; k; v], where HF's q_proj holds
    [q_h; gate_h] per head (loops, no reshapes)."""
    hpg = heads // groups
    rows = []
    for grp in range(groups):
        hs = range(grp * hpg, (grp + 1) * hpg)
        rows += [q_proj[2 * h * d:(2 * h + 1) * d] for h in hs]  # queries
        rows += [q_proj[(2 * h + 1) * d:(2 * h + 2) * d] for h in hs]  # gates
        rows += [k[grp * d:(grp + 1) * d], v[grp * d:(grp + 1) * d]]
    return torch.cat(rows)


@pytest.mark.parametrize("heads,groups,tp", HEADS_GROUPS_TP)
def test_gated_qkv_weight_heads_groups_d4_h16(heads, groups, tp):
    d = 4
    q, k, v = rand(2 * heads * d, 16), rand(groups * d, 16), rand(groups * d, 16)
    fused = megatron_gated_qkv(q, k, v, heads, groups, d)
    roundtrip(GatedQKV(heads, groups, d), list(fused.chunk(tp, 0)), [q, k, v])


def test_gated_qkv_rejects_ungated_rows_heads8_groups2_d4():
    with pytest.raises(ShapeMismatchError, match=r"gated linear_qkv rows .*expected 80, got 48"):
        GatedQKV(8, 2, 4).hf_shapes((48, 16))


def megatron_gdn_in_proj(qkvz, ba, nk, nv, dk, dv, tp):
    """megatron-core 0.16.1 GatedDeltaNet.in_proj shards from HF's in_proj_qkvz / in_proj_ba: shard i is
    [q; k; v; z; b; a] of its key heads (HF: per key head h, [q_h; k_h; v_h; z_h] and [b_h; a_h])."""
    r = nv // nk
    w = 2 * dk + 2 * r * dv
    shards = []
    for i in range(tp):
        heads = range(i * nk // tp, (i + 1) * nk // tp)
        parts = {n: [] for n in "qkvzba"}
        for h in heads:
            base = h * w
            parts["q"].append(qkvz[base:base + dk])
            parts["k"].append(qkvz[base + dk:base + 2 * dk])
            parts["v"].append(qkvz[base + 2 * dk:base + 2 * dk + r * dv])
            parts["z"].append(qkvz[base + 2 * dk + r * dv:base + w])
            parts["b"].append(ba[2 * r * h:2 * r * h + r])
            parts["a"].append(ba[2 * r * h + r:2 * r * (h + 1)])
        shards.append(torch.cat([t for n in "qkvzba" for t in parts[n]]))
    return shards


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("nk,nv", [(4, 8), (4, 4), (4, 12)])
def test_gdn_in_proj_nk_nv_dk4_dv3_h8(tp, nk, nv):
    dk, dv = 4, 3
    qkvz, ba = rand(2 * nk * dk + 2 * nv * dv, 8), rand(2 * nv, 8)
    roundtrip(GDNInProj(nk, nv, dk, dv), megatron_gdn_in_proj(qkvz, ba, nk, nv, dk, dv, tp), [qkvz, ba])


def test_gdn_in_proj_matches_megatron_and_hf_splits_of_an_activation_nk2_nv4_dk4_dv3_tp2():
    """The semantics, not only the permutation: Megatron's forward split of each TP shard's projection
    (gated_delta_net.py) gives the heads HF's fix_query_key_value_ordering gives (modeling_qwen3_next.py)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    nk, nv, dk, dv, hidden, tp = 2, 4, 4, 3, 8, 2
    cfg = AutoConfig.for_model("qwen3_next", hidden_size=hidden, linear_num_key_heads=nk, linear_num_value_heads=nv,
                               linear_key_head_dim=dk, linear_value_head_dim=dv, num_hidden_layers=1,
                               layer_types=["linear_attention"])
    hf = Qwen3NextGatedDeltaNet(cfg, 0)
    # small integers: every product and sum is exact in fp32, so no BLAS kernel choice (which differs with the
    # output width: 2 rows of b vs a full shard) can change a bit and the comparison stays exact
    def ints(*shape):
        return torch.randint(-4, 5, shape, generator=g).float()

    qkvz, ba = ints(*hf.in_proj_qkvz.weight.shape), ints(*hf.in_proj_ba.weight.shape)
    x = ints(1, 3, hidden)
    q, k, v, z, b, a = hf.fix_query_key_value_ordering(x @ qkvz.t(), x @ ba.t())
    shards = GDNInProj(nk, nv, dk, dv).shards_from_hf([qkvz, ba], tp, (2 * nk * dk + 2 * nv * dv + 2 * nv, hidden))
    for i, shard in enumerate(shards):  # Megatron: split [qkv | z | b | a], then qkv into [q | k | v]
        y = x @ shard.t()
        qkv, zi, bi, ai = torch.split(y, [(2 * nk * dk + nv * dv) // tp, nv * dv // tp, nv // tp, nv // tp], -1)
        qi, ki, vi = torch.split(qkv, [nk * dk // tp, nk * dk // tp, nv * dv // tp], -1)
        kh, vh = slice(i * nk // tp, (i + 1) * nk // tp), slice(i * nv // tp, (i + 1) * nv // tp)
        assert torch.equal(qi.reshape(1, 3, -1, dk), q[:, :, kh]) and torch.equal(ki.reshape(1, 3, -1, dk), k[:, :, kh])
        assert torch.equal(vi.reshape(1, 3, -1, dv), v[:, :, vh]) and torch.equal(zi.reshape(1, 3, -1, dv), z[:, :, vh])
        assert torch.equal(bi, b[:, :, vh]) and torch.equal(ai, a[:, :, vh])


def test_gdn_in_proj_rejects_rows_nk2_nv4_dk4_dv3():
    with pytest.raises(ShapeMismatchError, match=r"GDN in_proj rows .*expected 48, got 40"):
        GDNInProj(2, 4, 4, 3).hf_shapes((40, 8))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parts_conv1d_q8_k8_v12_k4(tp):
    """GDN conv1d [conv_dim, 1, kernel]: each TP shard holds its rows of q, of k and of v."""
    q, k, v = rand(8, 1, 4), rand(8, 1, 4), rand(12, 1, 4)
    shards = [torch.cat([t.chunk(tp, 0)[i] for t in (q, k, v)]) for i in range(tp)]
    roundtrip(ColumnParts((8, 8, 12)), shards, [torch.cat([q, k, v])])


def test_zero_centered_norm_12_fp32_and_bf16():
    """w_hf = w + 1, rounded in the tensor's dtype; HF -> Megatron -> HF is bit-exact for 0.5 <= w_hf <= 2."""
    op = ZeroCentered()
    for dtype in (torch.float32, torch.bfloat16):
        hf = (1.0 + 0.1 * rand(12)).to(dtype)
        w = op.shard_from_hf([hf], 0, 1, (12,))
        assert w.dtype == dtype and torch.equal(op.hf_tensors([w])[0], hf)
        w = (0.1 * rand(12)).to(dtype)
        assert torch.equal(op.hf_tensors([w])[0], w + 1)


def test_zero_centered_megatron_round_trip_loses_low_bits_in_bf16_4096():
    """Megatron -> HF -> Megatron is not exact: w + 1 drops the bits of w below the precision of 1 + w.
    Measured for w ~ 0.1 * N(0, 1): fp32 round trip error <= 2^-24 (half an ulp of 1), bf16 <= 2^-8."""
    op = ZeroCentered()
    for dtype, bound in ((torch.float32, 2.0 ** -24), (torch.bfloat16, 2.0 ** -8)):
        w = (0.1 * rand(4096)).to(dtype)
        back = op.shard_from_hf(op.hf_tensors([w]), 0, 1, (4096,))
        err = (back.double() - w.double()).abs().max().item()
        assert 0 < err <= bound, (dtype, err)


# DeepSeek sparse attention: the indexer's rotary rows (megatron-core 0.16-0.18 vs transformers 5.24)


@pytest.mark.parametrize("hf_interleaved", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
def test_indexer_rope_rows_give_megatron_the_scores_transformers_computes(hf_interleaved):
    """The oracle is both libraries' own rope: transformers' indexer rope on HF rows (DeepSeek-V3.2: half-split
    `apply_rotary_pos_emb`; GLM-5: `apply_rotary_pos_emb_interleave`, rows first) and megatron-core 0.16.1's
    `_apply_rotary_pos_emb_bshd(multi_latent_attention=True)` on the rows IndexerRope gives Megatron (rope rows
    last, what `DSAIndexer._apply_rope` splits off) score every (query head, key) pair alike, at every position."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    heads, d, r, c, s = 3, 8, 4, 5, 6
    wq, wk, x = rand(heads * d, c).double(), rand(d, c).double(), rand(s, c).double()
    inv = 1.0 / 10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)  # [s, r]: both libraries' cos/sin layout
    q, k = (x @ wq.T).view(s, heads, d), (x @ wk.T).view(s, 1, d)
    rope = apply_rotary_pos_emb_interleave if hf_interleaved else apply_rotary_pos_emb
    qr, kr = rope(q[..., :r].transpose(0, 1)[None], k[..., :r].transpose(0, 1)[None], emb.cos()[None],
                  emb.sin()[None], unsqueeze_dim=1)
    hf_q = torch.cat([qr[0].transpose(0, 1), q[..., r:]], -1)
    hf_k = torch.cat([kr[0].transpose(0, 1), k[..., r:]], -1)
    hf = torch.einsum("shd,tgd->sht", hf_q, hf_k)

    op = IndexerRope(d, r, interleave=not hf_interleaved)  # the DeepSeek-V3.2 rows interleaved, GLM-5's not
    mq, mk = (x @ op.shard_from_hf([wq], 0, 1, tuple(wq.shape)).T).view(s, heads, d), \
        (x @ op.shard_from_hf([wk], 0, 1, tuple(wk.shape)).T).view(s, 1, d)
    f = emb[:, None, None, :]  # megatron's freqs [s, 1, 1, r]; input [s, b=1, heads, d]

    def megatron(t):
        pe = _apply_rotary_pos_emb_bshd(t[:, None, :, d - r:], f, rotary_interleaved=False,
                                        multi_latent_attention=True)
        return torch.cat([t[..., :d - r], pe[:, 0]], -1)

    diff = (torch.einsum("shd,tgd->sht", megatron(mq), megatron(mk)) - hf).abs().max().item()
    print(f"indexer rope scores: max |megatron - transformers| {diff:.1e} (float64)")
    assert diff <= 3 * 7.1e-15, diff  # float64 round-off: 2.7e-15 and 7.1e-15 measured (2026-11-28)
    # without the row move (a one-to-one copy) the scores differ
    wrong = torch.einsum("shd,tgd->sht", megatron(q), megatron(k))
    assert (wrong - hf).abs().max() > 1e-2


@pytest.mark.parametrize("tp_dim", [0, 1])
def test_whole_or_split_decides_from_the_shard_merged12_tp3(tp_dim):
    """The Qwen3-VL merger's linears: split over TP natively (column / row), whole in an embedded HF tower, one
    name; the shard's size along the TP dim says which (as for MLA's down projections)."""
    from mcore2hf.layouts.ops import WholeOrSplit

    op = WholeOrSplit(12, tp_dim)
    full = rand(12, 12)
    assert op.split((12, 12), 3) == (1, None)
    shape = (4, 12) if tp_dim == 0 else (12, 4)
    assert op.split(shape, 3) == (3, tp_dim)
    roundtrip(op, list(full.chunk(3, tp_dim)), [full])
    with pytest.raises(ShapeMismatchError):
        op.split((5, 5), 3)
