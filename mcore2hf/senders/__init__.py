"""Senders: where buckets go. One protocol: `send(bucket)` for each bucket, then `finish()` (or `abort()`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..buckets import Bucket
from .safetensors import SafetensorsWriter


@runtime_checkable
class Sender(Protocol):
    def send(self, bucket: Bucket) -> None: ...

    def finish(self) -> None: ...


__all__ = ["Sender", "SafetensorsWriter"]
