"""The export to HF buckets on the one core: the plan's buckets as all-ranks or chosen-receivers programs
(`builders`), compiled into the core's arena, copy lists and collectives, run bucket after bucket.

Every tensor travels as its *stacked shards*: the TP shards one after the other in a flat byte buffer. Per
bucket and rank there is at most one collective per group, each on one flat buffer (on CPU, one point-to-point
round straight between the members' buffers, `Core.gather`):

all ranks receive (colocated RL sync, the default):
  1. TP all-gather (dense tensors) and expert-TP all-gather (experts) of the shards this rank holds;
  2. EP all-gather of the experts of this PP stage (each EP rank contributes its own experts);
  3. PP all-gather of everything, each stage contributing the tensors it owns (the broadcast from the
     owning stage, with all stages' buckets interleaved so every stage sends at once).
  Data-parallel replicas run the same on their own groups, so no byte is sent twice to a rank.
chosen receivers (saving, a distributed sender): every shard is sent once, from one holder chosen to balance
  the senders (`routes`), straight to each receiver (one batched point-to-point round per bucket).

Compiled once (first export), reused by every later export:
* staging lives in a preallocated arena; each all-gather is in place (a rank packs its part straight into its
  slot of the receive buffer), and packing is one `_foreach_copy_` per collective into precomputed views;
* the final step is each layout op's strided copies (`LayoutOp.copies`) from the arena into the bucket's flat
  output buffer, with runs of same-shaped tensors (a layer's experts) merged into one batched copy;
* where the plan allows (`BucketPlan.direct`), the last grouped all-gather lands in the output itself: each rank
  runs its sources' layout-op copies into its slot of the output and gathers in place.

Memory: one arena (about a bucket of staging) and the output buffer of the bucket being built; with
`arenas=2` the next bucket's first collectives also overlap this bucket's conversion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from ..buckets import Bucket
from ..layouts_stacked import Stacked
from ..naming import LocalTensor
from ..parallel import ParallelContext
from ..plan import BucketPlan, ExportPlan, Source, align
from ..quantize import BLOCK, FP8RowSlices, quantize_flat
from .builders import bucket_program, memory_estimate, stage_bytes
from .executor import CBucket, Copy, Core, CRound, CStage, copy_bytes
from .program import LOCAL, OUT, Loc, Program
from .sources import Pack


class Executor:
    """Runs the plan's buckets on this rank; every rank of the world must run the same plan in step."""

    def __init__(self, plan: ExportPlan, ctx: ParallelContext, local: dict[str, LocalTensor],
                 receivers: tuple[int, ...] | None, device: torch.device, arenas: int = 1):
        self.plan, self.ctx, self.local, self.device = plan, ctx, local, device
        self.core = Core(local, device, quantize=plan.quantize)
        self.core.blob_hooks(plan.sources.values())
        self.receivers = receivers
        self.arenas_n = max(1, arenas)
        # bytes summed over exports: received by the collectives, packed before them (a direct stage's layout
        # copies included), copied into the output after them (what a direct stage saves)
        self.stats = {"gather_s": 0.0, "convert_s": 0.0, "received_bytes": 0, "packed_bytes": 0, "copied_bytes": 0}
        self.programs = [self._program(b) for b in plan.buckets]
        self._compiled: list[CBucket] | None = None

    def _program(self, b: BucketPlan) -> Program:
        return bucket_program(b, self.ctx, self.receivers)

    # -- compilation ---------------------------------------------------------------------------------------------
    def memory_estimate(self) -> dict[str, int]:
        """This rank's extra memory for an export: the staging arena(s) and the largest output bucket it builds
        (lora="merged": and `merge_bytes`, the merge arena(s): a bucket's merged weights and stacked factors)."""
        est = memory_estimate(self.plan, [stage_bytes(p)[1] for p in self.programs], self.ctx.rank,
                              self.receivers, self.arenas_n)
        merge = [0] * self.arenas_n
        for k, names in self._merges():
            merge[k % self.arenas_n] = max(merge[k % self.arenas_n], self.core.lora.layout(names)[1])
        if sum(merge):
            est["merge_bytes"] = sum(merge)
            est["total_bytes"] += sum(merge)
        return est

    def _merge_names(self, prog: Program) -> list[str]:
        """The LoRA-merged weights this rank reads in a bucket (or a round): those it sends or holds for its own
        output (chosen receivers), else every one it holds."""
        if prog.p2p is not None:
            sent = [s.name for items in prog.p2p.sends.values() for s, _, _ in items]
            kept = [n for n, loc in prog.where.items() if loc.region in (LOCAL, "mixed")]
            return self.core.lora.names(sent + kept)
        return self.core.lora.names(s.name for s in prog.bucket.sources)

    def _merges(self) -> list[tuple[int, list[str]]]:
        """(bucket index, merged names) per bucket and round that merges anything."""
        out = []
        for k, p in enumerate(self.programs):
            for r in p.rounds or [p]:
                names = self._merge_names(r)
                if names:
                    out.append((k, names))
        return out

    def compile(self) -> None:
        if self._compiled is not None:
            return
        self.core.lora.make_arenas([(k % self.arenas_n, names) for k, names in self._merges()])
        sizes = [stage_bytes(p)[1] for p in self.programs]
        self.core.make_arenas([max([sz for i, sz in enumerate(sizes) if i % self.arenas_n == a] or [0])
                               for a in range(self.arenas_n)])
        self._compiled = [self._compile_bucket(k, p) for k, p in enumerate(self.programs)]
        direct = any(p.bucket.direct is not None for p in self.programs if p.receive)
        self.core.make_pool(max([p.bucket.nbytes for p in self.programs if p.receive] or [0]), 3 if direct else 2)

    def _view(self, a: int, byte_offset: int, s: Source) -> torch.Tensor:
        return self.core.arenas[a].view(byte_offset, s.dtype, s.shard_shape)

    def _compile_bucket(self, k: int, prog: Program) -> CBucket:
        a = k % self.arenas_n
        b = prog.bucket
        if prog.rounds:
            cb = CBucket(k, prog.receive, a, b.nbytes, program=prog,
                         rounds=[self._compile_bucket(k, r) for r in prog.rounds])
            cb.dtypes = tuple(sorted({d for r in cb.rounds for d in r.dtypes}, key=str))
            return cb
        core = self.core
        arena = core.arenas[a].flat
        stage_offs, _ = stage_bytes(prog)
        cb = CBucket(k, prog.receive, a, b.nbytes, program=prog)
        cb.dtypes = tuple(sorted({e.dtype for e in b.entries} | {s.dtype for s in b.sources}, key=str))
        bases = cb.bases
        cb.merge_pack, cb.merges = core.lora.compile(self._merge_names(prog), a, cb.bases)  # first: the views below read the merged slots
        inplace: set[str] = set()  # sources quantized straight into the output (no blob)
        region_base: dict = {}
        if prog.p2p is not None:
            r = prog.p2p
            base = 0
            cb.p2p = CRound(Pack(), [], [])
            for dst_rank, items in r.sends.items():
                n = r.send_bytes[dst_rank]
                for s, _i, off in items:
                    core.pack_into(cb.p2p.pack, self._view(a, base + off, s), core.whole(s.name, s.shard_shape), bases)
                cb.p2p.sends.append((dst_rank, arena[base:base + n]))
                base += align(n)
            recv_base = base
            for src_rank, off in r.recv_from.items():
                cb.p2p.recvs.append((src_rank, arena[recv_base + off:recv_base + off + r.recv_bytes[src_rank]]))
            region_base[0] = recv_base
        for j, st in enumerate(prog.stages):
            base = stage_offs[j]
            region_base[j] = base
            cb.depends.append(st.depends)
            cb.striped.append(st.striped)
            if st.direct:
                cat = self._whole_slot(prog, j, bases)
                pre = [] if cat else self._compile_copies(prog, a, region_base, bases, direct=j, inplace=inplace)
                cb.stages.append(CStage(st.axis.group, None, direct=(pre, st.axis.size, st.axis.rank, st.slot),
                                        cat=cat))
                continue
            recv = arena[base:base + st.axis.size * st.slot]
            pack = Pack()
            for s, off in st.packs:
                if st.striped:  # this rank's own TP shard
                    core.pack_into(pack, self._view(a, base + st.axis.rank * st.slot + off, s),
                                   core.whole(s.name, s.shard_shape), bases)
                else:  # every shard of the source, from where it is now
                    loc = prog.before[j].get(s.name, Loc(LOCAL))
                    step = align(s.shard_nbytes)
                    for i in range(s.count):
                        dst = self._view(a, base + st.axis.rank * st.slot + off + i * step, s)
                        src = core.whole(s.name, s.shard_shape) if loc.region == LOCAL else \
                            self._view(a, region_base[loc.region] + loc.offsets[i], s)
                        core.pack_into(pack, dst, src, bases)
            cb.stages.append(CStage(st.axis.group, recv, st.axis.rank, st.slot, pack))
        if prog.receive:
            cb.copies = self._compile_copies(prog, a, region_base, bases, inplace=inplace)
        cb.prequant = core.prequant_groups([s for s in b.sources if s.name not in inplace], self.local)
        cb.moved = _moved(prog, cb)
        return cb

    def _whole_slot(self, prog: Program, j: int, bases: dict) -> tuple | None:
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
        views = []
        for s in srcs:
            n = math.prod(s.shard_shape)
            v = self.core.sources.view(s.name, (n,), (1,), 0, bases)
            views.append(s.name if v is None else v)
        return srcs[0].dtype, lo // isz, hi // isz, views

    def _compile_copies(self, prog: Program, a: int, region_base: dict, bases: dict,
                        direct: int | None = None, inplace: set | None = None) -> list[Copy]:
        """The copies into the output buffer after the collectives, or with `direct` = j those of the sources
        this rank converts into its slot of direct stage j, before it (from where they were then). A local
        weight quantized on its shard whose outputs are whole row ranges of it is quantized straight into its
        entries instead (its name added to `inplace`): no blob, the fp8 bytes written once."""
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
            elif loc.region == LOCAL and inplace is not None and self._quantize_in_place(s, outs, bases, raw):
                inplace.add(s.name)
            elif loc.region == LOCAL:
                for c in specs:
                    strides, off = c.resolve(0)
                    raw.append(Copy(s.dtype, c.sizes, c.dst_strides, outs[c.out].start // isz + c.dst_offset,
                                    name=s.name, src_strides=strides, src_offset=off, add=c.add))
            else:
                base = region_base[0 if loc.region == "mixed" else loc.region]
                for j, c in enumerate(specs):
                    for copy in self._placed(s, c, outs, loc.offsets, base, a):
                        copy.tag, copy.add = (type(s.resolved.op).__name__, j), c.add
                        raw.append(copy)
            # duplicates of the first output (MTP's embedding / head copies), after the gather
            for name in s.resolved.copies if direct is None else ():
                e, first = entries[name], outs[0]
                raw.append(Copy(s.dtype, (first.nbytes // isz,), (1,), e.start // isz, src_strides=(1,),
                                src_offset=first.start // isz, dup=True))
        return self.core.finish_copies(raw, bases)

    def _quantize_in_place(self, s: Source, outs: list, bases: dict, raw: list[Copy]) -> bool:
        """A weight held whole and quantized before the collectives (FP8RowSlices over one shard, whole rows):
        each piece, rows [a, b) of it placed at row d of an output, quantized from a view of the parameter straight
        into those rows of the weight entry and their rows of its scale_inv entry. Bit-identical to quantizing the
        output: pieces start on block boundaries and end on one or at the last row of both (FP8RowSlices)."""
        op = s.resolved.op
        if not (s.prequant and isinstance(op, FP8RowSlices) and s.count == 1 and op.axis == 0):
            return False
        cols = op.cols
        scale_cols = -(-cols // BLOCK)
        found = []
        for k, pieces in enumerate(op.outputs):
            w, sc = outs[2 * k], outs[2 * k + 1]
            for _, lo, hi, d in pieces:
                view = self.core.sources.view(s.name, (hi - lo, cols), (cols, 1), lo * cols, bases, hooked=True)
                if view is None:
                    return False
                found.append(Copy(w.dtype, (hi - lo, cols), (cols, 1), w.start // w.dtype.itemsize + d * cols,
                                  src=view, scale=(sc.start // sc.dtype.itemsize + d // BLOCK * scale_cols,
                                                   (-(-(hi - lo) // BLOCK), scale_cols))))
        raw.extend(found)
        return True

    @staticmethod
    def _placed(s: Source, c, outs, offs, base, a: int) -> list[Copy]:
        """Copies of spec `c` for a source whose shard i sits at byte offset offs[i] (or is local)."""
        isz = s.dtype.itemsize
        dst0 = outs[c.out].start // isz + c.dst_offset
        placed = all(o != LOCAL for o in offs)
        steps = {offs[i + 1] - offs[i] for i in range(len(offs) - 1)} if placed and len(offs) > 1 else {s.shard_nbytes}
        if placed and len(steps) == 1 and min(steps) > 0:  # evenly spaced, ascending: one strided copy
            step = steps.pop() // isz
            strides, off = c.resolve(step)
            return [Copy(s.dtype, c.sizes, c.dst_strides, dst0, src_strides=strides,
                         src_offset=(base + offs[0]) // isz + off, arena=a)]
        # shards not evenly spaced (point-to-point segments in any order, or partly local): one copy per shard
        out = []
        per_shard = c.src_strides and c.src_strides[0] == "S" and c.sizes[0] == s.count
        for i in (range(s.count) if per_shard else [c.src_shards]):
            sizes, dstr, sstr = (c.sizes[1:], c.dst_strides[1:], c.src_strides[1:]) if per_shard else \
                (c.sizes, c.dst_strides, c.src_strides)
            doff = dst0 + (i * c.dst_strides[0] if per_shard else 0)
            if offs[i] == LOCAL:
                out.append(Copy(s.dtype, sizes, dstr, doff, name=s.name, src_strides=sstr, src_offset=c.src_offset))
            else:
                out.append(Copy(s.dtype, sizes, dstr, doff, src_strides=sstr,
                                src_offset=(base + offs[i]) // isz + c.src_offset, arena=a))
        return out

    # -- running -------------------------------------------------------------------------------------------------
    def _current(self, index: int) -> CBucket:
        """Bucket `index` compiled, recompiled first if training swapped a parameter's storage since."""
        cb = self._compiled[index]
        if cb.stale():
            cb = self._compiled[index] = self._compile_bucket(index, self.programs[index])
        return cb

    def start(self, index: int, first_only: bool = False) -> tuple:
        """Issue the collectives of bucket `index` that depend on nothing of this bucket not yet done (of its
        first round, for a bucket gathered in rounds)."""
        cb = self._current(index)
        if cb.rounds:
            return cb, self.core.start(cb.rounds[0], first_only)
        return cb, self.core.start(cb, first_only)

    def finish(self, run: tuple) -> Bucket:
        cb, started = run
        b = self.plan.buckets[cb.index]
        try:
            if cb.rounds:
                flat = self._finish_rounds(cb, started)
            else:
                flat = self.core.complete(started, self.stats)
        finally:
            if self.core.scheme is not None:
                self.core.drop_blobs(s.name for s in b.sources)  # this bucket's FP8 blobs are no longer needed
        if flat is not None and b.out_entries is not None:  # FP8: each full HF weight quantized as a whole
            flat = quantize_flat(flat, b.entries, b.out_entries, self.core.scheme)
        return Bucket(b.index, flat, b.output)

    def _finish_rounds(self, cb: CBucket, started: tuple) -> torch.Tensor | None:
        """A stacked tensor over the budget: each round's pieces are gathered into the (reused) staging arena and
        written into their items of the one output buffer, so the output is the only full copy held."""
        flat = self.core.output(cb.nbytes) if cb.receive else None
        for r, rcb in enumerate(cb.rounds):
            if r:
                started = self.core.start(rcb)
            self.core.complete(started, self.stats, flat=flat)
        return flat

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
        with self.core.running():
            yield from self._buckets(on_bucket, timing)

    def _buckets(self, on_bucket: Callable[[int], None] | None, timing: bool) -> Iterator[Bucket]:
        self.core.timing = timing
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


def _moved(prog: Program, cb: CBucket) -> dict[str, int]:
    """Bytes of one compiled bucket on this rank per run: received, packed, copied after the collectives."""
    received = sum((st.axis.size - 1) * st.slot for st in prog.stages)
    packed = sum(copy_bytes(st.direct[0]) + (st.direct[3] if st.cat else 0) if st.direct else st.pack.nbytes
                 for st in cb.stages)
    if cb.p2p is not None:
        received += prog.p2p.recv_total
        packed += cb.p2p.pack.nbytes
    return {"received_bytes": received, "packed_bytes": packed, "copied_bytes": copy_bytes(cb.copies)}
