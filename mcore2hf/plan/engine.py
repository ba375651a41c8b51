"""The engine-shard planner (issue 15, design: docs/engine_shard_planner.md): each engine rank receives exactly
the regions it loads, built from the Megatron shards where they are held. Routes are computed once from the
`ExportPlan` (same buckets, same order), with no communication, identically on every rank: each layout op's
pieces (`layout_pieces.pieces`) clipped to every engine rank's regions (`engine_shards`), each routed by the one
least-loaded-holder rule (`routes`), with a build-time check that every slice is tiled exactly once.
The per-rank programs (`transfer.builders.engine_program`) and their executor (`transfer.engine`) run it."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..arch.mapping import ModelDims
from ..errors import problem_list
from ..layouts.pieces import Piece, pieces
from .engine_shards import EngineRank, EngineShardError, clip, engine_regions, has_sharding_kind
from .export import ExportPlan
from .routes import LeastLoaded


@dataclass(frozen=True)
class SliceEntry:
    """One region of one HF tensor in a receiver's output buffer (bytes), the raw slice an engine rank loads."""

    name: str
    shape: tuple[int, ...]  # the full HF tensor's
    region: tuple[tuple[int, int, int], ...]
    dtype: torch.dtype
    start: int
    nbytes: int

    @property
    def slice_shape(self) -> tuple[int, ...]:
        lengths = {d: n for d, _, n in self.region}
        return tuple(lengths.get(d, s) for d, s in enumerate(self.shape))


@dataclass(frozen=True)
class Route:
    """The elements of one piece (already clipped to a region) from one holder to one engine rank; a local copy
    when sender == receiver."""

    source: str
    sender: int
    receiver: int
    entry: int  # index of the SliceEntry in the receiver's outputs of this bucket
    piece: Piece

    @property
    def local(self) -> bool:
        return self.sender == self.receiver


@dataclass
class EngineShardPlan:
    export: ExportPlan
    ranks: list[EngineRank]
    routes: list[list[Route]]  # per bucket
    outputs: list[dict[int, list[SliceEntry]]]  # per bucket, per receiver rank

    def bytes_by_receiver(self) -> dict[int, dict[str, int]]:
        """Per receiver: bytes it loads ("needed"), of them received over the wire ("wire") and copied locally."""
        out = {er.rank: dict(needed=0, wire=0, local=0) for er in self.ranks}
        for b, routes in enumerate(self.routes):
            for r in routes:
                n = r.piece.numel * self.export.sources[r.source].dtype.itemsize
                out[r.receiver]["local" if r.local else "wire"] += n
            for rank, entries in self.outputs[b].items():
                out[rank]["needed"] += sum(e.nbytes for e in entries)
        return out


def plan_engine_shards(export: ExportPlan, ranks: list[EngineRank], dims: ModelDims) -> EngineShardPlan:
    """Routes from holders to engine ranks, per bucket of `export` (same buckets, same order): every element an
    engine rank loads comes exactly once, from itself where it holds it, else from the least loaded holder."""
    if export.quantize is not None:
        raise EngineShardError(f"engine-sharded export of a quantized ({export.quantize.name}) plan: not supported yet "
                               "(FP8 blocks need 128-aligned regions); export unquantized or to all ranks")
    if len({er.rank for er in ranks}) != len(ranks):
        raise EngineShardError(f"engine ranks: expected one engine rank per training rank, found "
                               f"{sorted(er.rank for er in ranks)}")
    unknown = sorted({n for s in export.sources.values() for n in s.hf_names
                      if not has_sharding_kind(n, export.model_type)})
    if unknown:  # e.g. GLM-4.5V's / Kimi-K2.5's vision tower: not in the table; every such tensor named
        raise EngineShardError(f"engine-sharded export: {len(unknown)} HF tensor(s) have no engine sharding rule "
                               f"(mcore2hf.plan.engine_shards.KINDS / ARCH_KINDS; of the vision towers only Qwen3-VL's and "
                               f"Qwen3.5's are covered: export the others with buckets() or exclude them with a name "
                               f"filter): " + problem_list(unknown, groups=8))
    piece_cache: dict = {}
    loads = LeastLoaded()  # the one route rule (routes.py), shared with the receivers export
    all_routes, all_outputs = [], []
    for b in export.buckets:
        routes: list[Route] = []
        outputs: dict[int, list[SliceEntry]] = {er.rank: [] for er in ranks}
        where: dict[int, dict] = {er.rank: {} for er in ranks}
        offsets: dict[int, list[int]] = {er.rank: [0] for er in ranks}
        for s in b.sources:
            op = s.resolved.op
            key = (id(op), s.shard_shape, s.count, tuple(s.hf_shapes))
            if key not in piece_cache:
                piece_cache[key] = (op, pieces(op, s.shard_shape, s.count, s.hf_shapes))
            ps = piece_cache[key][1]
            item = s.dtype.itemsize
            for j, (name, shape) in enumerate(zip(s.hf_names, s.out_shapes())):
                # a published copy (j >= n_out) is output 0 again
                mine = [p for p in ps if p.out == j] if j < op.n_out else [p for p in ps if p.out == 0]
                for er in ranks:
                    regions = engine_regions(name, shape, dims, er.placement, export.model_type)
                    entries = outputs[er.rank]
                    for region in regions:
                        index = _slice_entry(where[er.rank], entries, name, shape, region, s.dtype,
                                             offsets[er.rank])
                        for p in mine:
                            c = clip(p, region)
                            if c is None:
                                continue
                            sender = loads.route(s.holders[c.shard], er.rank, c.numel * item)
                            routes.append(Route(s.name, sender, er.rank, index, c))
        _check_tiling(b.index, routes, outputs)
        all_routes.append(routes)
        all_outputs.append(outputs)
    return EngineShardPlan(export, list(ranks), all_routes, all_outputs)


def _slice_entry(index: dict, entries: list[SliceEntry], name, shape, region, dtype, offset: list[int]) -> int:
    """The index of (name, region)'s SliceEntry in the receiver's outputs, packed after the last one if new
    (stacked sources share one HF tensor: its entries are made once)."""
    k = index.get((name, region))
    if k is None:
        lengths = {d: ln for d, _, ln in region}
        n = dtype.itemsize * math.prod(lengths.get(d, s) for d, s in enumerate(shape))
        start = -(-offset[0] // dtype.itemsize) * dtype.itemsize  # tight, aligned for the dtype's view
        entries.append(SliceEntry(name, tuple(shape), tuple(region), dtype, start, n))
        offset[0] = start + n
        k = index[(name, region)] = len(entries) - 1
    return k


def _check_tiling(bucket: int, routes: list[Route], outputs: dict[int, list[SliceEntry]]) -> None:
    """No byte twice, none missing: per receiver and slice, the routed pieces are pairwise disjoint and their
    elements add up to the slice's (each piece lies inside its slice: clip made it so)."""
    by_entry: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for r in routes:
        by_entry[(r.receiver, r.entry)].append(r.piece)
    for rank, entries in outputs.items():
        for k, e in enumerate(entries):
            ps = by_entry.get((rank, k), [])
            got = sum(p.numel for p in ps) * e.dtype.itemsize
            overlap = _first_overlap(ps)
            if got != e.nbytes or overlap:
                raise AssertionError(f"internal error: bucket {bucket}, rank {rank}, {e.name} {e.region}: routed "
                                     f"{got} of {e.nbytes} bytes, overlap {overlap}")


def _first_overlap(ps: list[Piece]) -> tuple[Piece, Piece] | None:
    """A pair of pieces that may share an element, or None. Sort and sweep along the dim where the pieces' starts
    differ most: only pieces whose intervals on that dim overlap are compared (others cannot meet), so a slice
    tiled by many pieces costs ~n log n, not n^2."""
    if len(ps) < 2:
        return None
    d = max(range(len(ps[0].start)), key=lambda k: len({p.start[k] for p in ps}))
    active: list[tuple[int, Piece]] = []  # (last coordinate on dim d, piece) of pieces the sweep still meets
    for p in sorted(ps, key=lambda q: q.start[d]):
        lo = p.start[d]
        active = [(hi, q) for hi, q in active if hi >= lo]
        for _, q in active:
            if _meet(q, p):
                return q, p
        active.append((lo + (p.count[d] - 1) * p.step[d], p))
    return None


def _meet(a: Piece, b: Piece) -> bool:
    """Whether two pieces may share an element: on every dim the progressions' intervals overlap and their
    offsets agree modulo gcd of the steps (exact for the steps the ops produce: 1, and 2 with offsets 0 / 1)."""
    for sa, qa, na, sb, qb, nb in zip(a.start, a.step, a.count, b.start, b.step, b.count):
        if sa + (na - 1) * qa < sb or sb + (nb - 1) * qb < sa or (sa - sb) % math.gcd(qa, qb):
            return False
    return True
