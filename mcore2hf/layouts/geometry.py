"""Tensor geometry, one home: element counts, byte sizes, contiguous strides, and the alignment every tensor of a
flat buffer starts at (plans, buckets, staging arenas, readers and writers all lay tensors out with these)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ALIGN = 64  # byte alignment of every tensor inside flat buffers (dtype views and vectorized copies need it)


def align(n: int) -> int:
    """`n` bytes rounded up to the next multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of `shape` and `dtype`."""
    return numel(shape) * dtype.itemsize


def row_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous tensor of `shape`."""
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= d
    return tuple(reversed(out))
