"""The weight-update process group: trainer source rank 0 plus every engine rank, beside the training world.

Joined the way SGLang's `/init_weights_update_group`, vLLM RL workers and OpenRLHF do it, so either side can be
an engine: a TCP rendezvous at master_address:master_port (rank 0 hosts the store), a store prefixed with the
group name, and a new process group registered with an identity rank map.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist


def host_store(timeout: timedelta = timedelta(seconds=120)):
    """Rank 0's rendezvous store on a port the OS picks (`store.port` is what the engines are told): no port is
    chosen first and bound later, when another process may have taken it."""
    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)


def join_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "nccl",
                             timeout: timedelta = timedelta(seconds=120), store=None):
    """Create (rank 0) or join the group; returns the process group. Every member must call it. Rank 0 may pass
    the store it hosts already (`host_store`)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **options)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg) -> None:
    """Tear a weight-update group down (after a failure, so a retry starts clean)."""
    try:
        abort = getattr(pg, "abort", None)
        if abort is not None and dist.get_backend(pg) == "nccl":
            abort()
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - best effort: the peer may be gone already
        pass


def start_broadcast(tensor, pg):
    """Start a broadcast from rank 0 of `pg` (a group outside the default world); returns its work handle."""
    # newer torch names the source by its rank in the group (group_src); older takes `src`, the same rank here
    # (the group is registered with an identity rank map)
    kwargs = {"group_src": 0} if "group_src" in inspect.signature(dist.broadcast).parameters else {"src": 0}
    return dist.broadcast(tensor, group=pg, async_op=True, **kwargs)


def broadcast(tensor, pg, timeout: timedelta):
    """Broadcast from group rank 0 and wait at most `timeout` (raises instead of hanging on a lost peer)."""
    work = start_broadcast(tensor, pg)
    if not work.wait(timeout=timeout):
        raise TimeoutError(f"broadcast of {tensor.numel()} bytes did not complete within {timeout}")
