"""What the engine senders share, whatever the engine's protocol (sglang.py and vllm.py hold only their routes,
payloads and session rules, and subclass these):

- `call` / `quietly`: an engine call whose every failure is an EngineError (or, during cleanup, its text);
- `SenderBase`: the weight version, this rank's first error, the agreement that fails every rank together
  (collective.agree over a gloo group whose timeout outlasts the engine calls), and the framing of one sync on
  the engines this rank drives: pause, the protocol's end of the sync (flush, close the update sessions), the
  agreement, then resume; after a failure the sessions still open are closed and the paused engines resumed
  (where the protocol allows: vLLM's stay paused);
- `ColocatedSender`: trainer and engine share GPUs (CUDA IPC): trainer ranks in groups of the engine's TP size,
  each group's payloads gathered to its first rank, which calls the engine; buckets kept alive until it answered;
- `BroadcastSender`: engines elsewhere: trainer rank 0 and every engine rank in a weight-update group, each bucket
  broadcast while the engines are told what to expect; torn down and formed anew after a failure.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from ..collective import agree
from ..errors import EngineError, UnsupportedEngine, UsageError
from ..plan.engine_shards import EngineRank, colocated_ranks
from ..transfer.buckets import Bucket
from . import checker, drafts
from .process_group import destroy_group, host_store, join_weight_update_group, start_broadcast
from .protocol import Passes, Sender, SyncSpec


def check_pause_mode(mode: str, modes: tuple[str, ...]) -> None:
    """ValueError unless `mode` is one of the engine's pause modes."""
    if mode not in modes:
        raise ValueError(f"pause_mode: expected one of {modes}, found {mode!r}")


def call(fn, **kwargs):
    """Call an engine method; any failure becomes an EngineError."""
    try:
        return fn(**kwargs)
    except EngineError:
        raise
    except Exception as e:  # noqa: BLE001
        raise EngineError(f"{type(e).__name__}: {e}") from e


def quietly(fn, **kwargs) -> str | None:
    """Best-effort engine call during cleanup: the error text, or None."""
    try:
        call(fn, **kwargs)
    except EngineError as e:
        return str(e)
    return None


class SenderBase(Sender):
    """Version bookkeeping, the error agreement, and the engine calls around one sync, whatever the protocol.

    An engine protocol gives the hooks: `_driven()` (the engines this rank calls, as the protocol holds them),
    `_pause_engine` / `_resume_engine`, `_finish_sessions()` (the end of a sync on them: flush, close the update
    sessions, committing the version when nothing failed; failures recorded), `_close_sessions()` (after a
    failure, best effort) and `_engine_draft(engine)` (what the engine serves as its speculative-decoding draft)."""

    receivers: object = "all"
    verify: str | None = None  # this sync's verification (sync(verify=...)): None, "proof" or "checksum"
    checksums: dict | None = None  # after a verified sync: {engine: {engine rank: digest}}, every rank's engines
    _pause_route = "pause"  # the protocol's pause call, named in a recorded failure
    _resume_on_failure = True  # False: an engine stays paused after a failed sync, until one succeeds

    def __init__(self, timeout: float, engines_per_rank: int = 1):
        self.timeout = timedelta(seconds=timeout)
        # our own collectives (small control messages) wait while another rank makes its engine calls, each up to
        # `timeout`: per engine up to 4 in send (begin, end, begin over a stale session, then the update) and 2 in
        # finish (flush, end), plus a group teardown. Waiting only `timeout` turned an engine's timeout into a
        # gloo timeout on the waiting ranks (colocated engine TP 2: the second rank, in the engine group's
        # broadcast) instead of EngineError on every rank
        self._control_timeout = self.timeout * (6 * engines_per_rank + 1) + timedelta(seconds=30)
        self.version = 0  # last version every engine confirmed
        self._pending = None
        self._error: str | None = None
        self._quarantine: list = []
        self._status_group = dist.new_group(backend="gloo", timeout=self._control_timeout)
        self._paused: list = []  # engines this rank paused and has not resumed yet
        self.adapter, self._adapter_entries, self._kept = None, None, []

    def begin(self, version: int) -> None:
        self._pending, self._error = version, None

    # ---- this sync's kind (sync() calls prepare before begin, passes after it)
    _spec = SyncSpec()
    #: this sync's passes (Passes.roles) and which of this rank's engines take the draft pass (ids)
    _passes = Passes(("target",))
    _draft_engines: frozenset = frozenset()
    _role = "target"  # the pass being sent (start_role)
    #: the draft pass reaches every engine or none (a broadcast whose receivers all need a draft session)
    _draft_every_engine = False

    def prepare(self, spec: SyncSpec) -> None:
        drafts.check_choice(spec)
        self.set_verify(None if spec.adapter is not None else spec.verify)
        self.set_adapter(spec.adapter, list(spec.adapter_entries) if spec.adapter is not None else None,
                         verify=spec.verify if spec.adapter is not None else None)
        self._spec, self._role, self._draft_engines = spec, "target", frozenset()

    def roles(self, spec: SyncSpec) -> tuple[str, ...]:
        if spec.adapter is not None:
            return ("all",)
        return ("target",) if drafts.without_draft(spec) else ("target", "draft")

    def _engine_draft(self, engine) -> drafts.EngineDraft:
        """What `engine` serves as its speculative-decoding draft (may raise EngineError)."""
        return drafts.EngineDraft(self._where(engine), "unknown", f"{type(self).__name__} cannot ask")

    def passes(self) -> Passes:
        """Collective, after begin and before anything is paused: an adapter-only sync checks that every engine
        can load adapters (UnsupportedEngine on every rank); a weight sync decides from every engine's draft
        whether a draft pass follows the target's (drafts.decide: the same on every rank, or the same error)."""
        if self.adapter is not None:
            self.check_adapter()
            self._passes = Passes(("all",))
            return self._passes
        fixed = drafts.without_draft(self._spec)
        if fixed is not None:
            self._passes = fixed
            return fixed
        mine, error = [], self._error  # a rank whose begin failed: every rank fails here, with its error
        for engine in self._driven() if error is None else []:
            try:
                mine.append((id(engine), self._engine_draft(engine)))
            except EngineError as e:
                error = f"{self._where(engine)}: asking what it serves as its draft: {e}"
                break
        agree(error, EngineError, "weight update failed: ", self._status_group)
        gathered: list = [None] * dist.get_world_size(self._status_group)
        dist.all_gather_object(gathered, [d for _, d in mine], group=self._status_group)
        self._passes = drafts.decide(self._spec, [d for part in gathered for d in part], self.draft_copies,
                                     self._draft_every_engine)
        if "draft" in self._passes.roles:
            self._draft_engines = frozenset(i for i, d in mine if d.kind in ("mtp", "unknown"))
        return self._passes

    def _takes_draft(self, engine) -> bool:
        """This engine's draft is updated by this sync (it takes the draft pass)."""
        return id(engine) in self._draft_engines

    def start_role(self, role: str) -> None:
        self._role = role

    # ---- adapter sync (sync() of an HFExporter(lora="adapter")): the protocol gives `_adapter_refusal` and the
    # adapter's load at the end of the sync (`_finish_sessions`); the buckets are kept until then, because an
    # engine loads an adapter whole, in one call (docs/lora.md "Adapter sync into engines")
    lora_name: str | None = None  # the engine's name of the adapter (the `model` / `lora_path` requests use)
    adapter: dict | None = None  # this sync's adapter_config.json when it syncs the LoRA adapter alone, else None
    _kept: list  # this sync's buckets, kept until the adapter is loaded (set by set_adapter)

    #: whether the engine can check an adapter's bytes as it loads them (verify="checksum" of an adapter-only sync)
    adapter_checksums: bool = False
    _adapter_verify = False  # this adapter-only sync's verify="checksum" (set_adapter)

    def set_adapter(self, config: dict | None, entries: list | None = None, verify: str | None = None) -> None:
        """This sync's kind (called by sync() before begin): the adapter's adapter_config.json and its tensors'
        plan entries for an adapter-only sync, None for a weight sync; `verify` ("checksum") has the engine check
        every adapter tensor's sha256 as it loads it, where the protocol can."""
        if config is not None and not self.lora_name:
            raise UsageError(f"an adapter-only sync (HFExporter(lora='adapter')) into {type(self).__name__}: "
                             "expected the sender built with lora_name='<the adapter's name on the engine>'")
        if config is not None and verify is not None and (verify != "checksum" or not self.adapter_checksums):
            raise UsageError(f"verify={verify!r} with an adapter-only sync into {type(self).__name__}: expected "
                             + ("verify='checksum' (the engine checks each adapter tensor's sha256 as it loads it; "
                                "'proof' is for the base weights)" if self.adapter_checksums else
                                "verify=None (this engine takes no checksums with an adapter; SGLang's senders do)"))
        self.adapter, self._adapter_entries, self._kept = config, entries, []
        self._adapter_verify = config is not None and verify == "checksum"

    def _adapter_refusal(self, engine) -> str | None:
        """Why this engine cannot load an adapter from us (release, flags), or None; may raise EngineError."""
        return f"{type(self).__name__} cannot sync a LoRA adapter"

    def check_adapter(self) -> None:
        """Collective, after begin and before anything is paused: every rank raises UnsupportedEngine (the same
        message) if an engine cannot take this adapter-only sync."""
        error = None
        for engine in self._driven() if self._error is None else []:
            try:
                error = self._adapter_refusal(engine)
            except EngineError as e:
                error = str(e)
            if error:
                error = f"{self._where(engine)}: {error}"
                break
        agree(error, UnsupportedEngine, "adapter-only sync refused: ", self._status_group)

    def _keep(self, bucket: Bucket) -> None:
        """Adapter sync: the bucket is kept (its bytes unchanged) until the adapter is loaded at finish."""
        self._note_sent(bucket)
        if bucket.flat is not None:
            self._kept.append(bucket)

    # ---- verified sync (sync(verify=...)): the protocol gives the engine's checker calls
    def set_verify(self, mode: str | None) -> None:
        """This sync's verification mode (called by sync() before begin)."""
        self.verify = checker.check_mode(mode)
        self.checksums, self._sent, self._baselines, self._records = None, set(), {}, []
        self._sent_draft: set[str] = set()  # the draft pass's tensors (a draft runner's mismatches are traced there)

    def _where(self, engine) -> str:
        url = getattr(engine, "url", None) or getattr(getattr(engine, "engine", None), "url", None)
        return str(url or f"{type(getattr(engine, 'engine', engine)).__name__} on trainer rank {dist.get_rank()}")

    def _checksums(self, engine) -> dict[str, dict[str, str]]:
        """The engine checker's per-parameter checksums, per engine rank ({rank: {parameter: checksum}})."""
        raise NotImplementedError

    def _snapshot_and_reset(self, engine) -> None:
        """Proof sync: the engine keeps its loaded weights aside (where its checker does) and overwrites them."""
        raise NotImplementedError

    def _engine_compare(self, engine, baseline: dict) -> list[str]:
        """Proof sync: the engine parameters its own comparator finds changed since the snapshot / baseline."""
        raise NotImplementedError

    def _note_sent(self, bucket: Bucket) -> None:
        if self.verify:  # mismatches are traced back to what we sent
            (self._sent_draft if self._role == "draft" else self._sent).update(e.name for e in bucket.entries)

    def start_verify(self) -> None:
        """Proof sync, after pause and before the first bucket: per engine a checksum baseline, then the engine's
        snapshot and reset (every parameter overwritten), so only what this sync loads can restore it."""
        if self.verify != "proof" or self._error is not None:
            return
        for engine in self._driven():
            try:
                self._baselines[id(engine)] = self._checksums(engine)
                self._snapshot_and_reset(engine)
            except EngineError as e:
                self._fail(f"verify (before the sync) on {self._where(engine)}: {e}")
                return

    def _verify_end(self) -> None:
        """After the sessions closed: each engine's checksums recorded; a proof sync also compares (the engine's
        comparator and the per-rank checksums against the baseline), mismatches traced to the HF tensors sent."""
        for engine in self._driven():
            where = self._where(engine)
            try:
                own = self._engine_compare(engine, self._baselines[id(engine)]) if self.verify == "proof" else []
                now = self._checksums(engine)
            except EngineError as e:
                self._fail(f"verify on {where}: {e}")
                return
            self._records.append((where, {rank: checker.rank_digest(c) for rank, c in now.items()}))
            if self.verify == "proof":
                bad = checker.changed(self._baselines[id(engine)], now)
                bad += [n for n in own if n not in bad and not any(b.endswith(f": {n}") for b in bad)]
                if bad:
                    self._fail(f"verify: {where}: {len(bad)} engine parameters differ from the weights it loaded "
                               f"(engine parameter <- HF tensors sent): "
                               f"{checker.explain(bad, self._sent, draft=self._sent_draft)}")
                    return

    def _agree_replicas(self) -> None:
        """Every rank: the engines' digests of all ranks; replicas (engines with the same ranks) must agree."""
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._records, group=self._status_group)
        records = [r for part in gathered for r in part]
        self.checksums = dict(records)
        problem = checker.replica_disagreement(records)
        if problem:
            self._after_failure()
            raise EngineError("weight update failed: " + problem)

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = message

    def _agree(self) -> None:
        """Raise on every rank if any rank recorded an error."""
        agree(self._error, EngineError, "weight update failed: ", self._status_group)

    def commit(self) -> None:
        self.version = self._pending
        self._quarantine.clear()

    def _driven(self) -> list:
        """The engines this rank calls (none on a rank that only takes part in the collectives)."""
        return []

    def _pause_engine(self, engine) -> None:
        raise NotImplementedError

    def _resume_engine(self, engine) -> None:
        raise NotImplementedError

    def _finish_sessions(self) -> None:
        """The protocol's end of a sync on this rank's engines, before the agreement; failures recorded."""

    def _close_sessions(self) -> None:
        """After a failure, best effort: close the update sessions still open on this rank's engines."""

    def pause(self) -> None:
        """Pause this rank's engines; not once this sync has failed (nothing reaches an engine we refused). A failure
        is recorded, not raised, so every rank fails the sync together at finish()."""
        if self._error is not None:
            return
        for engine in self._driven():
            try:
                self._pause_engine(engine)
            except EngineError as e:
                self._fail(f"{self._pause_route}: {e}")
            else:
                if not any(engine is p for p in self._paused):  # still paused after a failed sync: once
                    self._paused.append(engine)

    def resume(self) -> None:
        while self._paused:
            self._resume_engine(self._paused[0])
            self._paused.pop(0)

    def finish(self) -> None:
        """End the sync on this rank's engines, then raise on every rank if any rank recorded an error (having
        closed this rank's update sessions and, unless the protocol keeps them paused, resumed its engines)."""
        self._finish_sessions()
        if self.verify and self._error is None:
            self._verify_end()
        try:
            self._agree()
        except EngineError:
            self._after_failure()
            raise
        if self.verify:
            self._agree_replicas()

    def _after_failure(self) -> None:
        self._close_sessions()
        self._kept = []
        # an adapter-only sync leaves the base weights as they were: its engines generate again
        if self._resume_on_failure or self.adapter is not None:
            paused, self._paused = self._paused, []
            for engine in paused:
                quietly(self._resume_engine, engine=engine)

    def abort(self) -> None:
        """Best-effort, local: after an exception inside sync(), close our sessions and resume our engines (as
        after a failed finish)."""
        self._after_failure()


class ColocatedSender(SenderBase):
    """Trainer and engine share GPUs. Trainer ranks form consecutive groups of `engine_tp_size` ranks; group i
    feeds engine i, whose first rank gathers the group's payloads (one per engine TP rank, in order) and calls the
    engine (`engine`: this rank's engine client on the first rank of its group, None elsewhere). Every rank of
    the group keeps its bucket alive until the engine has answered. Subclasses give `_payload` and `_update`."""

    receivers = "all"
    engine_kind = ""  # whose engine-sharding rules apply ("sglang" / "vllm")

    def __init__(self, engine, engine_tp_size: int, timeout: float, engine_sharding: bool = False,
                 engine_ep_size: int = 1, engine_placement: dict | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % engine_tp_size:
            raise ValueError(f"world size {world} is not a multiple of engine_tp_size {engine_tp_size}")
        self.engine_sharding = engine_sharding
        self._engine_ranks: list[EngineRank] | None = None
        if engine_sharding:  # refused (EngineShardError, the same on every rank) before any group or engine call
            # colocated_ranks' default groups are the groups below: instance k on ranks [k*tp, (k+1)*tp), its TP
            # rank r fed by rank k*tp + r (the GPU that rank's payload is for)
            self._engine_ranks = colocated_ranks(world, self.engine_kind, engine_tp_size, engine_ep_size,
                                                 **(engine_placement or {}))
        elif engine_ep_size != 1 or engine_placement:
            raise UsageError(f"engine_ep_size={engine_ep_size}, engine_placement={engine_placement}: expected "
                             "engine_sharding=True (they only say how an engine-sharded sync splits tensors)")
        super().__init__(timeout)
        self.tp = engine_tp_size
        self.first = rank - rank % engine_tp_size
        self.is_first = rank == self.first
        if self.is_first and engine is None:
            raise ValueError(f"rank {rank} is the first rank of its engine group and needs the engine client")
        self.engine = engine if self.is_first else None
        self.group = None
        for start in range(0, world, engine_tp_size):  # every rank creates every group
            g = dist.new_group(list(range(start, start + engine_tp_size)), backend="gloo",
                               timeout=self._control_timeout)
            if start == self.first:
                self.group = g

    def engine_ranks(self) -> list[EngineRank] | None:
        """The engine ranks this world feeds when engine-sharded (sync() plans the export for them), else None."""
        return self._engine_ranks

    def _payload(self, bucket: Bucket):
        raise NotImplementedError

    def _update(self, payloads: list) -> None:
        """Call the engine with the group's payloads (first rank only); raises EngineError."""
        raise NotImplementedError

    def send(self, bucket: Bucket) -> None:
        if self.adapter is not None:
            return self._keep(bucket)
        self._note_sent(bucket)
        if not self._group_call(lambda: self._payload(bucket), self._update, f"bucket {bucket.index}"):
            # an engine that timed out may still read this memory through its IPC mapping: keep it until a
            # later update succeeds, so the allocator cannot hand it to the next bucket meanwhile
            self._quarantine.append(bucket.flat)

    def _group_call(self, payload_fn, call_fn, what: str) -> bool:
        """Every rank of the engine group serializes its payload (`payload_fn()`, for its engine TP rank), the
        first rank gathers them and calls `call_fn(payloads)` (raises EngineError); every rank learns the outcome
        (its tensors stay alive until then). False, with the failure recorded, when anything failed."""
        try:
            payload = payload_fn()
        except Exception as e:  # noqa: BLE001
            payload = None
            self._fail(f"serializing {what}: {e}")
        gathered = [None] * self.tp if self.is_first else None
        dist.gather_object(payload, gathered, dst=self.first, group=self.group)
        status = None
        if self.is_first and self._error is None:
            if any(p is None for p in gathered):
                status = f"{what}: a rank of the engine group could not serialize its part"
            else:
                try:
                    call_fn(gathered)
                except EngineError as e:
                    status = f"{what}: {e}"
        box = [status]
        dist.broadcast_object_list(box, src=self.first, group=self.group)
        if box[0]:
            self._fail(box[0])
        return not box[0]




def refuse_broadcast_sharding(engine_sharding: bool) -> None:
    if engine_sharding:
        raise UsageError("engine_sharding=True with a distributed sender: expected a colocated sender (the "
                         "broadcast delivers full tensors to every engine rank; per-rank delivery to engines in "
                         "another world is the disaggregated path)")


class BroadcastSender(SenderBase):
    """Trainer rank 0 forms a weight-update group with every engine rank (engine i's ranks at rank_offset 1 + the
    earlier engines' sizes) and broadcasts each bucket's flat buffer, while the engines are told what to expect.
    Subclasses give the engine calls (`_init_calls`, `_update_calls`)."""

    receivers = (0,)
    _join_failed = "joining the weight-update group: "

    def __init__(self, engines, engine_world_sizes: list[int], master_address: str, master_port: int,
                 group_name: str, backend: str, timeout: float):
        super().__init__(timeout, engines_per_rank=len(engine_world_sizes))  # rank 0 drives every engine
        self.is_source = dist.get_rank() == 0
        self.engines = list(engines or []) if self.is_source else []
        if self.is_source and len(self.engines) != len(engine_world_sizes):
            raise ValueError("one engine client per entry of engine_world_sizes is needed on rank 0")
        self.sizes = list(engine_world_sizes)
        self.world_size = 1 + sum(self.sizes)
        self.master_address, self.master_port = master_address, master_port
        self.base_name, self.backend = group_name, backend
        self.token = uuid.uuid4().hex[:8]  # engines refuse a group name they already have (e.g. after a restart)
        self.pg = None
        self.attempt = 0

    @property
    def group_name(self) -> str:
        return f"{self.base_name}_{self.token}_{self.attempt}"

    def _init_calls(self, offsets: list[int]) -> list[tuple]:
        raise NotImplementedError

    def _update_calls(self, bucket: Bucket) -> list[tuple]:
        raise NotImplementedError

    def _destroy_calls(self) -> list[tuple]:
        """Engine calls that drop the current group on the engines (none by default)."""
        return []

    def connect(self) -> None:
        """Form the weight-update group (rank 0 and every engine rank). Called by begin() when needed."""
        if not self.is_source or self.pg is not None:
            return
        self.attempt += 1
        offsets = [1 + sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._prepare_rendezvous()
        errors = self._parallel(self._init_calls(offsets), self._join)
        if errors:
            self._teardown()
            raise EngineError(self._join_failed + "; ".join(errors))

    def _prepare_rendezvous(self) -> None:
        """Set `self.port`, the rendezvous port the engines are told; master_port=0: a store on a port the OS picks."""
        self._store = host_store(self.timeout) if self.master_port == 0 else None
        self.port = self._store.port if self._store is not None else self.master_port

    def _join(self) -> None:
        self.pg = join_weight_update_group(self.master_address, self.port, 0, self.world_size,
                                           self.group_name, self.backend, self.timeout, store=self._store)

    def _start_threads(self, calls, errors: list[str]) -> list[threading.Thread]:
        def run(fn, kwargs):
            try:
                call(fn, **kwargs)
            except EngineError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=run, args=c, daemon=True) for c in calls]
        for t in threads:
            t.start()
        return threads

    def _parallel(self, calls, local) -> list[str]:
        """Engine calls in threads (each blocks until the group op completes), `local` meanwhile; errors."""
        errors: list[str] = []
        threads = self._start_threads(calls, errors)
        try:
            local()
        except Exception as e:  # noqa: BLE001
            errors.append(f"trainer rank 0: {type(e).__name__}: {e}")
        for t in threads:
            t.join(self.timeout.total_seconds())
            if t.is_alive():
                errors.append(f"an engine did not answer within {self.timeout}")
        return errors

    def _broadcast_with(self, calls, flat) -> list[str]:
        """Broadcast `flat` while the engine calls run; stops waiting as soon as every engine call has returned,
        one with an error, and the broadcast is still pending (an engine that refused the update never joins it:
        no use waiting out the timeout)."""
        errors: list[str] = []
        threads = self._start_threads(calls, errors)
        deadline = time.monotonic() + self.timeout.total_seconds()
        try:
            work = start_broadcast(flat, self.pg)
            while not work.is_completed():
                if errors and not any(t.is_alive() for t in threads):  # every engine returned, one refused
                    errors.append("trainer rank 0: the broadcast was abandoned, no engine is receiving it")
                    break
                if time.monotonic() > deadline:
                    errors.append(f"trainer rank 0: broadcast of {flat.numel()} bytes did not complete within "
                                  f"{self.timeout}")
                    break
                time.sleep(0.002)
            else:
                work.wait()
        except Exception as e:  # noqa: BLE001
            errors.append(f"trainer rank 0: {type(e).__name__}: {e}")
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                errors.append(f"an engine did not answer within {self.timeout}")
        return errors

    def begin(self, version: int) -> None:
        super().begin(version)
        if self.adapter is not None:  # an adapter-only sync goes by the engine's own adapter route, not the group
            return
        try:
            self.connect()
        except EngineError as e:
            self._fail(str(e))

    def _before_send(self) -> None:
        """Engine calls due before the first bucket (e.g. opening an update session); raises EngineError."""

    def send(self, bucket: Bucket) -> None:
        if self.adapter is not None:
            return self._keep(bucket)
        if not self.is_source or self._error is not None:
            return
        self._note_sent(bucket)
        try:
            self._before_send()
        except EngineError as e:
            self._fail(f"bucket {bucket.index}: {e}")
            return
        errors = self._broadcast_with(self._update_calls(bucket), bucket.flat)
        if errors:
            self._fail(f"bucket {bucket.index}: " + "; ".join(errors))
            self._teardown()  # a lost peer leaves the group unusable: a retry forms a new one

    def _teardown(self) -> None:
        if self.pg is not None:
            destroy_group(self.pg)
            self.pg = None
        self._store = None
        for fn, kwargs in self._destroy_calls():  # the engines' end of the group, so a retry starts clean
            quietly(fn, **kwargs)

    def close(self) -> None:
        """Tear the weight-update group down on the engines and here (call when done syncing)."""
        if self.is_source and self.attempt:
            self._teardown()
