"""Megatron's torch_dist checkpoint format (torch.distributed.checkpoint as megatron-core's dist_checkpointing
writes it), read and written chunk by chunk, with no torch.distributed, no model and no GPU.

Reading: the checkpoint's `.metadata` says where every chunk of every tensor is (a byte range of a `.distcp` file
holding one uncompressed `torch.save`d chunk), so each tensor is assembled from exactly the bytes it needs (a layer
of a stacked-layers chunk is one contiguous read), every byte read covered by the chunk's CRC32. Checkpoint keys are
global already (layer and expert indices), in Megatron's sharded-state-dict names, which `checkpoint_keys` maps to
canonical names (`checkpoint_sources`).

Writing: one chunk per `torch.save` at a byte range of a `.distcp` file, as torch.distributed.checkpoint's
FileSystemWriter writes them, the `.metadata` that indexes them, and dist_checkpointing's `common.pt` and
`metadata.json` (`DistcpWriter`); the iteration directory's files (`TORCH_DIST_OUTPUT`) and the tracker file.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import uuid
import zipfile
import zlib

import regex
import torch

from ..arch.naming import HybridLayout
from ..errors import CheckpointError, ImportTargetError
from ..layouts.geometry import row_strides
from .checkpoint_keys import PARTS, CkptSource, canonical_parts
from .paths import OutputKind


class DistCheckpointReader:
    """Reads tensors (or slices of them) of a torch_dist checkpoint directory chunk by chunk."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        self.path = path
        meta_json = os.path.join(path, "metadata.json")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(f"{path} is not a torch_dist checkpoint: no .metadata file")
        if os.path.isfile(meta_json):
            import json

            with open(meta_json) as f:
                backend = json.load(f).get("sharded_backend")
            if backend not in (None, "torch_dist"):
                raise CheckpointError(f"{path}: sharded backend {backend!r} is not supported (only torch_dist)")
        try:
            self.meta = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}/.metadata cannot be read ({type(e).__name__}: {e})") from None
        self._index = MetadataIndex
        self.tensors = {k: v for k, v in self.meta.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self._sizes: dict[str, int] = {}
        self._verified: set[tuple[str, int]] = set()
        self.bytes_read = 0

    def check_files(self, keys) -> None:
        """Every chunk of `keys` lies inside its file: a truncated checkpoint fails before anything is written."""
        for key in keys:
            for chunk in self.tensors[key].chunks:
                self._locate(key, chunk)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def sources(self, num_layers: int, tied: bool, hybrid: HybridLayout | None = None
                ) -> tuple[list[CkptSource], list[str]]:
        return checkpoint_sources(self, num_layers, hybrid)  # a tied output layer is not saved apart from the embedding

    def tp_of(self, source: CkptSource) -> int:
        """TP of the checkpoint's chunking of this tensor along dim 0 (vocab-parallel tensors)."""
        return len({c.offsets[0] for c in self.tensors[source.key].chunks})

    def checkpoint_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in os.listdir(self.path) if f.endswith(".distcp"))

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def _locate(self, key: str, chunk) -> tuple[str, int, int]:
        info = self.meta.storage_data.get(self._index(key, chunk.offsets))
        if info is None:
            raise CheckpointError(f"{self.path}: no storage entry for a chunk of {key} at offset {list(chunk.offsets)}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{key}: transformed (e.g. compressed) chunks are not supported")
        file = os.path.join(self.path, info.relative_path)
        size = self._sizes.get(file)
        if size is None:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file} is missing (it holds a chunk of {key})")
            size = self._sizes[file] = os.path.getsize(file)
        if info.offset + info.length > size:
            raise CheckpointError(f"{file} is truncated: a chunk of {key} needs bytes [{info.offset}, "
                                  f"{info.offset + info.length}), the file has {size}")
        return file, info.offset, info.length

    def _chunk_part(self, key: str, chunk, sub: tuple[int, ...]) -> torch.Tensor:
        """chunk[sub], reading only its bytes: each chunk is an uncompressed torch.save zip at a byte range of a
        .distcp file, so its tensor layout comes from data.pkl and the sub-tensor from one contiguous read."""
        file, start, length = self._locate(key, chunk)
        where = f"{file} (chunk of {key} at bytes [{start}, {start + length}))"
        with open(file, "rb") as f:
            window = _Window(f, start, length)
            try:
                layout = _chunk_layout(window)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{where} is corrupt: {type(e).__name__}: {e}") from None
            if layout is None:  # unusual serialization: load the chunk whole (torch verifies it)
                window.seek(0)
                try:
                    return torch.load(io.BytesIO(window.read(length)), map_location="cpu", weights_only=True)[sub]
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(f"{where} is corrupt: {type(e).__name__}: {e}") from None
            dtype, storage_offset, size, stride, data_off, data_len, crc = layout
            if tuple(size) != tuple(chunk.sizes):
                raise CheckpointError(f"{where} is corrupt: tensor shape {list(size)}, metadata says {list(chunk.sizes)}")
            rest, rest_stride = size[len(sub):], stride[len(sub):]
            if tuple(rest_stride) != row_strides(rest):
                window.seek(0)
                return torch.load(io.BytesIO(window.read(length)), map_location="cpu", weights_only=True)[sub]
            first = storage_offset + sum(i * st for i, st in zip(sub, stride))
            count = 1
            for d in rest:
                count *= d
            item = dtype.itemsize
            window.seek(data_off + first * item)
            raw = window.read(count * item)
            if len(raw) != count * item:
                raise CheckpointError(f"{where} is truncated: its data ends early")
            whole = first == 0 and count * item == data_len
            if whole and zlib.crc32(raw) != crc:
                raise CheckpointError(f"{where} is corrupt: CRC32 mismatch")
            if not whole and (file, start) not in self._verified:
                _verify_crc(window, data_off, data_len, crc, where)
                self._verified.add((file, start))
        self.bytes_read += len(raw)
        return torch.frombuffer(bytearray(raw), dtype=dtype).view(rest) if count else torch.empty(rest, dtype=dtype)

    def read(self, key: str, lead: tuple[int, ...] = ()) -> torch.Tensor:
        """The tensor `key`, or its sub-tensor key[lead] (indices into its leading dims: stacked layers,
        stacked experts), assembled from the parts of the chunks that hold it."""
        md = self.tensors[key]
        shape = list(md.size)
        k = len(lead)
        out = torch.empty(shape[k:], dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            off, size = chunk.offsets, chunk.sizes
            if any(not off[d] <= lead[d] < off[d] + size[d] for d in range(k)):
                continue
            src = self._chunk_part(key, chunk, tuple(lead[d] - off[d] for d in range(k)))
            out[tuple(slice(o, o + n) for o, n in zip(off[k:], size[k:]))].copy_(src)
            covered += src.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.path}: the chunks of {key}{list(lead)} cover {covered} of {out.numel()} elements")
        return out


class _Window(io.RawIOBase):
    """A read-only view of bytes [start, start + length) of an open file (zipfile reads the chunk through it)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        data = self.f.read(max(n, 0))
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a torch.save data.pkl for one tensor's layout without touching its storage."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"unexpected {module}.{name}")

    def persistent_load(self, pid):
        return pid


def _chunk_layout(window: _Window):
    """(dtype, storage_offset, size, stride, data offset, data length, crc) of the chunk, or None if unusual."""
    zf = zipfile.ZipFile(window)
    pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
    obj = _LayoutUnpickler(io.BytesIO(zf.read(pkl))).load()
    if not (isinstance(obj, tuple) and obj and obj[0] == "tensor"):
        return None
    _, storage, offset, size, stride = obj
    if not (isinstance(storage, tuple) and storage[0] == "storage"):
        return None
    dtype = getattr(storage[1], "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    info = zf.getinfo(pkl[: -len("data.pkl")] + f"data/{storage[2]}")
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    window.seek(info.header_offset)
    header = window.read(30)
    data_off = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return dtype, offset, size, stride, data_off, info.file_size, info.CRC


def _verify_crc(window: _Window, start: int, length: int, crc: int, where: str) -> None:
    """CRC32 of a chunk's whole data, streamed (a partial read cannot check it otherwise)."""
    window.seek(start)
    value, left = 0, length
    while left:
        block = window.read(min(left, 64 * 2**20))
        if not block:
            raise CheckpointError(f"{where} is truncated: its data ends early")
        value = zlib.crc32(block, value)
        left -= len(block)
    if value != crc:
        raise CheckpointError(f"{where} is corrupt: CRC32 mismatch")


def checkpoint_sources(reader: DistCheckpointReader, num_layers: int,
                       hybrid: HybridLayout | None = None) -> tuple[list[CkptSource], list[str]]:
    """Canonical sources of every model tensor of the checkpoint (its keys read by `checkpoint_keys`); also the
    keys that are not model weights. `hybrid`: a hybrid model's checkpoint (naming.checkpoint_hybrid_layout)."""
    found, ignored = canonical_parts(reader.tensors, reader.shape, num_layers, hybrid)
    sources = []
    for name, parts in found.items():
        order = [parts[p] for p in PARTS if p in parts]  # gate (_w) before up (_v); GDN: Megatron's order
        key, lead = order[0]
        shape = list(reader.shape(key))[len(lead):]
        for k, ld in order[1:]:
            shape[0] += reader.shape(k)[len(ld)]
        sources.append(CkptSource(name, key, [list(order)], tuple(shape), reader.dtype(key)))
    return sources, ignored


def torch_save(obj, f) -> None:
    """torch.save, raising the OSError of a failed write (a full disk) as itself: torch 2.13 reports it as a
    RuntimeError ("unexpected pos", caffe2 inline_container.cc) whose context is the OSError."""
    try:
        torch.save(obj, f)
    except RuntimeError as e:
        if isinstance(e.__context__, OSError):
            raise e.__context__ from e
        raise


class DistcpWriter:
    """Writes chunks into `.distcp` files the way torch.distributed.checkpoint's FileSystemWriter does (one
    `torch.save` per tensor chunk, raw bytes per object) and the `.metadata` that indexes them."""

    def __init__(self, path: str, file_bytes: int):
        from torch.distributed.checkpoint.metadata import Metadata  # noqa: F401 - fail early if DCP is absent

        self.path, self.file_bytes = path, file_bytes
        self.index, self.file, self.name = 0, None, ""
        self.storage: dict = {}
        self.chunks: dict[str, list] = {}
        self.bytes = 0

    def _stream(self):
        if self.file is None or self.file.tell() >= self.file_bytes:
            if self.file is not None:
                self.file.close()
            self.name = f"__0_{self.index}.distcp"
            self.index += 1
            self.file = open(os.path.join(self.path, self.name), "wb")  # noqa: SIM115 - closed in finish
        return self.file

    def tensor(self, key: str, offsets: tuple[int, ...], t: torch.Tensor) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        t = t.contiguous()
        if t.untyped_storage().nbytes() != t.nbytes:  # torch.save writes whole storages
            t = t.clone()
        f = self._stream()
        start = f.tell()
        torch_save(t, f)
        self._record(MetadataIndex(key, offsets), start, f.tell() - start)
        self.chunks.setdefault(key, []).append(ChunkStorageMetadata(torch.Size(offsets), t.shape))

    def blob(self, key: str, data: bytes) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        f = self._stream()
        start = f.tell()
        f.write(data)
        self._record(MetadataIndex(key), start, len(data))

    def _record(self, index, start: int, length: int) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        self.storage[index] = _StorageInfo(self.name, start, length)
        self.bytes += length

    def finish(self, keys: dict[str, tuple], objects: list[str], iteration: int) -> None:
        """The `_extra_state` objects (`torch.save([None])`, what the local spec's linears hold; strategies/torch.py:
        a list of the rank's objects' data), `.metadata` indexing every chunk, then `common.pt` and
        `metadata.json` (dist_checkpointing's strategies/common.py and core.py), which say the directory is a
        complete checkpoint."""
        empty = io.BytesIO()
        torch.save([None], empty)
        for key in objects:
            self.blob(key, empty.getvalue())
        self._metadata(keys, objects)
        torch_save({"checkpoint_version": 3.0, "iteration": iteration}, os.path.join(self.path, "common.pt"))
        with open(os.path.join(self.path, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, f)

    def _metadata(self, keys: dict[str, tuple], objects: list[str]) -> None:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            Metadata,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        sd_meta: dict = {k: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), self.chunks[k])
                         for k, (shape, dtype) in keys.items()}
        sd_meta.update({k: BytesStorageMetadata() for k in objects})
        meta = Metadata(state_dict_metadata=sd_meta, storage_data=self.storage,
                        storage_meta=StorageMeta(checkpoint_id=self.path, save_id=str(uuid.uuid4())))
        with open(os.path.join(self.path, ".metadata"), "wb") as f:
            pickle.dump(meta, f)  # as FileSystemWriter.finish (torch 2.13 filesystem.py) writes it


_DISTCP_FILES = regex.compile(r"\.metadata|metadata\.json|common\.pt|__\d+_\d+\.distcp")


def torch_dist_files(directory: str) -> set[str]:
    """The names of a torch_dist iteration directory's own files (what FileSystemWriter and Megatron write)."""
    return {n for n in os.listdir(directory)
            if _DISTCP_FILES.fullmatch(n) and os.path.isfile(os.path.join(directory, n))}


#: an iteration directory: `.metadata` and metadata.json (dist_checkpointing's check) say it is complete
TORCH_DIST_OUTPUT = OutputKind("a torch_dist checkpoint directory (no .metadata or .distcp files)", torch_dist_files,
                               last=(".metadata", "metadata.json"), error=ImportTargetError)


def iteration_dir(ckpt_dir: str, iteration: int) -> str:
    return os.path.join(ckpt_dir, f"iter_{iteration:07d}")
