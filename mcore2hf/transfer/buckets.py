"""Buckets: byte-bounded groups of full HF tensors living in one flat byte buffer.

The flat buffer and its metadata follow SGLang's flattened-bucket format (uint8 buffer; per tensor name, shape,
dtype, start_idx/end_idx/numel in bytes), so senders hand `flat` to an engine with no extra copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..plan.export import HFEntry


@dataclass(frozen=True)
class TensorMeta:
    """Field names and meaning of SGLang's FlattenedTensorMetadata (indices are byte offsets into `flat`)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class Bucket:
    """Full HF tensors of one bucket. Iterating yields (HF name, tensor) pairs, views into `flat`.

    On ranks that are not receivers a bucket is empty (`len(bucket) == 0`, `flat is None`): every rank still
    gets one bucket per step, so loops stay in lockstep."""

    def __init__(self, index: int, flat: torch.Tensor | None, entries: list[HFEntry]):
        self.index = index
        self.flat = flat
        self.entries = entries if flat is not None else []
        self._named: list[tuple[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return 0 if self.flat is None else self.flat.numel()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        if self._named is None:
            flat = self.flat
            self._named = [(e.name, flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape))
                           for e in self.entries]
        return self._named

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.named_tensors())

    def metadata(self) -> list[TensorMeta]:
        return [TensorMeta(e.name, torch.Size(e.shape), e.dtype, e.start, e.start + e.nbytes, e.nbytes)
                for e in self.entries]

    def __repr__(self) -> str:
        return f"Bucket(index={self.index}, tensors={len(self)}, bytes={self.nbytes})"

