"""Compatibility module: the executors moved to `mcore2hf.transfer` (one core, `transfer.executor`; the export to
HF buckets, `transfer.export`; the engine-sharded export, `transfer.engine`; the per-rank programs and their
builders, `transfer.program` / `transfer.builders`). Kept so that `from mcore2hf.gather import Executor` and
the like still work."""

from __future__ import annotations

from .transfer.builders import all_ranks_program, engine_program, memory_estimates, receivers_program
from .transfer.engine import EngineBucket, EngineExecutor
from .transfer.export import Executor
from .transfer.program import LOCAL, OUT, EngineProgram, Loc, P2PRound, Program, Stage

__all__ = ["LOCAL", "OUT", "EngineBucket", "EngineExecutor", "EngineProgram", "Executor", "Loc", "P2PRound", "Program",
           "Stage", "all_ranks_program", "engine_program", "memory_estimates", "receivers_program"]
