"""vLLM: the two patterns RL stacks use with vLLM workers, with the same bucket protocol.

Engine side: `MCore2HFWorkerExtension`, a worker extension class
(`LLM(..., worker_extension_cls="mcore2hf.senders.vllm.MCore2HFWorkerExtension")`), adds to every worker:

* `mcore2hf_update_from_ipc(payloads, version)`: colocated workers. `payloads` maps a GPU's UUID to the CUDA IPC
  handle of that GPU's flat bucket and its metadata; each worker takes the entry of its own GPU (UUIDs, not
  indices, because trainer and engine may see different CUDA_VISIBLE_DEVICES), opens it on its own device and
  loads the tensors with `model_runner.model.load_weights`.
* `mcore2hf_init_group(...)` / `mcore2hf_update_from_broadcast(names, dtypes, shapes, version)`: remote workers join
  a weight-update group with the trainer's rank 0 and receive each bucket's flat buffer by broadcast.

Trainer side: `VLLMColocatedSender` and `VLLMDistributedSender`, driven by `sync()` like the SGLang senders; the
engine object is anything with vLLM's `collective_rpc(method, args=...)` (an `LLM`, an `AsyncLLM`, a Ray actor
wrapper).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from ..buckets import Bucket
from .process_group import broadcast, join_weight_update_group
from .receiver import tight_views
from .sglang import _BroadcastSender, _call, _ColocatedSender


def device_uuid(device: torch.device | int | None = None) -> str:
    """A GPU's UUID ('cpu' for CPU tensors), the key colocated payloads are matched by."""
    if device is None or (isinstance(device, torch.device) and device.type == "cpu"):
        return "cpu"
    index = device.index if isinstance(device, torch.device) else device
    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_payload(bucket: Bucket) -> dict:
    """{device uuid: (IPC handle of the flat buffer, metadata)} for this rank's bucket."""
    meta = [(m.name, str(m.dtype).removeprefix("torch."), list(m.shape), m.start_idx, m.end_idx)
            for m in bucket.metadata()]
    return {device_uuid(bucket.flat.device): (reduce_tensor(bucket.flat), meta)}


def open_ipc(handle, device_index: int | None):
    """Rebuild a tensor from `reduce_tensor` output, on this process's device index for CUDA handles."""
    rebuild, args = handle
    if device_index is not None and getattr(rebuild, "__name__", "") == "rebuild_cuda_tensor":
        args = list(args)
        args[6] = device_index  # the trainer's index of the GPU may differ from the worker's
    return rebuild(*args)


def rebuild_bucket(flat: torch.Tensor, meta) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, dtype, shape, start, end in meta:
        out.append((name, flat[start:end].view(getattr(torch, dtype)).view(tuple(shape))))
    return out


class MCore2HFWorkerExtension:
    """Methods added to each vLLM worker (self.model_runner, self.device are the worker's)."""

    def mcore2hf_device_uuid(self) -> str:
        return device_uuid(self.device)

    def mcore2hf_update_from_ipc(self, payloads: dict, version: int) -> int:
        uuid = self.mcore2hf_device_uuid()
        if uuid not in payloads:
            raise KeyError(f"no weights for this worker's device {uuid}; payloads cover {sorted(payloads)}")
        handle, meta = payloads[uuid]
        flat = open_ipc(handle, self.device.index if self.device.type == "cuda" else None)
        weights = rebuild_bucket(flat, meta)
        self.model_runner.model.load_weights(weights=weights)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.mcore2hf_version = version
        return len(weights)

    def mcore2hf_init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            group_name: str, backend: str = "nccl", timeout: float = 120.0) -> bool:
        from datetime import timedelta

        rank = rank_offset + (dist.get_rank() if dist.is_initialized() else 0)
        self._mcore2hf_timeout = timedelta(seconds=timeout)
        self._mcore2hf_group = join_weight_update_group(master_address, master_port, rank, world_size, group_name,
                                                        backend, self._mcore2hf_timeout)
        return True

    def mcore2hf_update_from_broadcast(self, names, dtypes, shapes, version: int) -> int:
        from .receiver import packed_nbytes

        flat = torch.empty(packed_nbytes(dtypes, shapes), dtype=torch.uint8, device=self.device)
        broadcast(flat, self._mcore2hf_group, self._mcore2hf_timeout)
        weights = tight_views(flat, names, dtypes, shapes)
        self.model_runner.model.load_weights(weights=weights)
        self.mcore2hf_version = version
        return len(weights)


class VLLMColocatedSender(_ColocatedSender):
    """Colocated vLLM workers: each trainer rank sends its bucket's IPC handle keyed by its GPU's UUID; the first
    rank of each engine group (`engine_tp_size` consecutive trainer ranks) calls `collective_rpc` once on `llm`.
    Grouping, lifetime and errors: see _ColocatedSender."""

    def __init__(self, llm, engine_tp_size: int, *, timeout: float = 300.0):
        super().__init__(llm, engine_tp_size, timeout)

    def _payload(self, bucket: Bucket):
        return ipc_payload(bucket)

    def _update(self, payloads: list) -> None:
        merged = {}
        for p in payloads:
            merged.update(p)
        _call(self.engine.collective_rpc, method="mcore2hf_update_from_ipc", args=(merged, self._pending))


class VLLMDistributedSender(_BroadcastSender):
    """Remote vLLM workers: trainer rank 0 broadcasts each bucket; `engines` (rank 0) call collective_rpc."""

    def __init__(self, engines, engine_world_sizes: list[int], master_address: str, master_port: int, *,
                 group_name: str = "mcore2hf_weights", backend: str = "nccl", timeout: float = 300.0):
        super().__init__(engines, engine_world_sizes, master_address, master_port, group_name, backend, timeout)

    def _init_calls(self, offsets: list[int]) -> list[tuple]:
        return [(e.collective_rpc, dict(method="mcore2hf_init_group", args=(
            self.master_address, self.master_port, off, self.world_size, self.group_name, self.backend,
            self.timeout.total_seconds()))) for e, off in zip(self.engines, offsets)]

    def _update_calls(self, bucket: Bucket) -> list[tuple]:
        args = ([e.name for e in bucket.entries], [str(e.dtype).removeprefix("torch.") for e in bucket.entries],
                [list(e.shape) for e in bucket.entries], self._pending)
        return [(e.collective_rpc, dict(method="mcore2hf_update_from_broadcast", args=args)) for e in self.engines]
