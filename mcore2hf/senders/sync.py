"""sync(exporter, sender): one weight update, pause -> buckets -> finish -> continue, with a weight version."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import UsageError
from ..plan.options import DEFAULT_BUCKET_BYTES
from .checker import check_mode

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


    def summary(self) -> str:
        wire = "" if self.received_bytes is None else f", {self.received_bytes / 2**30:.2f} GiB received"
        if self.verify:
            ranks = sum(len(r) for r in (self.checksums or {}).values())
            wire += f", verified ({self.verify}: {len(self.checksums or {})} engines, {ranks} engine ranks agree)"
        return (f"weights v{self.version}: {self.buckets} buckets, {self.bytes / 2**30:.2f} GiB in {self.seconds:.2f} s "
                f"(gather {self.gather_s:.2f} s, convert {self.convert_s:.2f} s, send {self.send_s:.2f} s{wire})")


def sync(exporter, sender, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, pause: bool = True,
         progress: bool = True, timing: bool = False, name_filter=None, debug_nan: bool = False,
         verify: str | None = None) -> SyncReport:
    """Push the model's current weights through `sender`; collective over the model's world.

    The version (`sender.version + 1`) goes with every engine call and is committed only when every rank and
    engine succeeded; on any failure every rank raises `EngineError`, the version stays, and calling sync again
    retries from the start. Engine senders leave their engines resumed, with no update session open, on success and
    after a failure (the weights are then partly updated: serve them only after a successful retry; vLLM's engines
    stay paused after a failure, until a sync succeeds); an exception
    raised inside sync on one rank makes that rank's sender clean up its own engines (`sender.abort()`). `timing=True`
    synchronizes the device between phases so the gather / convert split is exact (slower). `name_filter` selects
    HF tensors at plan level (see `HFExporter.plan`). Only `send` and `finish` are required of a sender (see
    `mcore2hf.senders.EngineSender` for the optional parts).

    Engine-sharded (a colocated sender built with `engine_sharding=True`): each rank receives only the regions its
    engine rank loads and hands the sender full-shaped tensors with only those written (`debug_nan=True` fills
    the rest with NaN); the plan is built, and refused with EngineShardError, before any engine is called.
    `gather_s` is then the whole executor (transfers and placement), `convert_s` 0.

    `verify` runs the engines' own weight checkers (SGLang >= 0.5.20 `/weights_checker`, vLLM >= 0.33.0
    `/weight_checker`; docs/engines.md "Verified sync"): "checksum" records every engine rank's checksum in the
    report and fails the sync unless every replica holds the same weights; "proof" (when the engines hold the
    weights the trainer holds, e.g. the first sync after they loaded its checkpoint) also takes a baseline,
    overwrites every engine parameter and, after the sync, fails it unless every parameter came back to the same
    bytes, naming each engine parameter that did not and the HF tensors sent for it.

    Adapter-only sync (docs/lora.md "Adapter sync into engines"): an `HFExporter(model, cfg, lora="adapter")` into
    an engine sender built with `lora_name=...` exports the LoRA adapter alone and has each engine load it under
    that name at the end (SGLang >= 0.5.20 `/load_lora_adapter_from_tensors`, vLLM `/v1/load_lora_adapter` with
    `load_inplace`), with the same version and failure rules; an engine that cannot load adapters is refused
    (UnsupportedEngine on every rank) before anything is paused. The first sync may be the base weights (any other
    exporter), later ones the adapter: the choice is which exporter is passed.
    `verify="checksum"` with an adapter-only sync into SGLang sends every adapter tensor's sha256
    (`expected_checksums`): each engine TP rank checks what it received before it loads it (a difference raises in
    its scheduler, which stops that SGLang server: the sync fails); other engines refuse `verify` for adapters."""
    mode = check_mode(verify)
    if mode is not None and not hasattr(sender, "set_verify"):
        raise UsageError(f"verify={mode!r}: expected an SGLang or vLLM engine sender (the engines' weight checkers), "
                         f"found {type(sender).__name__}")
    if mode == "proof" and not pause:
        raise UsageError("verify='proof' overwrites the engines' weights before the sync: expected pause=True")
    # an adapter-only sync: HFExporter(lora="adapter") into an engine sender built with lora_name (the engine loads
    # the adapter whole at the end, its base weights untouched); any other exporter syncs weights
    adapter = getattr(exporter, "lora", None) == "adapter"
    if adapter and not hasattr(sender, "set_adapter"):
        raise UsageError(f"an adapter-only sync (HFExporter(lora='adapter')): expected an SGLang or vLLM engine "
                         f"sender built with lora_name=..., found {type(sender).__name__} (save_pretrained writes "
                         "a PEFT directory)")
    if hasattr(sender, "set_verify"):  # an adapter-only sync checks the adapter (set_adapter), not the base weights
        sender.set_verify(None if adapter else mode)
    if hasattr(sender, "set_adapter"):  # collective (the adapter's plan) on every rank, before any engine call
        sender.set_adapter(exporter.adapter_config(bucket_bytes, name_filter) if adapter else None,
                           list(exporter.plan(bucket_bytes, name_filter).hf_entries()) if adapter else None,
                           verify=mode if adapter else None)
    version = getattr(sender, "version", 0) + 1
    ranks = sender.engine_ranks() if getattr(sender, "engine_sharding", False) else None
    engine_exec = None
    if ranks is not None:
        if not hasattr(exporter, "engine_executor"):
            raise UsageError(f"engine sharding: expected an HFExporter (with engine_executor), found "
                             f"{type(exporter).__name__}")
        # collective and deterministic: every rank plans (or raises the same EngineShardError) before begin()
        engine_exec = exporter.engine_executor(ranks, bucket_bytes, name_filter, output="masked", debug=debug_nan)
        received0 = engine_exec.stats["received_bytes"]
    elif debug_nan:
        raise UsageError("debug_nan: expected a sender with engine_sharding=True (an all-ranks sync writes every "
                         "element)")
    # the base checkpoint's tensors the model does not hold (HFExporter(base=...): a frozen vision tower), checked
    # before any engine is called (an engine-sharded executor refuses them above)
    base_groups = [] if engine_exec is not None or not hasattr(exporter, "base_groups") else \
        exporter.base_groups(bucket_bytes, name_filter)
    t0 = time.perf_counter()
    if hasattr(sender, "begin"):
        sender.begin(version)  # engine senders check the engines here, before anything is paused or sent
    try:
        if adapter:
            sender.check_adapter()  # collective: an engine that cannot load adapters refused before any pause
        if pause and hasattr(sender, "pause"):
            sender.pause()
        if mode == "proof":
            sender.start_verify()  # baseline, snapshot, reset: after pause, before the first bucket
        if engine_exec is None:
            extra = {} if name_filter is None else {"name_filter": name_filter}  # duck-typed exporters need not know it
            executor = exporter.executor(bucket_bytes, getattr(sender, "receivers", "all"), **extra)
            # this sync's phase times; the executor's byte counters (received/packed/copied) stay and keep counting
            executor.stats = {**getattr(executor, "stats", {}), "gather_s": 0.0, "convert_s": 0.0}
            stats, total, buckets = executor.stats, len(executor.programs), executor.run(timing=timing)
            if base_groups:  # read on the receiving ranks, after the model's buckets
                total += len(base_groups)
                buckets = itertools.chain(buckets, exporter.base_buckets(
                    bucket_bytes, getattr(sender, "receivers", "all"), name_filter, groups=base_groups))
        else:
            stats = {"gather_s": 0.0, "convert_s": 0.0}
            total, buckets = len(engine_exec.programs), (b.as_bucket() for b in engine_exec.run())
        bar = None
        if progress and dist.get_rank() == 0:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="bucket", desc=f"sync v{version}", leave=False, disable=None)
        n, nbytes, send_s = 0, 0, 0.0
        t_made = time.perf_counter()
        for bucket in buckets:
            t = time.perf_counter()
            if engine_exec is not None:
                stats["gather_s"] += t - t_made
            sender.send(bucket)
            t_made = time.perf_counter()
            send_s += t_made - t
            n += 1
            nbytes += bucket.nbytes
            del bucket  # dropped before the next is built: one output bucket alive (plus what the sender holds)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        sender.finish()  # raises on every rank if anything failed anywhere
        if hasattr(sender, "commit"):
            sender.commit()
        if engine_exec is None and base_groups:
            exporter.base_delivered()
        if pause and hasattr(sender, "resume"):
            sender.resume()
    except BaseException:
        if hasattr(sender, "abort"):
            sender.abort()
        raise
    report = SyncReport(version, n, nbytes, time.perf_counter() - t0, stats["gather_s"], stats["convert_s"], send_s,
                        None if engine_exec is None else engine_exec.stats["received_bytes"] - received0, mode,
                        getattr(sender, "checksums", None) if mode else None)
    if dist.get_rank() == 0:
        log.info("%s", report.summary())
    return report
