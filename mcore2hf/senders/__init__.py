"""Senders: where buckets go, driven by `sync(exporter, sender)` with a weight version.

Every sender implements the `Sender` protocol: `send(bucket)` per bucket and `finish()` after the last one
(raising on every rank if anything failed). `sync()` also uses, when a sender has them, the parts of
`EngineSender`: `version` (last committed weight version), `receivers` (which ranks need full tensors:
"all" or ranks), `begin(version)`, `pause()` / `resume()`, `commit()` and `abort()` (local cleanup after an
exception). A sender with only `send` and `finish` (e.g. `SafetensorsWriter`) works with `sync()` too.
Colocated senders built with `engine_sharding=True` also give `engine_ranks()`: `sync()` then plans an
engine-sharded export for them (each rank receives only what its engine rank loads) and sends its masked buckets.
`sync(..., verify="proof" | "checksum")` needs an engine sender (`set_verify`, `start_verify`, `checksums`: the
engines' own weight checkers, see senders/checker.py and docs/engines.md "Verified sync").
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..errors import EngineError, UnsupportedEngine
from ..formats.safetensors import SafetensorsWriter
from ..transfer.buckets import Bucket
from .sglang import SGLangColocatedSender, SGLangDistributedSender, SGLangHTTPEngine
from .sync import SyncReport, sync
from .vllm import VLLMColocatedSender, VLLMDistributedSender, VLLMHTTPEngine, VLLMLocalEngine


@runtime_checkable
class Sender(Protocol):
    """What every sender implements."""

    def send(self, bucket: Bucket) -> None: ...

    def finish(self) -> None: ...


@runtime_checkable
class EngineSender(Sender, Protocol):
    """What the engine senders (SGLang, vLLM) implement on top; each part is optional for `sync()`."""

    version: int
    receivers: object

    def begin(self, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


__all__ = ["Sender", "EngineSender", "SafetensorsWriter", "EngineError", "UnsupportedEngine", "SGLangHTTPEngine",
           "SGLangColocatedSender", "SGLangDistributedSender", "VLLMHTTPEngine", "VLLMLocalEngine",
           "VLLMColocatedSender", "VLLMDistributedSender", "SyncReport", "sync"]
