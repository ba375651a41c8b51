"""Run a function on every rank of a fresh gloo world with Megatron's parallel state initialized (CPU).

    results = run_world(fn, Layout(tp=2, pp=2, ep=2), *args)   # fn(*args) on each rank; a list of returns

`fn` must be importable by module and name (a module-level function). A failure on any rank raises
`WorldError` with that rank's traceback; a hang is cut at `timeout` seconds.
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import socket
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch.multiprocessing as mp


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None  # None: Megatron's default (= tp)
    first_stage_layers: int | None = None  # uneven pipeline: layers on the first / last stage
    last_stage_layers: int | None = None
    world_size: int | None = None  # None: the smallest world both the dense and the expert grids fit

    @property
    def size(self) -> int:
        if self.world_size:
            return self.world_size
        etp = self.etp or self.tp
        return math.lcm(self.tp * self.pp, self.ep * etp * self.pp)

    def config_overrides(self) -> dict:
        """TransformerConfig fields for an uneven pipeline split."""
        out = {}
        if self.first_stage_layers is not None:
            out["num_layers_in_first_pipeline_stage"] = self.first_stage_layers
        if self.last_stage_layers is not None:
            out["num_layers_in_last_pipeline_stage"] = self.last_stage_layers
        return out

    def __str__(self) -> str:
        s = f"tp{self.tp}-pp{self.pp}"
        if self.vpp:
            s += f"-vpp{self.vpp}"
        s += f"-ep{self.ep}-etp{self.etp or self.tp}"
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            s += f"-uneven{self.first_stage_layers}.{self.last_stage_layers}"
        return s + f"-w{self.size}"


class WorldError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(layout: Layout) -> None:
    """Initialize Megatron's parallel state (and the CPU shims) in an already-initialized gloo world."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random

    from .cpu import apply_cpu_shims

    apply_cpu_shims()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp)
    torch.manual_seed(1234)
    if not torch.cuda.is_available():
        tp_random.get_cuda_rng_tracker().reset()
    else:
        tp_random.model_parallel_cuda_manual_seed(1234)


def _worker(rank: int, size: int, port: int, layout: dict, fn: Callable, args: tuple, out,
            backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # megatron-core warns about apex, TE and fusions on every rank
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=size)
        init_megatron(Layout(**layout))
        result = fn(*args)
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_world(fn: Callable, layout: Layout, *args, timeout: float = 600, backend: str = "gloo") -> list:
    """fn(*args) on every rank of a new world with `layout`; returns the per-rank results.

    backend "gloo" (CPU) or "nccl" (one GPU per rank)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    size = layout.size
    port = free_port()
    # not daemonic: dist_checkpointing.save writes files from child processes of its own
    procs = [ctx.Process(target=_worker, args=(r, size, port, asdict(layout), fn, args, out, backend), daemon=False)
             for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < size:
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue_mod.Empty:
                raise WorldError(f"world {layout} timed out after {timeout}s; finished ranks: "
                                 f"{sorted(results)}; failed: {sorted(errors)}") from None
            (results if ok else errors)[rank] = value
            if errors:
                break  # the others may be blocked in a collective with the failed rank
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise WorldError(f"rank {rank} of world {layout} failed:\n{errors[rank]}")
    return [results[r] for r in range(size)]
