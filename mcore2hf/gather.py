"""Gathers: turn the plan into per-bucket collectives and copies, compile them once, run them every export.

Every tensor travels as its *stacked shards*: the TP shards one after the other in a flat byte buffer. Per
bucket and rank there is at most one collective per group, each on one flat buffer:

all ranks receive (colocated RL sync, the default):
  1. TP all-gather (dense tensors) and expert-TP all-gather (experts) of the shards this rank holds;
  2. EP all-gather of the experts of this PP stage (each EP rank contributes its own experts);
  3. PP all-gather of everything, each stage contributing the tensors it owns (the broadcast from the
     owning stage, with all stages' buckets interleaved so every stage sends at once).
  Data-parallel replicas run the same on their own groups, so no byte is sent twice to a rank.
chosen receivers (saving, a distributed sender): every shard is sent once, from one holder chosen to balance
  the senders, straight to each receiver (one batched point-to-point round per bucket); nobody else receives.

Compiled once (first export), reused by every later export:
* staging lives in a preallocated arena; each all-gather is in place (a rank packs its part straight into its
  slot of the receive buffer), and packing is one `_foreach_copy_` per collective into precomputed views;
* the final step is each layout op's strided copies (`LayoutOp.copies`) from the arena into the bucket's flat
  output buffer, with runs of same-shaped tensors (a layer's experts) merged into one batched copy, so the
  host issues a few hundred copies per export instead of work per tensor;
* where the plan allows (`BucketPlan.direct`: every member of the last grouped all-gather, EP ranks or PP stages,
  contributes the same bytes), that all-gather lands in the output itself: each rank runs its sources' layout-op
  copies into its slot of the output (member m's HF tensors are bytes [m * slot, (m + 1) * slot)) and gathers in
  place, so the bulk of the bytes (the experts, at EP) is written once and never copied after the collective.

Memory: one arena (about a bucket of staging) and the output buffer of the bucket being built; with
`arenas=2` the next bucket's first collectives also overlap this bucket's conversion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .buckets import Bucket
from .engine_shards import EngineShardError, EngineSlice, place_slices, region_slices
from .layouts import Stacked, _row_strides
from .naming import LocalTensor
from .parallel import Axis, ParallelContext
from .plan import BucketPlan, ExportPlan, Source, align
from .quantize import (
    FP8RowSlices,
    chunks,
    get_scheme,
    per_block_cast_to_fp8,
    per_block_cast_to_fp8_batched,
    quantize_flat,
)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

LOCAL = "local"
OUT = "out"  # in the bucket's output buffer already (a direct stage put it there)


@dataclass
class Loc:
    """Where a source's shards are on this rank: a local parameter, or byte offsets in a staging region."""

    region: str | int  # LOCAL, or the index of a stage's receive region
    offsets: tuple[int, ...] = (0,)  # byte offset of each shard in the region


@dataclass
class Stage:
    """One coalesced collective: an all-gather on a group (in place), or a point-to-point round."""

    axis: Axis | None
    slot: int  # bytes each member contributes (padded to the largest)
    packs: list[tuple[Source, int]]  # this rank's sources and their byte offset in its slot
    striped: bool  # TP stage: member i holds shard i of every source
    depends: bool = False  # packs read an earlier stage of this bucket
    #: lands in the output buffer (BucketPlan.direct): each member converts its sources into its slot of it
    direct: bool = False


@dataclass
class P2PRound:
    sends: dict[int, list[tuple[Source, int, int]]]  # receiver -> [(source, shard, byte offset)]
    send_bytes: dict[int, int]
    recv_from: dict[int, int]  # sender -> offset of its segment in the receive buffer
    recv_bytes: dict[int, int]
    recv_total: int


@dataclass
class Program:
    """What this rank does for one bucket."""

    bucket: BucketPlan
    receive: bool
    stages: list[Stage] = field(default_factory=list)
    p2p: P2PRound | None = None
    where: dict[str, Loc] = field(default_factory=dict)
    before: list[dict[str, Loc]] = field(default_factory=list)  # `where` as it was when each stage packed
    #: a stacked tensor gathered in rounds (BucketPlan.rounds): one program per round, all into one output
    rounds: list[Program] | None = None

    def add(self, stage: Stage) -> int:
        self.before.append(dict(self.where))
        self.stages.append(stage)
        return len(self.stages) - 1


def _my_sources(b: BucketPlan, ctx: ParallelContext) -> list[Source]:
    """Sources of the bucket this rank holds (its shard, for sharded ones)."""
    return [s for s in b.sources if ctx.pp.rank in s.stages and (not s.is_expert or s.ep == ctx.ep.rank)]


def all_ranks_program(b: BucketPlan, ctx: ParallelContext) -> Program:
    prog = Program(b, receive=True)
    where = prog.where
    held = _my_sources(b, ctx)
    for s in held:
        if s.count == 1:
            where[s.name] = Loc(LOCAL)
    for axis, expert in ((ctx.tp, False), (ctx.etp, True)):
        items = [s for s in held if s.is_expert == expert and s.count > 1]
        if not items:
            continue
        packs, slot = [], 0
        for s in items:
            packs.append((s, slot))
            slot += align(s.shard_nbytes)
        k = prog.add(Stage(axis, slot, packs, striped=True))
        for s, o in packs:  # shard i is in member i's slot
            where[s.name] = Loc(k, tuple(i * slot + o for i in range(s.count)))

    def grouped(axis: Axis, members: list[list[Source]], mine: int, last: bool) -> None:
        if last and b.direct is not None:  # the plan laid member m's HF tensors out at [m * slot, (m + 1) * slot)
            depends = any(where[s.name].region != LOCAL for s in members[mine])
            prog.add(Stage(axis, b.direct, [(s, 0) for s in members[mine]], striped=False, depends=depends,
                           direct=True))
            for s in (s for srcs in members for s in srcs):
                where[s.name] = Loc(OUT)
            return
        layouts = []
        for srcs in members:
            offs, off = [], 0
            for s in srcs:
                offs.append(off)
                off += s.stacked_nbytes
            layouts.append((srcs, offs))
        slot = max((offs[-1] + srcs[-1].stacked_nbytes) if srcs else 0 for srcs, offs in layouts)
        if slot == 0:
            return
        srcs, offs = layouts[mine]
        depends = any(where[s.name].region != LOCAL for s in srcs)
        k = prog.add(Stage(axis, slot, list(zip(srcs, offs)), striped=False, depends=depends))
        # everything delivered here is read from here afterwards, own part included: one region, constant
        # strides, so same-shaped tensors of every member merge into batched copies
        for m, (srcs_m, offs_m) in enumerate(layouts):
            for s, off in zip(srcs_m, offs_m):
                step = align(s.shard_nbytes)
                where[s.name] = Loc(k, tuple(m * slot + off + i * step for i in range(s.count)))

    if ctx.ep.size > 1:
        members = [[s for s in b.sources if s.is_expert and ctx.pp.rank in s.stages and s.ep == m]
                   for m in range(ctx.ep.size)]
        grouped(ctx.ep, members, ctx.ep.rank, last=ctx.pp.size == 1)
    if ctx.pp.size > 1:
        grouped(ctx.pp, [[s for s in b.sources if s.stage == st] for st in range(ctx.pp.size)], ctx.pp.rank,
                last=True)
    missing = [s.name for s in b.sources if s.name not in where]
    assert not missing, f"internal error: no route to {missing[:5]}"
    return prog


def receivers_program(b: BucketPlan, ctx: ParallelContext, receivers: tuple[int, ...]) -> Program:
    me = ctx.rank
    prog = Program(b, receive=me in receivers)
    load: dict[int, int] = {}
    # (sender, receiver) -> [(source, shard)]; the sender of each shard balances the bytes sent per rank
    routes: dict[tuple[int, int], list[tuple[Source, int]]] = {}
    offsets: dict[str, list] = {}
    for s in b.sources:
        offs: list = [None] * s.count
        for i in range(s.count):
            holders = s.holders[i]
            need = [r for r in receivers if r not in holders]
            if me in receivers and me in holders:
                offs[i] = LOCAL
            if not need:
                continue
            sender = min(holders, key=lambda r: (load.get(r, 0), r))
            load[sender] = load.get(sender, 0) + s.shard_nbytes * len(need)
            for r in need:
                routes.setdefault((sender, r), []).append((s, i))
        offsets[s.name] = offs
    sends: dict[int, list] = {}
    send_bytes: dict[int, int] = {}
    for (p, r), items in routes.items():
        if p != me:
            continue
        off, lst = 0, []
        for s, i in items:
            lst.append((s, i, off))
            off += align(s.shard_nbytes)
        sends[r], send_bytes[r] = lst, off
    recv_from: dict[int, int] = {}
    recv_bytes: dict[int, int] = {}
    total = 0
    if prog.receive:
        for (p, r), items in sorted(routes.items()):
            if r != me:
                continue
            recv_from[p] = total
            off = total
            for s, i in items:
                offsets[s.name][i] = off
                off += align(s.shard_nbytes)
            recv_bytes[p] = off - total
            total = off
        for s in b.sources:
            offs = offsets[s.name]
            if all(o == LOCAL for o in offs):
                if s.count > 1:  # this receiver holds every shard: only possible for count 1
                    raise AssertionError(f"internal error: {s.name}")
                prog.where[s.name] = Loc(LOCAL)
            elif any(o == LOCAL for o in offs):
                prog.where[s.name] = Loc("mixed", tuple(offs))  # some shards here, some received
            else:
                prog.where[s.name] = Loc(0, tuple(offs))
    prog.p2p = P2PRound(sends, send_bytes, recv_from, recv_bytes, total)
    return prog


# --------------------------------------------------------------------------------------------------------------
# compilation: arena layout, precomputed views, merged copies


@dataclass
class CStage:
    group: object
    recv: torch.Tensor | None  # uint8 view of the arena: members * slot (None: direct, the output's first bytes)
    mine: torch.Tensor | None  # this rank's slot (the in-place all-gather input)
    dsts: list[torch.Tensor]  # pack destinations (typed views of `mine`)
    srcs: list  # pack sources: parameters / arena views, or callables for buffers
    dynamic: list[int]  # indices of srcs that are callables
    #: a direct stage: its layout-op copies of this rank's sources into its slot of the output, and the slot
    direct: tuple[list[Copy], int, int, int] | None = None  # (copies, members, member index, slot bytes)
    #: a direct stage whose sources are all whole-shard copies filling the slot in order: one concatenation
    #: (dtype, first and end element of the slot, sources) instead of the copies (a kernel, not one per tensor)
    cat: tuple[torch.dtype, int, int, list] | None = None


@dataclass
class CP2P:
    sends: list[tuple[int, torch.Tensor, list, list, list[int]]]  # (dst rank, buffer, dsts, srcs, dynamic)
    recvs: list[tuple[int, torch.Tensor]]  # (src rank, buffer)


@dataclass
class Copy:
    """A (batched) strided copy into the output buffer."""

    dtype: torch.dtype
    sizes: tuple[int, ...]
    dst_strides: tuple[int, ...]
    dst_offset: int
    src: torch.Tensor | None  # precomputed view of the arena (None: from a parameter, see `local`)
    local: object = None  # the parameter (or buffer getter) for local sources
    src_strides: tuple[int, ...] = ()
    src_offset: int = 0
    tag: tuple = ()  # (op, index in its copies()): gate and up halves never merge with each other
    add: float = 0.0  # added after the copy (StridedCopy.add)


@dataclass
class CBucket:
    plan: BucketPlan
    receive: bool
    arena: int
    stages: list[CStage] = field(default_factory=list)
    p2p: CP2P | None = None
    copies: list[Copy] = field(default_factory=list)
    dtypes: tuple[torch.dtype, ...] = ()
    # FP8 on the shards: this rank's shards to quantize before the bucket's collectives, by shard shape
    prequant: list[tuple[FP8RowSlices, list[tuple[str, object]]]] = field(default_factory=list)
    program: Program | None = None
    rounds: list[CBucket] | None = None  # a bucket gathered in rounds: each round's collectives and copies
    #: bytes per export: received by its collectives, written packing them, copied into the output after them
    moved: tuple[int, int, int] = (0, 0, 0)


def _source_of(lt: LocalTensor):
    """A parameter is used as is (stays valid when training swaps its .data); buffers and computed tensors (a LoRA
    merge) are read through their getter each time."""
    return lt.get if lt.param is None else lt.param


def _getters(srcs: list) -> list[int]:
    """Indices of the sources that are buffer getters (called at each export) rather than tensors."""
    return [i for i, x in enumerate(srcs) if not isinstance(x, torch.Tensor)]


class Executor:
    """Runs the plan's buckets on this rank; every rank of the world must run the same plan in step."""

    def __init__(self, plan: ExportPlan, ctx: ParallelContext, local: dict[str, LocalTensor],
                 receivers: tuple[int, ...] | None, device: torch.device, arenas: int = 1):
        self.plan, self.ctx, self.local, self.device = plan, ctx, local, device
        self.scheme = get_scheme(plan.quantize)
        self._blobs: dict[str, torch.Tensor] = {}  # this export's shards quantized before the collectives
        self.receivers = receivers
        self.arenas_n = max(1, arenas)
        # bytes summed over exports: received by the collectives, packed before them (a direct stage's layout
        # copies included), copied into the output after them (what a direct stage saves)
        self.stats = {"gather_s": 0.0, "convert_s": 0.0, "received_bytes": 0, "packed_bytes": 0, "copied_bytes": 0}
        self._timing = False
        self.programs = [self._program(b) for b in plan.buckets]
        self._compiled: list[CBucket] | None = None

    def _program(self, b: BucketPlan) -> Program:
        def make(bp: BucketPlan) -> Program:
            if self.receivers is None:
                return all_ranks_program(bp, self.ctx)
            return receivers_program(bp, self.ctx, self.receivers)

        if not b.rounds:
            return make(b)
        # each round is a bucket of its own for the collectives (staging of <= the budget, reused by the next
        # round); its copies write its pieces' items into the one output the whole bucket describes
        rounds = [make(replace(b, sources=r, rounds=None)) for r in b.rounds]
        return Program(b, receive=rounds[0].receive, rounds=rounds)

    def _src(self, s: Source):
        """What a source's local shard is read from: the parameter (or a buffer getter), or for a tensor
        quantized on the shards a getter of its FP8 blob (quantized once per export, dropped after its bucket)."""
        lt = self.local[s.name]
        if not s.prequant:
            return _source_of(lt)
        op: FP8RowSlices = s.resolved.op
        param, n = _source_of(lt), s.shard_shape[0]
        data, soff = op.rows * op.cols, op.scale_offset
        ue8m0 = self.scheme.ue8m0

        def blob() -> torch.Tensor:
            b = self._blobs.get(s.name)
            if b is None:
                p = param if isinstance(param, torch.Tensor) else param()
                q, sf = per_block_cast_to_fp8(p.detach(), ue8m0)
                b = torch.empty(n, dtype=torch.uint8, device=p.device)
                b[:data].copy_(q.view(torch.uint8).view(-1))
                b[soff:].copy_(sf.view(torch.uint8).view(-1))
                self._blobs[s.name] = b
            return b

        return blob

    # -- compilation ---------------------------------------------------------------------------------------------
    def _stage_bytes(self, prog: Program) -> tuple[list[int], int]:
        if prog.rounds:
            return [], max(self._stage_bytes(r)[1] for r in prog.rounds)
        offs, total = [], 0
        if prog.p2p is not None:
            total = prog.p2p.recv_total + sum(prog.p2p.send_bytes.values())
            return [0], align(total)
        for st in prog.stages:
            offs.append(total)
            if not st.direct:  # a direct stage gathers into the output, not the arena
                total += align(st.axis.size * st.slot)
        return offs, total

    def memory_estimate(self) -> dict[str, int]:
        """This rank's extra memory for an export: the staging arena(s) and the largest output bucket it builds."""
        sizes = [self._stage_bytes(p)[1] for p in self.programs]
        arenas = [max([sz for i, sz in enumerate(sizes) if i % self.arenas_n == a] or [0]) for a in range(self.arenas_n)]
        me = self.ctx.rank
        # a quantized export holds the gathered bucket and its quantized copy at once
        out = max([b.nbytes + (b.out_nbytes if b.out_entries is not None else 0) for b in self.plan.buckets
                   if self.receivers is None or me in self.receivers] or [0])
        # a bucket whose collective lands in its output allocates that output when it starts, while the consumer
        # still holds the previous bucket
        nxt = max([b.nbytes for b in self.plan.buckets if b.direct is not None and self.receivers is None] or [0])
        return {"arena_bytes": sum(arenas), "largest_bucket_bytes": out, "next_bucket_bytes": nxt,
                "total_bytes": sum(arenas) + out + nxt}

    def compile(self) -> None:
        if self._compiled is not None:
            return
        sizes = [self._stage_bytes(p)[1] for p in self.programs]
        per_arena = [max([sz for i, sz in enumerate(sizes) if i % self.arenas_n == a] or [0])
                     for a in range(self.arenas_n)]
        self.arenas = [torch.empty(max(n, 64), dtype=torch.uint8, device=self.device) for n in per_arena]
        self._typed = [{} for _ in self.arenas]
        self._compiled = [self._compile_bucket(k, p) for k, p in enumerate(self.programs)]

    def _typed_arena(self, a: int, dtype: torch.dtype) -> torch.Tensor:
        t = self._typed[a].get(dtype)
        if t is None:
            buf = self.arenas[a]
            t = self._typed[a][dtype] = buf[:buf.numel() - buf.numel() % dtype.itemsize].view(dtype)
        return t

    def _view(self, a: int, byte_offset: int, s: Source) -> torch.Tensor:
        t = self._typed_arena(a, s.dtype)
        return t[byte_offset // s.dtype.itemsize:][:s.shard_nbytes // s.dtype.itemsize].view(s.shard_shape)

    def _compile_bucket(self, k: int, prog: Program) -> CBucket:
        a = k % self.arenas_n
        if prog.rounds:
            cb = CBucket(prog.bucket, prog.receive, a, program=prog,
                         rounds=[self._compile_bucket(k, r) for r in prog.rounds])
            cb.dtypes = tuple(sorted({d for r in cb.rounds for d in r.dtypes}, key=str))
            cb.moved = tuple(sum(r.moved[i] for r in cb.rounds) for i in range(3))
            return cb
        arena = self.arenas[a]
        stage_offs, _ = self._stage_bytes(prog)
        cb = CBucket(prog.bucket, prog.receive, a, program=prog)
        groups: dict[tuple, tuple] = {}
        for s in prog.bucket.sources:
            if s.prequant and s.name in self.local:
                op = s.resolved.op
                groups.setdefault((op.rows, op.cols), (op, []))[1].append((s.name, _source_of(self.local[s.name])))
        cb.prequant = list(groups.values())
        region_base: dict = {}
        if prog.p2p is not None:
            r = prog.p2p
            base = 0
            cb.p2p = CP2P([], [])
            for dst_rank, items in r.sends.items():
                n = r.send_bytes[dst_rank]
                dsts = [self._view(a, base + off, s) for s, _i, off in items]
                srcs = [self._src(s) for s, _i, _off in items]
                cb.p2p.sends.append((dst_rank, arena[base:base + n], dsts, srcs, _getters(srcs)))
                base += align(n)
            recv_base = base
            for src_rank, off in r.recv_from.items():
                cb.p2p.recvs.append((src_rank, arena[recv_base + off:recv_base + off + r.recv_bytes[src_rank]]))
            region_base[0] = recv_base
        for j, st in enumerate(prog.stages):
            base = stage_offs[j]
            region_base[j] = base
            if st.direct:
                cat = self._whole_slot(prog, j)
                pre = [] if cat else self._compile_copies(prog, a, region_base, direct=j)
                cb.stages.append(CStage(st.axis.group, None, None, [], [], [],
                                        direct=(pre, st.axis.size, st.axis.rank, st.slot), cat=cat))
                continue
            recv = arena[base:base + st.axis.size * st.slot]
            mine = recv[st.axis.rank * st.slot:(st.axis.rank + 1) * st.slot]
            dsts, srcs = [], []
            for s, off in st.packs:
                if st.striped:  # this rank's own TP shard
                    dsts.append(self._view(a, base + st.axis.rank * st.slot + off, s))
                    srcs.append(self._src(s))
                else:  # every shard of the source, from where it is now
                    loc = prog.before[j].get(s.name, Loc(LOCAL))
                    step = align(s.shard_nbytes)
                    for i in range(s.count):
                        dsts.append(self._view(a, base + st.axis.rank * st.slot + off + i * step, s))
                        if loc.region == LOCAL:
                            srcs.append(self._src(s))
                        else:
                            srcs.append(self._view(a, region_base[loc.region] + loc.offsets[i], s))
            cb.stages.append(CStage(st.axis.group, recv, mine, dsts, srcs, _getters(srcs)))
        if prog.receive:
            cb.copies = self._compile_copies(prog, a, region_base)
            cb.dtypes = tuple(sorted({e.dtype for e in prog.bucket.entries} | {s.dtype for s in prog.bucket.sources},
                                     key=str))
        cb.moved = _moved(prog, cb)
        return cb

    def _whole_slot(self, prog: Program, j: int) -> tuple | None:
        """The concatenation that fills this rank's slot of direct stage j, when its sources are local shards of one
        dtype that their layout ops move unchanged (`_whole`) into outputs laid back to back over the slot."""
        st = prog.stages[j]
        srcs = [s for s, _ in st.packs]
        entries = {e.name: e for e in prog.bucket.entries}
        outs = [entries[n] for s in srcs for n in s.resolved.hf_names]
        if not srcs or len({s.dtype for s in srcs} | {e.dtype for e in outs}) != 1:
            return None
        if not all(prog.before[j].get(s.name, Loc(LOCAL)).region == LOCAL and _whole(s) for s in srcs):
            return None
        lo, hi, isz = st.axis.rank * st.slot, (st.axis.rank + 1) * st.slot, srcs[0].dtype.itemsize
        ends = [lo] + [e.start + e.nbytes for e in outs]
        if any(e.start != end for e, end in zip(outs, ends)) or ends[-1] != hi or lo % isz:
            return None
        return srcs[0].dtype, lo // isz, hi // isz, [self._src(s) for s in srcs]

    def _compile_copies(self, prog: Program, a: int, region_base: dict, direct: int | None = None) -> list[Copy]:
        """The copies into the output buffer after the collectives, or with `direct` = j those of the sources
        this rank converts into its slot of direct stage j, before it (from where they were then)."""
        entries = {e.name: e for e in prog.bucket.entries}
        raw: list[Copy] = []
        if direct is not None:
            st = prog.stages[direct]
            lo, hi = st.axis.rank * st.slot, (st.axis.rank + 1) * st.slot
            todo = [(s, prog.before[direct].get(s.name, Loc(LOCAL))) for s, _ in st.packs]
            bad = [n for s, _ in todo for n in s.resolved.hf_names
                   if not (lo <= entries[n].start and entries[n].start + entries[n].nbytes <= hi)]
            assert not bad, f"internal error: {bad[:3]} outside this rank's slot [{lo}, {hi}) of the output"
        else:
            todo = [(s, prog.where[s.name]) for s in prog.bucket.sources]
        for s, loc in todo:
            outs = [entries[n] for n in s.resolved.hf_names]
            isz = s.dtype.itemsize
            specs = s.resolved.op.copies(s.shard_shape, s.count)
            if loc.region == OUT:  # a direct stage delivered its outputs
                pass
            elif loc.region == LOCAL:
                for c in specs:
                    strides, off = c.resolve(0)
                    raw.append(Copy(s.dtype, c.sizes, c.dst_strides, outs[c.out].start // isz + c.dst_offset,
                                    None, self._src(s), strides, off, add=c.add))
            else:
                base = region_base[0 if loc.region == "mixed" else loc.region]
                for j, c in enumerate(specs):
                    for copy in self._placed(s, c, outs, loc.offsets, base, a):
                        copy.tag, copy.add = (type(s.resolved.op).__name__, j), c.add
                        raw.append(copy)
            # duplicates of the first output (MTP's embedding / head copies), after the gather
            for name in s.resolved.copies if direct is None else ():
                e, first = entries[name], outs[0]
                raw.append(Copy(s.dtype, (first.nbytes // isz,), (1,), e.start // isz, None, ("out", first.start // isz),
                                (1,), 0))
        return _merge(raw, self._typed_arena, a)

    def _placed(self, s: Source, c, outs, offs, base, a: int) -> list[Copy]:
        """Copies of spec `c` for a source whose shard i sits at byte offset offs[i] (or is local)."""
        isz = s.dtype.itemsize
        dst0 = outs[c.out].start // isz + c.dst_offset
        placed = all(o != LOCAL for o in offs)
        steps = {offs[i + 1] - offs[i] for i in range(len(offs) - 1)} if placed and len(offs) > 1 else {s.shard_nbytes}
        if placed and len(steps) == 1 and min(steps) > 0:  # evenly spaced, ascending: one strided copy
            step = steps.pop() // isz
            strides, off = c.resolve(step)
            return [Copy(s.dtype, c.sizes, c.dst_strides, dst0, None, ("arena", a), strides,
                         (base + offs[0]) // isz + off)]
        # shards not evenly spaced (point-to-point segments in any order, or partly local): one copy per shard
        out = []
        per_shard = c.src_strides and c.src_strides[0] == "S" and c.sizes[0] == s.count
        for i in (range(s.count) if per_shard else [c.src_shards]):
            sizes, dstr, sstr = (c.sizes[1:], c.dst_strides[1:], c.src_strides[1:]) if per_shard else \
                (c.sizes, c.dst_strides, c.src_strides)
            doff = dst0 + (i * c.dst_strides[0] if per_shard else 0)
            if offs[i] == LOCAL:
                out.append(Copy(s.dtype, sizes, dstr, doff, None, self._src(s), sstr, c.src_offset))
            else:
                out.append(Copy(s.dtype, sizes, dstr, doff, None, ("arena", a), sstr,
                                (base + offs[i]) // isz + c.src_offset))
        return out

    # -- collectives ---------------------------------------------------------------------------------------------
    @staticmethod
    def _pack(dsts: list, srcs: list, dynamic: list[int]) -> None:
        if not dsts:
            return
        if dynamic:
            srcs = list(srcs)
            for i in dynamic:
                srcs[i] = srcs[i]()
        torch._foreach_copy_(dsts, srcs)

    def _launch(self, cb: CBucket, j: int, works: list, flat: torch.Tensor | None) -> None:
        st = cb.stages[j]
        if st.direct is not None:  # this rank's sources converted into its slot of the output, gathered in place
            copies, members, me, slot = st.direct
            if st.cat is not None:
                dtype, lo, hi, srcs = st.cat
                typed = flat[:flat.numel() - flat.numel() % dtype.itemsize].view(dtype)
                torch.cat([(p if isinstance(p, torch.Tensor) else p()).reshape(-1) for p in srcs], out=typed[lo:hi])
            self._copy_into(copies, cb.dtypes, flat)
            recv = flat[:members * slot]
            works.append(_all_gather(recv, recv[me * slot:(me + 1) * slot], group=st.group, async_op=True))
            return
        self._pack(st.dsts, st.srcs, st.dynamic)
        works.append(_all_gather(st.recv, st.mine, group=st.group, async_op=True))

    def _quantize_held(self, cb: CBucket) -> None:
        """The FP8 blobs of this rank's shards in the bucket, quantized per shard shape in batched passes of
        bounded size (their fp32 temporaries stay far below a bucket)."""
        for op, items in cb.prequant:
            for todo in chunks([(n, src) for n, src in items if n not in self._blobs], op.rows * op.cols):
                self._quantize_batch(op, todo)

    def _quantize_batch(self, op: FP8RowSlices, todo: list) -> None:
        if todo:
            x = torch.stack([(src if isinstance(src, torch.Tensor) else src()).detach() for _, src in todo])
            q, sf = per_block_cast_to_fp8_batched(x, self.scheme.ue8m0)
            del x
            n, data, soff = len(todo), op.rows * op.cols, op.scale_offset
            blobs = torch.empty((n, FP8RowSlices.blob_nbytes(op.rows, op.cols)), dtype=torch.uint8, device=q.device)
            blobs[:, :data].copy_(q.view(torch.uint8).reshape(n, data))
            blobs[:, soff:].copy_(sf.view(torch.uint8).reshape(n, -1))
            for k, (name, _) in enumerate(todo):
                self._blobs[name] = blobs[k]

    def start(self, index: int, first_only: bool = False) -> tuple:
        """Issue the collectives of bucket `index` that depend on nothing of this bucket not yet done (of its
        first round, for a bucket gathered in rounds)."""
        cb = self._compiled[index]
        if cb.rounds:
            _, works, j, _ = self._start(cb.rounds[0], first_only)
            return cb, works, j, None
        return self._start(cb, first_only)

    def _start(self, cb: CBucket, first_only: bool = False) -> tuple:
        """(bucket, collectives in flight, next stage, output buffer: allocated here when a stage lands in it)"""
        flat = None
        if cb.receive and any(st.direct is not None for st in cb.stages):
            flat = torch.empty(cb.plan.nbytes, dtype=torch.uint8, device=self.device)
        if cb.prequant:
            self._quantize_held(cb)
        works: list = []
        if cb.p2p is not None:
            ops = []
            for dst_rank, buf, dsts, srcs, dyn in cb.p2p.sends:
                self._pack(dsts, srcs, dyn)
                ops.append(dist.P2POp(dist.isend, buf, dst_rank))
            for src_rank, buf in cb.p2p.recvs:
                ops.append(dist.P2POp(dist.irecv, buf, src_rank))
            if ops:
                works.extend(dist.batch_isend_irecv(ops))
            return cb, works, 0, flat
        stages = cb.program.stages
        j = 0
        while j < len(stages) and not stages[j].depends and (not first_only or stages[j].striped):
            self._launch(cb, j, works, flat)
            j += 1
        return cb, works, j, flat

    def _now(self) -> float:
        if self._timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def finish(self, run: tuple) -> Bucket:
        cb, works, j, flat = run
        for key, n in zip(("received_bytes", "packed_bytes", "copied_bytes"), cb.moved):
            self.stats[key] += n
        if cb.rounds:
            return self._finish_rounds(cb, works, j)
        self._gather(cb, works, j, flat)
        t1 = self._now()
        bucket = self._convert(cb, flat)
        self.stats["convert_s"] += self._now() - t1
        return bucket

    def _gather(self, cb: CBucket, works: list, j: int, flat: torch.Tensor | None = None) -> None:
        t0 = self._now()
        for w in works:
            w.wait()
        while j < len(cb.stages):
            works = []
            self._launch(cb, j, works, flat)
            for w in works:
                w.wait()
            j += 1
        self.stats["gather_s"] += self._now() - t0

    def _finish_rounds(self, cb: CBucket, works: list, j: int) -> Bucket:
        """A stacked tensor over the budget: each round's pieces are gathered into the (reused) staging arena and
        written into their items of the one output buffer, so the output is the only full copy held."""
        b = cb.plan
        flat = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device) if cb.receive else None
        try:
            for r, rcb in enumerate(cb.rounds):
                if r:
                    _, works, j, _ = self._start(rcb)
                self._gather(rcb, works, j)
                t1 = self._now()
                if flat is not None:
                    self._copy_into(rcb.copies, rcb.dtypes, flat)
                self.stats["convert_s"] += self._now() - t1
        finally:
            for s in b.sources:
                self._blobs.pop(s.name, None)
        return self._output(b, flat)

    def _convert(self, cb: CBucket, flat: torch.Tensor | None) -> Bucket:
        b = cb.plan
        try:
            return self._build(cb, flat)
        finally:
            for s in b.sources:  # this bucket's FP8 blobs are no longer needed
                self._blobs.pop(s.name, None)

    def _build(self, cb: CBucket, flat: torch.Tensor | None) -> Bucket:
        b = cb.plan
        if not cb.receive:
            return Bucket(b.index, None, b.output)
        if flat is None:
            flat = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
        self._copy_into(cb.copies, cb.dtypes, flat)
        return self._output(b, flat)

    def _output(self, b, flat: torch.Tensor | None) -> Bucket:
        """The bucket as sent, from its gathered HF tensors (one round or several)."""
        if flat is not None and b.out_entries is not None:  # FP8: each full HF weight quantized as a whole
            flat = quantize_flat(flat, b.entries, b.out_entries, self.scheme)
        return Bucket(b.index, flat, b.output)

    @staticmethod
    def _copy_into(copies: list[Copy], dtypes: tuple[torch.dtype, ...], flat: torch.Tensor) -> None:
        """Compiled copies (layout ops) from staging and parameters into the output buffer `flat`."""
        n = flat.numel()
        typed = {dt: flat[:n - n % dt.itemsize].view(dt) for dt in dtypes}
        for c in copies:
            dst = typed[c.dtype].as_strided(c.sizes, c.dst_strides, c.dst_offset)
            if c.src is not None:
                dst.copy_(c.src)
            elif isinstance(c.local, tuple):  # a duplicate of another output
                dst.copy_(typed[c.dtype].as_strided(c.sizes, c.src_strides, c.local[1] + c.src_offset))
            else:
                p = c.local if isinstance(c.local, torch.Tensor) else c.local()  # a buffer getter
                if not p.is_contiguous():
                    p = p.contiguous()
                dst.copy_(p.as_strided(c.sizes, c.src_strides, p.storage_offset() + c.src_offset))
            if c.add:
                dst.add_(c.add)

    def run(self, on_bucket: Callable[[int], None] | None = None, timing: bool = False) -> Iterator[Bucket]:
        """Yield the buckets in order. `timing` synchronizes the device around phases so `stats` split exactly.

        Holds no reference to a yielded bucket while building the next (torch.no_grad as a generator decorator
        would): a consumer that drops each bucket keeps one output buffer alive."""
        steps = self._run(on_bucket, timing)
        while True:
            with torch.no_grad():  # parameters require grad; packing them must not record autograd history
                bucket = next(steps, None)
            if bucket is None:
                return
            yield bucket
            del bucket

    def _run(self, on_bucket: Callable[[int], None] | None, timing: bool) -> Iterator[Bucket]:
        self._timing = timing
        self.compile()
        n = len(self.programs)
        if n == 0:
            return
        pending = self.start(0)
        for k in range(n):
            nxt = None
            if k + 1 < n and self.arenas_n > 1:  # the next bucket's first collectives overlap this conversion
                nxt = self.start(k + 1, first_only=True)
            bucket = self.finish(pending)
            if k + 1 < n and nxt is None:  # one arena: start the next as soon as this one is converted
                nxt = self.start(k + 1)
            if on_bucket is not None:
                on_bucket(k)
            yield bucket
            del bucket  # a consumer that dropped it frees it before the next is built: one output bucket alive
            pending = nxt


def _whole(s: Source) -> bool:
    """Its layout op moves the shard's elements unchanged and in order into its outputs laid back to back (an
    expert's fc1 [gate; up] -> gate_proj, up_proj at expert-TP 1; fc2 -> down_proj): one contiguous copy."""
    if s.count != 1 or isinstance(s.resolved.op, Stacked):
        return False
    base, n = [], 0
    for shape in s.hf_shapes:
        base.append(n)
        n += math.prod(shape)
    if n != math.prod(s.shard_shape):
        return False
    covered = 0
    for c in s.resolved.op.copies(s.shard_shape, 1):
        strides, off = c.resolve(0)
        want, k = [], 1
        for d in reversed(c.sizes):
            want.insert(0, k)
            k *= d
        if c.add or off != base[c.out] + c.dst_offset or any(
                d > 1 and not (a == b == w) for d, a, b, w in zip(c.sizes, strides, c.dst_strides, want)):
            return False
        covered += math.prod(c.sizes)
    return covered == n


def _copy_bytes(copies: list[Copy]) -> int:
    total = 0
    for c in copies:
        n = c.dtype.itemsize
        for d in c.sizes:
            n *= d
        total += n
    return total


def _moved(prog: Program, cb: CBucket) -> tuple[int, int, int]:
    """(received, packed, copied after the collectives) bytes of one compiled bucket on this rank."""
    received = sum((st.axis.size - 1) * st.slot for st in prog.stages)
    packed = sum(_copy_bytes(st.direct[0]) + (st.direct[3] if st.cat else 0) if st.direct else
                 sum(d.numel() * d.element_size() for d in st.dsts) for st in cb.stages)
    if cb.p2p is not None:
        received += prog.p2p.recv_total
        packed += sum(d.numel() * d.element_size() for _, _, dsts, _, _ in cb.p2p.sends for d in dsts)
    return received, packed, _copy_bytes(cb.copies)


def _merge(raw: list[Copy], typed_arena, a: int) -> list[Copy]:
    """Merge copies with equal shapes and strides whose source and destination offsets advance in equal
    positive steps (a layer's experts from one EP rank, say) into batched copies; resolve arena sources to
    precomputed views. Order does not matter: destinations are disjoint and sources are only read."""
    out: list[Copy] = []
    duplicates: list[Copy] = []  # copies of outputs: run after everything else
    groups: dict[tuple, list[Copy]] = {}
    for c in raw:
        if isinstance(c.local, tuple) and c.local[0] == "arena":
            groups.setdefault((c.dtype, c.sizes, c.dst_strides, c.src_strides, c.local, c.tag, c.add), []).append(c)
        elif isinstance(c.local, tuple):
            duplicates.append(c)
        else:
            out.append(c)  # parameters: one copy each
    for group in groups.values():
        group.sort(key=lambda c: (c.src_offset, c.dst_offset))
        i = 0
        while i < len(group):
            first, n = group[i], 1
            if i + 1 < len(group):
                dstep = group[i + 1].dst_offset - first.dst_offset
                sstep = group[i + 1].src_offset - first.src_offset
                if dstep > 0 and sstep > 0:  # as_strided takes no negative strides
                    while (i + n < len(group) and group[i + n].dst_offset - group[i + n - 1].dst_offset == dstep
                           and group[i + n].src_offset - group[i + n - 1].src_offset == sstep):
                        n += 1
            out.append(_finalize(first, n, dstep if n > 1 else None, sstep if n > 1 else None, typed_arena))
            i += n
    return out + duplicates


def _finalize(c: Copy, count: int, dstep, sstep, typed_arena) -> Copy:
    sizes, dstr, sstr = c.sizes, c.dst_strides, c.src_strides
    if count > 1:
        sizes, dstr, sstr = (count, *sizes), (dstep, *dstr), (sstep, *sstr)
    if isinstance(c.local, tuple) and c.local[0] == "arena":
        src = typed_arena(c.local[1], c.dtype).as_strided(sizes, sstr, c.src_offset)
        return Copy(c.dtype, sizes, dstr, c.dst_offset, src, add=c.add)
    return Copy(c.dtype, sizes, dstr, c.dst_offset, None, c.local, sstr, c.src_offset, add=c.add)


# --------------------------------------------------------------------------------------------------------------
# engine-sharded export (issue 15): each rank receives only the regions its engine rank loads. A separate program
# beside receivers_program for now (design 3.3 folds receivers_program onto the same view-based P2P round): one
# batched point-to-point round per bucket, sends packed from strided views of the local shards, local pieces
# copied straight from the shards.


@dataclass
class _EngineBucketProgram:
    entries: list  # SliceEntry of this rank
    nbytes: int
    sends: list  # (peer, nbytes, [(source, piece)])
    recvs: list  # (peer, nbytes, [(entry index, piece)])
    local: list  # (entry index, source, piece)


@dataclass
class _EngineCompiled:
    """A bucket's run, compiled once: every view precomputed except the output's (a new buffer per bucket)."""

    entries: list  # SliceEntry of this rank (raw slices)
    out: list  # the output's layout: SliceEntry ("slices") or HFEntry of the full tensors ("masked")
    nbytes: int
    dtypes: tuple
    sends: list  # (peer, arena view) in peer order
    recvs: list  # (peer, arena view) in peer order
    pack_dsts: list  # send-arena views, one per piece sent, all packed by one _foreach_copy_
    pack_srcs: list  # shard views (None where computed at each run: a buffer getter, a non-contiguous shard)
    pack_dyn: list  # (index, source name, (sizes, strides, offset))
    local: list  # Copy: this rank's own pieces (src a shard view, or local=(name,) for a dynamic shard)
    unpack: list  # Copy: merged strided copies from the receive arena
    bases: list  # (source name, shard, data_ptr) the precomputed shard views rely on
    sent: int = 0
    received: int = 0
    local_bytes: int = 0


class EngineExecutor:
    """Runs an EngineShardPlan on this rank; every member of the transport group runs it in step (collective).

    Transport: with `group` (any torch ProcessGroup, also one outside the default world, e.g. a weight-update
    group built from a TCPStore, see senders/process_group.py) the routes' ranks are ranks in `group` and `rank`
    is this process's: batch_isend_irecv on it where torch.distributed knows the group, else the group's own
    send/recv (a bare backend). Otherwise the default world, with `rank` defaulting to `ctx.rank`. A process holding nothing (a disaggregated engine
    process) passes `ctx=None`, `local={}` and its `rank`: it runs the receive side only.

    Output: "slices" packs the raw regions tight (`EngineBucket.slices()`); "masked" lays the buffer out as the
    full-shaped HF tensors of the export plan's bucket (its layout, the same on every rank) and every piece
    is written straight into its final position (`EngineBucket.as_bucket()` is free). `debug` fills a masked
    output with NaN first (float dtypes; integer tensors' unsent regions stay uninitialized).

    Compiled on the first run (the shards' storages are known then): send packing is one `_foreach_copy_` into
    a send arena reused by every bucket and step, receive unpacking a few merged strided copies from the
    receive arena, local pieces precomputed shard views; a later run's Python work is one output view per local
    piece and per merged receive copy (the output is a new buffer per bucket), none per received piece."""

    def __init__(self, eplan, ctx: ParallelContext | None, local: dict[str, LocalTensor], device: torch.device, *,
                 group=None, rank: int | None = None, output: str = "slices", debug: bool = False):
        if rank is None:
            if ctx is None:
                raise EngineShardError("EngineExecutor: expected `rank` (this process's rank in the transport group) "
                                       "when no ParallelContext is given, found neither")
            rank = ctx.rank
        if output not in ("slices", "masked"):
            raise EngineShardError(f"engine-shard output: expected 'slices' or 'masked', found {output!r}")
        self.eplan, self.ctx, self.local, self.device = eplan, ctx, local, device
        self.group, self.rank, self.output, self.debug = group, rank, output, debug
        # the default world, or a group registered with torch.distributed (new_group, join_weight_update_group)
        self._batched = group is None or group in dist.distributed_c10d._world.pg_group_ranks
        self._feeds = any(rank in out for out in eplan.outputs)  # an engine rank's feeder (or the engine rank)
        self.programs = [self._program(k) for k in range(len(eplan.routes))]
        self.stats = {"sent_bytes": 0, "received_bytes": 0, "local_bytes": 0}
        self._compiled: list[_EngineCompiled] | None = None

    def _program(self, k: int) -> _EngineBucketProgram:
        me, plan = self.rank, self.eplan.export
        entries = self.eplan.outputs[k].get(me, [])
        sends: dict[int, list] = {}
        recvs: dict[int, list] = {}
        local = []
        for r in self.eplan.routes[k]:  # the same order on every rank: sender and receiver agree on offsets
            src = plan.sources[r.source]
            if r.sender == me and src.name not in self.local:
                raise EngineShardError(f"engine-shard plan: rank {me} is to send {src.name} (bucket {k}) but holds "
                                       f"no local tensor of that name (expected the holders' local tensors)")
            if r.local:
                if r.receiver == me:
                    local.append((r.entry, src, r.piece))
            elif r.sender == me:
                sends.setdefault(r.receiver, []).append((src, r.piece))
            elif r.receiver == me:
                recvs.setdefault(r.sender, []).append((r.entry, src, r.piece))
        nbytes = max((e.start + e.nbytes for e in entries), default=0)
        return _EngineBucketProgram(entries, nbytes,
                                    [(p, _packed_bytes([(s, c) for s, c in items]), items)
                                     for p, items in sorted(sends.items())],
                                    [(p, _packed_bytes([(s, c) for _, s, c in items]), items)
                                     for p, items in sorted(recvs.items())],
                                    local)

    # -- compilation ---------------------------------------------------------------------------------------------
    def _arena_bytes(self, prog: _EngineBucketProgram) -> int:
        return sum(align(n) for _, n, _ in prog.sends) + sum(align(n) for _, n, _ in prog.recvs)

    def compile(self) -> None:
        if self._compiled is not None:
            return
        n = max([self._arena_bytes(p) for p in self.programs] or [0])
        self._arena = torch.empty(max(n, 64), dtype=torch.uint8, device=self.device)
        self._typed: dict = {}
        self._compiled = [self._compile(p, k) for k, p in enumerate(self.programs)]

    def _typed_arena(self, _a: int, dtype: torch.dtype) -> torch.Tensor:
        t = self._typed.get(dtype)
        if t is None:
            n = self._arena.numel()
            t = self._typed[dtype] = self._arena[:n - n % dtype.itemsize].view(dtype)
        return t

    def _base(self, name: str) -> tuple[torch.Tensor | None, object]:
        """(the shard to precompute views of, or None when it must be read at each run; what it was read from)."""
        src = _source_of(self.local[name])
        if isinstance(src, torch.Tensor) and src.is_contiguous():
            return src.detach(), src
        return None, src

    def _full_layout(self, k: int) -> list:
        """A masked output's layout: every HF tensor of the bucket, in the export plan's layout, on every rank that
        feeds an engine rank (vLLM's packed IPC update sends one name/shape list for all its workers, so the
        layouts must agree); nothing on a rank that feeds none."""
        return list(self.eplan.export.buckets[k].output) if self._feeds else []

    def _layout(self, entries: list, k: int) -> tuple[list, dict]:
        """The output's entries and, per SliceEntry index, (element offset of the region's origin in its dtype's
        view of the output, the strides there, the region's start per dim)."""
        if self.output == "slices":
            out = entries
            where = {}
            for i, e in enumerate(entries):
                lo = {d: o for d, o, _ in e.region}
                where[i] = (e.start // e.dtype.itemsize, _row_strides(e.slice_shape),
                            tuple(lo.get(d, 0) for d in range(len(e.shape))))
            return out, where
        out = self._full_layout(k)
        by_name = {h.name: h for h in out}
        where = {i: (by_name[e.name].start // e.dtype.itemsize, _row_strides(e.shape), (0,) * len(e.shape))
                 for i, e in enumerate(entries)}
        return out, where

    def _compile(self, prog: _EngineBucketProgram, k: int) -> _EngineCompiled:
        out, where = self._layout(prog.entries, k)
        nbytes = max((e.start + e.nbytes for e in out), default=0)
        cb = _EngineCompiled(prog.entries, out, nbytes, tuple(sorted({e.dtype for e in out}, key=str)),
                             [], [], [], [], [], [], [], [])
        bases: dict[str, tuple] = {}

        def base(name: str):
            if name not in bases:
                bases[name] = self._base(name)
            return bases[name][0]

        arena, off = self._arena, 0
        for peer, n, items in prog.sends:
            for (s, c), o in zip(items, _offsets(items)):
                isz = s.dtype.itemsize
                cb.pack_dsts.append(arena[off + o:off + o + c.numel * isz].view(s.dtype).view(c.count))
                b = base(s.name)
                if b is None:
                    cb.pack_srcs.append(None)
                    cb.pack_dyn.append((len(cb.pack_dsts) - 1, s.name, c.src_view()))
                else:
                    sizes, strides, so = c.src_view()
                    cb.pack_srcs.append(b.as_strided(sizes, strides, b.storage_offset() + so))
            cb.sends.append((peer, arena[off:off + n]))
            cb.sent += n
            off += align(n)
        raw = []
        for peer, n, items in prog.recvs:
            for (entry, s, c), o in zip(items, _offsets([(s, c) for _, s, c in items])):
                isz = s.dtype.itemsize
                sizes, dstr, doff = _dst(where[entry], c)
                raw.append(Copy(s.dtype, sizes, dstr, doff, None, ("arena", 0), _row_strides(c.count),
                                (off + o) // isz, tag=(c.add,), add=c.add))
            cb.recvs.append((peer, arena[off:off + n]))
            cb.received += n
            off += align(n)
        cb.unpack = _merge(raw, self._typed_arena, 0)
        for entry, s, c in prog.local:
            sizes, dstr, doff = _dst(where[entry], c)
            ss, sstr, so = c.src_view()
            b = base(s.name)
            src = None if b is None else b.as_strided(ss, sstr, b.storage_offset() + so)
            cb.local.append(Copy(s.dtype, sizes, dstr, doff, src, None if b is not None else (s.name,), sstr, so,
                                 add=c.add))
            cb.local_bytes += c.numel * s.dtype.itemsize
        cb.bases = [(name, b[1], b[1].data_ptr()) for name, b in bases.items() if b[0] is not None]
        return cb

    def _stale(self, cb: _EngineCompiled) -> bool:
        """Whether a shard was replaced since compiling (training swapped a parameter's .data): views follow."""
        return any(t.data_ptr() != ptr for _, t, ptr in cb.bases)

    # -- running -------------------------------------------------------------------------------------------------
    def _exchange(self, sends: list, recvs: list, tag: int) -> list:
        """Post every send and receive of a bucket at once ((peer, buffer) each); returns the works to wait on."""
        if self._batched:  # coalesced (NCCL launches the bucket's sends and receives as one group)
            ops = [dist.P2POp(dist.isend, buf, group=self.group, group_peer=peer) for peer, buf in sends] + \
                  [dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer) for peer, buf in recvs]
            return dist.batch_isend_irecv(ops) if ops else []
        # a group torch.distributed does not know (a bare backend, e.g. ProcessGroupGloo(store, rank, size)): its
        # own send/recv, which take its ranks directly
        works = [self.group.recv([buf], peer, tag) for peer, buf in recvs]
        return works + [self.group.send([buf], peer, tag) for peer, buf in sends]

    def _dynamic(self, name: str, shards: dict) -> torch.Tensor:
        t = shards.get(name)
        if t is None:  # once per bucket: a non-contiguous shard is copied once, not once per piece
            t = _source_of(self.local[name])
            t = t if isinstance(t, torch.Tensor) else t()  # a buffer getter
            t = shards[name] = (t if t.is_contiguous() else t.contiguous()).detach()
        return t

    def run(self) -> Iterator[EngineBucket]:
        """Yield this rank's bucket of every plan bucket in order (collective over the transport group)."""
        with torch.no_grad():
            self.compile()
        for k in range(len(self._compiled)):
            with torch.no_grad():
                cb = self._compiled[k]
                if cb.bases and self._stale(cb):
                    cb = self._compiled[k] = self._compile(self.programs[k], k)
                bucket = self._run(k, cb)
            yield bucket
            del bucket

    def _run(self, k: int, cb: _EngineCompiled) -> EngineBucket:
        shards: dict = {}
        if cb.pack_dsts:
            srcs = cb.pack_srcs
            if cb.pack_dyn:
                srcs = list(srcs)
                for i, name, (sizes, strides, off) in cb.pack_dyn:
                    t = self._dynamic(name, shards)
                    srcs[i] = t.as_strided(sizes, strides, t.storage_offset() + off)
            torch._foreach_copy_(cb.pack_dsts, srcs)
        works = self._exchange(cb.sends, cb.recvs, k)
        flat = torch.empty(cb.nbytes, dtype=torch.uint8, device=self.device)
        n = flat.numel()
        typed = {dt: flat[:n - n % dt.itemsize].view(dt) for dt in cb.dtypes}
        if self.debug and self.output == "masked":
            for e in cb.out:
                if e.dtype.is_floating_point:
                    flat[e.start:e.start + e.nbytes].view(e.dtype).fill_(float("nan"))
        self._copies(cb.local, typed, shards)  # overlaps the transfers
        for w in works:
            w.wait()
        self._copies(cb.unpack, typed, shards)
        self.stats["sent_bytes"] += cb.sent
        self.stats["received_bytes"] += cb.received
        self.stats["local_bytes"] += cb.local_bytes
        masked = self.output == "masked"
        return EngineBucket(k, flat, cb.entries, cb.out if masked else None, cb.out if masked else self._full_layout(k),
                            nan=masked and self.debug)

    def _copies(self, copies: list[Copy], typed: dict, shards: dict) -> None:
        if not copies:
            return
        dsts, srcs, adds = [], [], []
        for c in copies:
            dst = typed[c.dtype].as_strided(c.sizes, c.dst_strides, c.dst_offset)
            src = c.src
            if src is None:  # a dynamic shard
                t = self._dynamic(c.local[0], shards)
                src = t.as_strided(c.sizes, c.src_strides, t.storage_offset() + c.src_offset)
            dsts.append(dst)
            srcs.append(src)
            if c.add:
                adds.append((dst, c.add))
        torch._foreach_copy_(dsts, srcs)
        for dst, add in adds:
            dst.add_(add)


class EngineBucket:
    """One rank's share of a bucket: the regions its engine rank loads, in one flat byte buffer. `slices()` gives
    the raw slices with their (dim, offset, length) metadata for custom engines; `as_bucket()` the full-shaped
    HF tensors, only those regions written, for stock engines' load_weights (free when the executor's output is
    "masked": the buffer already is that bucket)."""

    def __init__(self, index: int, flat: torch.Tensor, entries: list, full: list | None = None,
                 layout: list | None = None, nan: bool = False):
        self.index, self.flat, self.entries, self.full, self.nan = index, flat, entries, full, nan
        self.layout = full if layout is None else layout  # as_bucket()'s: the export plan's (same on every rank)

    def __len__(self) -> int:
        return len(self.entries)

    def slices(self) -> list[tuple[str, EngineSlice]]:
        """(HF name, EngineSlice) per region, views of `flat` (a tensor with several regions appears once each)."""
        if self.full is not None:
            tensors = dict(self.as_bucket().named_tensors())
            return [(e.name, EngineSlice(e.region, tensors[e.name][region_slices(e.region)])) for e in self.entries]
        return [(e.name, EngineSlice(e.region, self.flat[e.start:e.start + e.nbytes].view(e.dtype)
                                     .view(e.slice_shape))) for e in self.entries]

    def as_bucket(self, debug: bool = False) -> Bucket:
        """The full-shaped tensors as an all-ranks Bucket (flat, entries, named_tensors(), metadata()), so every
        sender sends it unchanged. Free for a "masked" executor's bucket (its NaN fill is the executor's `debug`);
        from a "slices" one it is packed into a new buffer (NaN outside the regions with `debug`)."""
        if self.full is not None:
            if debug and not self.nan:  # written in place: the NaN fill had to come first, in the executor
                raise EngineShardError("as_bucket(debug=True) on a masked bucket: expected an executor built with "
                                       "debug=True (it fills NaN before writing), found debug=False")
            if not hasattr(self, "_bucket"):
                self._bucket = Bucket(self.index, self.flat, self.full)
            return self._bucket
        entries = self.layout or []
        flat = torch.empty(max((e.start + e.nbytes for e in entries), default=0), dtype=torch.uint8,
                           device=self.flat.device)
        bucket = Bucket(self.index, flat, entries)
        tensors = dict(bucket.named_tensors())
        if debug:
            for t in tensors.values():
                if t.is_floating_point():
                    t.fill_(float("nan"))
        for name, s in self.slices():
            place_slices([s], tensors[name])
        return bucket

    def masked(self, debug: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(HF name, full-shaped tensor) as a stock `load_weights` takes them: `as_bucket(debug).named_tensors()`."""
        return self.as_bucket(debug).named_tensors()

    def __repr__(self) -> str:
        return f"EngineBucket(index={self.index}, slices={len(self)}, bytes={self.flat.numel()})"


def _dst(where: tuple, piece) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A piece's destination in a dtype view of the output: (sizes, strides, element offset)."""
    origin, strides, lo = where
    start = origin + sum((a - o) * st for a, o, st in zip(piece.start, lo, strides))
    return tuple(piece.count), tuple(q * st for q, st in zip(piece.step, strides)), start


def _offsets(items: list) -> list[int]:
    """Byte offsets of pieces packed in order, each aligned for its dtype (sender and receiver agree)."""
    out, off = [], 0
    for s, c in items:
        isz = s.dtype.itemsize
        off = -(-off // isz) * isz
        out.append(off)
        off += c.numel * isz
    return out


def _packed_bytes(items: list) -> int:
    offs = _offsets(items)
    return (offs[-1] + items[-1][1].numel * items[-1][0].dtype.itemsize) if items else 0
