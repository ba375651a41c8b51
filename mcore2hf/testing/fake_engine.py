"""A faithful stand-in for an inference engine, run as a separate process, for sender tests (CPU or GPU).

It serves SGLang's weight-sync endpoints with SGLang's semantics: payloads are deserialized with a restricted
unpickler like SGLang's, flattened buckets are rebuilt as SGLang's scheduler rebuilds them (views
`flat[start:end].view(dtype).reshape(shape)`), the distributed path joins the weight-update group as SGLang's
`init_custom_process_group` does and receives into a buffer laid out from names / dtypes / shapes in request order.
It also hosts vLLM's worker-extension pattern: `/collective_rpc` calls a method of `MCore2HFWorkerExtension` on a
fake worker whose `model_runner.model.load_weights` records tensors.

Every received tensor is recorded as a SHA-256 of its bytes, per engine TP rank, with the weight version; GET
/mcore2hf_state returns them. Failures can be injected: `fail` (answer an error), `sleep` (answer late) or `exit`
(the process dies) on the n-th call of an endpoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


class _State:
    def __init__(self, tp_size: int, device: str, faults: dict):
        self.tp_size, self.device, self.faults = tp_size, device, faults
        self.lock = threading.Lock()
        self.weights: dict[int, dict[str, tuple[str, str, list]]] = {r: {} for r in range(tp_size)}
        self.versions: list[str] = []
        self.calls: list[tuple[str, dict]] = []
        self.counts: dict[str, int] = {}
        self.paused = False
        self.flushes = 0
        self.group = None
        self.timeout = None
        self.worker = None

    def record(self, rank: int, named):
        for name, t in named:
            self.weights[rank][name] = (digest(t), str(t.dtype).removeprefix("torch."), list(t.shape))


class _FakeModel:
    def __init__(self, state: _State):
        self.state = state

    def load_weights(self, weights):
        self.state.record(0, weights)


def _make_worker(state: _State):
    from mcore2hf.senders.vllm import MCore2HFWorkerExtension

    class Worker(MCore2HFWorkerExtension):
        pass

    w = Worker()
    w.device = torch.device(state.device)
    w.model_runner = SimpleNamespace(model=_FakeModel(state))
    return w


def _handler(state: _State):
    from mcore2hf.senders.receiver import packed_nbytes, tight_views
    from mcore2hf.senders.serialize import deserialize

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, ok: bool, message: str = "", extra: dict | None = None):
            body = json.dumps({"success": ok, "message": message, **(extra or {})}).encode()
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/mcore2hf_state":
                with state.lock:
                    out = {"weights": {str(r): w for r, w in state.weights.items()}, "versions": state.versions,
                           "calls": [c for c, _ in state.calls], "paused": state.paused, "flushes": state.flushes,
                           "bodies": {c: keys for c, keys in state.calls}}
                body = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._reply(False, "not found")

        def do_POST(self):
            if state.device.startswith("cuda"):  # the current device is per thread: each request has its own
                torch.cuda.set_device(torch.device(state.device))
            path = self.path
            n = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(n) or b"{}")
            with state.lock:
                state.counts[path] = state.counts.get(path, 0) + 1
                count = state.counts[path]
                state.calls.append((path, sorted(req)))
            fault = state.faults.get(path)
            if fault and fault[1] == count:
                kind = fault[0]
                if kind == "fail":
                    return self._reply(False, f"injected failure on call {count} of {path}")
                if kind == "sleep":
                    time.sleep(fault[2])
                if kind == "exit":
                    os._exit(17)
            try:
                handler = getattr(self, "_" + path.strip("/").replace("/", "_"))
            except AttributeError:
                return self._reply(False, f"unknown endpoint {path}")
            try:
                extra = handler(req) or {}
            except Exception as e:  # noqa: BLE001 - SGLang answers errors, it does not crash
                return self._reply(False, f"{type(e).__name__}: {e}")
            self._reply(True, "Success", extra)

        def _update_weights_from_tensor(self, req):
            items = req["serialized_named_tensors"]
            if len(items) != state.tp_size:
                raise ValueError(f"{len(items)} payloads for an engine of TP size {state.tp_size}")
            if req.get("load_format") != "flattened_bucket":
                raise ValueError(f"load_format {req.get('load_format')!r}")
            for rank, item in enumerate(items):  # what SGLang's TP rank `rank` does with its entry
                obj = deserialize(item)
                flat, meta = obj["flattened_tensor"], obj["metadata"]
                named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in meta]
                state.record(rank, named)
            state.versions.append(req.get("weight_version"))

        def _init_weights_update_group(self, req):
            from datetime import timedelta

            from mcore2hf.senders.process_group import join_weight_update_group

            state.timeout = timedelta(seconds=60)
            state.group = join_weight_update_group(req["master_address"], req["master_port"], req["rank_offset"],
                                                   req["world_size"], req["group_name"], req["backend"], state.timeout)

        def _update_weights_from_distributed(self, req):
            from mcore2hf.senders.process_group import broadcast

            if req.get("load_format") != "flattened_bucket":
                raise ValueError(f"load_format {req.get('load_format')!r}")
            flat = torch.empty(packed_nbytes(req["dtypes"], req["shapes"]), dtype=torch.uint8, device=state.device)
            broadcast(flat, state.group, state.timeout)
            state.record(0, tight_views(flat, req["names"], req["dtypes"], req["shapes"]))
            state.versions.append(req.get("weight_version"))

        def _pause_generation(self, req):
            state.paused = True

        def _continue_generation(self, req):
            state.paused = False

        def _flush_cache(self, req):
            state.flushes += 1

        def _collective_rpc(self, req):
            if state.worker is None:
                state.worker = _make_worker(state)
            args = pickle.loads(base64.b64decode(req["args"]))
            result = getattr(state.worker, req["method"])(*args)
            if req["method"] != "mcore2hf_init_group":
                state.versions.append(str(args[-1]))
            return {"result": result}

    return Handler


def serve(port: int, tp_size: int = 1, device: str = "cpu", faults: dict | None = None, ready=None) -> None:
    """Run the fake engine (blocking). `faults`: {endpoint: ("fail" | "sleep" | "exit", nth call[, seconds])}."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    state = _State(tp_size, device, faults or {})
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(state))
    if ready is not None:
        ready.set()
    server.serve_forever()


class EngineProcess:
    """A fake engine in a spawned process, with an SGLangHTTPEngine-compatible client and a vLLM-like
    `collective_rpc`."""

    def __init__(self, tp_size: int = 1, device: str = "cpu", faults: dict | None = None, port: int | None = None):
        import multiprocessing as mp

        from .world import free_port

        self.port = port or free_port()
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self.proc = ctx.Process(target=serve, args=(self.port, tp_size, device, faults, ready), daemon=True)
        self.proc.start()
        if not ready.wait(60):
            raise RuntimeError("fake engine did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 60.0):
        from mcore2hf.senders.sglang import SGLangHTTPEngine

        return SGLangHTTPEngine(self.url, timeout=timeout)

    def state(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/mcore2hf_state", timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


class HTTPCollectiveRPC:
    """vLLM's `collective_rpc(method, args=...)` over HTTP to an EngineProcess (for tests)."""

    def __init__(self, url: str, timeout: float = 60.0):
        self.client = __import__("mcore2hf.senders.sglang", fromlist=["SGLangHTTPEngine"]).SGLangHTTPEngine(url, timeout)

    def collective_rpc(self, method: str, args=()):
        return self.client._post("/collective_rpc", {"method": method,
                                                     "args": base64.b64encode(pickle.dumps(args)).decode()})
