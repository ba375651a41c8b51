"""Compatibility module: the export to HF buckets moved to `mcore2hf.transfer` (its one executor core,
`transfer.executor`; `Executor`, `transfer.export`; the per-rank programs and their builders, `transfer.program`
/ `transfer.builders`). Still here: the engine-sharded executor, until it runs on the same core."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .buckets import Bucket
from .engine_shards import EngineShardError, EngineSlice, place_slices, region_slices
from .layouts import row_strides
from .naming import LocalTensor
from .parallel import ParallelContext
from .plan import align
from .transfer.builders import all_ranks_program, receivers_program
from .transfer.export import Executor
from .transfer.program import LOCAL, OUT, Loc, P2PRound, Program, Stage

__all__ = ["LOCAL", "OUT", "EngineBucket", "EngineExecutor", "Executor", "Loc", "P2PRound", "Program", "Stage",
           "all_ranks_program", "receivers_program"]


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


def _source_of(lt: LocalTensor):
    """A parameter is used as is (stays valid when training swaps its .data); buffers are looked up each time."""
    return lt.get if lt.is_buffer else lt.param


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
                where[i] = (e.start // e.dtype.itemsize, row_strides(e.slice_shape),
                            tuple(lo.get(d, 0) for d in range(len(e.shape))))
            return out, where
        out = self._full_layout(k)
        by_name = {h.name: h for h in out}
        where = {i: (by_name[e.name].start // e.dtype.itemsize, row_strides(e.shape), (0,) * len(e.shape))
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
                raw.append(Copy(s.dtype, sizes, dstr, doff, None, ("arena", 0), row_strides(c.count),
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
