"""Layout-op pieces: which elements of which HF output each TP shard supplies, as per-dim arithmetic progressions
(`Piece`). What the engine-shard planner needs of an op (a piece is sent by one holder and cut exactly to an engine
rank's regions by `engine_shards.clip`), derived from the op's `copies()` alone, so every op (present and future)
gets it for free; and the row-major helpers the executors share."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ShapeMismatchError
from .geometry import row_strides
from .ops import LayoutOp, S, Shape


@dataclass(frozen=True)
class Piece:
    """The elements one shard gives one HF output, per HF dim an arithmetic progression: HF coordinate
    `start + i * step` for `i < count`, read from the shard (contiguous, flat) at `src_offset + sum(i_d *
    src_strides[d])`. Every HF dim is listed (dims the piece spans whole have start 0, step 1, count = size)."""

    out: int
    shard: int
    start: tuple[int, ...]
    step: tuple[int, ...]
    count: tuple[int, ...]
    src_strides: tuple[int, ...]
    src_offset: int
    add: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.count)

    def dst_view(self, shape: Shape) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(sizes, strides, offset) of the piece in the contiguous HF tensor of `shape`."""
        h = row_strides(shape)
        return (self.count, tuple(q * s for q, s in zip(self.step, h)),
                sum(a * s for a, s in zip(self.start, h)))

    def src_view(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(sizes, strides, offset) of the piece in its (contiguous) shard."""
        return self.count, self.src_strides, self.src_offset


def _refine(size: int, dst: int, src, shape: Shape, h: tuple[int, ...]) -> list[tuple[int, int, object, int]]:
    """One copy dim as dims (size, HF dim, src stride, dst step in that HF dim) that each stay in one HF dim:
    ops move whole rows, so a dim running over several HF dims splits at the HF dims' sizes."""
    d = next(i for i, s in enumerate(h) if s <= dst)
    if dst % h[d]:
        raise ShapeMismatchError(f"piece refinement: destination stride {dst} is not a multiple of HF stride {h[d]}")
    q = dst // h[d]
    if (size - 1) * q < shape[d] or size == 1:
        return [(size, d, src, q)]
    inner = shape[d] // q
    if shape[d] % q or size % inner or d == 0 or src == S:
        raise ShapeMismatchError(f"piece refinement: a copy dim of {size} x stride {dst} does not factor over the "
                                 f"HF shape {shape}")
    return _refine(size // inner, dst * inner, src * inner, shape, h) + [(inner, d, src, q)]


def pieces(op: LayoutOp, shard_shape: Shape, count: int, hf_shapes: Sequence[Shape]) -> list[Piece]:
    """The op's `copies` split per shard and per HF dim: pieces of all shards partition every HF output (and
    executing them equals `to_hf`). Several copy dims on one HF dim (a QKV group's rows) are enumerated, all
    but the innermost, so each piece is a product of one progression per HF dim."""
    step = math.prod(shard_shape)
    out = []
    for c in op.copies(tuple(shard_shape), count):
        if 0 in c.sizes:
            continue
        shape = tuple(hf_shapes[c.out])
        h = row_strides(shape)
        dims = [r for n, dst, src in zip(c.sizes, c.dst_strides, c.src_strides) for r in _refine(n, dst, src, shape, h)]
        base = list(divmod_coords(c.dst_offset, shape))
        shard_dims = [i for i, r in enumerate(dims) if r[2] == S]
        by_dim: dict[int, list[int]] = {}
        for i, r in enumerate(dims):
            if r[2] != S:
                by_dim.setdefault(r[1], []).append(i)
        # per HF dim keep the finest (last) copy dim as the progression, enumerate the others
        finest = {d: min(ids, key=lambda i: dims[i][3]) for d, ids in by_dim.items()}
        enum = shard_dims + [i for d, ids in by_dim.items() for i in ids if i != finest[d]]
        keep = {i: d for d, i in finest.items()}
        for idx in _product([dims[i][0] for i in enum]):
            start, src_off = list(base), c.src_offset + c.src_shards * step
            for i, j in zip(enum, idx):
                n, d, src, q = dims[i]
                start[d] += j * q
                src_off += j * (step if src == S else src)
            shard, local = divmod(src_off, step)
            counts, steps, strides = [1] * len(shape), [1] * len(shape), [0] * len(shape)
            for i, d in keep.items():
                n, _, src, q = dims[i]
                counts[d], steps[d], strides[d] = n, q, src
            last = local + sum((n - 1) * st for n, st in zip(counts, strides))
            if not (local >= 0 and last < step and all(a + (n - 1) * q < s for a, n, q, s
                                                       in zip(start, counts, steps, shape))):
                raise ShapeMismatchError(f"piece of {type(op).__name__}: leaves its shard or HF tensor {shape}")
            out.append(Piece(c.out, shard, tuple(start), tuple(steps), tuple(counts), tuple(strides), local, c.add))
    return out


def divmod_coords(offset: int, shape: Shape) -> tuple[int, ...]:
    """Row-major coordinates of the flat element `offset` of a contiguous tensor of `shape`."""
    coords = []
    for s in reversed(shape):
        offset, r = divmod(offset, s)
        coords.append(r)
    return tuple(reversed(coords))


def _product(sizes: list[int]):
    return itertools.product(*(range(n) for n in sizes))
