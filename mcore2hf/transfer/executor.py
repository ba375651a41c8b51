"""The one executor core: runs compiled per-rank programs (`program`) for every kind of export.

A program is compiled once (first run) into a `CBucket` per bucket: views of a staging arena reused by every
export, copy lists of precomputed views, the collectives or the point-to-point round to launch. A later run's
host work is launching those: one `_foreach_copy_` per pack, one per copy list (the output is a new buffer per
bucket, so only its views are made per run), no per-tensor Python beyond that.

* `sources`: what the core reads and writes: `Sources` (this rank's local tensors, one staleness policy for all
  exports: a contiguous parameter read through views precomputed at compile time, each compiled bucket recording
  the storages it relies on and recompiled when training swapped a parameter's .data since; a buffer, a
  grouped-expert item, a non-contiguous parameter and an FP8 blob read once per bucket run), `Arena`, `Pack`,
  `OutputPool`; `lora_merges`: LoRA-merged weights computed batched when their bucket starts.
* `Copy` lists, merged into batched strided copies (`merge`).
* `Core`: the arena(s), compile helpers, and the run: packing, in-place all-gathers (into the arena, or into the
  output for a direct stage), one point-to-point round over the default world or any process group, the FP8
  quantization of held shards (a hook before the collectives), the copies into the output.

Transport: on CUDA an all-gather is NCCL's (one ring launch) and a round one batch_isend_irecv (one grouped
launch); on CPU (gloo) both are the group's own sends and receives posted at once (`Core.post`), an all-gather
as one round straight between the members' buffers (gloo's all-gather gathers into a temporary buffer and copies
it out, and batch_isend_irecv doubles the wall time of a small round: bench/RESULTS.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..layout_pieces import row_strides
from ..naming import LocalTensor
from ..quantize import (
    FP8Into,
    FP8RowSlices,
    chunks,
    get_scheme,
    per_block_cast_to_fp8,
    per_block_cast_to_fp8_batched,
)
from .lora_merges import LoRAMerges
from .sources import Arena, OutputPool, Pack, Sources

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def graphs_default() -> bool:
    """Whether a copy list on a pooled CUDA buffer is captured once as a CUDA graph and replayed (MCORE2HF_GRAPHS=0:
    launched eagerly each time)."""
    return os.environ.get("MCORE2HF_GRAPHS", "1") != "0"


@dataclass
class Copy:
    """A (batched) strided copy into a dtype view of the output buffer: (sizes, dst_strides, dst_offset), in
    elements. The source: a precomputed view (`src`), a local tensor read at each run (`name`, viewed at
    src_strides / src_offset), or the output itself (`dup`: a duplicate of another output, run last); before
    `merge`, `arena` names the staging arena a source lies in (offset in its dtype view)."""

    dtype: torch.dtype
    sizes: tuple[int, ...]
    dst_strides: tuple[int, ...]
    dst_offset: int
    src: torch.Tensor | None = None
    name: str | None = None
    src_strides: tuple[int, ...] = ()
    src_offset: int = 0
    arena: int | None = None
    dup: bool = False
    tag: tuple = ()  # (op, index in its copies()): gate and up halves never merge with each other
    add: float = 0.0  # added after the copy (StridedCopy.add)
    #: block-FP8 quantized into the output instead of copied: `src` the weight [m, n], the destination its fp8
    #: entry; (element offset of its scale_inv in the float32 view of the output, the scale's shape)
    scale: tuple | None = None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.sizes:
            n *= d
        return n


@dataclass
class Prepared:
    """A copy list's launches on one output buffer: (destinations, sources) per `_foreach_copy_`, the copies
    whose source is read at each run, constants to add, duplicates of outputs."""

    lists: list[tuple[list, list]] = field(default_factory=list)
    cats: list[tuple[torch.Tensor, list]] = field(default_factory=list)  # (output run, sources) per torch.cat
    dynamic: list[tuple[torch.Tensor, Copy]] = field(default_factory=list)
    adds: list[tuple[torch.Tensor, float]] = field(default_factory=list)
    dups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    quant: FP8Into | None = None  # weights quantized into their fp8 and scale entries
    graph: object = None  # the static launches captured as a CUDA graph (False: capture failed, run eagerly)


@dataclass
class CStage:
    """A compiled all-gather (in place)."""

    group: object
    recv: torch.Tensor | None  # uint8 view of the arena: members * slot (None: direct, the output's first bytes)
    me: int = 0  # this rank's member index: its slot, recv[me * slot:(me + 1) * slot], is the all-gather input
    slot: int = 0
    pack: Pack = field(default_factory=Pack)
    #: a direct stage: its layout-op copies of this rank's sources into its slot of the output, and the slot
    direct: tuple[list[Copy], int, int, int] | None = None  # (copies, members, member index, slot bytes)
    #: a direct stage whose sources are all whole-shard copies filling the slot in order: one concatenation
    #: (dtype, first and end element of the slot, sources: views or names read at each run)
    cat: tuple[torch.dtype, int, int, list] | None = None


@dataclass
class CRound:
    """A compiled point-to-point round: the sends packed into the arena, every send and receive posted at once."""

    pack: Pack
    sends: list[tuple[int, torch.Tensor]]  # (peer, arena view) in peer order
    recvs: list[tuple[int, torch.Tensor]]  # (peer, arena view) in peer order


@dataclass
class CBucket:
    """One bucket's run on this rank, compiled."""

    index: int
    receive: bool  # builds an output buffer
    arena: int
    nbytes: int = 0  # output bytes
    dtypes: tuple[torch.dtype, ...] = ()  # dtype views of the output the copies use
    stages: list[CStage] = field(default_factory=list)
    depends: list[bool] = field(default_factory=list)  # per stage: its packs read an earlier stage
    striped: list[bool] = field(default_factory=list)  # per stage: a TP stage (the first collectives)
    p2p: CRound | None = None
    local: list[Copy] = field(default_factory=list)  # from own shards, while the transfers are in flight
    copies: list[Copy] = field(default_factory=list)  # after the transfers
    # FP8 on the shards: this rank's shards to quantize before the bucket's collectives, by shard shape
    prequant: list[tuple[FP8RowSlices, list[str]]] = field(default_factory=list)
    bases: dict = field(default_factory=dict)  # name -> (parameter, data_ptr) the precomputed views rely on
    #: byte counters per run, added to the executor's stats
    moved: dict[str, int] = field(default_factory=dict)
    program: object = None
    rounds: list[CBucket] | None = None  # a bucket gathered in rounds: each round's collectives and copies
    #: (copy list, pooled output buffer) -> its Prepared launches (`Core.run_copies`)
    prepared: dict = field(default_factory=dict)
    #: LoRA merges run first (`LoRAMerges.compile`): the weights and factors packed into the merge arena, then one
    #: batched product per term of each group of like merges
    merge_pack: Pack | None = None
    merges: list[tuple] = field(default_factory=list)

    watched: tuple | None = None  # `bases` as Sources.watch gives it, made on the first check

    def stale(self) -> bool:
        if self.watched is None:
            self.watched = Sources.watch(self.bases)
        return not Sources.unchanged(self.watched) or any(r.stale() for r in self.rounds or ())


class Core:
    """Compiles and runs per-rank programs. Transport: the default world, or `group` (any torch ProcessGroup, also
    one outside the default world: on CUDA batch_isend_irecv where torch.distributed knows the group, else (a bare
    backend, or CPU tensors) the group's own send/recv, whose ranks are taken directly: `post`)."""

    def __init__(self, local: dict[str, LocalTensor], device: torch.device, group=None, quantize: str | None = None):
        self.device = device
        self.sources = Sources(local)
        self.group = group
        # the default world, or a group registered with torch.distributed (new_group, join_weight_update_group)
        self.batched = group is None or group in dist.distributed_c10d._world.pg_group_ranks
        self.scheme = get_scheme(quantize)
        self._blobs: dict[str, torch.Tensor] = {}  # this export's shards quantized before the collectives
        self.arenas: list[Arena] = []
        self.timing = False
        # on CUDA, NCCL's all-gather is one ring launch and batch_isend_irecv one grouped launch: kept there
        self.cpu_p2p = device.type == "cpu"
        #: transport operations issued, summed over runs: collectives (all-gathers) and point-to-point messages
        self.counts = {"collectives": 0, "messages": 0}
        self.graphs = graphs_default()
        self.pool: OutputPool | None = None  # made by the executor's compile (`make_pool`)
        self.lora = LoRAMerges(self.sources, device)  # LoRA-merged weights of a bucket and their stacked factors
        self._running = False

    @contextmanager
    def running(self) -> Iterator[None]:
        """One export at a time on this core: a second one iterated beside it (two loops zipped over the same
        settings) would write the same staging arena and pooled buffers, so it is refused before anything moves.
        An export abandoned mid-way (its loop broken, the generator dropped) ends here too."""
        if self._running:
            from ..errors import UsageError

            raise UsageError("an export with these settings (bucket size, receivers, overlap, name filter, quantize, "
                             "engine placement) is still being iterated on this rank: iterate it to the end or drop "
                             "it before starting another (they share one staging arena and output buffers); exports "
                             "with other settings may run interleaved")
        self._running = True
        try:
            yield
        finally:
            self._running = False

    # -- compile helpers -----------------------------------------------------------------------------------------
    def make_arenas(self, sizes: list[int]) -> None:
        self.arenas = [Arena(n, self.device) for n in sizes]

    def make_pool(self, nbytes: int, limit: int = 2) -> None:
        """At most `limit` output buffers of `nbytes` (the largest bucket this rank builds), reused (`OutputPool`);
        none when nothing is built here."""
        self.pool = OutputPool(nbytes, self.device, limit) if nbytes > 0 else None

    def output(self, nbytes: int) -> torch.Tensor:
        """A bucket's output buffer: pooled where one is free (see OutputPool's lifetime rule), else new."""
        if self.pool is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.pool.take(nbytes)

    def pack_into(self, pack: Pack, dst: torch.Tensor, src, bases: dict) -> None:
        """Add one pack: `src` an arena view, or (name, sizes, strides, offset) of a local tensor."""
        if isinstance(src, tuple):
            name, sizes, strides, off = src
            view = self.sources.view(name, sizes, strides, off, bases)
            if view is None:
                pack.dynamic.append((len(pack.dsts), name, (sizes, strides, off)))
            src = view
        pack.dsts.append(dst)
        pack.srcs.append(src)

    @staticmethod
    def whole(name: str, shape: tuple[int, ...]) -> tuple:
        """A pack source: the whole local shard of `name`."""
        return (name, tuple(shape), row_strides(shape), 0)

    def finish_copies(self, raw: list[Copy], bases: dict) -> list[Copy]:
        """Merge the arena-sourced copies into batched ones and resolve them to arena views; local sources to
        precomputed views where their storage allows; duplicates of outputs last."""
        out: list[Copy] = []
        for c in merge(raw):
            if c.arena is not None:
                c.src = self.arenas[c.arena].typed(c.dtype).as_strided(c.sizes, c.src_strides, c.src_offset)
                c.arena = None
            elif c.name is not None:
                view = self.sources.view(c.name, c.sizes, c.src_strides, c.src_offset, bases)
                if view is not None:
                    c.src, c.name = view, None
            out.append(c)
        return out

    def blob_hooks(self, sources) -> None:
        """FP8 on the shards: each held source quantized before the collectives is read through a hook giving its
        blob (quantized once per export, dropped after its bucket). Before compiling: no view of them is made."""
        for s in sources:
            if s.prequant and s.name in self.sources.local:
                self.sources.hooks[s.name] = self._blob_hook(s.name, s.resolved.op, s.shard_shape[0])

    @staticmethod
    def prequant_groups(sources: list, local: dict) -> list[tuple[FP8RowSlices, list[str]]]:
        """The held sources quantized before the collectives, grouped by shard shape (batched quantization)."""
        groups: dict[tuple, tuple] = {}
        for s in sources:
            if s.prequant and s.name in local:
                op = s.resolved.op
                groups.setdefault((op.rows, op.cols), (op, []))[1].append(s.name)
        return list(groups.values())

    def _blob_hook(self, name: str, op: FP8RowSlices, n: int) -> Callable[[], torch.Tensor]:
        data, soff = op.rows * op.cols, op.scale_offset

        def blob() -> torch.Tensor:
            b = self._blobs.get(name)
            if b is None:  # not quantized in a batch (a round's piece): on its own
                p = self.sources.tensor(name)
                q, sf = per_block_cast_to_fp8(p, self.scheme.ue8m0)
                b = torch.empty(n, dtype=torch.uint8, device=p.device)
                b[:data].copy_(q.view(torch.uint8).view(-1))
                b[soff:].copy_(sf.view(torch.uint8).view(-1))
                self._blobs[name] = b
            return b

        return blob

    # -- run -----------------------------------------------------------------------------------------------------
    def run_copies(self, copies: list[Copy], flat: torch.Tensor, dtypes: tuple, cache: dict,
                   memo: dict | None = None, key=None) -> None:
        """Copies into the output buffer `flat`: batched launches (then the constants added, then duplicates). On a
        pooled buffer, the copies' views are made once per buffer (`memo[key, slot]`) and replayed: on CUDA, the
        launches that read no source at run time are captured as a CUDA graph after their first run."""
        if not copies:
            return
        slot = self.pool.slot(flat) if self.pool is not None and memo is not None else None
        if slot is None:  # a buffer of its own (the consumer holds the pooled ones): views for this run only
            prep = self.prepare(copies, flat, dtypes, once=True)
        else:
            prep = memo.get((key, slot))
            if prep is None:
                prep = memo[key, slot] = self.prepare(copies, self.pool.aliases[slot], dtypes)
        if prep.dynamic:
            dsts, srcs = [], []
            for dst, c in prep.dynamic:
                t = self.sources.resolve(c.name, cache)
                dsts.append(dst)
                srcs.append(t.as_strided(c.sizes, c.src_strides, t.storage_offset() + c.src_offset))
            torch._foreach_copy_(dsts, srcs)
        if prep.graph:
            prep.graph.replay()
            return
        self.launch_static(prep)
        if slot is not None and prep.graph is None and self.graphs and flat.is_cuda and not self.timing:
            prep.graph = self.capture(prep)

    @staticmethod
    def launch_static(prep: Prepared) -> None:
        """Everything of a prepared list but the sources read at run time (those ran first)."""
        for dsts, srcs in prep.lists:
            torch._foreach_copy_(dsts, srcs)
        for out, srcs in prep.cats:
            torch.cat(srcs, out=out)
        if prep.quant is not None:
            prep.quant.run()
        for dst, add in prep.adds:
            dst.add_(add)
        for dst, src in prep.dups:  # read outputs written above
            dst.copy_(src)

    def capture(self, prep: Prepared):
        """`launch_static(prep)` as a CUDA graph (captured, not run: its first run was eager), or False where
        capture fails (then it runs eagerly every time)."""
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.launch_static(prep)
                finally:
                    graph.capture_end()
        except RuntimeError as e:
            import logging

            logging.getLogger("mcore2hf").warning("CUDA graph capture of a bucket's copies failed, launching them "
                                                  "eagerly: %s", e)
            return False
        torch.cuda.current_stream(self.device).wait_stream(side)
        return graph

    def prepare(self, copies: list[Copy], flat: torch.Tensor, dtypes: tuple, once: bool = False) -> Prepared:
        """The copies' destination views in `flat`, grouped into launches: per dtype, the pairs both contiguous (a
        CUDA `_foreach_copy_` takes its fast multi-tensor path only when every pair of its list allows it), then
        the strided ones; sources read at each run apart; weights quantized into their entries."""
        n = flat.numel()
        typed = {dt: flat[:n - n % dt.itemsize].view(dt) for dt in dtypes}
        prep = Prepared()
        fast: dict[torch.dtype, tuple[list, list]] = {}
        slow: tuple[list, list] = ([], [])
        quant = []
        for c in copies:
            view = typed[c.dtype]
            dst = view.as_strided(c.sizes, c.dst_strides, c.dst_offset)
            if c.scale is not None:
                soff, sshape = c.scale
                quant.append((c.src, dst, typed[torch.float32].as_strided(sshape, row_strides(sshape), soff)))
                continue
            if c.src is None:
                if c.dup:
                    prep.dups.append((dst, view.as_strided(c.sizes, c.src_strides, c.src_offset)))
                    continue
                prep.dynamic.append((dst, c))
            else:
                lists = fast.setdefault(c.dtype, ([], [])) if dst.is_contiguous() and c.src.is_contiguous() else slow
                lists[0].append(dst)
                lists[1].append(c.src)
            if c.add:
                prep.adds.append((dst, c.add))
        if flat.device.type == "cpu" and not once:  # `_foreach_copy_` loops over copy_ there: runs of outputs, cat
            for dt in list(fast):
                fast[dt] = Core._cat_runs(*fast[dt], typed[dt], prep.cats)
        prep.lists = [lists for lists in (*fast.values(), slow) if lists[0]]
        if quant:
            prep.quant = FP8Into(quant, self.scheme.ue8m0)
        return prep

    @staticmethod
    def _cat_runs(dsts: list, srcs: list, view: torch.Tensor, cats: list) -> tuple[list, list]:
        """Contiguous copies whose destinations follow each other in `view` as one `torch.cat` per run (into
        `cats`); the rest returned."""
        base = view.data_ptr()
        isz = view.element_size()
        order = sorted(range(len(dsts)), key=lambda i: dsts[i].data_ptr())
        rest: tuple[list, list] = ([], [])
        i = 0
        while i < len(order):
            j = i + 1
            end = dsts[order[i]].data_ptr() + dsts[order[i]].numel() * isz
            while j < len(order) and dsts[order[j]].data_ptr() == end:
                end += dsts[order[j]].numel() * isz
                j += 1
            if j - i > 1:
                lo = (dsts[order[i]].data_ptr() - base) // isz
                cats.append((view[lo:lo + (end - dsts[order[i]].data_ptr()) // isz],
                             [srcs[k].reshape(-1) for k in order[i:j]]))
            else:
                rest[0].append(dsts[order[i]])
                rest[1].append(srcs[order[i]])
            i = j
        return rest

    def post(self, group, sends: list, recvs: list, tag: int, known: bool = True) -> list:
        """Post sends and receives [(peer, buffer)] on `group` (None: the default world; peers are its ranks) at
        once; returns the works to wait on. The group's own send/recv on CPU (`cpu_p2p`) or on a group
        torch.distributed does not know (`known` False: a bare backend, e.g. ProcessGroupGloo(store, rank,
        size)); else batch_isend_irecv (NCCL launches the sends and receives as one group)."""
        self.counts["messages"] += len(sends) + len(recvs)
        if self.cpu_p2p or not known:
            pg = dist.group.WORLD if group is None else group
            works = [pg.recv([buf], peer, tag) for peer, buf in recvs]  # receives first, as a bare backend's were
            return works + [pg.send([buf], peer, tag) for peer, buf in sends]
        ops = [dist.P2POp(dist.isend, buf, group=group, group_peer=peer) for peer, buf in sends] + \
              [dist.P2POp(dist.irecv, buf, group=group, group_peer=peer) for peer, buf in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def gather(self, recv: torch.Tensor, me: int, slot: int, group, tag: int) -> list:
        """All-gather in place on `group`: member `me`'s slot of `recv` (`slot` bytes each) to every member; returns
        the works to wait on. On CPU (`cpu_p2p`) one point-to-point round straight between the members' buffers:
        every byte crosses once, where gloo's all-gather also copies the whole result out of a temporary buffer
        (half the process CPU time of a large gather over loopback TCP, bench/host_overhead.py)."""
        if slot == 0:
            return []
        mine = recv[me * slot:(me + 1) * slot]
        if not self.cpu_p2p:
            self.counts["collectives"] += 1
            return [_all_gather(recv, mine, group=group, async_op=True)]
        peers = [p for p in range(recv.numel() // slot) if p != me]
        return self.post(group, [(p, mine) for p in peers], [(p, recv[p * slot:(p + 1) * slot]) for p in peers], tag)

    def exchange(self, rnd: CRound, tag: int) -> list:
        """Post every send and receive of a round at once; returns the works to wait on."""
        return self.post(self.group, rnd.sends, rnd.recvs, tag, self.batched)

    def launch(self, cb: CBucket, j: int, works: list, flat: torch.Tensor | None, cache: dict) -> None:
        """Stage j: pack and all-gather in place; a direct stage converts this rank's sources into its slot of
        the output and gathers there."""
        st = cb.stages[j]
        if st.direct is not None:
            copies, members, me, slot = st.direct
            if st.cat is not None:
                dtype, lo, hi, srcs = st.cat
                typed = flat[:flat.numel() - flat.numel() % dtype.itemsize].view(dtype)
                torch.cat([p if isinstance(p, torch.Tensor) else self.sources.resolve(p, cache).reshape(-1)
                           for p in srcs], out=typed[lo:hi])
            self.run_copies(copies, flat, cb.dtypes, cache, cb.prepared, j)
            works.extend(self.gather(flat[:members * slot], me, slot, st.group, cb.index))
            return
        self.sources.copy_pack(st.pack, cache)
        works.extend(self.gather(st.recv, st.me, st.slot, st.group, cb.index))

    def quantize_held(self, cb: CBucket) -> None:
        """The FP8 blobs of this rank's shards in the bucket, quantized per shard shape in batched passes of
        bounded size (their fp32 temporaries stay far below a bucket)."""
        for op, names in cb.prequant:
            for todo in chunks([n for n in names if n not in self._blobs], op.rows * op.cols):
                if not todo:
                    continue
                x = torch.stack([self.sources.tensor(n) for n in todo])
                q, sf = per_block_cast_to_fp8_batched(x, self.scheme.ue8m0)
                del x
                n, data, soff = len(todo), op.rows * op.cols, op.scale_offset
                blobs = torch.empty((n, FP8RowSlices.blob_nbytes(op.rows, op.cols)), dtype=torch.uint8,
                                    device=q.device)
                blobs[:, :data].copy_(q.view(torch.uint8).reshape(n, data))
                blobs[:, soff:].copy_(sf.view(torch.uint8).reshape(n, -1))
                for k, name in enumerate(todo):
                    self._blobs[name] = blobs[k]

    def drop_blobs(self, names) -> None:
        for n in names:
            self._blobs.pop(n, None)

    def start(self, cb: CBucket, first_only: bool = False) -> tuple:
        """Issue what of bucket `cb` depends on nothing not yet done: (bucket, works in flight, next stage, output
        buffer (allocated here when a stage lands in it), per-run source cache)."""
        cache: dict = {}
        flat = None
        if cb.receive and any(st.direct is not None for st in cb.stages):
            flat = self.output(cb.nbytes)
        if cb.merges:  # LoRA-merged weights first: everything below reads them
            self.lora.run(cb.merge_pack, cb.merges, cache)
        if cb.prequant:
            self.quantize_held(cb)
        works: list = []
        if cb.p2p is not None:
            self.sources.copy_pack(cb.p2p.pack, cache)
            works.extend(self.exchange(cb.p2p, cb.index))
            return cb, works, 0, flat, cache
        j = 0
        while j < len(cb.stages) and not cb.depends[j] and (not first_only or cb.striped[j]):
            self.launch(cb, j, works, flat, cache)
            j += 1
        return cb, works, j, flat, cache

    def now(self) -> float:
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def complete(self, run: tuple, stats: dict, fill: Callable[[torch.Tensor], None] | None = None,
                 flat: torch.Tensor | None = None) -> torch.Tensor | None:
        """Finish a started bucket: its local copies while the transfers are in flight, the remaining stages, the
        copies after them; returns the output buffer (None on a rank that builds none). `fill` runs on a new
        output before anything is written to it; `flat` is an output to write into (rounds of one bucket)."""
        cb, works, j, started, cache = run
        flat = started if flat is None else flat
        if flat is None and cb.receive:
            flat = self.output(cb.nbytes)
            if fill is not None:
                fill(flat)
        if cb.local:
            self.run_copies(cb.local, flat, cb.dtypes, cache, cb.prepared, "local")
        t0 = self.now()
        for w in works:
            w.wait()
        while j < len(cb.stages):
            works = []
            self.launch(cb, j, works, flat, cache)
            for w in works:
                w.wait()
            j += 1
        t1 = self.now()
        if cb.receive:
            self.run_copies(cb.copies, flat, cb.dtypes, cache, cb.prepared, "copies")
        if "gather_s" in stats:
            stats["gather_s"] += t1 - t0
            stats["convert_s"] += self.now() - t1
        for k, n in cb.moved.items():
            stats[k] += n
        return flat


def merge(raw: list[Copy]) -> list[Copy]:
    """Merge arena-sourced copies with equal shapes and strides whose source and destination offsets advance in
    equal positive steps (a layer's experts from one EP rank, say) into batched copies. Order does not matter:
    destinations are disjoint and sources are only read; duplicates of outputs come last."""
    out: list[Copy] = []
    duplicates: list[Copy] = []
    groups: dict[tuple, list[Copy]] = {}
    for c in raw:
        if c.arena is not None:
            groups.setdefault((c.dtype, c.sizes, c.dst_strides, c.src_strides, c.arena, c.tag, c.add), []).append(c)
        elif c.dup:
            duplicates.append(c)
        else:
            out.append(c)  # local sources: one copy each
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
            if n > 1:
                first = Copy(first.dtype, (n, *first.sizes), (dstep, *first.dst_strides), first.dst_offset,
                             src_strides=(sstep, *first.src_strides), src_offset=first.src_offset,
                             arena=first.arena, add=first.add)
            out.append(first)
            i += n
    return out + duplicates


def copy_bytes(copies: list[Copy]) -> int:
    return sum(c.nbytes for c in copies)
