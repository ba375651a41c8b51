"""Senders: where buckets go. One protocol: `begin(version)`, `send(bucket)` per bucket, `finish()`; engine
senders also have `pause()` / `resume()` and `receivers` (which ranks need full tensors). `sync(exporter,
sender)` drives them with a weight version."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..buckets import Bucket
from .safetensors import SafetensorsWriter
from .sglang import EngineError, SGLangColocatedSender, SGLangDistributedSender, SGLangHTTPEngine
from .sync import SyncReport, sync


@runtime_checkable
class Sender(Protocol):
    def send(self, bucket: Bucket) -> None: ...

    def finish(self) -> None: ...


__all__ = ["Sender", "SafetensorsWriter", "EngineError", "SGLangHTTPEngine", "SGLangColocatedSender",
           "SGLangDistributedSender", "SyncReport", "sync"]

from .vllm import VLLMColocatedSender, VLLMDistributedSender, VLLMHTTPEngine, VLLMLocalEngine  # noqa: E402

__all__ += ["VLLMColocatedSender", "VLLMDistributedSender", "VLLMHTTPEngine", "VLLMLocalEngine"]
