"""Buckets: byte-bounded groups of full HF tensors living in one flat byte buffer.

The flat buffer and its metadata follow SGLang's flattened-bucket format (uint8 buffer; per tensor name, shape,
dtype, start_idx/end_idx/numel in bytes), so senders hand `flat` to an engine with no extra copy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..formats.hf_dir import HFDirectory, StoredTensor
from ..plan.export import HFEntry, align

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's measured sweet spot between memory and per-bucket overhead


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


def group_tensors(tensors: Sequence[StoredTensor], bucket_bytes: int) -> list[list[StoredTensor]]:
    """Stored tensors in order, in groups of at most `bucket_bytes` (64-byte aligned each; a larger tensor alone)."""
    groups: list[list[StoredTensor]] = []
    size = 0
    for t in tensors:
        if not groups or (groups[-1] and size + align(t.nbytes) > bucket_bytes):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += align(t.nbytes)
    return groups


def stored_buckets(directory: str | os.PathLike, groups: Sequence[Sequence[StoredTensor]], first_index: int,
                   device: torch.device | None, role: str = "base checkpoint") -> Iterator[Bucket]:
    """Buckets of tensors read from an HF directory (hf_dir, positioned reads straight into each bucket's flat
    buffer, then one host-to-device copy): one bucket in memory at a time. `device` None: this rank receives
    nothing and gets empty buckets, one per group, so every rank's loop stays in step."""
    with HFDirectory(directory, role=role) as d:
        for k, group in enumerate(groups):
            entries, start = [], 0
            for t in group:
                entries.append(HFEntry(t.name, tuple(t.shape), t.dtype, start, t.nbytes, f"{role}:{t.file}"))
                start += align(t.nbytes)
            if device is None:
                yield Bucket(first_index + k, None, entries)
                continue
            flat = torch.empty(start, dtype=torch.uint8)
            for e in entries:
                d.read_into(e.name, flat[e.start:e.start + e.nbytes])
            yield Bucket(first_index + k, flat if device.type == "cpu" else flat.to(device), entries)
