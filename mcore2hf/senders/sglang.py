"""SGLang senders: colocated (CUDA IPC, `/update_weights_from_tensor`) and distributed (broadcast,
`/update_weights_from_distributed`), both with `load_format="flattened_bucket"` and a weight version.

Supported: sglang 0.5.6 through 0.5.23 (checked against each release's wheel source, see RELEASES). The protocol of
one sync, on every engine:

    GET  /server_info (>= 0.5.6; /get_server_info before)   once per sender: version, tp_size, dp_size
    POST /pause_generation {"mode": "abort"|"retract"}       -> {"message", "status": "ok"}
    POST /begin_weight_update {}                             (>= 0.5.21 only) -> {"success", "message"}
    POST /update_weights_from_tensor  {"serialized_named_tensors": [base64 pickle per engine TP rank],
          "load_format": "flattened_bucket", "flush_cache": false, "weight_version"}     -> {"success", "message"}
      or /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
          "group_name", "backend"} once, then per bucket /update_weights_from_distributed {"names", "dtypes",
          "shapes", "group_name", "flush_cache": false, "weight_version", "load_format": "flattened_bucket"} with
          one broadcast from rank 0 of the tightly packed buffer
    POST /flush_cache                                        -> plain text; HTTP 400 while requests are queued
    POST /end_weight_update {}                               (>= 0.5.21 only; finalizes quantized weights)
    POST /continue_generation {}                             -> {"message", "status": "ok"}
    POST /destroy_weights_update_group {"group_name"}        on teardown and before a retry

(sglang 0.5.23 entrypoints/http_server.py, managers/io_struct.py, managers/scheduler_components/weight_updater.py;
0.5.20 and 0.5.6 the same files less the session routes; 0.5.4.post3 has no /server_info.)

An engine is anything with the method names of `SGLangHTTPEngine` (keyword arguments as above): it talks to a
server, an in-process engine needs a thin adapter with the same methods.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..buckets import Bucket
from ..collective import agree
from ..errors import EngineError, HTTPStatusError, UnsupportedEngine, UsageError
from ..plan import EngineRank, colocated_ranks
from .http import HTTPClient
from .process_group import destroy_group, host_store, join_weight_update_group
from .serialize import flattened_payload, serialize

# Release boundaries, each read in that release's wheel.
RELEASES = {
    # 0.5.6: FlattenedTensorBucket.supports_multi_dtypes, byte-indexed metadata, and load_format on
    # update_weights_from_distributed (model_runner.py); 0.5.4.post3 ignores load_format there and its buckets are
    # single-dtype, element-indexed: our buckets would be misread.
    "min": (0, 5, 6),
    # 0.5.21: update_weights_from_tensor / _distributed answer 400 outside begin_weight_update/end_weight_update
    # (managers/scheduler_components/weight_updater.py); 0.5.20 has neither route.
    "sessions": (0, 5, 21),
}

# How each route answers success (sglang 0.5.6-0.5.23 entrypoints/http_server.py): "success" = JSON
# {"success": true, "message"} (HTTP 400 with success false), "status" = JSON {"message", "status": "ok"},
# "text" = plain text (HTTP 400 on failure), "json" = any JSON object.
REPLIES = {
    "/server_info": "json", "/get_server_info": "json",
    "/pause_generation": "status", "/continue_generation": "status",
    "/flush_cache": "text",
    "/begin_weight_update": "success", "/end_weight_update": "success",
    "/update_weights_from_tensor": "success", "/update_weights_from_distributed": "success",
    "/init_weights_update_group": "success", "/destroy_weights_update_group": "success",
}

PAUSE_MODES = ("abort", "retract")


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)", str(text))
    if not m:
        raise UnsupportedEngine(f"cannot read the SGLang version {text!r} (expected e.g. '0.5.23')")
    return int(m[1]), int(m[2]), int(m[3])


@dataclass(frozen=True)
class ServerFacts:
    """What the version probe learned about one server."""

    version: str
    tp_size: int | None
    dp_size: int | None

    @property
    def release(self) -> tuple[int, int, int]:
        return parse_version(self.version)

    @property
    def sessions(self) -> bool:
        return self.release >= RELEASES["sessions"]


def check_server(info: dict, where: str, tp_size: int | None = None) -> ServerFacts:
    """ServerFacts from a server-info reply; UnsupportedEngine naming the version when we cannot serve it."""
    if not isinstance(info, dict) or "version" not in info:
        raise UnsupportedEngine(f"{where}: server info has no 'version' (found keys {sorted(info)[:10]})")
    facts = ServerFacts(str(info["version"]), info.get("tp_size"), info.get("dp_size"))
    need = ".".join(map(str, RELEASES["min"]))
    if facts.release < RELEASES["min"]:
        raise UnsupportedEngine(f"{where}: sglang {facts.version} is not supported: mcore2hf needs sglang >= {need} "
                                "(older releases read flattened buckets as single-dtype, element-indexed, and ignore "
                                "load_format on the distributed path)")
    if facts.dp_size not in (None, 1):
        raise UnsupportedEngine(f"{where}: sglang {facts.version} runs with dp_size={facts.dp_size}; SGLang's weight "
                                "updates need dp_size 1 (one server per data-parallel replica)")
    if tp_size is not None and facts.tp_size not in (None, tp_size):
        raise UnsupportedEngine(f"{where}: sglang {facts.version} runs with tp_size={facts.tp_size}, the sender was "
                                f"given {tp_size}")
    return facts


class SGLangHTTPEngine(HTTPClient):
    """HTTP client of one SGLang server, for the routes weight sync uses (replies read as REPLIES says)."""

    def _request(self, path: str, payload: dict | None = None, method: str = "POST", timeout: float | None = None):
        _, text = self.request(path, payload or {}, method, timeout)  # a POST always carries a JSON object
        kind = REPLIES.get(path, "json")
        if kind == "text":
            return text
        try:
            out = json.loads(text)
        except ValueError:
            raise EngineError(f"{self.url}{path}: expected a JSON reply, found {text[:200]!r}") from None
        if kind == "success" and not (isinstance(out, dict) and out.get("success") is True):
            raise EngineError(f"{self.url}{path}: expected {{'success': true, ...}}, found {str(out)[:300]}")
        if kind == "status" and not (isinstance(out, dict) and out.get("status") == "ok"):
            raise EngineError(f"{self.url}{path}: expected {{'status': 'ok', ...}}, found {str(out)[:300]}")
        return out

    def _post(self, path: str, payload: dict | None = None):  # the former name, for callers of other routes
        return self._request(path, payload)

    def server_info(self) -> dict:
        """GET /server_info, or /get_server_info on releases that only have that (<= 0.5.5)."""
        try:
            return self._request("/server_info", method="GET", timeout=min(self.timeout, 30.0))
        except HTTPStatusError as e:
            if e.status != 404:
                raise
        return self._request("/get_server_info", method="GET", timeout=min(self.timeout, 30.0))

    def update_weights_from_tensor(self, **kwargs) -> dict:
        return self._request("/update_weights_from_tensor", kwargs)

    def update_weights_from_distributed(self, **kwargs) -> dict:
        return self._request("/update_weights_from_distributed", kwargs)

    def init_weights_update_group(self, **kwargs) -> dict:
        return self._request("/init_weights_update_group", kwargs)

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self._request("/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self) -> dict:
        return self._request("/begin_weight_update")

    def end_weight_update(self) -> dict:
        return self._request("/end_weight_update")

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._request("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._request("/continue_generation")

    def flush_cache(self) -> str:
        return self._request("/flush_cache")


def _call(fn, **kwargs):
    """Call an engine method; any failure becomes an EngineError."""
    try:
        return fn(**kwargs)
    except EngineError:
        raise
    except Exception as e:  # noqa: BLE001
        raise EngineError(f"{type(e).__name__}: {e}") from e


def _quietly(fn, **kwargs) -> str | None:
    """Best-effort engine call during cleanup: the error text, or None."""
    try:
        _call(fn, **kwargs)
    except EngineError as e:
        return str(e)
    return None


class _EngineState:
    """One SGLang engine as a sender drives it: probed facts, paused, session open."""

    def __init__(self, engine, tp_size: int | None, pause_mode: str, flush: bool = True):
        self.engine, self.tp_size, self.pause_mode, self.flush = engine, tp_size, pause_mode, flush
        self.facts: ServerFacts | None = None
        self.paused = self.session = False
        self.cache_flushed = True

    @property
    def where(self) -> str:
        return getattr(self.engine, "url", type(self.engine).__name__)

    def probe(self) -> None:
        if self.facts is None:
            get = getattr(self.engine, "server_info", None) or self.engine.get_server_info
            self.facts = check_server(_call(get), self.where, self.tp_size)

    def pause(self) -> None:
        _call(self.engine.pause_generation, mode=self.pause_mode)
        self.paused = True

    def open_session(self) -> None:
        if self.session or not self.facts.sessions:
            return
        try:
            _call(self.engine.begin_weight_update)
        except EngineError as e:
            if "already open" not in str(e):  # a session left by a crashed trainer: close it, open ours
                raise
            _call(self.engine.end_weight_update)
            _call(self.engine.begin_weight_update)
        self.session = True

    def finish(self) -> None:
        """Success path: flush the cache (see SGLangColocatedSender's pause_mode), close the session."""
        self.cache_flushed = self.flush
        try:
            if self.flush:
                _call(self.engine.flush_cache)
        except EngineError as e:
            if self.pause_mode == "abort":
                raise EngineError(f"flush_cache: {e}") from None
            # retract: requests wait in the queue, and releases before the paused-idle check (< 0.5.23 at least)
            # refuse the flush; the prefix cache keeps KV computed with the previous weights
            self.cache_flushed = False
            warnings.warn(f"{self.where}: sglang {self.facts.version} refused /flush_cache in retract mode ({e}); "
                          "its prefix cache still holds KV computed with the previous weights", stacklevel=2)
        if self.session:
            _call(self.engine.end_weight_update)
            self.session = False

    def cleanup(self) -> list[str]:
        """After a failure: close our session, resume generation (never leave the engine paused)."""
        problems = []
        if self.session:
            problems.append(_quietly(self.engine.end_weight_update))
            self.session = False
        if self.paused:
            problems.append(_quietly(self.engine.continue_generation))
            self.paused = False
        return [p for p in problems if p]

    def resume(self) -> None:
        if self.paused:
            _call(self.engine.continue_generation)
            self.paused = False


def _check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode: expected one of {PAUSE_MODES}, found {mode!r}")


class _SenderBase:
    """Version bookkeeping and the error agreement every sender needs."""

    receivers: object = "all"

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

    def begin(self, version: int) -> None:
        self._pending, self._error = version, None

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = message

    def _agree(self) -> None:
        """Raise on every rank if any rank recorded an error."""
        agree(self._error, EngineError, "weight update failed: ", self._status_group)

    def commit(self) -> None:
        self.version = self._pending
        self._quarantine.clear()


class _SGLangMixin:
    """Probe, pause, session and cleanup over this rank's `_engines` (list of _EngineState)."""

    _engines: list

    def _probe_all(self) -> None:
        """Every rank raises UnsupportedEngine (the same message) if any engine cannot be served."""
        if getattr(self, "_probed", False):
            return
        error = None
        for st in self._engines:
            try:
                st.probe()
            except EngineError as e:
                error = str(e)
                break
        agree(error, UnsupportedEngine, group=self._status_group)
        self._probed = True

    def pause(self) -> None:
        for st in self._engines:
            try:
                st.pause()
            except EngineError as e:
                self._fail(f"pause_generation: {e}")

    def resume(self) -> None:
        for st in self._engines:
            st.resume()

    @property
    def cache_flushed(self) -> bool:
        """False when the last sync left a prefix cache unflushed (flush_cache=False, or refused in retract mode)."""
        return all(st.cache_flushed for st in self._engines)

    def _finish_engines(self) -> None:
        if self._error is None:
            for st in self._engines:
                try:
                    st.finish()
                except EngineError as e:
                    self._fail(str(e))
        try:
            self._agree()
        except EngineError:
            self._cleanup()
            raise

    def _cleanup(self) -> None:
        for st in self._engines:
            st.cleanup()

    def abort(self) -> None:
        """Best-effort, local: after an exception inside sync(), close our sessions and resume our engines."""
        self._cleanup()


class _ColocatedSender(_SenderBase):
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
        try:
            payload = self._payload(bucket)
        except Exception as e:  # noqa: BLE001
            payload = None
            self._fail(f"serializing bucket {bucket.index}: {e}")
        gathered = [None] * self.tp if self.is_first else None
        dist.gather_object(payload, gathered, dst=self.first, group=self.group)
        status = None
        if self.is_first and self._error is None:
            if any(p is None for p in gathered):
                status = f"bucket {bucket.index}: a rank of the engine group could not serialize its bucket"
            else:
                try:
                    self._update(gathered)
                except EngineError as e:
                    status = f"bucket {bucket.index}: {e}"
        box = [status]
        dist.broadcast_object_list(box, src=self.first, group=self.group)  # buckets stay alive until here
        if box[0]:
            self._fail(box[0])
            # an engine that timed out may still read this memory through its IPC mapping: keep it until a
            # later update succeeds, so the allocator cannot hand it to the next bucket meanwhile
            self._quarantine.append(bucket.flat)

    def finish(self) -> None:
        self._agree()


class SGLangColocatedSender(_SGLangMixin, _ColocatedSender):
    """Trainer and engine share GPUs: each rank's bucket goes to the engine as a CUDA IPC handle keyed by GPU UUID,
    no copy, through /update_weights_from_tensor (`serialized_named_tensors`: one flattened-bucket payload per
    engine TP rank). Grouping, lifetime and errors: see _ColocatedSender.

    `pause_mode`: "abort" (default; in-flight requests are aborted, then the cache is flushed after the update,
    as slime does) or "retract" (requests go back to the queue and are recomputed after continue; releases whose
    flush refuses a non-empty queue keep the prefix cache of the old weights: a warning, and `cache_flushed` is
    False). `flush_cache=False` skips the flush. `api_key` is for engines built from URLs (`engine` may also be
    a URL string).

    `engine_sharding=True`: each rank receives and sends only what its engine TP rank loads (full-shaped
    tensors, the rest unwritten; SGLang's weight loaders narrow to exactly that). `engine_ep_size`: the engine's
    `--ep-size`; `engine_placement`: other EnginePlacement fields (`moe_tp`, `replicated_shared_experts=True`
    for DeepEP-class `--moe-a2a-backend`). Settings the rules refuse raise EngineShardError here."""

    engine_kind = "sglang"

    def __init__(self, engine, engine_tp_size: int, *, timeout: float = 300.0, http: bool = True,
                 flush_cache: bool = True, pause_mode: str = "abort", api_key: str | None = None,
                 engine_sharding: bool = False, engine_ep_size: int = 1, engine_placement: dict | None = None):
        _check_pause_mode(pause_mode)
        if isinstance(engine, str):
            engine = SGLangHTTPEngine(engine, timeout=timeout, api_key=api_key)
        super().__init__(engine, engine_tp_size, timeout, engine_sharding, engine_ep_size, engine_placement)
        self.http, self.flush = http, flush_cache
        self._engines = [_EngineState(self.engine, engine_tp_size, pause_mode, flush_cache)] if self.is_first else []

    def begin(self, version: int) -> None:
        super().begin(version)
        self._probe_all()

    def _payload(self, bucket: Bucket):
        return serialize(flattened_payload(bucket), output_str=self.http)

    def _update(self, payloads: list) -> None:
        self._engines[0].open_session()
        _call(self.engine.update_weights_from_tensor, serialized_named_tensors=payloads,
              load_format="flattened_bucket", flush_cache=False, weight_version=str(self._pending))

    def finish(self) -> None:
        self._finish_engines()


def refuse_broadcast_sharding(engine_sharding: bool) -> None:
    if engine_sharding:
        raise UsageError("engine_sharding=True with a distributed sender: expected a colocated sender (the "
                         "broadcast delivers full tensors to every engine rank; per-rank delivery to engines in "
                         "another world is the disaggregated path)")


class _BroadcastSender(_SenderBase):
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
                _call(fn, **kwargs)
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
        kwargs = {"group_src": 0} if "group_src" in _broadcast_params() else {"src": 0}
        deadline = time.monotonic() + self.timeout.total_seconds()
        try:
            work = dist.broadcast(flat, group=self.pg, async_op=True, **kwargs)
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
        try:
            self.connect()
        except EngineError as e:
            self._fail(str(e))

    def _before_send(self) -> None:
        """Engine calls due before the first bucket (e.g. opening an update session); raises EngineError."""

    def send(self, bucket: Bucket) -> None:
        if not self.is_source or self._error is not None:
            return
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
            _quietly(fn, **kwargs)

    def close(self) -> None:
        """Tear the weight-update group down on the engines and here (call when done syncing)."""
        if self.is_source and self.attempt:
            self._teardown()

    def finish(self) -> None:
        self._agree()


def _broadcast_params():
    import inspect

    return inspect.signature(dist.broadcast).parameters


class SGLangDistributedSender(_SGLangMixin, _BroadcastSender):
    """Engines on other GPUs or nodes: trainer rank 0 broadcasts each bucket over a weight-update group.

    `engines` (on trainer rank 0) are the engine clients (or URLs) and `engine_world_sizes` their TP sizes; engine
    i's ranks join the group at rank_offset 1 + sum of the earlier sizes. Only rank 0 receives full tensors
    (`receivers = [0]`); the other trainer ranks only take part in the gathers. `pause_mode`, `flush_cache` and
    `api_key` as for SGLangColocatedSender. Call `close()` when done: the engines keep the group otherwise."""

    _join_failed = "init_weights_update_group failed: "

    def __init__(self, engines, engine_world_sizes: list[int], master_address: str, master_port: int, *,
                 group_name: str = "mcore2hf_weights", backend: str = "nccl", timeout: float = 300.0,
                 flush_cache: bool = True, pause_mode: str = "abort", api_key: str | None = None,
                 engine_sharding: bool = False):
        refuse_broadcast_sharding(engine_sharding)
        _check_pause_mode(pause_mode)
        engines = [SGLangHTTPEngine(e, timeout=timeout, api_key=api_key) if isinstance(e, str) else e
                   for e in (engines or [])]
        super().__init__(engines, engine_world_sizes, master_address, master_port, group_name, backend, timeout)
        self.flush = flush_cache
        self._engines = [_EngineState(e, n, pause_mode, flush_cache)
                         for e, n in zip(self.engines, self.sizes)]
        self._group_on_engines: str | None = None

    def begin(self, version: int) -> None:
        _SenderBase.begin(self, version)
        self._probe_all()  # collective: every rank raises UnsupportedEngine before anything moves
        try:
            self.connect()
        except EngineError as e:
            self._fail(str(e))

    def _init_calls(self, offsets: list[int]) -> list[tuple]:
        self._group_on_engines = self.group_name
        return [(e.init_weights_update_group, dict(master_address=self.master_address, master_port=self.port,
                                                    rank_offset=off, world_size=self.world_size,
                                                    group_name=self.group_name, backend=self.backend))
                for e, off in zip(self.engines, offsets)]

    def _destroy_calls(self) -> list[tuple]:
        name, self._group_on_engines = self._group_on_engines, None
        return [(e.destroy_weights_update_group, dict(group_name=name)) for e in self.engines] if name else []

    def _before_send(self) -> None:
        for st in self._engines:
            st.open_session()

    def _update_calls(self, bucket: Bucket) -> list[tuple]:
        meta = dict(names=[e.name for e in bucket.entries],
                    dtypes=[str(e.dtype).removeprefix("torch.") for e in bucket.entries],
                    shapes=[list(e.shape) for e in bucket.entries], group_name=self.group_name,
                    flush_cache=False, weight_version=str(self._pending), load_format="flattened_bucket")
        return [(e.update_weights_from_distributed, meta) for e in self.engines]

    def _cleanup(self) -> None:
        super()._cleanup()
        if self.is_source and self.pg is not None:  # a failed sync: the next one forms a fresh group
            self._teardown()

    def finish(self) -> None:
        self._finish_engines()
