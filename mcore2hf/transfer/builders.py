"""Program builders: the plan's buckets as per-rank programs (`program`), built once, identically reasoned on
every rank (no communication): the all-ranks export (collectives), the chosen-receivers export (one point-to-point
round) and the engine-shard export (one point-to-point round of pieces clipped to engine regions). The two
point-to-point builders route with the one rule of `routes`."""

from __future__ import annotations

from ..parallel import Axis, ParallelContext
from ..plan import BucketPlan, EngineShardPlan, Source, align
from .program import LOCAL, OUT, EngineProgram, Item, Loc, P2PRound, Program, Stage
from .routes import LeastLoaded


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
    loads = LeastLoaded()
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
            sender = loads.sender(holders, s.shard_nbytes * len(need))  # one sender for every receiver in need
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


def engine_program(eplan: EngineShardPlan, k: int, rank: int) -> EngineProgram:
    """Bucket k of an engine-shard plan on transport rank `rank`: the routes that start or end here, in plan order
    (the same on every rank, so sender and receiver agree on offsets), grouped by peer in ascending order."""
    export = eplan.export
    sends: dict[int, list[Item]] = {}
    recvs: dict[int, list[Item]] = {}
    local = []
    for r in eplan.routes[k]:
        if r.sender != rank and r.receiver != rank:
            continue
        src = export.sources[r.source]
        if r.local:
            local.append(Item(src.name, src.dtype, r.piece, r.entry))
        elif r.sender == rank:
            sends.setdefault(r.receiver, []).append(Item(src.name, src.dtype, r.piece))
        else:
            recvs.setdefault(r.sender, []).append(Item(src.name, src.dtype, r.piece, r.entry))
    feeds = any(rank in out for out in eplan.outputs)  # an engine rank's feeder (or the engine rank)
    # a masked output is laid out as the whole bucket on every rank that feeds an engine rank (vLLM's packed IPC
    # update sends one name/shape list for all its workers, so the layouts must agree)
    return EngineProgram(k, eplan.outputs[k].get(rank, []), list(export.buckets[k].output) if feeds else [],
                         sorted(sends.items()), sorted(recvs.items()), local)
