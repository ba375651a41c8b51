"""Disaggregated engine-sharded delivery (issue 15 point 5): engines in another world (other GPUs or nodes)
receive only the regions each engine rank loads, straight from the trainer ranks that hold them, many sources
at once, instead of every full tensor broadcast from trainer rank 0.

The weight-update group holds every trainer rank (group rank = its rank in the training world) and every engine
rank (engine instance k's TP rank r at group rank `trainer_world + k * tp + r`, `disaggregated_ranks`). The
EngineShardPlan is built with those group ranks; no engine rank holds a shard, so every piece is a route from a
holder, and the planner spreads them over the holders (least loaded first). Trainer side: `EngineShardPusher`
(every trainer rank, collective over the group). Engine side: `EngineShardReceiver` (the reference receiver;
the engine process has no Megatron model): it gets its per-bucket programs (`EngineProgram`, JSON, no pickle) from
trainer rank 0 once per plan and runs them: per bucket one receive per sending trainer rank, all posted at once,
yielding `EngineBucket`s (`slices()` raw `(name, EngineSlice)`, `masked()` full-shaped tensors for a `load_weights`).

Stock engine protocols (read in sglang 0.5.23 and vllm 0.33.0): SGLang's `update_weights_from_distributed`
(model_runner_components/weight_updater.py) and vLLM's `nccl` backend (distributed/weight_transfer/nccl_engine.py)
broadcast full tensors from one source. vLLM 0.33.0 also ships two sharded backends, not spoken here:
`nccl_m2n` (weight_transfer/m2n_engine.py: the same group layout, trainer ranks [0, T), workers [T, T + N), but
one `nccl.m2n.reshard` per parameter from DTensor placements, a GPU-only runtime, and fused parameters
(qkv_proj, gate_up_proj, MoE w13/w2) fall back to full tensors, m2n_layout.py) and `sharded_rdt` (Ray Direct
Transport pulls, sharded_rdt_engine.py). A custom engine worker calls the reference receiver itself, e.g. a vLLM `worker_extension_cls` method or an SGLang custom weight-loader hook that
joins the group (`EngineShardReceiver.join(...)`, group rank = trainer world + its global engine rank), then per
sync calls `setup()` when the trainer says the plan changed and `for b in receiver.buckets():
model.load_weights(b.masked())`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch

from ..plan.engine import EngineShardPlan
from ..plan.engine_shards import EnginePlacement, EngineRank, EngineShardError
from ..plan.options import DEFAULT_BUCKET_BYTES
from ..transfer.builders import engine_program
from ..transfer.engine import EngineBucket, EngineExecutor
from ..transfer.program import EngineProgram, packed_bytes
from .process_group import join_weight_update_group

PROGRAM_VERSION = 2  # 2: the per-bucket EngineProgram itself (1: routes rebuilt into a plan)
#: message tags: bucket k's pieces travel with tag k (EngineExecutor's transport); the program with its own tag
PROGRAM_TAG = 2**30


def disaggregated_ranks(trainer_world: int, engine: str, tp_size: int, ep_size: int = 1, instances: int = 1,
                        **placement) -> list[EngineRank]:
    """Engine instance k's TP rank r at weight-update group rank `trainer_world + k * tp_size + r` (after every
    trainer rank). `placement` passes EnginePlacement fields (moe_tp, replicated_shared_experts)."""
    if trainer_world < 1 or instances < 1:
        raise EngineShardError(f"disaggregated engines: expected a trainer world >= 1 and instances >= 1, found "
                               f"{trainer_world} and {instances}")
    return [EngineRank(EnginePlacement(engine, r, tp_size, ep_size, **placement), k, trainer_world + k * tp_size + r)
            for k in range(instances) for r in range(tp_size)]


def receive_program(eplan: EngineShardPlan, rank: int) -> dict:
    """The per-bucket programs of group rank `rank` (an engine rank holding nothing) as plain JSON data: per bucket
    its SliceEntries, the bucket's full layout and, per sending rank, the pieces it receives in the order the
    senders pack them (`EngineProgram.to_dict`). `EngineShardReceiver` runs exactly these (`receive_plan`)."""
    buckets = []
    for k in range(len(eplan.routes)):
        prog = engine_program(eplan, k, rank)
        if prog.local or prog.sends:
            raise EngineShardError(f"group rank {rank} holds shards of the model: a disaggregated engine rank "
                                   "must come after every trainer rank in the weight-update group")
        buckets.append(prog.to_dict())
    return dict(version=PROGRAM_VERSION, rank=rank, buckets=buckets)


def receive_plan(program: dict) -> list[EngineProgram]:
    """The per-bucket programs of `receive_program`'s value, as the EngineExecutor runs them."""
    return [EngineProgram.from_dict(b) for b in program["buckets"]]


def _encode(program: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(program, separators=(",", ":")).encode()), dtype=torch.uint8)


def _wait(work, timeout: timedelta, what: str) -> None:
    if not work.wait(timeout):
        raise TimeoutError(f"{what} did not complete within {timeout}")


class EngineShardPusher:
    """Trainer side (every trainer rank; collective over the weight-update group): the engine-shard plan for
    engine ranks in another world, executed with this rank's group rank. Trainer rank 0 ships each engine rank
    its receive program on the first push of a plan."""

    def __init__(self, exporter, engine_ranks: Sequence[EngineRank], group, group_rank: int,
                 bucket_bytes: int | None = None, name_filter=None, timeout: float = 120.0):
        self.exporter, self.group, self.rank = exporter, group, group_rank
        self.engine_ranks = list(engine_ranks)
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self.name_filter, self.timeout = name_filter, timedelta(seconds=timeout)
        trainer = exporter.ctx.world_size
        low = [er.rank for er in self.engine_ranks if er.rank < trainer]
        if low:
            raise EngineShardError(f"disaggregated engine ranks: expected group ranks >= the trainer world "
                                   f"{trainer} (disaggregated_ranks), found {low}")
        self.plan = exporter.engine_plan(self.engine_ranks, self.bucket_bytes, name_filter)
        self._executor = None
        self._shipped = False
        self.stats = {"sent_bytes": 0}

    def ship_programs(self) -> None:
        """Trainer rank 0: each engine rank's receive program (length, then JSON bytes)."""
        if self.rank != 0:
            return
        dev = self.exporter.device  # NCCL sends device tensors only
        for er in self.engine_ranks:
            blob = _encode(receive_program(self.plan, er.rank)).to(dev)
            for t in (torch.tensor([blob.numel()], dtype=torch.int64, device=dev), blob):
                _wait(self.group.send([t], er.rank, PROGRAM_TAG), self.timeout,
                      f"receive program to group rank {er.rank}")

    def push(self) -> dict:
        """One sync: every bucket's pieces to the engine ranks that load them. Returns this rank's bytes sent."""
        if not self._shipped:
            self.ship_programs()
            self._shipped = True
        if self._executor is None:
            ex = self.exporter
            self._executor = EngineExecutor(self.plan, ex.ctx, ex.local_tensors, ex.device, group=self.group,
                                            rank=self.rank)
        before = self._executor.stats["sent_bytes"]
        for _ in self._executor.run():  # a trainer rank feeds no engine rank here: its buckets are empty
            pass
        sent = self._executor.stats["sent_bytes"] - before
        self.stats["sent_bytes"] += sent
        return {"sent_bytes": sent}


class EngineShardReceiver:
    """Engine side, the reference receiver: one engine rank of the weight-update group, with no model. `setup()`
    receives the receive program from trainer rank 0 (once per plan); `buckets()` receives one sync."""

    def __init__(self, group, rank: int, device: str | torch.device = "cpu", timeout: float = 120.0,
                 output: str = "slices", debug: bool = False):
        self.group, self.rank, self.device = group, rank, torch.device(device)
        self.output, self.debug = output, debug
        self.timeout = timedelta(seconds=timeout)
        self.program: dict | None = None
        self._executor: EngineExecutor | None = None
        self.stats = {"received_bytes": 0}

    @classmethod
    def join(cls, master_address: str, master_port: int, rank: int, world_size: int,
             group_name: str = "weight_update_group", backend: str = "nccl", device: str | None = None,
             timeout: float = 120.0, store=None, output: str = "slices", debug: bool = False
             ) -> EngineShardReceiver:
        """Join the weight-update group (as every member must) at group rank `rank`; `output` / `debug` as in
        the constructor."""
        pg = join_weight_update_group(master_address, master_port, rank, world_size, group_name, backend,
                                      timedelta(seconds=timeout), store=store)
        return cls(pg, rank, device or ("cuda" if backend == "nccl" else "cpu"), timeout, output, debug)

    def setup(self) -> dict:
        """Receive this rank's program from trainer rank 0 (after the trainers built or changed their plan)."""
        n = torch.empty(1, dtype=torch.int64, device=self.device)
        _wait(self.group.recv([n], 0, PROGRAM_TAG), self.timeout, "receive program length from group rank 0")
        blob = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        _wait(self.group.recv([blob], 0, PROGRAM_TAG), self.timeout, "receive program from group rank 0")
        program = json.loads(bytes(blob.cpu().tolist()))  # no numpy needed
        if program.get("version") != PROGRAM_VERSION or program.get("rank") != self.rank:
            raise EngineShardError(f"receive program: expected version {PROGRAM_VERSION} for group rank {self.rank}, "
                                   f"found version {program.get('version')} for rank {program.get('rank')}")
        self.program = program
        self._executor = EngineExecutor.from_programs(receive_plan(program), self.device, group=self.group,
                                                      rank=self.rank, output=self.output, debug=self.debug)
        return program

    @property
    def expected_bytes(self) -> int:
        """Bytes one sync brings this rank (the sum of its regions)."""
        return sum(packed_bytes(items) for p in self._ready("expected_bytes").programs for _, items in p.recvs)

    def buckets(self) -> Iterator[EngineBucket]:
        """One sync: per bucket, one receive per sending trainer rank posted at once (the EngineExecutor running
        the programs it was sent), pieces written into this rank's slices, or into full-shaped tensors with
        output="masked". Buckets are views of a fresh buffer each: clone what you keep past the next one."""
        executor = self._ready("buckets()")
        before = executor.stats["received_bytes"]
        yield from executor.run()
        self.stats["received_bytes"] += executor.stats["received_bytes"] - before

    def _ready(self, what: str) -> EngineExecutor:
        """The executor setup() built from the received program; refuses before any transfer without one."""
        if self._executor is None:
            raise EngineShardError(f"EngineShardReceiver.{what}: expected setup() to have received the program, "
                                   "found none")
        return self._executor
