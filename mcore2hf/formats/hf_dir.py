"""The one reader of HF checkpoint directories: `model.safetensors`, or shards named by
`model.safetensors.index.json` (the index wins where both exist, as every reader of ours always did).

Opening validates the whole directory from its headers alone (nothing is loaded): the index names files that
exist, every file's header parses (safetensors 0.8 `safetensors/src/tensor.rs`: 8-byte little-endian header
length, at most 100 MB of JSON header, then the data; each tensor's `data_offsets` relative to the data, the
tensors tiling it with no gap or overlap, and the file ending exactly where the data does), the index and the
headers agree on which file holds each tensor, and no tensor is in two files. Every problem is an
`HFDirectoryError` naming the file (a truncated file with the byte range its header promises).

Tensors are read with positioned reads (no memory map: an mmap's pages count in the reader's RSS until the file
is closed), whole or as a slice: `slice(name)[a:b]`, `[:, a:b]`, `[i:i + 1, :, a:b]`. A slice reads each row's
selection on its own where it is long (`RUN_BYTES`), else runs of whole rows of at most `CHUNK_BYTES` (recursing
into a larger row), so memory is the result plus at most one chunk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import HFDirectoryError
from ..layouts.geometry import align, numel
from ..plan.export import HFEntry
from ..transfer.buckets import Bucket

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: a PEFT adapter directory's one weights file (peft 0.21.2 PeftModel.save_pretrained; read like SINGLE)
ADAPTER_SINGLE = "adapter_model.safetensors"
MAX_HEADER = 100_000_000  # safetensors 0.8 `MAX_HEADER_SIZE`: it refuses larger headers
CHUNK_BYTES = 16 * 2**20  # a sliced read holds at most this much beyond its result
RUN_BYTES = 1024  # a row's selection at least this long is read on its own (less: whole rows, narrowed)

#: torch dtype <-> safetensors dtype string (safetensors 0.8 `Dtype`; the sub-byte F4 / F6 ones torch cannot hold)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
    torch.complex64: "C64",
}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of an HF directory as its header describes it: `path` (absolute) at byte `offset` (absolute)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str  # the file's name in the directory
    path: str
    offset: int
    nbytes: int


def has_weights(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding an index or model.safetensors (nothing validated)."""
    root = os.fspath(path)
    return os.path.isfile(os.path.join(root, INDEX)) or os.path.isfile(os.path.join(root, SINGLE))


def read_header(path: str) -> tuple[dict, int]:
    """(header without `__metadata__`, byte offset of the data) of one safetensors file, checked as safetensors
    0.8 checks it; every problem an HFDirectoryError naming the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFDirectoryError(path, f"{path} is not a safetensors file: {size} bytes, shorter than the "
                                             f"8-byte header length")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER or 8 + n > size:
                raise HFDirectoryError(path, f"{path} is not a safetensors file or is truncated: its header length "
                                             f"says bytes 8..{8 + n} hold the header, the file has {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise HFDirectoryError(path, f"cannot read {path}: {e.strerror or e}") from e
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HFDirectoryError(path, f"{path} has a header that is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise HFDirectoryError(path, f"{path} has a header that is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    spans = []
    for name, h in header.items():
        if not (isinstance(h, dict) and isinstance(h.get("shape"), list) and isinstance(h.get("data_offsets"), list)
                and len(h["data_offsets"]) == 2 and all(isinstance(x, int) and x >= 0 for x in h["shape"])
                and all(isinstance(x, int) for x in h["data_offsets"])):
            raise HFDirectoryError(path, f"{path}: header entry {name!r} is not {{dtype, shape, data_offsets}}: {h}")
        if h.get("dtype") not in TORCH_DTYPES:
            raise HFDirectoryError(path, f"{path}: tensor {name} has dtype {h.get('dtype')!r}, expected one of "
                                         f"{sorted(TORCH_DTYPES)}")
        b, e = h["data_offsets"]
        want = numel(tuple(h["shape"])) * TORCH_DTYPES[h["dtype"]].itemsize
        if e - b != want:
            raise HFDirectoryError(path, f"{path}: tensor {name} ({h['dtype']} {h['shape']}) needs {want} bytes, "
                                         f"its data_offsets {h['data_offsets']} give {e - b}")
        spans.append((b, e, name))
    end = 0
    for b, e, name in sorted(spans):
        if b != end:
            raise HFDirectoryError(path, f"{path}: tensor {name} starts at data byte {b}, expected {end} (tensors "
                                         f"must tile the data without gap or overlap)")
        end = e
    if start + end != size:
        cut = next((f"{name} (bytes {start + b}..{start + e})" for b, e, name in sorted(spans)
                    if start + e > size), None)
        if size < start + end:
            raise HFDirectoryError(path, f"{path} is truncated: its header places tensor data at bytes "
                                         f"{start}..{start + end}, the file ends at byte {size}; first tensor cut: "
                                         f"{cut}")
        raise HFDirectoryError(path, f"{path} has {size - start - end} bytes after its last tensor (data at bytes "
                                     f"{start}..{start + end}, file {size} bytes): not a safetensors file")
    return header, start


def _file_name_problem(root: str, fname) -> str | None:
    if not isinstance(fname, str) or not fname or os.path.isabs(fname) or fname != os.path.basename(fname) \
            or fname in (".", ".."):
        return f"{os.path.join(root, INDEX)} maps tensors to {fname!r}: expected a file name in the directory"
    return None


class HFDirectory:
    """The validated tensors of one HF directory. `role` names it in errors (e.g. "base checkpoint")."""

    def __init__(self, path: str | os.PathLike, role: str = ""):
        root = os.path.abspath(os.fspath(path))
        self.path, self.role = root, role
        who = f"{role} {root}" if role else root
        if not os.path.isdir(root):
            gone = "" if os.path.exists(root) else " (it does not exist)"
            raise HFDirectoryError(root, f"{who} is not a directory{gone}, so not an HF directory")
        index = os.path.join(root, INDEX)
        weight_map: dict[str, str] | None = None
        if os.path.isfile(index):
            weight_map = self._read_index(index)
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(root, SINGLE)):
            files = [SINGLE]
        elif os.path.isfile(os.path.join(root, ADAPTER_SINGLE)):
            files = [ADAPTER_SINGLE]
        else:
            raise HFDirectoryError(root, f"{who} is not an HF directory: it has neither {INDEX} nor {SINGLE}")
        self._handles: dict[str, int] = {}
        problems: list[str] = []
        unreadable: set[str] = set()
        where: dict[str, list[str]] = {}  # tensor -> files whose header holds it
        self.tensors: dict[str, StoredTensor] = {}
        missing = [f for f in files if not os.path.isfile(os.path.join(root, f))]
        for f in missing:
            named = sorted(n for n, g in weight_map.items() if g == f)
            problems.append(f"{index} maps {len(named)} tensor(s) to {os.path.join(root, f)}, which does not exist "
                            f"(e.g. {named[0]})")
        for fname in (f for f in files if f not in missing):
            path_f = os.path.join(root, fname)
            try:
                header, start = read_header(path_f)
            except HFDirectoryError as e:
                problems.append(str(e))
                unreadable.add(fname)
                continue
            for name, h in header.items():
                where.setdefault(name, []).append(fname)
                b, e = h["data_offsets"]
                self.tensors.setdefault(name, StoredTensor(name, tuple(h["shape"]), TORCH_DTYPES[h["dtype"]], fname,
                                                           path_f, start + b, e - b))
        for name, fs in where.items():
            if len(fs) > 1:
                problems.append(f"tensor {name} is in {len(fs)} files: {', '.join(os.path.join(root, f) for f in fs)}")
            elif weight_map is not None and weight_map.get(name) != fs[0]:
                problems.append(f"{os.path.join(root, fs[0])} holds tensor {name}, which {index} "
                                + ("does not list" if name not in weight_map else f"maps to {weight_map[name]}"))
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in where and fname not in missing and fname not in unreadable:
                    problems.append(f"{index} maps tensor {name} to {os.path.join(root, fname)}, whose header "
                                    f"lacks it")
        if problems:
            first = problems[0] if len(problems) == 1 else \
                f"{who}: {len(problems)} problems: " + "; ".join(problems[:5]) \
                + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise HFDirectoryError(root, first, problems)

    @staticmethod
    def _read_index(index: str) -> dict[str, str]:
        try:
            with open(index) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise HFDirectoryError(index, f"cannot read {index}: {e}") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise HFDirectoryError(index, f"{index} has no 'weight_map' object of tensor name -> file name")
        for fname in set(wm.values()):
            problem = _file_name_problem(os.path.dirname(index), fname)
            if problem:
                raise HFDirectoryError(index, problem)
        return wm

    # -- what it holds --------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def info(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise HFDirectoryError(self.path, f"{self.path} has no tensor {name}") from None

    # -- reading ----------------------------------------------------------------------------------------------------

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor (one positioned read into its own buffer)."""
        return self.slice(name)[:]

    def slice(self, name: str) -> LazyTensor:
        """The tensor unread: `shape`, `dtype`, and `[...]` reads only what the slice needs."""
        return LazyTensor(self, self.info(name))

    def _fd(self, path: str) -> int:
        fd = self._handles.get(path)
        if fd is None:
            try:
                fd = self._handles[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise HFDirectoryError(path, f"cannot read {path}: {e.strerror or e}") from e
        return fd

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """The whole tensor `name`'s bytes into `out` (a contiguous CPU uint8 tensor of its size): one positioned
        read, no buffer of its own (live base completion reads a bucket's tensors into its flat buffer)."""
        t = self.info(name)
        if out.dtype != torch.uint8 or out.numel() != t.nbytes or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"read_into({name}): expected a contiguous CPU uint8 tensor of {t.nbytes} bytes, found "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        if t.nbytes:
            self._read_into(t, t.offset, memoryview(out.numpy()))

    def read_bytes(self, t: StoredTensor, offset: int, n: int) -> torch.Tensor:
        """`n` bytes at absolute `offset` of t's file, as a fresh uint8 tensor."""
        out = torch.empty(n, dtype=torch.uint8)  # not zero-filled, unlike a bytearray
        if n:
            self._read_into(t, offset, memoryview(out.numpy()))
        return out

    def _read_into(self, t: StoredTensor, offset: int, view: memoryview) -> None:
        n, fd, done = len(view), self._fd(t.path), 0
        while done < n:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                raise HFDirectoryError(t.path, f"cannot read {t.path} bytes {offset}..{offset + n} "
                                               f"(tensor {t.name}): {e.strerror or e}") from e
            if got == 0:
                raise HFDirectoryError(t.path, f"{t.path} is truncated: tensor {t.name} needs bytes "
                                               f"{offset}..{offset + n}, the file ends at byte {offset + done}")
            done += got

    def read_region(self, t: StoredTensor, offset: int, shape: tuple[int, ...], ranges: list[range]) -> torch.Tensor:
        """The sub-block `ranges` (one contiguous range per dim) of the C-order array `shape` at `offset`."""
        item = t.dtype.itemsize
        inner = numel(shape[1:])
        r0 = ranges[0]
        if all(len(r) == d for r, d in zip(ranges[1:], shape[1:], strict=True)):  # whole rows: one read
            raw = self.read_bytes(t, offset + r0.start * inner * item, len(r0) * inner * item)
            return raw.view(t.dtype).view(len(r0), *shape[1:])
        out = torch.empty([len(r) for r in ranges], dtype=t.dtype)
        row = inner * item
        below = numel(shape[2:]) * item  # bytes of one index of dim 1
        run = len(ranges[1]) * below
        if all(len(r) == d for r, d in zip(ranges[2:], shape[2:], strict=True)) and run >= RUN_BYTES:
            # each row's selection is one contiguous run worth its own read: straight into the result
            dst = memoryview(out.view(torch.uint8).reshape(-1).numpy())
            for i, r in enumerate(r0):
                self._read_into(t, offset + r * row + ranges[1].start * below, dst[i * run:(i + 1) * run])
            return out
        rest = tuple(slice(r.start, r.stop) for r in ranges[1:])
        if row > CHUNK_BYTES:  # a row larger than a chunk: read each row's own sub-block
            for i, r in enumerate(r0):
                out[i] = self.read_region(t, offset + r * row, shape[1:], list(ranges[1:]))
            return out
        per = min(len(r0), max(1, CHUNK_BYTES // max(row, 1)))  # small selections: runs of whole rows, narrowed
        buf = torch.empty(per * row, dtype=torch.uint8)  # one buffer for every run: its pages are faulted in once
        view = memoryview(buf.numpy())
        for i in range(0, len(r0), per):
            n = min(per, len(r0) - i)
            self._read_into(t, offset + (r0.start + i) * row, view[:n * row])
            out[i:i + n] = buf[:n * row].view(t.dtype).view(n, *shape[1:])[(slice(None), *rest)]
        return out

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()

    def __enter__(self) -> HFDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self, _close=os.close):  # bound now: at interpreter exit the module's globals may be gone
        for fd in getattr(self, "_handles", {}).values():
            _close(fd)


class LazyTensor:
    """A tensor of an HF directory, read on indexing: `x[:]`, `x[a:b]`, `x[:, a:b]`, `x[i:i + 1, :, a:b]`
    (slices of step 1 and integers). `get_shape()` as safetensors' slices have it, for the layout ops."""

    def __init__(self, directory: HFDirectory, info: StoredTensor):
        self.directory, self.info = directory, info
        self.shape, self.dtype, self.name = info.shape, info.dtype, info.name

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > len(self.shape) and not (len(self.shape) == 0 and key in ((), (slice(None),))):
            raise IndexError(f"{self.name}: {len(key)} indices for a tensor of shape {list(self.shape)}")
        ranges, squeeze = [], []
        for dim, size in enumerate(self.shape):
            k = key[dim] if dim < len(key) else slice(None)
            if isinstance(k, int):
                i = k + size if k < 0 else k
                if not 0 <= i < size:
                    raise IndexError(f"{self.name}: index {k} out of range for dim {dim} of size {size}")
                ranges.append(range(i, i + 1))
                squeeze.append(dim)
            elif isinstance(k, slice):
                r = range(size)[k]
                if r.step != 1:
                    raise IndexError(f"{self.name}: slices of step 1 only, got {k}")
                ranges.append(r)
            else:
                raise IndexError(f"{self.name}: index {k!r} is not a slice or an integer")
        if not self.shape:  # a scalar
            raw = self.directory.read_bytes(self.info, self.info.offset, self.info.nbytes)
            return raw.view(self.dtype).view(())
        out = self.directory.read_region(self.info, self.info.offset, self.shape, ranges)
        for dim in reversed(squeeze):
            out = out.squeeze(dim)
        return out


class StateDictTensors:
    """An in-memory state dict seen as an HF directory's tensors (what the loader takes instead of a path)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)
        self.path = "the given state dict"

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def slice(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        pass


def open_tensors(source: str | os.PathLike | Mapping[str, torch.Tensor]) -> HFDirectory | StateDictTensors:
    """An HF directory or an in-memory state dict, with the same names() / `in` / slice() / read() / close()."""
    return StateDictTensors(source) if isinstance(source, Mapping) else HFDirectory(source)


def read_all(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, as saved (small checkpoints: tests, the demo)."""
    with HFDirectory(path) as d:
        return {n: d.read(n) for n in d.names()}


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


class _Transposed:
    """A 3-D tensor (or lazily read one) seen with dims 1 and 2 swapped; indexing reads only what it selects."""

    def __init__(self, base):
        self.base = base
        shape = tuple(base.shape) if isinstance(base, torch.Tensor) else tuple(base.get_shape())
        self.shape = (shape[0], shape[2], shape[1], *shape[3:])
        self.dtype = base.dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (len(self.shape) - len(key))
        out = self.base[(key[0], key[2], key[1], *key[3:])]
        if not isinstance(key[1], int) and not isinstance(key[2], int):  # both survive: swap them back
            first = 0 if isinstance(key[0], int) else 1
            out = out.transpose(first, first + 1)
        return out.contiguous()


class PublishedView:
    """An HF source (HFDirectory or StateDictTensors) seen in the published checkpoints' layout: tensors stored as
    transformers' own `save_pretrained` writes them (the architecture's registered `published_layout`) under their
    published names and shapes, the others as they are (`as_published` builds it). Same names() / `in` / slice() /
    read() / close() / path as the source."""

    def __init__(self, reader, stored: dict[str, tuple[str, bool]]):
        self.reader, self.path = reader, reader.path
        self._stored = stored  # published name -> (stored name, transposed)

    def names(self) -> list[str]:
        return list(self._stored)

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def slice(self, name: str):
        stored, transposed = self._stored[name]
        x = self.reader.slice(stored)
        return _Transposed(x) if transposed else x

    def read(self, name: str) -> torch.Tensor:
        return self.slice(name)[:]

    def close(self) -> None:
        self.reader.close()


def as_published(reader, cfg):
    """`reader` (`open_tensors`) seen in the published layout: a checkpoint transformers itself saved (its names
    and packed-expert layout, the architecture's registered `published_layout`) reads as the published one, as
    transformers reads both (conversion_mapping.py: "qwen3_vl_moe" transposes on load only where the stored shape
    is not the model's, `Transpose(1, 2, check_dims=True)`; "kimi_k25" renames either form). A transposed tensor is told by its shape
    against the published one; a square one (hidden == 2 x ffn) reads as published. Unchanged where nothing
    differs."""
    import re

    from ..arch.hf_config import hf_tensor_shapes, published_layout
    from ..arch.registry import published_layout as registered

    rules = registered(cfg.model_type)
    names = reader.names()
    if not any(re.search(p, n) for p, _ in rules for n in names):
        return reader
    want = hf_tensor_shapes(cfg) if any(a == "transpose" for _, a in rules) else {}
    stored: dict[str, tuple[str, bool]] = {}
    for n in names:
        x = reader.slice(n)
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x.get_shape())
        published, pshape = published_layout(cfg.model_type, n, shape)
        transposed = pshape != shape and want.get(published) == pshape and want.get(published) != shape
        stored[published] = (n, transposed)
    return PublishedView(reader, stored)
