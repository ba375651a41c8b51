"""SGLang senders: colocated (CUDA IPC, `/update_weights_from_tensor`) and distributed (NCCL broadcast,
`/update_weights_from_distributed`), both with `load_format="flattened_bucket"` and a weight version.

Wire format, as SGLang's HTTP server and scheduler read it:

POST /update_weights_from_tensor        {"serialized_named_tensors": [one per engine TP rank: base64 ForkingPickler
                                          bytes of {"flattened_tensor", "metadata"}], "load_format": "flattened_bucket",
                                          "flush_cache": bool, "weight_version": str}
POST /init_weights_update_group         {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                          "backend"}
POST /update_weights_from_distributed   {"names", "dtypes" (e.g. "bfloat16"), "shapes", "group_name", "flush_cache",
                                          "weight_version", "load_format": "flattened_bucket"} then, on the group, one
                                          broadcast from rank 0 of the tightly packed flat buffer, tensors in `names`
                                          order (which is the bucket's byte order)
POST /pause_generation, /continue_generation, /flush_cache
Every response is JSON with "success" and "message" (HTTP 400 on failure).

An engine is anything with these method names (keyword arguments as above): `SGLangHTTPEngine` talks to a
server, an in-process engine needs a thin adapter with the same methods.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from datetime import timedelta

import torch.distributed as dist

from ..buckets import Bucket
from ..errors import Mcore2HFError
from .process_group import broadcast, destroy_group, join_weight_update_group
from .serialize import flattened_payload, serialize


class EngineError(Mcore2HFError):
    """An inference engine answered an error, timed out, or disappeared during a weight update."""


class SGLangHTTPEngine:
    """HTTP client of one SGLang server, for the endpoints weight sync uses."""

    def __init__(self, url: str, timeout: float = 300.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, payload: dict | None = None) -> dict:
        body = json.dumps(payload or {}).encode()
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            raise EngineError(f"{self.url}{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
        except OSError as e:  # refused, reset, timed out
            raise EngineError(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        out = json.loads(text) if text.strip() else {}
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"{self.url}{path}: {out.get('message', 'failed')}")
        return out

    def update_weights_from_tensor(self, **kwargs) -> dict:
        return self._post("/update_weights_from_tensor", kwargs)

    def update_weights_from_distributed(self, **kwargs) -> dict:
        return self._post("/update_weights_from_distributed", kwargs)

    def init_weights_update_group(self, **kwargs) -> dict:
        return self._post("/init_weights_update_group", kwargs)

    def pause_generation(self) -> dict:
        return self._post("/pause_generation")

    def continue_generation(self) -> dict:
        return self._post("/continue_generation")

    def flush_cache(self) -> dict:
        return self._post("/flush_cache")


def _call(fn, **kwargs):
    """Call an engine method; any failure becomes an EngineError."""
    try:
        return fn(**kwargs)
    except EngineError:
        raise
    except Exception as e:  # noqa: BLE001
        raise EngineError(f"{type(e).__name__}: {e}") from e


class _SenderBase:
    """Version bookkeeping and the error agreement every sender needs."""

    receivers: object = "all"

    def __init__(self, timeout: float):
        self.timeout = timedelta(seconds=timeout)
        self.version = 0  # last version every engine confirmed
        self._pending = None
        self._error: str | None = None
        self._quarantine: list = []
        self._status_group = dist.new_group(backend="gloo", timeout=self.timeout)  # small control messages

    def begin(self, version: int) -> None:
        self._pending, self._error = version, None

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = message

    def _agree(self) -> None:
        """Raise on every rank if any rank recorded an error."""
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, self._error, group=self._status_group)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            raise EngineError("weight update failed: " + "; ".join(failed))

    def commit(self) -> None:
        self.version = self._pending
        self._quarantine.clear()


class _ColocatedSender(_SenderBase):
    """Trainer and engine share GPUs. Trainer ranks form consecutive groups of `engine_tp_size` ranks; group i
    feeds engine i, whose first rank gathers the group's payloads (one per engine TP rank, in order) and calls the
    engine (`engine`: this rank's engine client on the first rank of its group, None elsewhere). Every rank of
    the group keeps its bucket alive until the engine has answered. Subclasses give `_payload` and `_update`."""

    receivers = "all"

    def __init__(self, engine, engine_tp_size: int, timeout: float):
        super().__init__(timeout)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % engine_tp_size:
            raise ValueError(f"world size {world} is not a multiple of engine_tp_size {engine_tp_size}")
        self.tp = engine_tp_size
        self.first = rank - rank % engine_tp_size
        self.is_first = rank == self.first
        if self.is_first and engine is None:
            raise ValueError(f"rank {rank} is the first rank of its engine group and needs the engine client")
        self.engine = engine if self.is_first else None
        self.group = None
        for start in range(0, world, engine_tp_size):  # every rank creates every group
            g = dist.new_group(list(range(start, start + engine_tp_size)), backend="gloo", timeout=self.timeout)
            if start == self.first:
                self.group = g

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


class SGLangColocatedSender(_ColocatedSender):
    """Trainer and engine share GPUs: each rank's bucket goes to the engine as a CUDA IPC handle, no copy, through
    SGLang's /update_weights_from_tensor (`serialized_named_tensors`: one flattened-bucket payload per engine TP
    rank). Grouping, lifetime and errors: see _ColocatedSender."""

    def __init__(self, engine, engine_tp_size: int, *, timeout: float = 300.0, http: bool = True,
                 flush_cache: bool = True):
        super().__init__(engine, engine_tp_size, timeout)
        self.http, self.flush = http, flush_cache

    def pause(self) -> None:
        if self.is_first:
            _call(self.engine.pause_generation)

    def resume(self) -> None:
        if self.is_first:
            _call(self.engine.continue_generation)

    def _payload(self, bucket: Bucket):
        return serialize(flattened_payload(bucket), output_str=self.http)

    def _update(self, payloads: list) -> None:
        _call(self.engine.update_weights_from_tensor, serialized_named_tensors=payloads,
              load_format="flattened_bucket", flush_cache=False, weight_version=str(self._pending))

    def finish(self) -> None:
        if self.is_first and self._error is None and self.flush:
            try:
                _call(self.engine.flush_cache)
            except EngineError as e:
                self._fail(f"flush_cache: {e}")
        self._agree()


class _BroadcastSender(_SenderBase):
    """Trainer rank 0 forms a weight-update group with every engine rank (engine i's ranks at rank_offset 1 + the
    earlier engines' sizes) and broadcasts each bucket's flat buffer, while the engines are told what to expect.
    Subclasses give the engine calls (`_init_calls`, `_update_calls`)."""

    receivers = (0,)
    _join_failed = "joining the weight-update group: "

    def __init__(self, engines, engine_world_sizes: list[int], master_address: str, master_port: int,
                 group_name: str, backend: str, timeout: float):
        super().__init__(timeout)
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

    def connect(self) -> None:
        """Form the weight-update group (rank 0 and every engine rank). Called by begin() when needed."""
        if not self.is_source or self.pg is not None:
            return
        self.attempt += 1
        offsets = [1 + sum(self.sizes[:i]) for i in range(len(self.sizes))]
        errors = self._parallel(self._init_calls(offsets), self._join)
        if errors:
            self._teardown()
            raise EngineError(self._join_failed + "; ".join(errors))

    def _join(self) -> None:
        self.pg = join_weight_update_group(self.master_address, self.master_port, 0, self.world_size,
                                           self.group_name, self.backend, self.timeout)

    def _parallel(self, calls, local) -> list[str]:
        """Engine calls in threads (each blocks until the group op completes), `local` meanwhile; errors."""
        errors: list[str] = []

        def run(fn, kwargs):
            try:
                _call(fn, **kwargs)
            except EngineError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=run, args=c, daemon=True) for c in calls]
        for t in threads:
            t.start()
        try:
            local()
        except Exception as e:  # noqa: BLE001
            errors.append(f"trainer rank 0: {type(e).__name__}: {e}")
        for t in threads:
            t.join(self.timeout.total_seconds())
            if t.is_alive():
                errors.append(f"an engine did not answer within {self.timeout}")
        return errors

    def begin(self, version: int) -> None:
        super().begin(version)
        try:
            self.connect()
        except EngineError as e:
            self._fail(str(e))

    def send(self, bucket: Bucket) -> None:
        if not self.is_source or self._error is not None:
            return
        errors = self._parallel(self._update_calls(bucket), lambda: broadcast(bucket.flat, self.pg, self.timeout))
        if errors:
            self._fail(f"bucket {bucket.index}: " + "; ".join(errors))
            self._teardown()  # a lost peer leaves the group unusable: a retry forms a new one

    def _teardown(self) -> None:
        if self.pg is not None:
            destroy_group(self.pg)
            self.pg = None

    def finish(self) -> None:
        self._agree()


class SGLangDistributedSender(_BroadcastSender):
    """Engines on other GPUs or nodes: trainer rank 0 broadcasts each bucket over a weight-update group.

    `engines` (on trainer rank 0) are the engine clients and `engine_world_sizes` their TP sizes; engine i's
    ranks join the group at rank_offset 1 + sum of the earlier sizes. Only rank 0 receives full tensors
    (`receivers = [0]`); the other trainer ranks only take part in the gathers."""

    _join_failed = "init_weights_update_group failed: "

    def __init__(self, engines, engine_world_sizes: list[int], master_address: str, master_port: int, *,
                 group_name: str = "mcore2hf_weights", backend: str = "nccl", timeout: float = 300.0,
                 flush_cache: bool = True):
        super().__init__(engines, engine_world_sizes, master_address, master_port, group_name, backend, timeout)
        self.flush = flush_cache

    def _init_calls(self, offsets: list[int]) -> list[tuple]:
        return [(e.init_weights_update_group, dict(master_address=self.master_address, master_port=self.master_port,
                                                    rank_offset=off, world_size=self.world_size,
                                                    group_name=self.group_name, backend=self.backend))
                for e, off in zip(self.engines, offsets)]

    def _update_calls(self, bucket: Bucket) -> list[tuple]:
        meta = dict(names=[e.name for e in bucket.entries],
                    dtypes=[str(e.dtype).removeprefix("torch.") for e in bucket.entries],
                    shapes=[list(e.shape) for e in bucket.entries], group_name=self.group_name,
                    flush_cache=False, weight_version=str(self._pending), load_format="flattened_bucket")
        return [(e.update_weights_from_distributed, meta) for e in self.engines]

    def pause(self) -> None:
        for e in self.engines:
            _call(e.pause_generation)

    def resume(self) -> None:
        for e in self.engines:
            _call(e.continue_generation)

    def finish(self) -> None:
        if self.is_source and self._error is None and self.flush:
            for e in self.engines:
                try:
                    _call(e.flush_cache)
                except EngineError as err:
                    self._fail(f"flush_cache: {err}")
        self._agree()
