"""This rank's place in Megatron's parallel layout: sizes, ranks and process groups, read once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .errors import ParallelStateError


@dataclass(frozen=True)
class Axis:
    """One parallel dimension as seen from this rank: its group, size, our index and the members' global ranks."""

    size: int
    rank: int
    ranks: tuple[int, ...]
    group: Any


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    tp: Axis
    pp: Axis
    ep: Axis
    etp: Axis
    vpp: int | None
    backend: str

    @classmethod
    def from_megatron(cls) -> ParallelContext:
        if not dist.is_available() or not dist.is_initialized():
            raise ParallelStateError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group() and "
                "megatron.core.parallel_state.initialize_model_parallel(...) before exporting"
            )
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise ParallelStateError(
                "Megatron's parallel state is not initialized: call "
                "megatron.core.parallel_state.initialize_model_parallel(...) before exporting"
            )

        def axis(group_fn, size_fn, rank_fn) -> Axis:
            group = group_fn()
            return Axis(size_fn(), rank_fn(), tuple(dist.get_process_group_ranks(group)), group)

        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            tp=axis(ps.get_tensor_model_parallel_group, ps.get_tensor_model_parallel_world_size,
                    ps.get_tensor_model_parallel_rank),
            pp=axis(ps.get_pipeline_model_parallel_group, ps.get_pipeline_model_parallel_world_size,
                    ps.get_pipeline_model_parallel_rank),
            ep=axis(ps.get_expert_model_parallel_group, ps.get_expert_model_parallel_world_size,
                    ps.get_expert_model_parallel_rank),
            etp=axis(ps.get_expert_tensor_parallel_group, ps.get_expert_tensor_parallel_world_size,
                     ps.get_expert_tensor_parallel_rank),
            vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
            backend=str(dist.get_backend()),
        )

    def describe(self) -> dict:
        return {"rank": self.rank, "pp": self.pp.rank, "tp": self.tp.rank, "ep": self.ep.rank,
                "etp": self.etp.rank, "tp_ranks": self.tp.ranks, "pp_ranks": self.pp.ranks,
                "ep_ranks": self.ep.ranks, "etp_ranks": self.etp.ranks}
