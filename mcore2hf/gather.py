"""Gathers: turn the plan into per-bucket collectives and run them, asynchronously and coalesced.

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

Bucket k+1's first collectives are issued before bucket k is converted and handed out (double buffering).
The final step, `LayoutOp.to_hf`, writes straight into the bucket's flat output buffer: one copy per byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .buckets import Bucket
from .naming import LocalTensor
from .parallel import Axis, ParallelContext
from .plan import BucketPlan, ExportPlan, Source, align

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Where a source's stacked shards are on this rank, once the collectives before the final step are done.
LOCAL = ("local",)


@dataclass
class Stage:
    """One coalesced all-gather on one group."""

    axis: Axis
    slot: int  # bytes each member contributes (padded to the largest)
    packs: list[tuple[Source, int]]  # this rank's sources and their offset in its slot
    striped: bool  # TP stage: member i holds shard i of every source


@dataclass
class P2PRound:
    """One batched point-to-point round: what this rank sends to each receiver and receives from each sender."""

    sends: dict[int, list[tuple[Source, int, int]]]  # receiver -> [(source, shard, offset)]
    send_bytes: dict[int, int]
    recv_from: dict[int, int]  # sender -> offset of its segment in the receive buffer
    recv_bytes: dict[int, int]
    recv_total: int


@dataclass
class Program:
    """What this rank does for one bucket."""

    bucket: BucketPlan
    receive: bool
    # waves[0] is the TP / expert-TP wave (possibly empty), then EP, then PP. Only waves[0] is issued ahead of
    # the previous bucket's later waves: its groups never span PP stages, so the issue order of every group is
    # the same on all its members (a stage without TP work must not move its PP collective ahead).
    waves: list[list[Stage]] = field(default_factory=lambda: [[]])
    p2p: P2PRound | None = None
    # source name -> location: LOCAL, ("striped", stage#, off), ("packed", stage#, member, off),
    # or for P2P a list with one entry per shard: LOCAL or ("seg", sender, off)
    where: dict[str, object] = field(default_factory=dict)


def _my_sources(b: BucketPlan, ctx: ParallelContext) -> list[Source]:
    """Sources of the bucket this rank holds (its shard, for sharded ones)."""
    return [s for s in b.sources if ctx.pp.rank in s.stages and (not s.is_expert or s.ep == ctx.ep.rank)]


def all_ranks_program(b: BucketPlan, ctx: ParallelContext) -> Program:
    prog = Program(b, receive=True)
    where = prog.where
    held = _my_sources(b, ctx)
    for s in held:
        if s.count == 1:
            where[s.name] = LOCAL
    n_stage = 0
    wave: list[Stage] = []
    for axis, expert in ((ctx.tp, False), (ctx.etp, True)):
        items = [s for s in held if s.is_expert == expert and s.count > 1]
        if not items:
            continue
        packs, off = [], 0
        for s in items:
            packs.append((s, off))
            where[s.name] = ("striped", n_stage, off)
            off += align(s.shard_nbytes)
        wave.append(Stage(axis, off, packs, striped=True))
        n_stage += 1
    prog.waves[0] = wave

    def grouped(axis: Axis, members: list[list[Source]], mine: int) -> None:
        nonlocal n_stage
        layouts = []
        for srcs in members:
            offs, off = [], 0
            for s in srcs:
                offs.append(off)
                off += s.stacked_nbytes
            layouts.append((srcs, offs, off))
        slot = max(lay[2] for lay in layouts)
        if slot == 0:
            return
        for m, (srcs, offs, _) in enumerate(layouts):
            if m == mine:
                continue
            for s, off in zip(srcs, offs):
                where[s.name] = ("packed", n_stage, m, off)
        srcs, offs, _ = layouts[mine]
        prog.waves.append([Stage(axis, slot, list(zip(srcs, offs)), striped=False)])
        n_stage += 1

    if ctx.ep.size > 1:
        members = [[s for s in b.sources if s.is_expert and ctx.pp.rank in s.stages and s.ep == m]
                   for m in range(ctx.ep.size)]
        grouped(ctx.ep, members, ctx.ep.rank)
    if ctx.pp.size > 1:
        # a stage contributes what it owns; tensors it holds a copy of (tied embedding) stay where they are
        members = [[s for s in b.sources if s.stage == st] for st in range(ctx.pp.size)]
        before = dict(where)
        grouped(ctx.pp, members, ctx.pp.rank)
        for s in b.sources:
            if ctx.pp.rank in s.stages and s.name in before:
                where[s.name] = before[s.name]
    missing = [s.name for s in b.sources if s.name not in where]
    assert not missing, f"internal error: no route to {missing[:5]}"
    return prog


def receivers_program(b: BucketPlan, ctx: ParallelContext, receivers: tuple[int, ...]) -> Program:
    me = ctx.rank
    prog = Program(b, receive=me in receivers)
    load: dict[int, int] = {}
    # (sender, receiver) -> [(source, shard)] ; the sender of each shard balances bytes sent per rank
    routes: dict[tuple[int, int], list[tuple[Source, int]]] = {}
    mine: dict[str, list] = {}
    for s in b.sources:
        locs: list = [None] * s.count
        for i in range(s.count):
            holders = s.holders[i]
            need = [r for r in receivers if r not in holders]
            if me in receivers and me in holders:
                locs[i] = LOCAL
            if not need:
                continue
            sender = min(holders, key=lambda r: (load.get(r, 0), r))
            load[sender] = load.get(sender, 0) + s.shard_nbytes * len(need)
            for r in need:
                routes.setdefault((sender, r), []).append((s, i))
        mine[s.name] = locs
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
                mine[s.name][i] = ("seg", p, off)
                off += align(s.shard_nbytes)
            recv_bytes[p] = off - total
            total = off
        prog.where = mine
    prog.p2p = P2PRound(sends, send_bytes, recv_from, recv_bytes, total)
    return prog


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class _Run:
    """The in-flight state of one bucket."""

    def __init__(self, prog: Program):
        self.prog = prog
        self.recv: list[torch.Tensor] = []  # per stage, [members * slot] bytes
        self.works: list = []
        self.next_wave = 0
        self.p2p_recv: torch.Tensor | None = None


class Executor:
    """Runs the plan's buckets on this rank; every rank of the world must run the same plan in step."""

    def __init__(self, plan: ExportPlan, ctx: ParallelContext, local: dict[str, LocalTensor],
                 receivers: tuple[int, ...] | None, device: torch.device):
        self.plan, self.ctx, self.local, self.device = plan, ctx, local, device
        self.receivers = receivers
        self.stats = {"gather_s": 0.0, "convert_s": 0.0}
        self._timing = False
        if receivers is None:
            self.programs = [all_ranks_program(b, ctx) for b in plan.buckets]
        else:
            self.programs = [receivers_program(b, ctx, receivers) for b in plan.buckets]

    # -- shard views -----------------------------------------------------------------------------------------
    def _local(self, s: Source) -> torch.Tensor:
        return self.local[s.name].get()

    def _view(self, buf: torch.Tensor, start: int, s: Source) -> torch.Tensor:
        return buf[start:start + s.shard_nbytes].view(s.dtype).view(s.shard_shape)

    def _shards(self, run: _Run, s: Source) -> list[torch.Tensor]:
        loc = run.prog.where[s.name]
        if loc == LOCAL:
            return [self._local(s)]
        if isinstance(loc, list):  # point-to-point: one location per shard
            return [self._local(s) if lo == LOCAL else self._view(run.p2p_recv, lo[2], s) for lo in loc]
        kind, k = loc[0], loc[1]
        stage = self._stage(run.prog, k)
        rows = run.recv[k].view(stage.axis.size, stage.slot)
        if kind == "striped":
            return [self._view(rows[i], loc[2], s) for i in range(s.count)]
        member, off = loc[2], loc[3]
        step = align(s.shard_nbytes)
        return [self._view(rows[member], off + i * step, s) for i in range(s.count)]

    @staticmethod
    def _stage(prog: Program, k: int) -> Stage:
        for wave in prog.waves:
            if k < len(wave):
                return wave[k]
            k -= len(wave)
        raise IndexError(k)

    # -- collectives -----------------------------------------------------------------------------------------
    def _launch_wave(self, run: _Run) -> None:
        prog = run.prog
        wave = prog.waves[run.next_wave]
        run.next_wave += 1
        for stage in wave:
            send = torch.empty(stage.slot, dtype=torch.uint8, device=self.device)
            for s, off in stage.packs:
                if stage.striped:  # my own TP shard
                    send[off:off + s.shard_nbytes].copy_(_bytes_view(self._local(s)))
                else:
                    step = align(s.shard_nbytes)
                    for i, shard in enumerate(self._shards(run, s)):
                        send[off + i * step:off + i * step + s.shard_nbytes].copy_(_bytes_view(shard))
            recv = torch.empty(stage.axis.size * stage.slot, dtype=torch.uint8, device=self.device)
            run.recv.append(recv)
            run.works.append(_all_gather(recv, send, group=stage.axis.group, async_op=True))

    def _launch_p2p(self, run: _Run) -> None:
        r = run.prog.p2p
        ops = []
        for dst, items in r.sends.items():
            send = torch.empty(r.send_bytes[dst], dtype=torch.uint8, device=self.device)
            for s, _i, off in items:
                shard = self._local(s)
                send[off:off + s.shard_nbytes].copy_(_bytes_view(shard))
            ops.append(dist.P2POp(dist.isend, send, dst))
        if r.recv_from:
            run.p2p_recv = torch.empty(r.recv_total, dtype=torch.uint8, device=self.device)
            for src, off in r.recv_from.items():
                ops.append(dist.P2POp(dist.irecv, run.p2p_recv[off:off + r.recv_bytes[src]], src))
        if ops:
            run.works.extend(dist.batch_isend_irecv(ops))

    def _wait(self, run: _Run) -> None:
        for w in run.works:
            w.wait()
        run.works.clear()

    def start(self, index: int) -> _Run:
        run = _Run(self.programs[index])
        if run.prog.p2p is not None:
            self._launch_p2p(run)
        else:
            self._launch_wave(run)  # the TP / expert-TP wave (no-op when empty)
        return run

    def _now(self) -> float:
        if self._timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def finish(self, run: _Run) -> Bucket:
        t0 = self._now()
        self._wait(run)
        while run.next_wave < len(run.prog.waves):
            self._launch_wave(run)
            self._wait(run)
        t1 = self._now()
        self.stats["gather_s"] += t1 - t0
        bucket = self._convert(run)
        self.stats["convert_s"] += self._now() - t1
        return bucket

    def _convert(self, run: _Run) -> Bucket:
        b = run.prog.bucket
        if not run.prog.receive:
            return Bucket(b.index, None, b.entries)
        flat = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
        views = {e.name: flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape) for e in b.entries}
        for s in b.sources:
            outs = [views[name] for name in s.hf_names]
            n = s.resolved.op.n_out
            s.resolved.op.to_hf(self._shards(run, s), outs[:n])
            for out in outs[n:]:
                out.copy_(outs[0])
        return Bucket(b.index, flat, b.entries)

    def run(self, on_bucket: Callable[[int], None] | None = None, timing: bool = False) -> Iterator[Bucket]:
        """Yield the buckets in order. `timing` synchronizes the device around phases so `stats` split exactly."""
        self._timing = timing
        n = len(self.programs)
        if n == 0:
            return
        pending = self.start(0)
        for k in range(n):
            nxt = self.start(k + 1) if k + 1 < n else None
            bucket = self.finish(pending)
            if on_bucket is not None:
                on_bucket(k)
            yield bucket
            pending = nxt
