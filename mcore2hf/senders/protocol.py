"""The sender protocol: what `sync()` drives, one method per step of a sync, each with a default that does nothing.

`Sender.send` is the one method a sender must give. `sync()` calls every other method on every sender, in this
order (docs/engines.md "Senders and sync()"):

    prepare(spec)      this sync's kind (verify, adapter, draft choice): refused here, before any engine call
    roles(spec)        the passes `passes()` may choose from: sync() plans each before any engine call
    begin(version)     the engines checked (collective: every rank raises the same error)
    passes()           which models the buckets are for: ("all",), ("target",) or ("target", "draft")
    pause()            the engines stop generating
    start_verify()     a proof sync's baseline and reset
    start_role(role)   before each pass: the buckets that follow are that model's
    send(bucket)       per bucket
    finish()           raises on every rank if anything failed anywhere
    commit()           the version is the engines' now
    resume()
    abort()            after an exception inside sync(), local cleanup

Any object with `send(bucket)` and `finish()` (SafetensorsWriter, a user's own sink) is taken as a sender through
`as_sender`, which gives it the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import UsageError
from ..plan.engine_shards import EngineRank
from ..transfer.buckets import Bucket


@runtime_checkable
class ModelExporter(Protocol):
    """What sync() uses of an exporter beyond `executor()` (HFExporter gives it all: the senders layer does not import
    the facade): plans, engine-sharded executors, the MTP draft's tensors, base completion, LoRA adapter configs. Any
    other exporter (an object with `executor(bucket_bytes, receivers)`) delivers its buckets in one plain pass."""

    lora: str | None

    def plan(self, *args, **kwargs): ...

    def executor(self, *args, **kwargs): ...

    def engine_executor(self, *args, **kwargs): ...

    def draft_tensors(self, *args, **kwargs): ...

    def base_groups(self, *args, **kwargs): ...

    def base_buckets(self, *args, **kwargs): ...

    def base_delivered(self) -> None: ...

    def adapter_config(self, *args, **kwargs): ...


#: sync(draft=...): "auto" updates the engines' MTP draft when the model holds MTP layers (else the target only),
#: "update" insists on it, "keep" leaves every draft as it is (a frozen or separately trained draft: EAGLE)
DRAFT_CHOICES = ("auto", "update", "keep")


@dataclass(frozen=True)
class SyncSpec:
    """One sync's kind, handed to the sender before any engine call."""

    verify: str | None = None  # "proof" / "checksum": the engines' own weight checkers; None
    adapter: dict | None = None  # an adapter-only sync: its adapter_config.json
    adapter_entries: tuple = ()  # ... and the plan entries of its tensors
    draft: str = "auto"  # DRAFT_CHOICES
    model_draft: bool = False  # the model holds MTP layers: the weights of the engines' MTP draft


@dataclass(frozen=True)
class Passes:
    """Which model each pass of buckets is for, in order, and what the sync report says about the engines' draft.

    ("all",): every tensor in one pass (a writer, an adapter); ("target",): the model without its MTP layers;
    ("target", "draft"): then the MTP layers to the engines' draft (`copies`: with the embedding / head copies the
    published checkpoints keep in them, which vLLM's MTP drafts load and SGLang's take from the target)."""

    roles: tuple[str, ...] = ("all",)
    draft: str | None = None
    copies: bool = False


class Sender:
    """What sync() drives (see the module docstring); every method but `send` does nothing by default."""

    version: int = 0  # the last weight version every engine confirmed
    receivers: object = "all"  # which ranks need full tensors: "all" or ranks
    checksums: dict | None = None  # after a verified sync: {engine: {engine rank: digest}}
    draft_copies: bool = False  # Passes.copies for this engine's MTP drafts

    def engine_ranks(self) -> list[EngineRank] | None:
        """The engine ranks an engine-sharded sync plans its export for; None: every rank gets full tensors."""
        return None

    def prepare(self, spec: SyncSpec) -> None:
        """Refuse what this sender cannot do; an engine sender remembers the spec."""
        if spec.verify is not None:
            raise UsageError(f"verify={spec.verify!r}: expected an SGLang or vLLM engine sender (the engines' weight "
                             f"checkers), found {self._name()}")
        if spec.adapter is not None:
            raise UsageError(f"an adapter-only sync (HFExporter(lora='adapter')): expected an SGLang or vLLM engine "
                             f"sender built with lora_name=..., found {self._name()} (save_pretrained writes a "
                             "PEFT directory)")
        if spec.draft != "auto":
            raise UsageError(f"draft={spec.draft!r}: expected an SGLang or vLLM engine sender (an engine's "
                             f"speculative-decoding draft), found {self._name()}, which takes every tensor")

    def _name(self) -> str:
        return type(self).__name__

    def roles(self, spec: SyncSpec) -> tuple[str, ...]:
        """The passes `passes()` may choose from, known before begin (sync() plans each of them first)."""
        return ("all",)

    def begin(self, version: int) -> None:
        """Check the engines before anything is paused or sent (collective)."""

    def passes(self) -> Passes:
        """After begin (collective): which models this sync's buckets are for."""
        return Passes()

    def pause(self) -> None: ...

    def start_verify(self) -> None: ...

    def start_role(self, role: str) -> None:
        """The buckets that follow are for `role` (one of `passes().roles`)."""

    def send(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def finish(self) -> None: ...

    def commit(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self) -> None: ...


class _Sink(Sender):
    """An object with send(bucket) and finish() as a Sender (its `receivers`, if it has one, kept)."""

    def __init__(self, sink):
        if not callable(getattr(sink, "send", None)) or not callable(getattr(sink, "finish", None)):
            raise UsageError(f"sync: expected a sender (send(bucket) and finish()), found {type(sink).__name__}")
        self.sink, self.receivers = sink, getattr(sink, "receivers", "all")

    def _name(self) -> str:
        return type(self.sink).__name__

    def send(self, bucket: Bucket) -> None:
        self.sink.send(bucket)

    def finish(self) -> None:
        self.sink.finish()


def as_sender(sender) -> Sender:
    """`sender` if it is a Sender, else the object with send / finish wrapped as one."""
    return sender if isinstance(sender, Sender) else _Sink(sender)
