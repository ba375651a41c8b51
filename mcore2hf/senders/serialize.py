"""Serializing buckets for inference engines: the flattened-bucket payload, SGLang's serializer format, and the
restricted unpickler our own receivers use.

A bucket travels as one flat uint8 tensor plus metadata (SGLang's `load_format="flattened_bucket"`):

    {"flattened_tensor": <uint8 tensor>, "metadata": [meta, ...]}

each meta having SGLang's FlattenedTensorMetadata fields (name, shape, dtype, start_idx, end_idx, numel; indices
in bytes; sglang 0.5.23 weight_sync/tensor_bucket.py). The HTTP form is base64 text of the pickle, as SGLang's
`MultiprocessingSerializer.serialize(obj, output_str=True)` writes it (sglang 0.5.23 utils/common.py).

`IPCPickler` is a ForkingPickler with its own reducers for tensors and storages (no global patch of torch):

* CUDA tensors become CUDA IPC handles whose device slot (argument 6 of `rebuild_cuda_tensor`) holds the GPU's
  UUID string, as SGLang's `_reduce_tensor_modified` writes it (sglang 0.5.23 utils/patch_torch.py). The engine
  maps the UUID back to its own device index, so trainer and engine may see different CUDA_VISIBLE_DEVICES.
  SGLang patches `torch.multiprocessing.reductions.rebuild_cuda_tensor` in its scheduler before unpickling
  (tp_worker.deserialize_own_rank), so the pickled reference resolves to its UUID-aware rebuild.
* CPU tensors share their storage through a shared-memory *file* (torch's `file_system` strategy:
  `rebuild_storage_filename`, on SGLang's allowlist), never through a file descriptor passed by
  multiprocessing's resource sharer, which only a process with the sender's authkey can open (an HTTP engine is
  an unrelated process). SGLang itself leaves CPU tensors to torch's default (file descriptors).

Metadata objects are `types.SimpleNamespace`: on the exact allowlist of sglang >= 0.5.21 and under the `types.`
prefix of older releases, while classes of this library would be refused by every engine.
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions as _red

from ..transfer.buckets import Bucket

DEVICE_ARG = 6  # index of the device in rebuild_cuda_tensor's arguments (sglang 0.5.23 utils/patch_torch.py)


def device_uuid(index: int) -> str:
    """A GPU's UUID as SGLang and vLLM write it (`str(torch.cuda.get_device_properties(i).uuid)`)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_from_uuid(device: int | str) -> int:
    """This process's index of the GPU a handle names (by UUID; an int is taken as is, as SGLang does)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for i in range(torch.cuda.device_count()):
            if device_uuid(i) == device:
                return i
        raise RuntimeError(f"no visible GPU has UUID {device} (CUDA_VISIBLE_DEVICES may hide it)")
    raise TypeError(f"device slot of a CUDA IPC handle: expected a GPU UUID or an index, found {device!r}")


def reduce_tensor_by_uuid(tensor: torch.Tensor):
    """torch's `reduce_tensor`, with a CUDA tensor's device given by UUID (what `IPCPickler` emits)."""
    rebuild, args = _red.reduce_tensor(tensor)
    if rebuild is _red.rebuild_cuda_tensor:
        args = (*args[:DEVICE_ARG], device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1:])
    return rebuild, args


def rebuild_cuda_tensor_by_uuid(*args):
    """`rebuild_cuda_tensor` for handles whose device slot holds a UUID (SGLang's `_rebuild_cuda_tensor_modified`,
    without patching torch)."""
    args = (*args[:DEVICE_ARG], device_from_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1:])
    return _red.rebuild_cuda_tensor(*args)


def _reduce_cpu_storage(storage):
    """torch's reduce_storage, `file_system` branch, whatever the global sharing strategy is."""
    if storage.size() == 0:
        return (_red.rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    _red.shared_cache[metadata[1]] = _red.StorageWeakRef(storage)
    return (_red.rebuild_storage_filename, (type(storage),) + metadata)


class IPCPickler(ForkingPickler):
    """ForkingPickler whose tensors are IPC handles keyed by GPU UUID (CPU: shared-memory files)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return reduce_tensor_by_uuid(obj)
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu":
            return _reduce_cpu_storage(obj)
        return NotImplemented


def bucket_metadata(bucket: Bucket) -> list:
    """FlattenedTensorMetadata records (as SimpleNamespace) for the bucket's tensors, in flat-buffer order."""
    return [types.SimpleNamespace(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                  end_idx=m.end_idx, numel=m.numel) for m in bucket.metadata()]


def flattened_payload(bucket: Bucket) -> dict:
    return {"flattened_tensor": bucket.flat, "metadata": bucket_metadata(bucket)}


def serialize(obj, output_str: bool = False) -> bytes | str:
    """IPCPickler bytes (CUDA tensors as IPC handles keyed by GPU UUID), or their base64 text for HTTP."""
    buf = io.BytesIO()
    IPCPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if output_str else data


def _dtype_names() -> set[str]:
    return {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


# Exact (module, name) pairs our receivers unpickle: a subset of sglang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS
# (utils/common.py; tests/test_sglang_contract.py checks the inclusion), enough for tensors, their CPU and CUDA IPC
# reductions, flattened-bucket payloads and plain data. No module prefixes: torch.* holds torch.load, torch.hub.load.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
                               "list", "range", "set", "slice", "str", "tuple")}
    | {("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("types", "SimpleNamespace"),
       ("multiprocessing.resource_sharer", "DupFd"), ("_codecs", "encode")}
    | {("torch", n) for n in ("Tensor", "Size", "device", "dtype", "UntypedStorage")}
    | {("torch", n) for n in _dtype_names()}
    | {("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
       ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
       ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2")}
    | {("torch.multiprocessing.reductions", n) for n in (
        "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
        "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")}
    | {("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
       ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")}
)

# What an allowed name resolves to in our receivers: UUID-aware CUDA rebuilds, and SGLang's names where sglang
# is not installed (the payload may come from a trainer that has it).
_RESOLVE = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor_by_uuid,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor_by_uuid,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): types.SimpleNamespace,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only the exact (module, name) pairs of ALLOWED_GLOBALS (never callables like eval, torch.load)."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: not on the allowlist of exact "
                                         "(module, name) pairs")
        return _RESOLVE.get((module, name)) or super().find_class(module, name)


def deserialize(data: bytes | str):
    """Inverse of `serialize` (bytes or base64 text), with the restricted unpickler."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return RestrictedUnpickler(io.BytesIO(data)).load()


def reconstruct(payload: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a flattened-bucket payload (no copy), as an engine rebuilds them."""
    flat = payload["flattened_tensor"]
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)) for m in payload["metadata"]]

