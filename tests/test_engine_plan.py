"""Engine-shard planning (issue 15, design NOTES-shard15b.md section 3): `layout_pieces.pieces` (which elements of
which HF output each Megatron shard supplies, derived from every op's `copies()`) and `engine_shards.clip`
(a piece cut to an engine rank's region). Pure tests on every registered architecture's tiny config."""

from __future__ import annotations

import functools

import pytest
import torch

from mcore2hf.errors import ShapeMismatchError
from mcore2hf.formats.hf_as_megatron import full_shape, megatron_names
from mcore2hf.layouts.ops import QKV, Column, GatedInterleaved, RowTransposed, VocabRows
from mcore2hf.layouts.pieces import Piece, pieces
from mcore2hf.layouts.stacked import Stacked
from mcore2hf.plan.engine_shards import EnginePlacement, EngineShardError, clip, engine_regions, region_slices
from mcore2hf.runtime.world import Layout, run_world

COUNTS = (1, 2, 4)


@functools.cache
def _model(model_type: str):
    """(dims, {HF name: shape}, [(op, full Megatron shape, HF names)]) of the tiny config, one entry per
    distinct (op, shape): the layers share op objects."""
    from mcore2hf.arch.hf_config import hf_tensor_shapes
    from mcore2hf.arch.registry import get_converter, get_model_spec
    from mcore2hf.runtime.tiny import tiny_config

    cfg = tiny_config(model_type)
    dims = get_model_spec(model_type).dims(cfg)
    conv = get_converter(model_type)
    shapes = hf_tensor_shapes(cfg, dims.num_mtp_layers, conv.not_held_by_model)
    found, _ = megatron_names(conv, dims, set(shapes))
    ops, seen = [], set()
    for r in found.values():
        hf_shapes = [tuple(shapes[n]) for n in r.hf_names]
        full = full_shape(r.op, hf_shapes, -(-dims.vocab_size // 128) * 128)
        key = (id(r.op), full)
        if key not in seen:
            seen.add(key)
            ops.append((r.op, full, r.hf_names))
    return dims, shapes, ops


def _counts(dims) -> list[int]:
    """Megatron TP sizes the tiny model allows (heads, groups and linear heads divide)."""
    sizes = [dims.num_attention_heads, dims.num_query_groups, dims.linear_num_key_heads or 4,
             dims.linear_num_value_heads or 4]
    return [c for c in COUNTS if all(s % c == 0 for s in sizes)]


def _shards(op, full, count) -> list[torch.Tensor] | None:
    if op.tp_dim is None:
        if count > 1:
            return None
    elif full[op.tp_dim] % count:
        return None
    shape = list(full)
    if op.tp_dim is not None:
        shape[op.tp_dim] //= count
    n = torch.Size(shape).numel()
    # distinct values everywhere, exact in float64: a misplaced element shows
    return [torch.arange(i * n, (i + 1) * n, dtype=torch.float64).reshape(shape) for i in range(count)]


def _run(ps: list[Piece], shards, outs) -> None:
    for p in ps:
        sizes, strides, off = p.dst_view(tuple(outs[p.out].shape))
        dst = outs[p.out].as_strided(sizes, strides, off)
        dst.copy_(shards[p.shard].contiguous().as_strided(*p.src_view()))
        if p.add:
            dst.add_(p.add)


def _cover(ps: list[Piece], shapes) -> list[torch.Tensor]:
    cover = [torch.zeros(s, dtype=torch.int32) for s in shapes]
    for p in ps:
        sizes, strides, off = p.dst_view(tuple(cover[p.out].shape))
        cover[p.out].as_strided(sizes, strides, off).add_(1)
    return cover


def _check_partition(op, full, shards, what) -> None:
    """Pieces cover each output element once (a stacked item: its item only) and reproduce `op.to_hf`."""
    hf_shapes = op.hf_shapes(full)
    # -1 marks elements no piece wrote (the shards' values are >= 0)
    want = [torch.full(s, -1.0, dtype=torch.float64) for s in hf_shapes]
    op.to_hf(shards, want)
    ps = pieces(op, tuple(shards[0].shape), len(shards), hf_shapes)
    for cover in _cover(ps, hf_shapes):
        expect = torch.zeros_like(cover)
        if isinstance(op, Stacked):
            expect[op.index] = 1
        else:
            expect.fill_(1)
        assert torch.equal(cover, expect), what
    got = [torch.full(s, -1.0, dtype=torch.float64) for s in hf_shapes]
    _run(ps, shards, got)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), what


MODEL_TYPES = sorted(__import__("mcore2hf.arch.registry", fromlist=["architectures"]).architectures())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pieces_partition_and_equal_to_hf_every_op_shards_1_2_4(model_type):
    """Pieces of all shards cover every element of every HF output exactly once, and executing them equals
    `op.to_hf` (torch.equal), for every op of the architecture at Megatron TP 1/2/4."""
    dims, _, ops = _model(model_type)
    checked = 0
    for op, full, names in ops:
        for count in _counts(dims):
            shards = _shards(op, full, count)
            if shards is None:
                continue
            _check_partition(op, full, shards, (names, count))
            checked += 1
    assert checked


def _placements(engine: str, tp: int, moe: bool) -> list[list[EnginePlacement]]:
    eps = [1] + ([tp] if moe and tp > 1 else []) + ([2] if moe and engine == "sglang" and tp == 4 else [])
    return [[EnginePlacement(engine, r, tp, ep_size=ep) for r in range(tp)] for ep in eps]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_clip_pieces_by_every_engine_rank_gives_exactly_its_regions(model_type):
    """Clipping the pieces of all Megatron shards (TP 2, or 1 where 2 does not divide) by an engine rank's regions
    covers exactly those regions once (engine TP 1/2/4, with and without EP, sglang and vllm), and the clipped
    pieces read the right source elements: the result equals the full HF tensor inside the regions."""
    dims, _, ops = _model(model_type)
    count = max(c for c in _counts(dims) if c <= 2)
    checked = 0
    for op, full, names in ops:
        shards = _shards(op, full, count) or _shards(op, full, 1)
        n = len(shards)
        hf_shapes = op.hf_shapes(full)
        want = [torch.empty(s, dtype=torch.float64) for s in hf_shapes]
        op.to_hf(shards, want)
        ps = pieces(op, tuple(shards[0].shape), n, hf_shapes)
        for engine in ("sglang", "vllm"):
            for tp in (1, 2, 4) if engine == "sglang" else (2, 4):  # at TP 1 both engines load everything
                for ranks in _placements(engine, tp, dims.num_experts > 0):
                    for p in ranks:
                        for j, name in enumerate(names):
                            try:
                                regions = engine_regions(name, hf_shapes[j], dims, p, model_type)
                            except EngineShardError:
                                continue  # refused placements (heads do not divide, gpt-oss EP on sglang)
                            mask = torch.zeros(hf_shapes[j], dtype=torch.int32)
                            for region in regions:
                                mask[region_slices(region)] += 1
                            if isinstance(op, Stacked):  # one stacked source gives its item only
                                keep = torch.zeros_like(mask)
                                keep[op.index] = 1
                                mask *= keep
                            mine = [c for q in ps if q.out == j for region in regions
                                    if (c := clip(q, region)) is not None]
                            cover = _cover([_reout(c) for c in mine], [hf_shapes[j]])[0]
                            assert torch.equal(cover, mask), (name, engine, tp, p)
                            got = torch.full(hf_shapes[j], float("nan"), dtype=torch.float64)
                            _run([_reout(c) for c in mine], shards, [got])
                            assert torch.equal(got[mask.bool()], want[j][mask.bool()]), (name, engine, tp, p)
                            checked += 1
    assert checked


def _reout(p: Piece) -> Piece:
    import dataclasses
    return dataclasses.replace(p, out=0)


def test_clip_progression_step2_rows_10x3_region_rows_3_to_7():
    """A GatedInterleaved-style piece (every other row) clipped to rows [3, 7): rows 3 and 5, source moved."""
    p = Piece(out=0, shard=0, start=(1, 0), step=(2, 1), count=(5, 3), src_strides=(3, 1), src_offset=0)
    c = clip(p, ((0, 3, 4),))
    assert (c.start, c.count, c.src_offset) == ((3, 0), (2, 3), 3)
    assert clip(p, ((0, 9, 1),)) == Piece(0, 0, (9, 0), (2, 1), (1, 3), (3, 1), 12)
    assert clip(p, ((0, 2, 1),)) is None


@pytest.mark.parametrize("op,full,count", [
    (Column(), (8, 6), 4), (QKV(4, 2, 3), (24, 5), 2), (GatedInterleaved(), (12, 5), 2),
    (RowTransposed(), (6, 8), 2), (VocabRows(100), (128, 4), 4)])
def test_pieces_small_ops_shapes(op, full, count):
    """Named small cases (shapes in the ids): partition and equality as above."""
    _check_partition(op, full, _shards(op, full, count), type(op).__name__)


def test_pieces_refuse_a_copy_that_does_not_factor_5_elements_of_5x2():
    """A copy of 5 flat elements of a 5x2 tensor (two rows and a half): no box per HF dim, refused."""
    from mcore2hf.layouts.ops import LayoutOp, StridedCopy

    class Odd(LayoutOp):
        def copies(self, shard_shape, count):
            return [StridedCopy(0, (5,), (1,), (1,))]

    with pytest.raises(ShapeMismatchError, match="does not factor"):
        pieces(Odd(), (10,), 1, [(5, 2)])


# ------------------------------------------------------------------------------------------------- export (gloo)

#: dense, MoE, MLA (+ MTP) and gated DeltaNet (+ MoE), in one world that has TP, PP and EP (expert TP 1 != TP)
EXPORT_MODELS = ["qwen3", "qwen3_moe", "deepseek_v3", "qwen3_next"]


def test_engine_sharded_export_tp2_pp2_ep2_equals_engine_slices_of_full_export_4_ranks(tmp_path, capsys):
    """End to end on CPU (real megatron-core models with the HF weights loaded, their forward checked against
    transformers', 4 gloo ranks at TP2 x PP2 x EP2, expert TP 1), plan_engine_shards + EngineExecutor for sglang
    and vllm at engine TP 1/2/4 (with engine EP for MoE; 2 kv heads, so TP 4 > kv heads): every rank's slices
    equal the engine's slices of the HF source tensors (torch.equal) and are exactly its engine_regions, masked debug tensors are NaN outside them, bytes received
    = the plan's wire bytes = regions bytes - locally held bytes, the world sends what it receives, and at
    engine TP == Megatron TP no TP-aligned piece a rank holds crosses the wire."""
    import worlds
    from oracle import logit_problems

    layout, models = Layout(tp=2, pp=2, ep=2, etp=1), EXPORT_MODELS

    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

    ckpts = {m: str(make_hf_checkpoint(tiny_config(m), tmp_path / m)) for m in models}
    per_rank = run_world(worlds.engine_export_suite, layout, ckpts, layout, 64 * 1024)
    logits = [r["logits"] for r in per_rank]  # the weights mcore2hf loaded: transformers' forward
    problems = logit_problems(logits, ckpts, worlds.TOKENS, str(layout))
    assert not problems, "\n".join(problems)
    res = [r["placements"] for r in per_rank]
    lines = []
    for key in res[0]:
        if isinstance(res[0][key], str):
            lines.append(f"{key}: {res[0][key]}")
            continue
        lines.append(f"{key}: wire/local/needed per rank "
                     + " ".join(f"{r[key]['wire']}/{r[key]['local']}/{r[key]['needed']}" for r in res))
    refused = [k for k, r in res[0].items() if isinstance(r, str)]
    # exactly the placements that cannot hold qwen3_next's 2 linear key heads are refused, the rest ran
    assert refused and all(k.startswith("qwen3_next") and " tp4 " in k for k in refused), refused
    assert len(refused) < len(res[0]), res[0]
    with capsys.disabled():
        print(f"\n{layout} engine-sharded export:\n" + "\n".join(lines))


def test_engine_plan_refusals_quantized_plan_and_bad_colocated_groups():
    """A quantized export plan, an engine TP that does not divide the world, overlapping groups: clear errors
    before anything is planned or sent."""
    from mcore2hf.plan.engine import plan_engine_shards
    from mcore2hf.plan.engine_shards import colocated_ranks
    from mcore2hf.plan.export import ExportPlan
    from mcore2hf.quantize.scheme import get_scheme

    with pytest.raises(EngineShardError, match=r"quantized \(fp8\) plan: not supported"):
        plan_engine_shards(ExportPlan("qwen3", {}, [], 1, [], 4, quantize=get_scheme("fp8")), colocated_ranks(4, "vllm", 2),
                           None)
    with pytest.raises(EngineShardError, match="engine TP 4 to divide the world size 6"):
        colocated_ranks(6, "sglang", 4)
    with pytest.raises(EngineShardError, match="groups of 2 distinct ranks"):
        colocated_ranks(4, "sglang", 2, groups=[[0, 1], [1, 2]])
    ranks = colocated_ranks(4, "sglang", 2, groups=[[2, 3], [0, 1]])  # configurable: instance 0 on ranks 2, 3
    assert [(er.instance, er.placement.tp_rank, er.rank) for er in ranks] == [(0, 0, 2), (0, 1, 3), (1, 0, 0),
                                                                               (1, 1, 1)]


def test_engine_executor_over_a_separate_gloo_group_with_an_engine_only_process_3_ranks(tmp_path):
    """Transport (disaggregated shape): 3 processes, the pieces cross a ProcessGroupGloo outside the default world
    whose ranks differ from the global ranks; two trainers (a real TP1 qwen3 each) feed sglang engine TP2, whose
    rank 0 is a process with no model (ctx=None, local={}). Its slices equal the full export's (torch.equal) and
    bytes received = the plan's."""
    import worlds

    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

    ckpt = str(make_hf_checkpoint(tiny_config("qwen3"), tmp_path / "qwen3"))
    res = run_world(worlds.engine_group_transport, Layout(world_size=3), ckpt, 64 * 1024)
    by_rank = {r["group_rank"]: r for r in res}
    assert by_rank[2]["sent_bytes"] == 0 and by_rank[2]["local_bytes"] == 0 and by_rank[2]["received_bytes"] > 0
    assert by_rank[0]["received_bytes"] == 0  # rank 0 feeds no engine rank: sends only
    assert sum(r["sent_bytes"] for r in res) == sum(r["received_bytes"] for r in res)


def test_masked_engine_bucket_as_bucket_debug_needs_a_nan_filling_executor():
    """A masked bucket was written in place: as_bucket(debug=True) cannot NaN-fill it afterwards, so it refuses
    unless the executor filled NaN first (it used to ignore `debug` silently)."""
    import pytest

    from mcore2hf.plan.engine_shards import EngineShardError
    from mcore2hf.plan.export import pack_tight
    from mcore2hf.transfer.engine import EngineBucket

    full = pack_tight([("w", (2, 3), torch.float32, "w")])
    flat = torch.full((24,), 0, dtype=torch.uint8)
    with pytest.raises(EngineShardError, match="expected an executor built with debug=True"):
        EngineBucket(0, flat, [], full).as_bucket(debug=True)
    bucket = EngineBucket(0, flat, [], full, nan=True)
    assert bucket.as_bucket(debug=True).flat is flat and bucket.as_bucket().flat is flat


def test_slices_bucket_as_bucket_equals_mask_to_engine_column_row_and_two_regions_of_one_tensor():
    """A raw-slices bucket's as_bucket() (the executor's masked placement run on its slices) equals mask_to_engine
    of the full tensors (an independent path: indexing), NaN outside the regions with debug, for a column region
    (strided destination), a row region of a bf16 tensor and one tensor with two regions."""
    from mcore2hf.plan.engine import SliceEntry
    from mcore2hf.plan.engine_shards import mask_to_engine, region_slices
    from mcore2hf.plan.export import pack_tight
    from mcore2hf.transfer.engine import EngineBucket

    full = {"a": torch.arange(24, dtype=torch.float32).reshape(6, 4),
            "b": torch.arange(12, dtype=torch.float32).reshape(4, 3).to(torch.bfloat16)}
    regions = {"a": [((1, 1, 2),), ((1, 3, 1),)], "b": [((0, 2, 2),)]}
    layout = pack_tight([(n, tuple(t.shape), t.dtype, n) for n, t in full.items()])
    entries, off = [], 0
    for n, t in full.items():
        for r in regions[n]:
            sl = t[region_slices(r)]
            off = -(-off // t.element_size()) * t.element_size()
            entries.append(SliceEntry(n, tuple(t.shape), r, t.dtype, off, sl.numel() * t.element_size()))
            off += entries[-1].nbytes
    flat = torch.zeros(off, dtype=torch.uint8)
    for e in entries:
        flat[e.start:e.start + e.nbytes].view(e.dtype).copy_(full[e.name][region_slices(e.region)].reshape(-1))
    bucket = EngineBucket(0, flat, entries, None, layout)
    got = dict(bucket.as_bucket(debug=True).named_tensors())
    assert [e.name for e in bucket.as_bucket().entries] == [e.name for e in layout]
    for n, t in full.items():
        want = mask_to_engine(t, regions[n], debug=True)
        assert got[n].shape == t.shape and got[n].dtype == t.dtype
        assert torch.equal(got[n].isnan(), want.isnan()) and torch.equal(got[n][~want.isnan()], want[~want.isnan()])
    plain = dict(bucket.masked())
    for n, t in full.items():
        for r in regions[n]:
            assert torch.equal(plain[n][region_slices(r)], t[region_slices(r)])


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("full", [(45, 7), (45,)])
def test_pieces_partition_fused_vision_qkv_heads3_d5(count, full):
    """The vision tower's fused QKV (one HF output [q; k; v]): pieces cover it once and equal `to_hf`."""
    from mcore2hf.layouts.ops import QKV

    op = QKV(3, 3, 5, fused=True)
    _check_partition(op, full, _shards(op, full, count), (full, count))
