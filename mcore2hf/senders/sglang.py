"""SGLang senders: colocated (CUDA IPC, `/update_weights_from_tensor`) and distributed (broadcast,
`/update_weights_from_distributed`), both with `load_format="flattened_bucket"` and a weight version.

Supported: sglang 0.5.6 through 0.5.23 (checked against each release's wheel source, see RELEASES). The protocol of
one sync, on every engine:

    GET  /server_info (>= 0.5.6; /get_server_info before)   once per sender: version, tp_size, dp_size
    POST /pause_generation {"mode": "abort"|"retract"}       -> {"message", "status": "ok"}
    POST /begin_weight_update {"selector"}                   (>= 0.5.21 only) -> {"success", "message"}
    POST /update_weights_from_tensor  {"serialized_named_tensors": [base64 pickle per engine TP rank],
          "load_format": "flattened_bucket", "flush_cache": false, "weight_version", "selector"}
                                                                                          -> {"success", "message"}
      or /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
          "group_name", "backend"} once, then per bucket /update_weights_from_distributed {"names", "dtypes",
          "shapes", "group_name", "flush_cache": false, "weight_version", "load_format": "flattened_bucket",
          "selector"} with one broadcast from rank 0 of the tightly packed buffer
    POST /flush_cache                                        -> plain text; HTTP 400 while requests are queued
    POST /end_weight_update {}                               (>= 0.5.21 only; finalizes quantized weights)
    POST /continue_generation {}                             -> {"message", "status": "ok"}
    POST /destroy_weights_update_group {"group_name"}        on teardown and before a retry

(sglang 0.5.23 entrypoints/http_server.py, managers/io_struct.py, managers/scheduler_components/weight_updater.py;
0.5.20 and 0.5.6 the same files less the session routes and selectors; 0.5.4.post3 has no /server_info.)

`selector` (>= 0.5.21): which runners a session, an update and a weight check apply to, "target" / "draft" /
"all" (the release's default): the target's buckets go with "target", the MTP layers' with "draft", a session
opens "all" only when the draft is updated, and the checker asks "all" then too (else "target": a proof must not
reset a draft the sync leaves alone). A server with a draft on a release before selectors is refused (check_server:
0.5.20's tensor path loads every update into draft and target, its distributed path into the target only, and its
checker resets the draft with the target, weight_updater.py:160-167, :144-157, :299-313).

An engine is anything with the method names of `SGLangHTTPEngine` (keyword arguments as above): it talks to a
server, an in-process engine needs a thin adapter with the same methods.

This module holds only SGLang's protocol: the engine groups, the broadcast group, the framing of a sync and the
HTTP client are shared with vLLM's senders (base.py, http.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass

import torch

from ..collective import agree
from ..errors import EngineError, HTTPStatusError, UnsupportedEngine, UsageError
from ..transfer.buckets import Bucket
from . import checker, drafts
from .base import (
    BroadcastSender,
    ColocatedSender,
    SenderBase,
    call,
    check_pause_mode,
    quietly,
    refuse_broadcast_sharding,
)
from .http import HTTPClient
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
    # verify (sync(verify=...)): /weights_checker with the `checksum` action, whose per-rank answer ("ranks":
    # checksums, per_gpu_checksum, parallelism_info) sync reads; 0.5.6-0.5.10 have the route with snapshot /
    # reset_tensors / compare only, 0.5.15 has checksum (read in those wheels); 0.5.20 and 0.5.23 run in the
    # contract tests (utils/weight_checker.py, managers/tokenizer_control_mixin.py check_weights).
    "checker": (0, 5, 20),
    # adapter-only sync: POST /load_lora_adapter_from_tensors (LoadLoRAAdapterFromTensorsReqInput: lora_name,
    # config_dict, serialized_named_tensors one per engine TP rank, load_format "flattened_bucket" or None, lora_id,
    # pinned, expected_checksums) and /unload_lora_adapter: read in 0.5.20 (http_server.py:1575,
    # io_struct.py:2301, tp_worker.py:249) and 0.5.23 (http_server.py:1663, io_struct.py:2548, tp_worker.py:217),
    # the same request; 0.5.4.post3 has /load_lora_adapter (from a path) only; 0.5.6-0.5.19 not checked
    "lora_tensors": (0, 5, 20),
    # speculative-decoding drafts: `selector` ("target" / "draft" / "all") on begin / update / checker requests,
    # read in 0.5.21 and 0.5.23 (managers/io_struct.py: UpdateWeightsFromDistributed-, UpdateWeightsFromTensor-,
    # BeginWeightUpdate- and CheckWeightsReqInput; 0.5.23 :2017, :2045, :2200, :2223); 0.5.20 has none
    "selectors": (0, 5, 21),
}

#: speculative algorithms without draft weights (0.5.23 speculative/base_spec_worker.py:170-175: "NGRAM and UNO
#: have no draft model")
NO_DRAFT_WEIGHTS = ("NGRAM", "UNO")

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
    "/weights_checker": "success",  # HTTP 400 {"success": false, "message"} when the checker raised
    # LoRAUpdateOutput {"success", "error_message", "loaded_adapters"}, HTTP 400 when success is false
    # (0.5.23 http_server.py:1663-1683)
    "/load_lora_adapter_from_tensors": "success", "/unload_lora_adapter": "success",
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
    lora: bool | None = None  # LoRA serving on (--enable-lora, or adapters given at start); None: not reported
    speculative: str | None = None  # the resolved --speculative-algorithm (None: no speculative decoding)
    draft_path: str | None = None  # the resolved --speculative-draft-model-path
    model_path: str | None = None

    @property
    def draft_kind(self) -> str | None:
        """What the server serves as its draft (drafts.KINDS): its own MTP layers when the resolved draft path is
        the model's (0.5.23 arg_groups/speculative_hook.py:720-725 and :1138-1142 set it so for MTP models; NEXTN
        resolves to EAGLE, :109-115), a model of its own otherwise (EAGLE3, STANDALONE, an EAGLE checkpoint)."""
        algo = (self.speculative or "").upper()
        if not algo or algo in NO_DRAFT_WEIGHTS:
            return None
        if algo in ("EAGLE", "NEXTN") and self.draft_path in (None, self.model_path):
            return "mtp"
        return "separate"

    @property
    def selectors(self) -> bool:
        return self.release >= RELEASES["selectors"]

    @property
    def lora_tensors(self) -> bool:
        return self.release >= RELEASES["lora_tensors"]

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
    # /server_info carries the resolved server arguments (0.5.23 utils/common.py:3584 build_server_info;
    # server_args.py:287: LoRA is on with enable_lora, or with lora_paths when enable_lora is unset)
    lora = None
    if "enable_lora" in info:
        lora = bool(info["enable_lora"]) or (info["enable_lora"] is None and bool(info.get("lora_paths")))
    facts = ServerFacts(str(info["version"]), info.get("tp_size"), info.get("dp_size"), lora,
                        info.get("speculative_algorithm"), info.get("speculative_draft_model_path"),
                        info.get("model_path"))
    need = ".".join(map(str, RELEASES["min"]))
    if facts.release < RELEASES["min"]:
        raise UnsupportedEngine(f"{where}: sglang {facts.version} is not supported: mcore2hf needs sglang >= {need} "
                                "(older releases read flattened buckets as single-dtype, element-indexed, and ignore "
                                "load_format on the distributed path)")
    if facts.dp_size not in (None, 1):
        raise UnsupportedEngine(f"{where}: sglang {facts.version} runs with dp_size={facts.dp_size}; SGLang's weight "
                                "updates need dp_size 1 (one server per data-parallel replica)")
    if facts.draft_kind is not None and not facts.selectors:
        raise UnsupportedEngine(f"{where}: sglang {facts.version} serves a speculative draft "
                                f"({facts.speculative}) and has no runner selectors (sglang >= "
                                f"{'.'.join(map(str, RELEASES['selectors']))}): its tensor path loads every update "
                                "into the draft worker, which loads it into draft and target alike (0.5.20 "
                                "scheduler_components/weight_updater.py:160-167, speculative/eagle_worker_v2.py:"
                                "1682-1702), its distributed path into the target only (:144-157), so a sync can "
                                "neither update the draft nor leave it alone; use sglang >= 0.5.21")
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

    def begin_weight_update(self, **kwargs) -> dict:
        return self._request("/begin_weight_update", kwargs)

    def end_weight_update(self) -> dict:
        return self._request("/end_weight_update")

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._request("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._request("/continue_generation")

    def flush_cache(self) -> str:
        return self._request("/flush_cache")

    def load_lora_adapter_from_tensors(self, **kwargs) -> dict:
        """POST /load_lora_adapter_from_tensors (LoadLoRAAdapterFromTensorsReqInput, 0.5.23 io_struct.py:2548)."""
        return self._request("/load_lora_adapter_from_tensors", kwargs)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """POST /unload_lora_adapter (UnloadLoRAAdapterReqInput: lora_name)."""
        return self._request("/unload_lora_adapter", {"lora_name": lora_name})

    def weights_checker(self, **kwargs) -> dict:
        """POST /weights_checker (CheckWeightsReqInput: action "snapshot" / "reset_tensors" / "compare" /
        "checksum"; 0.5.23 also allow_quant_error, skip_tensor_list, selector) -> {"success", "message", and for
        checksum "ranks": one ChecksumInfo per engine rank, "per_engine_checksum"} (sglang 0.5.23
        entrypoints/http_server.py:1599, managers/tokenizer_control_mixin.py:890)."""
        return self._request("/weights_checker", kwargs)


class _EngineState:
    """One SGLang engine as a sender drives it: probed facts, session open."""

    def __init__(self, engine, tp_size: int | None, pause_mode: str, flush: bool = True):
        self.engine, self.tp_size, self.pause_mode, self.flush = engine, tp_size, pause_mode, flush
        self.facts: ServerFacts | None = None
        self.session = False
        self.cache_flushed = True
        self.adapter_loaded = False  # we loaded an adapter of the sender's lora_name (unloaded before a new one)

    @property
    def where(self) -> str:
        return getattr(self.engine, "url", type(self.engine).__name__)

    def probe(self) -> None:
        if self.facts is None:
            get = getattr(self.engine, "server_info", None) or self.engine.get_server_info
            self.facts = check_server(call(get), self.where, self.tp_size)

    def selector(self, role: str) -> dict:
        """The `selector` argument of a request for `role` ("target" / "draft" / "all"), on releases with one."""
        return {"selector": role} if self.facts.selectors else {}

    def open_session(self, role: str) -> None:
        """Open the update session on the runners of `role` ("all" when the sync updates the draft too)."""
        if self.session or not self.facts.sessions:
            return
        try:
            call(self.engine.begin_weight_update, **self.selector(role))
        except EngineError as e:
            if "already open" not in str(e):  # a session left by a crashed trainer: close it, open ours
                raise
            call(self.engine.end_weight_update)
            call(self.engine.begin_weight_update, **self.selector(role))
        self.session = True

    def finish(self) -> None:
        """Success path: flush the cache (see SGLangColocatedSender's pause_mode), close the session."""
        self.cache_flushed = self.flush
        try:
            if self.flush:
                call(self.engine.flush_cache)
        except EngineError as e:
            if self.pause_mode == "abort":
                raise EngineError(f"flush_cache: {e}") from None
            # retract: requests wait in the queue, and releases before the paused-idle check (< 0.5.23 at least)
            # refuse the flush; the prefix cache keeps KV computed with the previous weights
            self.cache_flushed = False
            warnings.warn(f"{self.where}: sglang {self.facts.version} refused /flush_cache in retract mode ({e}); "
                          "its prefix cache still holds KV computed with the previous weights", stacklevel=2)
        if self.session:
            call(self.engine.end_weight_update)
            self.session = False


class _SGLangMixin:
    """SGLang's side of SenderBase's hooks over this rank's `_engines` (list of _EngineState), and the probe."""

    _engines: list
    _pause_route = "pause_generation"
    adapter_checksums = True  # LoadLoRAAdapterFromTensorsReqInput.expected_checksums (0.5.20 and 0.5.23)

    def _probe_all(self) -> None:
        """Every rank raises UnsupportedEngine (the same message) if any engine cannot be served (or, for a verified
        sync, verified)."""
        if not getattr(self, "_probed", False):
            error = None
            for st in self._engines:
                try:
                    st.probe()
                except EngineError as e:
                    error = str(e)
                    break
            agree(error, UnsupportedEngine, group=self._status_group)
            self._probed = True
        if self.verify:  # collective only when verifying: every rank passes the same mode
            agree(self._checker_refusal(), UnsupportedEngine, group=self._status_group)

    def _driven(self) -> list:
        return self._engines

    def _engine_draft(self, st: _EngineState) -> drafts.EngineDraft:
        """A server with a draft has selectors (check_server refuses the others)."""
        f = st.facts
        return drafts.EngineDraft(st.where, f.draft_kind, f"speculative_algorithm {f.speculative}, draft "
                                  f"{f.draft_path or 'the model itself'}")

    def _runners(self, st: _EngineState) -> str:
        """The runners this sync's session and checker calls cover: the draft's too only when it is updated."""
        return "all" if self._takes_draft(st) else "target"

    def _adapter_refusal(self, st: _EngineState) -> str | None:
        need = ".".join(map(str, RELEASES["lora_tensors"]))
        if not st.facts.lora_tensors:
            return (f"sglang {st.facts.version} cannot load an adapter from tensors: it needs sglang >= {need} "
                    "(/load_lora_adapter_from_tensors; 0.5.4.post3 loads adapters only from a path)")
        if st.facts.lora is False:
            return (f"sglang {st.facts.version} was started without LoRA: start it with --enable-lora (and "
                    "--max-lora-rank / --lora-target-modules covering the adapter)")
        return None

    def _load_adapter(self, st: _EngineState, payloads: list, load_format: str | None,
                      expected: dict[str, str] | None = None) -> None:
        """Replace the adapter `lora_name` on one engine (paused: requests wait in the tokenizer manager before
        they resolve an adapter name, tokenizer_manager.py:938-942, so none meets it missing): unload the one we
        loaded, then load this one. SGLang refuses to load a name it already has (lora_manager.py:351
        validate_new_adapter), so one left by an earlier run is unloaded and the load retried."""
        kwargs = dict(lora_name=self.lora_name, config_dict=self.adapter, serialized_named_tensors=payloads,
                      load_format=load_format)
        if expected is not None:  # each engine TP rank checks what it received (tp_worker.py:231-257, 0.5.20 :263)
            kwargs["expected_checksums"] = expected
        if st.adapter_loaded:
            call(st.engine.unload_lora_adapter, lora_name=self.lora_name)
            st.adapter_loaded = False
        try:
            call(st.engine.load_lora_adapter_from_tensors, **kwargs)
        except EngineError as e:
            if "already loaded" not in str(e):
                raise
            call(st.engine.unload_lora_adapter, lora_name=self.lora_name)
            call(st.engine.load_lora_adapter_from_tensors, **kwargs)
        st.adapter_loaded = True

    def _checker_refusal(self) -> str | None:
        """Why this sync's `verify` cannot run on these engines (their release), or None."""
        need = ".".join(map(str, RELEASES["checker"]))
        for st in self._engines if self.verify else []:
            if st.facts.release < RELEASES["checker"]:
                return (f"{st.where}: sglang {st.facts.version} cannot verify a sync: verify needs sglang >= {need} "
                        "(/weights_checker with the 'checksum' action; 0.5.6-0.5.10 have no checksum)")
        return None

    def _checksums(self, st: _EngineState) -> dict[str, dict[str, str]]:
        """Per engine rank and role ("dp0:pp0:tp0", "dp0:pp0:tp0:draft"): the checker's per-parameter checksums."""
        out = call(st.engine.weights_checker, action="checksum", **st.selector(self._runners(st)))
        ranks = {}
        for info in out.get("ranks") or []:
            p = info["parallelism_info"]
            p = p[0] if isinstance(p, list) else p  # 0.5.23: one entry per role (target, drafts), same GPU rank
            rank = f"dp{p['dp_rank']}:pp{p['pp_rank']}:tp{p['tp_rank']}"
            for role, named in checker.split_roles(dict(info["checksums"])).items():
                ranks[f"{rank}:{role}" if role else rank] = named
        if not ranks:
            raise EngineError(f"{st.where}/weights_checker: expected per-rank checksums ('ranks'), found "
                              f"{sorted(out)}")
        return ranks

    def _snapshot_and_reset(self, st: _EngineState) -> None:
        runners = st.selector(self._runners(st))  # a draft this sync leaves alone is neither kept nor reset
        call(st.engine.weights_checker, action="snapshot", **runners)  # the weights it loaded, kept on the host
        call(st.engine.weights_checker, action="reset_tensors", **runners)  # every checked parameter random

    def _engine_compare(self, st: _EngineState, baseline: dict) -> list[str]:
        """SGLang's comparator against its snapshot (utils/weight_checker.py:258 _check_tensors: raises
        "check tensor equality failed:" with a "name=..." line per tensor); only TP rank 0's answer reaches the
        HTTP reply, the per-rank checksums cover the others."""
        try:
            call(st.engine.weights_checker, action="compare", **st.selector(self._runners(st)))
        except EngineError as e:
            names = re.findall(r"name=(\S+)", str(e))
            if not names:
                raise
            return names
        return []

    def _pause_engine(self, engine: _EngineState) -> None:
        call(engine.engine.pause_generation, mode=engine.pause_mode)

    def _resume_engine(self, engine: _EngineState) -> None:
        call(engine.engine.continue_generation)

    @property
    def cache_flushed(self) -> bool:
        """False when the last sync left a prefix cache unflushed (flush_cache=False, or refused in retract mode)."""
        return all(st.cache_flushed for st in self._engines)

    def _finish_sessions(self) -> None:
        if self.adapter is not None:
            return self._finish_adapter()
        if self._error is None:
            for st in self._engines:
                try:
                    st.finish()
                except EngineError as e:
                    self._fail(str(e))

    def _close_sessions(self) -> None:
        for st in self._engines:
            if st.session:
                quietly(st.engine.end_weight_update)
                st.session = False


class SGLangColocatedSender(_SGLangMixin, ColocatedSender):
    """Trainer and engine share GPUs: each rank's bucket goes to the engine as a CUDA IPC handle keyed by GPU UUID,
    no copy, through /update_weights_from_tensor (`serialized_named_tensors`: one flattened-bucket payload per
    engine TP rank). Grouping, lifetime and errors: see ColocatedSender.

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
                 engine_sharding: bool = False, engine_ep_size: int = 1, engine_placement: dict | None = None,
                 lora_name: str | None = None):
        check_pause_mode(pause_mode, PAUSE_MODES)
        if isinstance(engine, str):
            engine = SGLangHTTPEngine(engine, timeout=timeout, api_key=api_key)
        super().__init__(engine, engine_tp_size, timeout, engine_sharding, engine_ep_size, engine_placement)
        self.http, self.flush, self.lora_name, self.pause_mode = http, flush_cache, lora_name, pause_mode
        self._engines = [_EngineState(self.engine, engine_tp_size, pause_mode, flush_cache)] if self.is_first else []

    def begin(self, version: int) -> None:
        super().begin(version)
        self._probe_all()

    def set_adapter(self, config: dict | None, entries: list | None = None, verify: str | None = None) -> None:
        if config is not None and config.get("target_parameters"):
            raise UsageError("SGLang loads expert adapters one per expert (lora/mem_pool.py:1000 experts.E.*): "
                             "expected HFExporter(..., lora_experts='per_expert'), found PEFT's stacked form")
        if config is not None and self.pause_mode == "retract":  # every rank refuses (the same argument)
            # a retracted request keeps its adapter acquired, and SGLang's unload waits for it
            # (tokenizer_control_mixin.py:646 wait_for_unload) while the engine is paused: it would never end
            raise UsageError("an adapter-only sync into SGLang replaces the adapter while the engine is paused: "
                             "expected pause_mode='abort' (retracted requests hold the old adapter)")
        super().set_adapter(config, entries, verify)

    def _finish_adapter(self) -> None:
        """Every rank of the engine group serializes the whole adapter (its own copy, on its GPU) for its engine TP
        rank, as a weight bucket goes; the first rank loads it: one flattened bucket, or the named tensors of
        several (load_format None: tp_worker.py:226 takes the dict as is)."""
        kept, self._kept = self._kept, []
        if len(kept) == 1:
            load_format = "flattened_bucket"

            def payload():
                return serialize(flattened_payload(kept[0]), output_str=self.http)
        else:
            load_format = None

            def payload():
                return serialize({n: t for b in kept for n, t in b}, output_str=self.http)
        def expected() -> dict[str, str] | None:  # SGLang's own digest: sha256 of the tensor's bytes (tp_worker.py:240)
            return {n: hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
                    .hexdigest() for b in kept for n, t in b} if self._adapter_verify else None

        # every rank of the group takes part; the first calls the engine only if nothing failed on it
        self._group_call(payload, lambda p: self._load_adapter(self._engines[0], p, load_format, expected()),
                         f"LoRA adapter {self.lora_name!r}")

    def _payload(self, bucket: Bucket):
        return serialize(flattened_payload(bucket), output_str=self.http)

    def _update(self, payloads: list) -> None:
        st = self._engines[0]
        if self._role == "draft" and not self._takes_draft(st):  # an engine without an MTP draft: not its tensors
            return
        st.open_session(self._runners(st))
        call(self.engine.update_weights_from_tensor, serialized_named_tensors=payloads,
             load_format="flattened_bucket", flush_cache=False, weight_version=str(self._pending),
             **st.selector(self._role))


class SGLangDistributedSender(_SGLangMixin, BroadcastSender):
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
        check_pause_mode(pause_mode, PAUSE_MODES)
        engines = [SGLangHTTPEngine(e, timeout=timeout, api_key=api_key) if isinstance(e, str) else e
                   for e in (engines or [])]
        super().__init__(engines, engine_world_sizes, master_address, master_port, group_name, backend, timeout)
        self.flush = flush_cache
        self._engines = [_EngineState(e, n, pause_mode, flush_cache)
                         for e, n in zip(self.engines, self.sizes)]
        self._group_on_engines: str | None = None

    def begin(self, version: int) -> None:
        SenderBase.begin(self, version)
        self._probe_all()  # collective: every rank raises UnsupportedEngine before anything moves
        try:
            self.connect()
        except EngineError as e:
            self._fail(str(e))

    def set_adapter(self, config: dict | None, entries: list | None = None, verify: str | None = None) -> None:
        if config is not None:
            raise UsageError("an adapter-only sync into SGLang goes through /load_lora_adapter_from_tensors, whose "
                             "tensors are shared in memory with the engine's ranks: expected SGLangColocatedSender "
                             "(the distributed sender broadcasts weights only)")
        super().set_adapter(config, entries, verify)

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
            st.open_session(self._runners(st))

    def _update_calls(self, bucket: Bucket) -> list[tuple]:
        """Every engine joins every broadcast; in the draft pass one without an MTP draft receives it into no
        runner (0.5.23 weight_updater.py:178-184 `_select_runners`: no draft worker, no draft runner)."""
        meta = dict(names=[e.name for e in bucket.entries],
                    dtypes=[str(e.dtype).removeprefix("torch.") for e in bucket.entries],
                    shapes=[list(e.shape) for e in bucket.entries], group_name=self.group_name,
                    flush_cache=False, weight_version=str(self._pending), load_format="flattened_bucket")
        return [(st.engine.update_weights_from_distributed, {**meta, **st.selector(self._role)})
                for st in self._engines]

    def _after_failure(self) -> None:
        super()._after_failure()
        if self.is_source and self.pg is not None:  # a failed sync: the next one forms a fresh group
            self._teardown()
