"""What the executor core reads and writes: this rank's local tensors (`Sources`, one staleness policy), the
staging arena (`Arena`), packs into it (`Pack`) and the pool of output buffers (`OutputPool`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..arch.naming import LocalTensor

_data_ptr = torch.Tensor.data_ptr
_use_count = torch._C._storage_Use_Count  # references to a storage (tensors, views, storage objects)


class OutputPool:
    """Output buffers reused by every bucket and export, so a bucket's copies run on views precomputed once.

    Lifetime rule: a buffer is handed out again only when nothing but the pool references its memory (its
    storage's use count): the Bucket, its `flat`, every tensor or view taken from it, dropped. A bucket you keep
    stays valid and is never overwritten: the next bucket then takes the other buffer, or a new one that is not
    kept (beyond `limit` buffers). A consumer that drops each bucket before asking for the next runs on one
    buffer; a plain `for` loop (its variable holds the previous bucket while the next is built) on two. The
    buffers are kept between exports, as the staging arena is (`HFExporter.release()` frees both). Precomputed
    views are made on an alias of each buffer's memory (`aliases`), which holds no reference to its storage, so
    the use count sees only what the consumer holds. Where a bucket's collective lands in its output, that output
    is taken when the bucket starts, while the previous one is still alive: `limit` 3 keeps a `for` loop pooled."""

    def __init__(self, nbytes: int, device: torch.device, limit: int = 2):
        self.nbytes, self.device, self.limit = max(nbytes, 64), device, limit
        self.buffers: list[torch.Tensor] = []
        self.aliases: list[torch.Tensor] = []
        self._free: list[int] = []  # each buffer's use count with no reference outside the pool
        self._slot: dict[int, int] = {}  # data_ptr -> buffer index

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of `nbytes` bytes: a pooled one nobody holds, else a new one."""
        if nbytes <= self.nbytes:
            for i, b in enumerate(self.buffers):
                if _use_count(b.untyped_storage()._cdata) <= self._free[i]:
                    return b[:nbytes]
            if len(self.buffers) < self.limit:
                b = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                alias = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
                    torch._C._construct_storage_from_data_pointer(b.data_ptr(), b.device, self.nbytes))
                self._slot[b.data_ptr()] = len(self.buffers)
                self.buffers.append(b)
                self.aliases.append(alias)
                self._free.append(_use_count(b.untyped_storage()._cdata))
                return b[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def slot(self, flat: torch.Tensor) -> int | None:
        """The pooled buffer `flat` starts, or None (a buffer of its own)."""
        return self._slot.get(flat.data_ptr())

    @staticmethod
    def nbytes_kept(pool: OutputPool | None) -> int:
        return 0 if pool is None else sum(b.numel() for b in pool.buffers)


class Arena:
    """A flat staging buffer, reused by every bucket and export, with cached dtype views."""

    def __init__(self, nbytes: int, device: torch.device):
        self.flat = torch.empty(max(nbytes, 64), dtype=torch.uint8, device=device)
        self.typed_views: dict[torch.dtype, torch.Tensor] = {}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        t = self.typed_views.get(dtype)
        if t is None:
            n = self.flat.numel()
            t = self.typed_views[dtype] = self.flat[:n - n % dtype.itemsize].view(dtype)
        return t

    def view(self, byte_offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of `shape` at `byte_offset` (aligned for the dtype)."""
        n = 1
        for d in shape:
            n *= d
        start = byte_offset // dtype.itemsize
        return self.typed(dtype)[start:start + n].view(shape)


class Sources:
    """This rank's local tensors as programs read them, one staleness policy for all exports: a contiguous parameter
    is read through views precomputed at compile time, each compiled bucket recording the storages it relies on
    (`watch`); when training swapped a parameter's .data since, the bucket is recompiled before it runs. A buffer or
    grouped-expert item (a getter), a non-contiguous parameter and an FP8 blob (a hook) are read once per bucket
    run (`resolve`); a LoRA-merged weight from its slot in a merge arena (`merged`)."""

    def __init__(self, local: dict[str, LocalTensor]):
        self.local = local
        #: name -> a function giving the tensor to read instead, once per bucket run (FP8 blobs)
        self.hooks: dict[str, Callable[[], torch.Tensor]] = {}
        #: a LoRA-merged weight's slot in a merge arena (`LoRAMerges.compile`), written when its bucket starts
        self.merged: dict[str, torch.Tensor] = {}

    def tensor(self, name: str) -> torch.Tensor:
        """The local tensor as it is now (a merged weight: its slot, merged by the running bucket)."""
        slot = self.merged.get(name)
        if slot is not None:
            return slot
        lt = self.local[name]
        # buffers and computed tensors (a LoRA merge) are read through their getter each time
        return (lt.get() if lt.is_buffer or lt.param is None else lt.param).detach()

    def view(self, name: str, sizes, strides, offset: int, bases: dict, hooked: bool = False) -> torch.Tensor | None:
        """A view precomputed now (its storage recorded in `bases`), or None when it must be read at each run.
        `hooked`: of the parameter itself even where a hook gives what is read instead (FP8 quantized in place)."""
        lt = self.local[name]
        if name in self.hooks and not hooked:
            return None
        slot = self.merged.get(name)
        if slot is not None:  # a merge arena is never reallocated: no storage to watch
            return slot.as_strided(sizes, strides, slot.storage_offset() + offset)
        if lt.is_buffer or lt.param is None or not lt.param.is_contiguous():
            return None
        b = lt.param.detach()
        bases[name] = (lt.param, b.data_ptr())
        return b.as_strided(sizes, strides, b.storage_offset() + offset)

    def resolve(self, name: str, cache: dict) -> torch.Tensor:
        """A source read at run time: once per bucket (a non-contiguous shard is made contiguous once, not once
        per piece)."""
        t = cache.get(name)
        if t is None:
            hook = self.hooks.get(name)
            t = hook() if hook is not None else self.tensor(name)
            t = cache[name] = t if t.is_contiguous() else t.contiguous()
        return t

    def copy_pack(self, pack: Pack, cache: dict) -> None:
        """A pack's copies, its sources read at each run (`dynamic`) resolved first."""
        if not pack.dsts:
            return
        srcs = pack.srcs
        if pack.dynamic:
            srcs = list(srcs)
            for i, name, (sizes, strides, off) in pack.dynamic:
                t = self.resolve(name, cache)
                srcs[i] = t.as_strided(sizes, strides, t.storage_offset() + off)
        torch._foreach_copy_(pack.dsts, srcs)

    @staticmethod
    def watch(bases: dict) -> tuple[tuple, list[int]]:
        """`bases` as (parameters, their data pointers then) for `unchanged`."""
        return tuple(p for p, _ in bases.values()), [ptr for _, ptr in bases.values()]

    @staticmethod
    def unchanged(watched: tuple[tuple, list[int]]) -> bool:
        """`not stale(bases)` in one pass in C (a later export checks every parameter of every bucket)."""
        params, ptrs = watched
        return list(map(_data_ptr, params)) == ptrs


@dataclass
class Pack:
    """Copies into precomputed destinations (arena views): static sources, and sources read at each run
    (`dynamic`: index, name, (sizes, strides, offset))."""

    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list = field(default_factory=list)
    dynamic: list[tuple[int, str, tuple]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(d.numel() * d.element_size() for d in self.dsts)
