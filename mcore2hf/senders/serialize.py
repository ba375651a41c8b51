"""Serializing buckets for inference engines: the flattened-bucket payload and SGLang's serializer format.

A bucket travels as one flat uint8 tensor plus metadata (SGLang's `load_format="flattened_bucket"`):

    {"flattened_tensor": <uint8 tensor>, "metadata": [meta, ...]}

each meta having SGLang's FlattenedTensorMetadata fields (name, shape, dtype, start_idx, end_idx, numel; indices
in bytes). It is pickled with `ForkingPickler`, so CUDA tensors become CUDA IPC handles (CPU tensors shared
memory) and the engine maps the trainer's memory with no copy; the HTTP form is base64 text, as SGLang's
`MultiprocessingSerializer` writes it. Metadata objects are `types.SimpleNamespace` (or SGLang's own class when
sglang is importable): SGLang's restricted unpickler accepts both, while classes of this library would be
rejected on an engine that does not have it installed.
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler

import torch

from ..buckets import Bucket

try:  # the engine's own metadata class and its device-UUID tensor reductions, when sglang is installed here
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as _SGLangMeta  # type: ignore
except Exception:  # noqa: BLE001
    _SGLangMeta = None


def _patch_reductions() -> None:
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # type: ignore
    except Exception:  # noqa: BLE001 - without sglang, torch's reductions reference CUDA devices by index
        return
    monkey_patch_torch_reductions()


def bucket_metadata(bucket: Bucket) -> list:
    """SGLang FlattenedTensorMetadata records for the bucket's tensors, in flat-buffer order."""
    make = _SGLangMeta or types.SimpleNamespace
    return [make(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
            for m in bucket.metadata()]


def flattened_payload(bucket: Bucket) -> dict:
    return {"flattened_tensor": bucket.flat, "metadata": bucket_metadata(bucket)}


def serialize(obj, output_str: bool = False) -> bytes | str:
    """ForkingPickler bytes (CUDA tensors as IPC handles), or their base64 text for HTTP."""
    _patch_reductions()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if output_str else data


# What the reference receivers accept (SGLang's restricted unpickler admits these module prefixes too).
ALLOWED_MODULE_PREFIXES = ("torch.", "collections.OrderedDict", "types.SimpleNamespace",
                           "multiprocessing.resource_sharer.", "multiprocessing.reduction.",
                           "sglang.srt.weight_sync.tensor_bucket.", "sglang.srt.utils.patch_torch.")
SAFE_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray", "int", "float", "bool",
                 "complex", "slice", "range"}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only tensors, their IPC reductions and plain data types (never callables like eval or open)."""

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in SAFE_BUILTINS:
            return super().find_class(module, name)
        if any(f"{module}.{name}".startswith(p) for p in ALLOWED_MODULE_PREFIXES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def deserialize(data: bytes | str):
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return RestrictedUnpickler(io.BytesIO(data)).load()


def reconstruct(payload: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a flattened-bucket payload (no copy), as an engine rebuilds them."""
    flat = payload["flattened_tensor"]
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)) for m in payload["metadata"]]
