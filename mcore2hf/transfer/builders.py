"""Program builders: the plan's buckets as per-rank programs (`program`), built once, identically reasoned on
every rank (no communication): the all-ranks export (collectives), the chosen-receivers export (one point-to-point
round) and the engine-shard export (one point-to-point round of pieces clipped to engine regions). The two
point-to-point builders take their routes from the planner (`mcore2hf.plan.routes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..layouts.geometry import align
from ..parallel import Axis, ParallelContext
from ..plan.engine import EngineShardPlan
from ..plan.export import BucketPlan, ExportPlan, Source
from ..plan.routes import receiver_routes
from .program import LOCAL, OUT, EngineProgram, Item, Loc, P2PRound, Program, Stage


def _my_sources(b: BucketPlan, ctx: ParallelContext) -> list[Source]:
    """Sources of the bucket this rank holds (its shard, for sharded ones)."""
    return [s for s in b.sources if ctx.pp.rank in s.stages and (not s.is_expert or s.ep == ctx.ep.rank)]


def all_ranks_program(b: BucketPlan, ctx: ParallelContext, shared: dict | None = None,
                      locations: bool = True) -> Program:
    """What rank `ctx` does for bucket `b` when every rank receives. `shared`: a cache of the grouped stages'
    member layouts, which depend on the bucket and the PP stage only, kept by a caller that builds the programs
    of many ranks; `locations=False`: the stages only (what the arena needs), not where every source lands after
    them (such a program sizes memory, it cannot be compiled)."""
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

    def grouped(axis: Axis, members: dict[int, list[Source]], mine: int, last: bool, layouts: dict, slot: int,
                earlier: Callable[[Source], bool]) -> None:
        # members and layouts: the members that contribute anything (of up to EP 64 x PP 16), by member index.
        # `depends` (the stage waits for an earlier stage of this bucket, so it is issued when the bucket completes,
        # not when it starts) is decided for the whole group, from what any member packs: every member must issue
        # the collective at the same point. Decided per member, a member packing only its own tensors issued it a
        # bucket early (before the previous bucket was handed out), and any collective the consumer or a second
        # export ran on the group in between was matched with the wrong one: garbage at PP x EP on NCCL.
        depends = any(earlier(s) for srcs in members.values() for s in srcs)
        if last and b.direct is not None:  # the plan laid member m's HF tensors out at [m * slot, (m + 1) * slot)
            srcs = members.get(mine, [])
            prog.add(Stage(axis, b.direct, [(s, 0) for s in srcs], striped=False, depends=depends, direct=True))
            if locations:
                for s in (s for srcs in members.values() for s in srcs):
                    where[s.name] = Loc(OUT)
            return
        if slot == 0:
            return
        srcs, offs = layouts.get(mine, ([], []))
        k = prog.add(Stage(axis, slot, list(zip(srcs, offs)), striped=False, depends=depends))
        # everything delivered here is read from here afterwards, own part included: one region, constant
        # strides, so same-shaped tensors of every member merge into batched copies
        if locations:
            for m, (srcs_m, offs_m) in layouts.items():
                for s, off in zip(srcs_m, offs_m):
                    step = align(s.shard_nbytes)
                    where[s.name] = Loc(k, tuple(m * slot + off + i * step for i in range(s.count)))

    def members_of(key: tuple, member) -> tuple[dict[int, list[Source]], dict, int]:
        found = shared.get(key) if shared is not None else None
        if found is None:
            members: dict[int, list[Source]] = {}
            for s in b.sources:
                m = member(s)
                if m is not None:
                    members.setdefault(m, []).append(s)
            layouts = {}
            for m, srcs in members.items():
                offs, off = [], 0
                for s in srcs:
                    offs.append(off)
                    off += s.stacked_nbytes
                layouts[m] = (srcs, offs)
            slot = max((offs[-1] + srcs[-1].stacked_nbytes for srcs, offs in layouts.values()), default=0)
            found = (members, layouts, slot)
            if shared is not None:
                shared[key] = found
        return found

    pp = ctx.pp.rank
    if ctx.ep.size > 1:
        found = members_of((id(b.sources), "ep", pp), lambda s: s.ep if s.is_expert and pp in s.stages else None)
        # an expert's holder runs the expert-TP all-gather first
        grouped(ctx.ep, found[0], ctx.ep.rank, ctx.pp.size == 1, *found[1:], lambda s: s.count > 1)
    if ctx.pp.size > 1:
        found = members_of((id(b.sources), "pp"), lambda s: s.stage)
        # a holder runs the TP / expert-TP all-gather (sharded tensors) and the EP all-gather (experts) first
        grouped(ctx.pp, found[0], pp, True, *found[1:], lambda s: s.count > 1 or (s.is_expert and ctx.ep.size > 1))
    if locations:
        missing = [s.name for s in b.sources if s.name not in where]
        assert not missing, f"internal error: no route to {missing[:5]}"
    return prog


def receivers_program(b: BucketPlan, ctx: ParallelContext, receivers: tuple[int, ...]) -> Program:
    me = ctx.rank
    prog = Program(b, receive=me in receivers)
    routes = receiver_routes(b.sources, receivers)  # the planner's decision; this builds this rank's round
    offsets: dict[str, list] = {
        s.name: [LOCAL if me in receivers and me in s.holders[i] else None for i in range(s.count)]
        for s in b.sources}
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


def stage_bytes(prog: Program) -> tuple[list[int], int]:
    """(byte offset of each stage's region in the arena, arena bytes the program needs)."""
    if prog.rounds:
        return [], max(stage_bytes(r)[1] for r in prog.rounds)
    offs, total = [], 0
    if prog.p2p is not None:
        total = prog.p2p.recv_total + sum(prog.p2p.send_bytes.values())
        return [0], align(total)
    for st in prog.stages:
        offs.append(total)
        if not st.direct:  # a direct stage gathers into the output, not the arena
            total += align(st.axis.size * st.slot)
    return offs, total


def memory_estimate(plan: ExportPlan, arena_bytes: list[int], rank: int, receivers: tuple[int, ...] | None,
                    arenas: int) -> dict[str, int]:
    """A rank's extra memory for an export, from the arena bytes its program needs per bucket (`stage_bytes`):
    the staging arena(s) (bucket k stages in arena k % arenas) and the largest output bucket it builds."""
    per_arena = [max([sz for i, sz in enumerate(arena_bytes) if i % arenas == a] or [0]) for a in range(arenas)]
    return memory_line(plan, per_arena, rank, receivers)


def memory_line(plan: ExportPlan, per_arena: list[int], rank: int, receivers: tuple[int, ...] | None) -> dict[str, int]:
    """`memory_estimate` from the size of each arena."""
    # a quantized export holds the gathered bucket and its quantized copy at once
    out = max([b.nbytes + (b.out_nbytes if b.out_entries is not None else 0) for b in plan.buckets
               if receivers is None or rank in receivers] or [0])
    # a bucket whose collective lands in its output allocates that output when it starts, while the consumer
    # still holds the previous bucket
    nxt = max([b.nbytes for b in plan.buckets if b.direct is not None and receivers is None] or [0])
    return {"arena_bytes": sum(per_arena), "largest_bucket_bytes": out, "next_bucket_bytes": nxt,
            "total_bytes": sum(per_arena) + out + nxt}


def memory_estimates(plan: ExportPlan, contexts: list[ParallelContext], arenas: int = 1) -> list[dict[str, int]]:
    """`Executor.memory_estimate()` of every rank of `contexts` (all ranks receive), in one process, in seconds
    for 1,024 ranks.

    A rank's program for a bucket is fixed, up to rank ids, by its PP stage and the bucket's experts it holds (its
    EP rank's; every rank of a stage holds the stage's dense sources): ranks of one stage that hold none of the
    bucket's experts share one program, each holding EP rank has its own. So the arena bytes are computed once
    per bucket and stage (`default`) and once per bucket and holding (stage, EP rank), from the same programs
    (without the locations only compilation needs); a rank's arena is then the largest over its holdings and
    the stage's default of the buckets it does not hold."""
    shared: dict = {}  # the grouped stages' layouts, per bucket and stage
    by_stage: dict[int, dict[int, ParallelContext]] = {}  # stage -> EP rank -> a rank there
    for ctx in contexts:
        by_stage.setdefault(ctx.pp.rank, {}).setdefault(ctx.ep.rank, ctx)

    def size(b: BucketPlan, ctx: ParallelContext) -> int:
        return stage_bytes(bucket_program(b, ctx, None, shared, locations=False))[1]

    n = len(plan.buckets)
    default: dict[int, list[int | None]] = {pp: [None] * n for pp in by_stage}
    held: dict[tuple[int, int], dict[int, int]] = {}  # (stage, EP rank) -> bucket -> arena bytes
    for k, b in enumerate(plan.buckets):
        holders = {(st, s.ep) for s in b.sources if s.is_expert for st in s.stages}
        for pp, ranks in by_stage.items():
            free = next((c for ep, c in ranks.items() if (pp, ep) not in holders), None)
            if free is not None:
                default[pp][k] = size(b, free)
        for pp, ep in holders:
            ctx = by_stage.get(pp, {}).get(ep)
            if ctx is not None:
                held.setdefault((pp, ep), {})[k] = size(b, ctx)
    # per stage and arena: the buckets by default bytes, largest first
    order = {pp: [sorted((k for k in range(a, n, arenas) if d[k] is not None), key=lambda k: -d[k])
                  for a in range(arenas)] for pp, d in default.items()}
    lines: dict[tuple[int, ...], dict[str, int]] = {}  # rank ids do not matter when every rank receives
    out = []
    for ctx in contexts:
        pp, ep = ctx.pp.rank, ctx.ep.rank
        mine = held.get((pp, ep), {})
        per_arena = []
        for a in range(arenas):
            best = max([sz for k, sz in mine.items() if k % arenas == a] or [0])
            first = next((k for k in order[pp][a] if k not in mine), None)
            per_arena.append(max(best, default[pp][first]) if first is not None else best)
        key = tuple(per_arena)
        if key not in lines:
            lines[key] = memory_line(plan, per_arena, ctx.rank, None)
        out.append(dict(lines[key]))
    return out


def bucket_program(b: BucketPlan, ctx: ParallelContext, receivers: tuple[int, ...] | None,
                   shared: dict | None = None, locations: bool = True) -> Program:
    """What rank `ctx` does for bucket `b`: all ranks receive (receivers None), or the chosen receivers.
    `shared`, `locations`: see `all_ranks_program`."""
    def make(bp: BucketPlan) -> Program:
        if receivers is None:
            return all_ranks_program(bp, ctx, shared, locations)
        return receivers_program(bp, ctx, receivers)

    if not b.rounds:
        return make(b)
    # each round is a bucket of its own for the collectives (staging of <= the budget, reused by the next
    # round); its copies write its pieces' items into the one output the whole bucket describes
    rounds = [make(replace(b, sources=r, rounds=None)) for r in b.rounds]
    return Program(b, receive=rounds[0].receive, rounds=rounds)
