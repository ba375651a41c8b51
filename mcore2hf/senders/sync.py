"""sync(exporter, sender): one weight update, pause -> buckets -> finish -> continue, with a weight version, into
the engines' target model and, where the model holds MTP layers, their speculative-decoding draft."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from ..arch.naming import NameSet
from ..errors import UsageError
from ..plan.options import DEFAULT_BUCKET_BYTES
from .checker import check_mode
from .protocol import ModelExporter, Passes, Sender, SyncSpec, as_sender

log = logging.getLogger("mcore2hf")


@dataclass
class SyncReport:
    version: int
    buckets: int
    bytes: int  # bytes handed to the sender on this rank
    seconds: float
    gather_s: float  # collectives of the export (issue + wait)
    convert_s: float  # layout ops into the output buckets
    send_s: float  # sender.send (serialize, engine calls / broadcasts)
    received_bytes: int | None = None  # engine-sharded: bytes this rank received over the wire (None: all-ranks)
    verify: str | None = None  # sync(verify=...): "proof" or "checksum" passed; None: not verified
    checksums: dict | None = None  # verified: {engine: {engine rank: digest of its parameters}}, every engine
    draft: str | None = None  # what the sync did with the engines' speculative-decoding draft (None: not an engine)
    draft_buckets: int = 0  # of `buckets`, those of the draft pass

    def summary(self) -> str:
        wire = "" if self.received_bytes is None else f", {self.received_bytes / 2**30:.2f} GiB received"
        if self.verify:
            ranks = sum(len(r) for r in (self.checksums or {}).values())
            wire += f", verified ({self.verify}: {len(self.checksums or {})} engines, {ranks} engine ranks agree)"
        draft = f"; draft: {self.draft}" if self.draft else ""
        return (f"weights v{self.version}: {self.buckets} buckets, {self.bytes / 2**30:.2f} GiB in {self.seconds:.2f} s "
                f"(gather {self.gather_s:.2f} s, convert {self.convert_s:.2f} s, send {self.send_s:.2f} s{wire}){draft}")


@dataclass
class _Pass:
    """One pass of buckets (for the target, the draft, or all) and its executor's phase times."""

    role: str
    total: int
    buckets: object  # iterator of Bucket
    stats: dict = field(default_factory=lambda: {"gather_s": 0.0, "convert_s": 0.0})
    engine: object = None  # the engine-shard executor (its byte counters), or None


class _Export:
    """The exporter's side of one sync: its checks, and the buckets of each pass. An HFExporter can do everything;
    any other exporter (an object with `executor(bucket_bytes, receivers)`) delivers its buckets in one pass."""

    def __init__(self, exporter, sender: Sender, bucket_bytes: int, name_filter, quantize, debug_nan: bool):
        self.ex, self.full, self.sender = exporter, isinstance(exporter, ModelExporter), sender
        self.bucket_bytes, self.name_filter, self.quantize, self.debug_nan = bucket_bytes, name_filter, quantize, debug_nan
        self.ranks = sender.engine_ranks()
        if not self.full and (self.ranks is not None or quantize is not None):
            raise UsageError(f"engine sharding and quantize: expected an HFExporter, found {type(exporter).__name__}")
        if debug_nan and self.ranks is None:
            raise UsageError("debug_nan: expected a sender with engine_sharding=True (an all-ranks sync writes every "
                             "element)")
        self.adapter = self.full and exporter.lora == "adapter"
        if self.adapter and quantize is not None:
            raise UsageError("a LoRA adapter export is not quantized: drop quantize")
        self.draft = exporter.draft_tensors(bucket_bytes, name_filter) if self.full else None
        # the base checkpoint's tensors the model does not hold (a frozen vision tower), checked before any engine
        # is called; an engine-sharded executor refuses them
        self.base = exporter.base_groups(bucket_bytes, name_filter, quantize) \
            if self.full and self.ranks is None else []

    def spec(self, verify: str | None, draft: str, pause: bool) -> SyncSpec:
        mode = check_mode(verify)
        if mode == "proof" and not pause:
            raise UsageError("verify='proof' overwrites the engines' weights before the sync: expected pause=True")
        adapter = (self.ex.adapter_config(self.bucket_bytes, self.name_filter),
                   tuple(self.ex.plan(self.bucket_bytes, self.name_filter).hf_entries())) if self.adapter else (None, ())
        return SyncSpec(mode, *adapter, draft=draft, model_draft=bool(self.draft and self.draft.layer))

    def filter(self, role: str, copies: bool):
        """The name filter of a pass: the target's tensors (never the MTP layers or their copies), the draft's (the
        MTP layers, with the copies where the engine's draft loads them), or every tensor."""
        if role == "all" or not (self.draft and self.draft.layer):
            return self.name_filter
        if role == "target":
            return NameSet(self.draft.layer | self.draft.copies, inside=False, within=self.name_filter)
        return NameSet(self.draft.layer | (self.draft.copies if copies else frozenset()), within=self.name_filter)

    def plan(self, roles: tuple[str, ...], copies: bool) -> None:
        """Plan every pass this sync may run (collective), so a refusal comes before any engine call."""
        for role in roles:
            if role == "draft" and not (self.draft and self.draft.layer):
                continue
            if self.ranks is not None:
                self.ex.engine_executor(self.ranks, self.bucket_bytes, self.filter(role, copies), output="masked",
                                        debug=self.debug_nan)
            elif self.full:
                self.ex.plan(self.bucket_bytes, self.filter(role, copies), self.quantize)

    def passes(self, passes: Passes, timing: bool) -> list[_Pass]:
        out = []
        for role in passes.roles:
            keep = self.filter(role, passes.copies)
            if self.ranks is not None:  # the exporter's refusals came in plan(); masked buckets as full tensors
                ex = self.ex.engine_executor(self.ranks, self.bucket_bytes, keep, output="masked", debug=self.debug_nan)
                out.append(_Pass(role, len(ex.programs), (b.as_bucket() for b in ex.run()), engine=ex))
                continue
            extra = {k: v for k, v in (("name_filter", keep), ("quantize", self.quantize)) if v is not None}
            ex = self.ex.executor(self.bucket_bytes, self.sender.receivers, **extra)
            # this sync's phase times; the executor's byte counters (received/packed/copied) stay and keep counting
            ex.stats = {**getattr(ex, "stats", {}), "gather_s": 0.0, "convert_s": 0.0}
            p = _Pass(role, len(ex.programs), ex.run(timing=timing), ex.stats)
            if self.base and role != "draft":  # read on the receiving ranks, after the model's buckets
                p.total += len(self.base)
                p.buckets = itertools.chain(p.buckets, self.ex.base_buckets(
                    self.bucket_bytes, self.sender.receivers, self.name_filter, self.quantize, groups=self.base))
            out.append(p)
        return out

    def delivered(self) -> None:
        if self.base:
            self.ex.base_delivered()


def sync(exporter, sender, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, pause: bool = True,
         progress: bool = True, timing: bool = False, name_filter=None, debug_nan: bool = False,
         verify: str | None = None, quantize=None, draft: str = "auto") -> SyncReport:
    """Push the model's current weights through `sender` (a `mcore2hf.senders.Sender`, or any object with
    send(bucket) and finish()); collective over the model's world. The version (`sender.version + 1`) is committed
    only when every rank and engine succeeded; on any failure every rank raises `EngineError` and calling sync
    again retries. `quantize="fp8"` / `"fp8-ue8m0"`: block-FP8 weights (docs/fp8.md). `verify="proof"` /
    `"checksum"`: the engines' own weight checkers. `draft="auto"` / `"update"` / `"keep"`: the engines'
    speculative-decoding draft (the model's MTP layers), updated with the target or left as it is. Engine-sharded,
    adapter-only and base-completed syncs, timing, failures: docs/engines.md "Senders and sync()"."""
    sender = as_sender(sender)
    export = _Export(exporter, sender, bucket_bytes, name_filter, quantize, debug_nan)
    spec = export.spec(verify, draft, pause)
    sender.prepare(spec)  # refusals before any engine call
    export.plan(sender.roles(spec), sender.draft_copies)
    version, t0 = sender.version + 1, time.perf_counter()
    sender.begin(version)  # engine senders check the engines here, before anything is paused or sent
    n = nbytes = drafts = 0
    send_s, received0 = 0.0, {}
    try:
        passes = sender.passes()
        if pause:
            sender.pause()
        sender.start_verify()  # a proof's baseline, snapshot, reset: after pause, before the first bucket
        runs = export.passes(passes, timing)
        received0 = {id(p): p.engine.stats["received_bytes"] for p in runs if p.engine is not None}
        bar = _bar(progress, sum(p.total for p in runs), version)
        for p in runs:
            sender.start_role(p.role)
            t_made = time.perf_counter()
            for bucket in p.buckets:
                t = time.perf_counter()
                p.stats["gather_s"] += (t - t_made) if p.engine is not None else 0.0
                sender.send(bucket)
                t_made = time.perf_counter()
                send_s, n, nbytes, drafts = send_s + t_made - t, n + 1, nbytes + bucket.nbytes, drafts + (p.role == "draft")
                del bucket  # dropped before the next is built: one output bucket alive (plus what the sender holds)
                bar.update(1)
        bar.close()
        sender.finish()  # raises on every rank if anything failed anywhere
        sender.commit()
        export.delivered()
        if pause:
            sender.resume()
    except BaseException:
        sender.abort()
        raise
    received = sum(p.engine.stats["received_bytes"] - received0[id(p)] for p in runs if p.engine is not None)
    report = SyncReport(version, n, nbytes, time.perf_counter() - t0, sum(p.stats["gather_s"] for p in runs),
                        sum(p.stats["convert_s"] for p in runs), send_s, received if export.ranks is not None else None,
                        verify, sender.checksums if verify else None, passes.draft, drafts)
    if dist.get_rank() == 0:
        log.info("%s", report.summary())
    return report


class _NoBar:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _bar(progress: bool, total: int, version: int):
    if not (progress and dist.get_rank() == 0):
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="bucket", desc=f"sync v{version}", leave=False, disable=None)
