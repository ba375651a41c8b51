"""Reference receiver for the distributed path: joins the weight-update group, receives a bucket's flat buffer
and rebuilds its tensors, exactly as SGLang's scheduler does. Used by the tests; usable inside a custom engine
worker (call `receive` when the metadata request arrives, then load the returned tensors).

Engine-sharded delivery (each engine rank receives only the regions it loads, from every trainer rank that holds
them) has its own reference receiver, `EngineShardReceiver` (mcore2hf/senders/engine_shard.py)."""

from __future__ import annotations

from datetime import timedelta

import torch

from ..layouts.geometry import nbytes
from .process_group import broadcast, destroy_group, join_weight_update_group


def tight_views(flat: torch.Tensor, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    """Views of a buffer holding the tensors back to back in the given order (SGLang's flattened layout)."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
        n = nbytes(shape, dt)
        out.append((name, flat[offset:offset + n].view(dt).view(tuple(shape))))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"metadata describes {offset} bytes, the buffer has {flat.numel()}")
    return out


def packed_nbytes(dtypes, shapes) -> int:
    total = 0
    for dtype, shape in zip(dtypes, shapes):
        dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
        total += nbytes(shape, dt)
    return total


class DistributedReceiver:
    """One engine rank of a weight-update group."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "nccl", device: str | None = None,
                 timeout: float = 120.0):
        self.timeout = timedelta(seconds=timeout)
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self.pg = join_weight_update_group(master_address, master_port, rank, world_size, group_name, backend,
                                           self.timeout)

    def receive(self, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
        flat = torch.empty(packed_nbytes(dtypes, shapes), dtype=torch.uint8, device=self.device)
        broadcast(flat, self.pg, self.timeout)
        return tight_views(flat, names, dtypes, shapes)

    def close(self) -> None:
        destroy_group(self.pg)
