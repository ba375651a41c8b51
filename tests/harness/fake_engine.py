"""A stand-in for an SGLang server on GPUs, run as a separate process: bench/gpu_senders.py only, because SGLang's GPU
stack cannot be installed on the GPU machines. The tests do not use it: they run each release's own code on CPU
(harness.sglang_real, tests/test_sglang_contract.py), failures and retries included.

It serves SGLang's weight-sync endpoints with SGLang's semantics: payloads are deserialized with a restricted
unpickler like SGLang's, flattened buckets are rebuilt as SGLang's scheduler rebuilds them (views
`flat[start:end].view(dtype).reshape(shape)`), the distributed path joins the weight-update group as SGLang's
`init_custom_process_group` does and receives into a buffer laid out from names / dtypes / shapes in request order.
(vLLM is tested against vLLM's own code only: tests/test_vllm_contract.py.)

It is no more lenient than the real releases in what tests/test_sglang_contract.py checks against their wheels
(`version` picks the release it behaves as): routes present per release (/server_info from 0.5.6, the session
routes from 0.5.21), update sessions required from 0.5.21 (400 with SGLang's message otherwise, without joining a
broadcast), each route's reply format (plain-text /flush_cache, {message, status} for pause / continue, {success,
message} with HTTP 400 for the update routes), CUDA IPC handles that must name the GPU by UUID (stricter than
SGLang, which also takes an index), an exact-allowlist unpickler, `Authorization: Bearer` when
started with an API key (401 otherwise), and dp_size / tp_size reported by the server info.

Every received tensor is recorded as a SHA-256 of its bytes, per engine TP rank, with the weight version; GET
/mcore2hf_state returns them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _release(version: str) -> tuple[int, int, int]:
    from mcore2hf.senders.sglang import parse_version

    return parse_version(version)


class _State:
    def __init__(self, tp_size: int, device: str, version: str = "0.5.23", dp_size: int = 1,
                 api_key: str | None = None):
        self.tp_size, self.device = tp_size, device
        self.version, self.release, self.dp_size, self.api_key = version, _release(version), dp_size, api_key
        self.session = False
        self.groups: dict = {}
        self.lock = threading.Lock()
        self.weights: dict[int, dict[str, tuple[str, str, list]]] = {r: {} for r in range(tp_size)}
        self.versions: list[str] = []
        self.calls: list[tuple[str, dict]] = []
        self.paused = False
        self.flushes = 0
        self.group = None
        self.timeout = None

    def record(self, rank: int, named):
        for name, t in named:
            self.weights[rank][name] = (digest(t), str(t.dtype).removeprefix("torch."), list(t.shape))


class _UUIDOnlyUnpickler:
    """Our restricted unpickler, refusing CUDA IPC handles that name the GPU by index instead of UUID."""

    @staticmethod
    def loads(data):
        import io

        from mcore2hf.senders import serialize as ser

        class Strict(ser.RestrictedUnpickler):
            def find_class(self, module, name):
                fn = super().find_class(module, name)
                if fn is ser.rebuild_cuda_tensor_by_uuid:
                    def checked(*args):
                        if not isinstance(args[ser.DEVICE_ARG], str):
                            raise ValueError(f"CUDA IPC handle names device {args[ser.DEVICE_ARG]!r}, not a GPU UUID")
                        return fn(*args)
                    return checked
                return fn

        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return Strict(io.BytesIO(data)).load()


def _handler(state: _State):
    from mcore2hf.senders.receiver import packed_nbytes, tight_views

    SESSIONS = state.release >= (0, 5, 21)
    routes = {"/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
              "/destroy_weights_update_group", "/pause_generation", "/continue_generation", "/flush_cache"} | ({"/begin_weight_update", "/end_weight_update"} if SESSIONS else set())
    texts = {"/flush_cache"}  # plain-text replies (sglang http_server.py flush_cache)
    statuses = {"/pause_generation", "/continue_generation"}  # {"message", "status": "ok"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, ok: bool, message: str = "", extra: dict | None = None, code: int | None = None):
            if self.path in texts and code is None:
                body, ctype = (message or "Cache flushed.\n").encode(), "text/plain"
            elif self.path in statuses and ok and code is None:
                body, ctype = json.dumps({"message": message, "status": "ok"}).encode(), "application/json"
            else:
                body = json.dumps({"success": ok, "message": message, **(extra or {})}).encode()
                ctype = "application/json"
            self.send_response(code or (200 if ok else 400))
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            if state.api_key and self.headers.get("Authorization") != f"Bearer {state.api_key}":
                self._reply(False, "Unauthorized", code=401)
                return False
            return True

        def do_GET(self):
            if self.path in ("/server_info", "/get_server_info"):
                if not self._authorized():
                    return None
                if self.path == "/server_info" and state.release < (0, 5, 6):
                    return self._reply(False, "Not Found", code=404)
                with state.lock:
                    state.calls.append((self.path, []))
                body = json.dumps({"version": state.version, "tp_size": state.tp_size,
                                   "dp_size": state.dp_size}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            if self.path == "/mcore2hf_state":
                with state.lock:
                    out = {"weights": {str(r): w for r, w in state.weights.items()}, "versions": state.versions,
                           "calls": [c for c, _ in state.calls], "paused": state.paused, "flushes": state.flushes,
                           "bodies": {c: keys for c, keys in state.calls}, "session": state.session,
                           "groups": sorted(state.groups)}
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
            if not self._authorized():
                return None
            if path not in routes:
                return self._reply(False, "Not Found", code=404)
            with state.lock:
                state.calls.append((path, sorted(req)))
            try:
                handler = getattr(self, "_" + path.strip("/").replace("/", "_"))
            except AttributeError:
                return self._reply(False, f"unknown endpoint {path}")
            try:
                extra = handler(req) or {}
            except Exception as e:  # noqa: BLE001 - SGLang answers errors, it does not crash
                return self._reply(False, f"{type(e).__name__}: {e}")
            self._reply(True, "Success", extra)

        def _need_session(self, what: str):
            if SESSIONS and not state.session:  # sglang 0.5.23 scheduler_components/weight_updater.py
                raise RuntimeError(f"{what} must run between begin_weight_update() and end_weight_update()")

        def _begin_weight_update(self, req):
            if state.session:
                raise RuntimeError("a weight-update session is already open; call end_weight_update() first")
            state.session = True

        def _end_weight_update(self, req):
            if not state.session:
                raise RuntimeError("no weight-update session is open; call begin_weight_update() first")
            state.session = False

        def _update_weights_from_tensor(self, req):
            self._need_session("update_weights_from_tensor")
            items = req["serialized_named_tensors"]
            if len(items) != state.tp_size:
                raise ValueError(f"{len(items)} payloads for an engine of TP size {state.tp_size}")
            if req.get("load_format") != "flattened_bucket":
                raise ValueError(f"load_format {req.get('load_format')!r}")
            for rank, item in enumerate(items):  # what SGLang's TP rank `rank` does with its entry
                obj = _UUIDOnlyUnpickler.loads(item)
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
            state.groups[req["group_name"]] = state.group

        def _destroy_weights_update_group(self, req):
            from mcore2hf.senders.process_group import destroy_group

            name = req.get("group_name", "weight_update_group")
            if name not in state.groups:
                raise RuntimeError("The group to be destroyed does not exist.")
            destroy_group(state.groups.pop(name))

        def _update_weights_from_distributed(self, req):
            from mcore2hf.senders.process_group import broadcast

            self._need_session("update_weights_from_distributed")
            if req.get("group_name") not in state.groups:
                raise RuntimeError(f"Group {req.get('group_name')} not in {sorted(state.groups)}")
            state.group = state.groups[req["group_name"]]
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

        def _flush_cache(self, req):  # no request is ever queued here: the flush always happens
            state.flushes += 1

    return Handler


def serve(port: int, tp_size: int = 1, device: str = "cpu", ready=None, options: dict | None = None) -> None:
    """Run the fake engine (blocking). `options`: version, dp_size, api_key."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    state = _State(tp_size, device, **(options or {}))
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(state))  # port 0: the OS picks one
    if ready is not None:
        ready.put(server.server_address[1])
    server.serve_forever()


class EngineProcess:
    """A fake engine in a spawned process, with an SGLangHTTPEngine client. It listens on a port the OS picks."""

    def __init__(self, tp_size: int = 1, device: str = "cpu", port: int | None = None, **options):
        import multiprocessing as mp
        import queue

        self.api_key = options.get("api_key")
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self.proc = ctx.Process(target=serve, args=(port or 0, tp_size, device, ready, options), daemon=True)
        self.proc.start()
        try:
            self.port = ready.get(timeout=60)
        except queue.Empty:
            raise RuntimeError("fake engine did not start") from None
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 60.0):
        from mcore2hf.senders.sglang import SGLangHTTPEngine

        return SGLangHTTPEngine(self.url, timeout=timeout, api_key=self.api_key)

    def state(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/mcore2hf_state", timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
