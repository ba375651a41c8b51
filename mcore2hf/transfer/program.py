"""Per-rank programs: what one rank does for one bucket, as plain data, built once per plan (`builders`) and
compiled by the one executor core (`executor`) into views of its arena.

* `Program`: an export to HF buckets: coalesced all-gathers (`Stage`: TP/expert-TP, EP, PP; a direct stage lands
  in the output) or one batched point-to-point round (`P2PRound`), then each source's layout-op copies from
  where its shards are (`Loc`) into the output.
* `EngineProgram`: an engine-sharded export: one batched point-to-point round of layout-op pieces clipped to the
  engine rank's regions, plus the pieces this rank copies locally. Serializable (`to_dict` / `from_dict`, JSON
  types only): a disaggregated engine rank runs the program it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layouts.pieces import Piece
from ..parallel import Axis
from ..plan.engine import SliceEntry
from ..plan.engine_shards import EngineShardError
from ..plan.export import BucketPlan, HFEntry, Source

LOCAL = "local"
OUT = "out"  # in the bucket's output buffer already (a direct stage put it there)


@dataclass
class Loc:
    """Where a source's shards are on this rank: a local parameter, or byte offsets in a staging region."""

    region: str | int  # LOCAL, OUT, "mixed" (point-to-point, partly local) or the index of a stage's region
    offsets: tuple = (0,)  # byte offset of each shard in the region (LOCAL for a local shard of a mixed one)


@dataclass
class Stage:
    """One coalesced collective: an all-gather on a group (in place)."""

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
    """What this rank does for one bucket of an export to HF buckets."""

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


@dataclass(frozen=True)
class Item:
    """One piece of a point-to-point round: a source's elements (`piece`, clipped to an engine region) and, on
    the receiving side, the output entry they land in."""

    source: str
    dtype: torch.dtype
    piece: Piece
    entry: int = -1  # index in the receiver's entries (-1 on the sending side)

    @property
    def nbytes(self) -> int:
        return self.piece.numel * self.dtype.itemsize


def packed_offsets(items: list[Item]) -> list[int]:
    """Byte offsets of items packed in order, each aligned for its dtype (sender and receiver agree)."""
    out, off = [], 0
    for it in items:
        isz = it.dtype.itemsize
        off = -(-off // isz) * isz
        out.append(off)
        off += it.nbytes
    return out


def packed_bytes(items: list[Item]) -> int:
    return (packed_offsets(items)[-1] + items[-1].nbytes) if items else 0


@dataclass
class EngineProgram:
    """What this rank does for one bucket of an engine-shard plan: per peer (ascending) the items it sends and
    receives, in plan order (the order both sides pack in), and the items it copies from its own shards."""

    index: int
    entries: list[SliceEntry]  # this rank's regions (the raw-slices output)
    layout: list[HFEntry]  # the bucket's full layout (a masked output's; [] on a rank that feeds no engine rank)
    sends: list[tuple[int, list[Item]]] = field(default_factory=list)
    recvs: list[tuple[int, list[Item]]] = field(default_factory=list)
    local: list[Item] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain JSON types. Sides a rank holding nothing has (receives): refused otherwise."""
        if self.sends or self.local:
            raise EngineShardError("engine-shard program: only a receive-only rank's program is sent (found sends "
                                   "or local pieces: a rank holding shards of the model)")
        return dict(index=self.index,
                    entries=[[e.name, list(e.shape), [list(t) for t in e.region], str(e.dtype), e.start, e.nbytes]
                             for e in self.entries],
                    layout=[[e.name, list(e.shape), str(e.dtype), e.start, e.nbytes, e.source] for e in self.layout],
                    recvs=[[peer, [[it.source, str(it.dtype), it.entry, list(it.piece.start), list(it.piece.step),
                                    list(it.piece.count), it.piece.add] for it in items]] for peer, items in self.recvs])

    @classmethod
    def from_dict(cls, d: dict) -> EngineProgram:
        recvs = [(peer, [Item(src, dtype_named(dt), Piece(0, 0, tuple(a), tuple(q), tuple(c), (0,) * len(c), 0, add),
                              entry) for src, dt, entry, a, q, c, add in items]) for peer, items in d["recvs"]]
        return cls(d["index"],
                   [SliceEntry(n, tuple(sh), tuple(tuple(t) for t in r), dtype_named(dt), st, nb)
                    for n, sh, r, dt, st, nb in d["entries"]],
                   [HFEntry(n, tuple(sh), dtype_named(dt), st, nb, src) for n, sh, dt, st, nb, src in d["layout"]],
                   recvs=recvs)


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype `str(dtype)` printed (a program's dtypes travel as these names)."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise EngineShardError(f"engine-shard program: expected a torch dtype name (e.g. 'torch.bfloat16'), found "
                               f"{name!r}")
    return dt
