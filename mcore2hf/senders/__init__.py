"""Senders: where buckets go, driven by `sync(exporter, sender)` with a weight version.

`Sender` (senders/protocol.py) is what `sync()` drives, one method per step of a sync (prepare, roles, begin,
passes, pause, start_verify, start_role, send, finish, commit, resume, abort), each with a default that does nothing
but `send`; the engine senders (SGLang, vLLM) fill them in. Any object with `send(bucket)` and `finish()` (e.g.
`SafetensorsWriter`) works with `sync()` too, as a Sender with the defaults (`as_sender`). What sync() does with an
engine's speculative-decoding draft: senders/drafts.py; verified sync: senders/checker.py and docs/engines.md.
"""

from __future__ import annotations

from ..errors import EngineError, UnsupportedEngine
from ..formats.safetensors import SafetensorsWriter
from .protocol import DRAFT_CHOICES, Passes, Sender, SyncSpec, as_sender
from .sglang import SGLangColocatedSender, SGLangDistributedSender, SGLangHTTPEngine
from .sync import SyncReport, sync
from .vllm import VLLMColocatedSender, VLLMDistributedSender, VLLMHTTPEngine, VLLMLocalEngine

__all__ = ["Sender", "SyncSpec", "Passes", "DRAFT_CHOICES", "as_sender", "SafetensorsWriter", "EngineError",
           "UnsupportedEngine", "SGLangHTTPEngine", "SGLangColocatedSender", "SGLangDistributedSender", "VLLMHTTPEngine", "VLLMLocalEngine",
           "VLLMColocatedSender", "VLLMDistributedSender", "SyncReport", "sync"]
