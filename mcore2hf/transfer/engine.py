"""The engine-sharded export on the one core (issue 15): each rank receives only the regions its engine rank
loads, in one point-to-point round per bucket, one message per peer (`EngineProgram`, from
`builders.engine_program` or, on a disaggregated engine rank, as sent by the trainers), sends packed from views of
the local shards, local pieces copied straight from the shards."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..buckets import Bucket
from ..engine_plan import EngineShardPlan
from ..engine_shards import EngineShardError, EngineSlice, region_slices
from ..layout_pieces import Piece, row_strides
from ..naming import LocalTensor
from ..parallel import ParallelContext
from ..plan import align
from .builders import engine_program
from .executor import CBucket, Copy, Core, CRound
from .program import EngineProgram, packed_bytes, packed_offsets
from .sources import Pack


class EngineExecutor:
    """Runs an EngineShardPlan on this rank; every member of the transport group runs it in step (collective).

    Transport: with `group` (any torch ProcessGroup, also one outside the default world, e.g. a weight-update
    group built from a TCPStore, see senders/process_group.py) the routes' ranks are ranks in `group` and `rank`
    is this process's: on CUDA batch_isend_irecv where torch.distributed knows the group, else (a bare backend,
    or CPU tensors) the group's own send/recv (`Core.post`). Otherwise the default world, with `rank` defaulting
    to `ctx.rank`. A process holding nothing (a disaggregated engine process) passes `ctx=None`, `local={}` and its
    `rank`: it runs the receive side only; or it runs the per-bucket programs it was sent (`from_programs`).

    Output: "slices" packs the raw regions tight (`EngineBucket.slices()`); "masked" lays the buffer out as the
    full-shaped HF tensors of the export plan's bucket (its layout, the same on every rank) and every piece
    is written straight into its final position (`EngineBucket.as_bucket()` is free). `debug` fills a masked
    output with NaN first (float dtypes; integer tensors' unsent regions stay uninitialized).

    Compiled on the first run by the core: send packing is one `_foreach_copy_` into a send arena reused by every
    bucket and step, receive unpacking a few merged strided copies from the receive arena, local pieces
    precomputed shard views; a later run's Python work is one output view per local piece and per merged
    receive copy (the output is a new buffer per bucket), none per received piece."""

    def __init__(self, eplan: EngineShardPlan | None, ctx: ParallelContext | None, local: dict[str, LocalTensor],
                 device: torch.device, *, group=None, rank: int | None = None, output: str = "slices",
                 debug: bool = False, programs: Sequence[EngineProgram] | None = None):
        if rank is None:
            if ctx is None:
                raise EngineShardError("EngineExecutor: expected `rank` (this process's rank in the transport group) "
                                       "when no ParallelContext is given, found neither")
            rank = ctx.rank
        if output not in ("slices", "masked"):
            raise EngineShardError(f"engine-shard output: expected 'slices' or 'masked', found {output!r}")
        self.eplan, self.ctx, self.local, self.device = eplan, ctx, local, device
        self.group, self.rank, self.output, self.debug = group, rank, output, debug
        self.core = Core(local, device, group=group)
        if programs is None:
            programs = [engine_program(eplan, k, rank) for k in range(len(eplan.routes))]
        self.programs = list(programs)
        for p in self.programs:
            missing = sorted({it.source for _, items in p.sends for it in items} - set(local))
            if missing:
                raise EngineShardError(f"engine-shard plan: rank {rank} is to send {missing[0]} (bucket {p.index}) but "
                                       f"holds no local tensor of that name (expected the holders' local tensors)")
        self.stats = {"sent_bytes": 0, "received_bytes": 0, "local_bytes": 0}
        self._compiled: list[CBucket] | None = None

    @classmethod
    def from_programs(cls, programs: Sequence[EngineProgram], device: torch.device, *, group, rank: int,
                      output: str = "slices", debug: bool = False) -> EngineExecutor:
        """The receive side of a process holding nothing, from its per-bucket programs (as sent to it)."""
        return cls(None, None, {}, device, group=group, rank=rank, output=output, debug=debug, programs=programs)

    # -- compilation ---------------------------------------------------------------------------------------------
    @staticmethod
    def _arena_bytes(prog: EngineProgram) -> int:
        return sum(align(packed_bytes(items)) for _, items in prog.sends + prog.recvs)

    def compile(self) -> None:
        if self._compiled is not None:
            return
        self.core.make_arenas([max([self._arena_bytes(p) for p in self.programs] or [0])])
        self.core.lora.make_arenas([(0, self._merge_names(p)) for p in self.programs])
        self._compiled = [self._compile(p) for p in self.programs]
        self.core.make_pool(max([cb.nbytes for cb in self._compiled] or [0]))

    def _merge_names(self, prog: EngineProgram) -> list[str]:
        """The LoRA-merged weights this rank reads in a bucket: those it sends pieces of or copies locally."""
        return self.core.lora.names([it.source for _, items in prog.sends for it in items] +
                                     [it.source for it in prog.local])

    def _layout(self, prog: EngineProgram) -> tuple[list, dict]:
        """The output's entries and where each SliceEntry's pieces land in it (`slices_where` / `masked_where`)."""
        if self.output == "slices":
            return prog.entries, slices_where(prog.entries)
        return prog.layout, masked_where(prog.entries, prog.layout)

    def _compile(self, prog: EngineProgram) -> CBucket:
        core = self.core
        out, where = self._layout(prog)
        cb = CBucket(prog.index, True, 0, max((e.start + e.nbytes for e in out), default=0),
                     tuple(sorted({e.dtype for e in out}, key=str)))
        cb.program = (prog, out)
        cb.merge_pack, cb.merges = core.lora.compile(self._merge_names(prog), 0, cb.bases)  # first: the views below read the merged slots
        arena = core.arenas[0]
        rnd = cb.p2p = CRound(Pack(), [], [])
        sent = received = local = 0
        off = 0
        for peer, items in prog.sends:
            n = packed_bytes(items)
            for it, o in zip(items, packed_offsets(items)):
                dst = arena.typed(it.dtype)[(off + o) // it.dtype.itemsize:][:it.piece.numel].view(it.piece.count)
                core.pack_into(rnd.pack, dst, (it.source, *it.piece.src_view()), cb.bases)
            rnd.sends.append((peer, arena.flat[off:off + n]))
            sent += n
            off += align(n)
        raw = []
        for peer, items in prog.recvs:
            n = packed_bytes(items)
            for it, o in zip(items, packed_offsets(items)):
                sizes, dstr, doff = _dst(where[it.entry], it.piece)
                raw.append(Copy(it.dtype, sizes, dstr, doff, src_strides=row_strides(it.piece.count),
                                src_offset=(off + o) // it.dtype.itemsize, arena=0, tag=(it.piece.add,),
                                add=it.piece.add))
            rnd.recvs.append((peer, arena.flat[off:off + n]))
            received += n
            off += align(n)
        cb.copies = core.finish_copies(raw, cb.bases)
        raw = []
        for it in prog.local:
            sizes, dstr, doff = _dst(where[it.entry], it.piece)
            _, sstr, so = it.piece.src_view()
            raw.append(Copy(it.dtype, sizes, dstr, doff, name=it.source, src_strides=sstr, src_offset=so,
                            add=it.piece.add))
            local += it.nbytes
        cb.local = core.finish_copies(raw, cb.bases)
        cb.moved = {"sent_bytes": sent, "received_bytes": received, "local_bytes": local}
        return cb

    # -- running -------------------------------------------------------------------------------------------------
    def run(self) -> Iterator[EngineBucket]:
        """Yield this rank's bucket of every plan bucket in order (collective over the transport group)."""
        with self.core.running():
            with torch.no_grad():
                self.compile()
            for k in range(len(self._compiled)):
                with torch.no_grad():
                    cb = self._compiled[k]
                    if cb.stale():  # training swapped a shard's storage since compiling: the views follow
                        cb = self._compiled[k] = self._compile(self.programs[k])
                    bucket = self._run(cb)
                yield bucket
                del bucket

    def _run(self, cb: CBucket) -> EngineBucket:
        prog, out = cb.program
        masked = self.output == "masked"
        fill = (lambda flat: nan_fill(flat, out)) if self.debug and masked else None
        flat = self.core.complete(self.core.start(cb), self.stats, fill)
        return EngineBucket(cb.index, flat, prog.entries, out if masked else None, prog.layout,
                            nan=masked and self.debug)


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
        # the executor's masked placement, run on this bucket's slices: each region a box piece of its slice
        entries = self.layout or []
        flat = torch.empty(max((e.start + e.nbytes for e in entries), default=0), dtype=torch.uint8,
                           device=self.flat.device)
        if debug:
            nan_fill(flat, entries)
        where = masked_where(self.entries, entries)
        copies = []
        for i, e in enumerate(self.entries):
            box = Piece(0, 0, _region_start(e), (1,) * len(e.shape), tuple(e.slice_shape),
                        row_strides(e.slice_shape), 0)
            src = self.flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.slice_shape)
            copies.append(Copy(e.dtype, *_dst(where[i], box), src=src))
        Core({}, flat.device).run_copies(copies, flat, tuple(sorted({e.dtype for e in entries}, key=str)), {})
        return Bucket(self.index, flat, entries)

    def masked(self, debug: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(HF name, full-shaped tensor) as a stock `load_weights` takes them: `as_bucket(debug).named_tensors()`."""
        return self.as_bucket(debug).named_tensors()

    def __repr__(self) -> str:
        return f"EngineBucket(index={self.index}, slices={len(self)}, bytes={self.flat.numel()})"


def slices_where(entries: list) -> dict[int, tuple]:
    """Per SliceEntry index, where its pieces land in a raw-slices output (the entries packed tight): (element
    offset of the region's origin in its dtype's view of the output, the slice's strides, the region's start per
    dim)."""
    return {i: (e.start // e.dtype.itemsize, row_strides(e.slice_shape), _region_start(e))
            for i, e in enumerate(entries)}


def _region_start(e) -> tuple[int, ...]:
    """A SliceEntry's region's first coordinate per dim of its full tensor."""
    lo = {d: o for d, o, _ in e.region}
    return tuple(lo.get(d, 0) for d in range(len(e.shape)))


def masked_where(entries: list, layout: list) -> dict[int, tuple]:
    """The one masked placement: per SliceEntry index, where its pieces land in the full-shaped HF tensors laid out
    as `layout` (the export plan's bucket), in `slices_where`'s form: the tensor's origin, its strides, zeros."""
    by_name = {h.name: h for h in layout}
    return {i: (by_name[e.name].start // e.dtype.itemsize, row_strides(e.shape), (0,) * len(e.shape))
            for i, e in enumerate(entries)}


def nan_fill(flat: torch.Tensor, layout: list) -> None:
    """The one NaN fill of a masked output (debug), before anything is written: its floating-point tensors."""
    for e in layout:
        if e.dtype.is_floating_point:
            flat[e.start:e.start + e.nbytes].view(e.dtype).fill_(float("nan"))


def _dst(where: tuple, piece) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A piece's destination in a dtype view of the output: (sizes, strides, element offset)."""
    origin, strides, lo = where
    start = origin + sum((a - o) * st for a, o, st in zip(piece.start, lo, strides))
    return tuple(piece.count), tuple(q * st for q, st in zip(piece.step, strides)), start
