"""SGLang's own code on CPU, for contract tests: one published release per process (its unpacked wheel first on
sys.path), with the GPU-only and heavy third-party imports it cannot load here replaced by permissive stubs.

Only sglang's modules run for real; a stub stands in for any module that is not installed (kernels, triton, CUDA
bindings, ...). `python -m mcore2hf.testing.sglang_real SITE_DIR --tp N` serves, on 127.0.0.1 port 0 (printed as
`PORT <n>`), a small HTTP front end whose routes and replies follow the release's entrypoints/http_server.py (which
routes exist is read from it; API-key check as utils/auth.py) and which builds each request with the release's
request types (io_struct). As in SGLang, each engine TP rank is its own scheduler process: rank 0 gets the request
and passes it to the other ranks with the release's broadcast_pyobj; every rank runs the release's scheduler-side
code: the weight-updater component (session checks, >= 0.5.20 layout), the TP worker's deserialization (its
SafeUnpickler, patch_torch's UUID-aware CUDA rebuild), the model runner's flattened-bucket rebuild and its
weight-update group (init_weights_update_group at rank_offset + tp_rank, init_custom_process_group, gloo) with the
distributed receive. The model is a recorder: every tensor given to `load_weights` is hashed; GET /mcore2hf_state
returns the hashes per rank, POST /mcore2hf_reset forgets them (the harness' own routes).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# Top-level packages sglang imports that are GPU-only or not needed for the weight-update path; any other missing
# module is stubbed too (see _StubFinder), these are stubbed even when installed, so the test is hermetic.
ALWAYS_STUB = ("sgl_kernel", "triton", "flashinfer", "vllm", "cuda", "pynvml", "deep_gemm", "torchao", "xgrammar",
               "outlines", "llguidance", "decord", "torch_memory_saver", "zmq", "setproctitle", "uvloop", "nvtx",
               "tiktoken", "sentencepiece", "openai", "partial_json_parser", "compressed_tensors", "datasets",
               "sglang.kernels", "sglang.jit_kernel", "flash_attn", "mooncake", "nixl", "aiter", "quack",
               "cutlass", "cuda_python", "numba", "msgpack_numpy", "interegular", "hf_transfer", "soundfile",
               "av", "cv2", "prometheus_client", "grpc", "einops",
               "timm", "blobfile", "modelscope", "gguf", "accelerate", "peft", "scipy", "pandas", "sklearn",
               "matplotlib", "IPython", "ray", "kernels", "tilelang", "apache_tvm_ffi", "tvm_ffi", "cuda_bindings",
               "nvidia", "sglang_router", "smg_grpc_proto", "opentelemetry", "py_spy", "torchvision", "torchaudio",
               "triton_kernels", "flashinfer_python", "mamba_ssm", "causal_conv1d", "fla", "gpustat")


class _Stub(types.ModuleType):
    """A module, class, function and value at once: any attribute, call, subclass or decoration works."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []  # a package: submodules import as stubs too
        self.__file__ = f"<stub {name}>"
        self.__version__ = "0.0.0"

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        child = _Stub(f"{self.__name__}.{attr}")
        setattr(self, attr, child)
        return child

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):  # a decorator: keep the decorated function
            return args[0]
        return _Stub(f"{self.__name__}()")

    def __get_pydantic_core_schema__(self, source, handler):  # a stub used as a field type accepts anything
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __mro_entries__(self, bases):  # `class X(stub.Base)` works
        return (_StubBase,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __or__(self, other):  # `stub.Type | None` in annotations evaluated at runtime
        return self

    __ror__ = __or__

    def __getitem__(self, item):
        return self

    def __setitem__(self, key, value):
        pass

    def __delitem__(self, key):
        pass

    def __contains__(self, item):
        return False

    def __len__(self):
        return 0

    def __float__(self):
        return 0.0

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __lt__(self, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __eq__(self, other):
        return other is self

    def __hash__(self):
        return id(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _StubBase:
    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    """First: stubs for ALWAYS_STUB. Last: a stub for any other module no finder could find (never for sglang's
    own modules, which must be real)."""

    def __init__(self, last: bool):
        self.last = last

    def find_spec(self, fullname, path, target=None):
        if fullname == "sglang" or fullname.startswith("sglang.") and not fullname.startswith(ALWAYS_STUB):
            return None
        forced = any(fullname == p or fullname.startswith(p + ".") for p in ALWAYS_STUB)
        # only sglang's imports get stubs: others' availability probes (find_spec, try/except ImportError) must
        # still see what is really installed
        if self.last == forced or not _imported_by_sglang():
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


def _imported_by_sglang() -> bool:
    f = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        f = f.f_back
    return f is not None and f.f_globals.get("__name__", "").startswith("sglang")


# Modules (and transformers' lazy attributes) that import triton & co. lazily; preloaded by install().
PRELOAD = ("torch._dynamo", "torch._inductor.codecache", "torch._inductor.utils", "transformers")
PRELOAD_TRANSFORMERS = ("AutoProcessor", "AutoImageProcessor", "AutoTokenizer", "AutoConfig", "PretrainedConfig",
                        "AutoModel", "AutoFeatureExtractor")


def install(site_dir: str) -> None:
    """Put one release's unpacked wheel first on sys.path and stub what it cannot import here."""
    if any(m == "sglang" or m.startswith("sglang.") for m in sys.modules):
        raise RuntimeError("sglang is already imported in this process: one release per process")
    sys.path.insert(0, site_dir)
    # load what torch and transformers import lazily while triton & co are still absent: with stubs in
    # sys.modules they would take them for the real packages. A name another torch/transformers lacks is skipped.
    import importlib

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:
            continue
    transformers = sys.modules.get("transformers")
    for name in PRELOAD_TRANSFORMERS if transformers else ():
        try:
            getattr(transformers, name)
        except (ImportError, AttributeError):
            continue
    sys.meta_path.insert(0, _StubFinder(last=False))
    sys.meta_path.append(_StubFinder(last=True))


# ---------------------------------------------------------------------------------------------------------------
# The engine: the release's scheduler-side weight-update code behind a small HTTP front end. The front end's
# replies follow the release's http_server.py route bodies (cited per route); the request types, session checks,
# unpickler, UUID-aware CUDA rebuild, flattened-bucket rebuild and group / broadcast receive are the release's own.


def _digest(t) -> str:
    import hashlib

    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _recorder(store: dict):
    """The model: an empty torch module whose load_weights hashes every tensor it is given (per TP rank)."""
    import torch

    class Recorder(torch.nn.Module):
        def load_weights(self, weights):
            _Recorder.load_weights(self, weights)

    m = Recorder()
    m.store = store
    return m


class _Recorder:

    def load_weights(self, weights):
        for name, t in weights:
            self.store[name] = (_digest(t), str(t.dtype).removeprefix("torch."), list(t.shape))


class Engine:
    """One SGLang server of `tp_size` ranks laid out as SGLang runs them: this (HTTP / tokenizer-manager) process
    and one scheduler process per engine TP rank (forked once the release's code is loaded). The tokenizer side
    hands each request to scheduler rank 0, which passes it to the other TP ranks with the release's
    broadcast_pyobj over the TP CPU group (managers/scheduler_components/request_receiver.py, 0.5.23;
    scheduler.py recv_requests, 0.5.20); every rank runs the release's scheduler-side method. Each rank's default
    process group is the engine's TP world (gloo), so the release's barriers and its init_weights_update_group
    (one group per process, joined at rank_offset + tp_rank) run as in SGLang."""

    def __init__(self, tp_size: int = 1, api_key: str | None = None, timeout: float = 300.0):
        import multiprocessing
        import tempfile

        from sglang.srt.managers import io_struct
        from sglang.srt.utils import common
        from sglang.version import __version__

        self.version, self.tp_size, self.api_key, self.timeout = __version__, tp_size, api_key, timeout
        self.io, self.common = io_struct, common
        self.versions: list[str] = []
        self.calls: list[str] = []
        self.paused = False
        # fork: each rank starts with the release's code already imported (a spawned start re-imports it, ~10 s
        # a rank on this machine); no thread has been started in this process yet
        ctx = multiprocessing.get_context("fork")
        init = f"file://{tempfile.mkdtemp(prefix='sglang-tp-')}/store"
        pipes = [ctx.Pipe() for _ in range(tp_size)]
        self.conns = [parent for parent, _ in pipes]
        self.procs = [ctx.Process(target=_scheduler_main, args=(r, tp_size, init, pipes[r][1]), daemon=True)
                      for r in range(tp_size)]
        for p in self.procs:
            p.start()
        for r, conn in enumerate(self.conns):
            ok, message = self._answer(r, conn)
            if not ok:
                raise RuntimeError(f"engine TP rank {r} did not start: {message}")

    def _answer(self, rank: int, conn) -> tuple[bool, object]:
        if not conn.poll(self.timeout):
            return False, f"engine TP rank {rank} did not answer within {self.timeout} s"
        try:
            return conn.recv()
        except EOFError:
            return False, f"engine TP rank {rank} exited (exit code {self.procs[rank].exitcode})"

    def request(self, cls_name: str, body: dict):
        """The release's request type built from the JSON body, as its HTTP layer validates it."""
        cls = getattr(self.io, cls_name)
        try:
            import msgspec

            if isinstance(cls, type) and issubclass(cls, msgspec.Struct):  # >= 0.5.21: msgspec structs
                # array-like on the wire to the scheduler: build by keyword, then let msgspec check the types
                return msgspec.convert(msgspec.to_builtins(cls(**body)), cls)
        except ImportError:
            pass
        return cls(**body)  # dataclasses (<= 0.5.20)

    def call(self, method: str, req) -> tuple[bool, object]:
        """Run `method` on every TP rank (request to rank 0, which broadcasts it). Success when every rank
        succeeds (stricter than SGLang, whose reply is rank 0's); the message is the first failure's, or rank
        0's (for the harness' own state query, every rank's answer)."""
        self.conns[0].send([(method, req)])
        outs = [self._answer(r, c) for r, c in enumerate(self.conns)]
        if method == _STATE:
            return all(o[0] for o in outs), [o[1] for o in outs]
        ok = all(o[0] for o in outs)
        return ok, next((o[1] for o in outs if not o[0]), outs[0][1])


_STATE, _RESET = "mcore2hf_state", "mcore2hf_reset"  # the harness' own requests (not SGLang's)


class _Rank:
    """One engine TP rank's scheduler-side objects, built from the release's code in the rank's own process:
    >= 0.5.20: SchedulerWeightUpdaterManager over a TP worker (_Worker) over a model runner with the release's
    WeightUpdater; older: the release's SchedulerUpdateWeightsMixin, TpModelWorker and ModelRunner methods (objects
    made without their GPU __init__). The model is a recorder."""

    def __init__(self, rank: int, tp_size: int):
        import importlib.util
        import types as _t

        import torch.distributed as dist

        group = dist.group.WORLD  # the engine's TP world: in SGLang the TP group's CPU (gloo) group
        self.weights: dict = {}
        model = _recorder(self.weights)
        if importlib.util.find_spec("sglang.srt.managers.scheduler_components") is None:
            self.manager = self._before_0_5_20(rank, group, model)
            return
        import dataclasses

        from sglang.srt.managers.scheduler_components import weight_updater as sched_wu
        from sglang.srt.model_executor.model_runner_components import weight_updater as runner_wu
        from sglang.srt.utils import common
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        ps = _t.SimpleNamespace(tp_rank=rank, tp_size=tp_size, dp_size=1, num_dp_ranks=1,
                                tp_group=_t.SimpleNamespace(cpu_group=group, rank=rank, ranks=list(range(tp_size))))
        for m in (sched_wu, runner_wu):  # runtime_context.get_parallel(): this process's rank
            m.get_parallel = lambda: ps
        if hasattr(runner_wu, "get_model"):  # weight cache off (runtime_context.get_model().weight_cache_mode)
            runner_wu.get_model = lambda: _t.SimpleNamespace(weight_cache_mode="off")
        updater = runner_wu.WeightUpdater(
            tp_rank=rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
            get_model=lambda: model, update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
        worker = _Worker(rank, _t.SimpleNamespace(weight_updater=updater, model=model), common,
                         monkey_patch_torch_reductions)
        scheduler = _t.SimpleNamespace(record_weight_version_change=lambda new_version: None)
        cls = sched_wu.SchedulerWeightUpdaterManager
        extra = {"tp_cpu_group": group} if any(f.name == "tp_cpu_group" and f.init
                                               for f in dataclasses.fields(cls)) else {}  # 0.5.20: an argument
        self.manager = cls(tp_worker=worker, draft_worker=None, memory_saver_adapter=None,
                           flush_cache=lambda **k: True, is_fully_idle=lambda **k: True, scheduler=scheduler,
                           **extra)

    @staticmethod
    def _before_0_5_20(rank: int, group, model):
        """0.5.6-0.5.19 layout (read in 0.5.10): scheduler_update_weights_mixin.py, tp_worker.py, model_runner.py."""
        import types as _t

        from sglang.srt.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.model_executor.model_runner import ModelRunner

        runner = ModelRunner.__new__(ModelRunner)
        runner.__dict__.update(model=model, device="cpu", tp_rank=rank, _model_update_group={},
                               server_args=_t.SimpleNamespace(custom_weight_loader=[]))
        worker = TpModelWorker.__new__(TpModelWorker)
        worker.__dict__.update(_model_runner=runner, tp_rank=rank)  # model_runner: a property

        class Scheduler(SchedulerUpdateWeightsMixin):
            pass

        scheduler = Scheduler()
        scheduler.__dict__.update(tp_worker=worker, draft_worker=None, tp_cpu_group=group,
                                  memory_saver_adapter=None, flush_cache=lambda: True, is_fully_idle=lambda: True)
        return scheduler

    def handle(self, method: str, req) -> tuple[bool, object]:
        if method == _STATE:
            return True, dict(self.weights)
        if method == _RESET:
            self.weights.clear()
            return True, ""
        try:
            out = getattr(self.manager, method)(req)
            return bool(out.success), out.message
        except Exception as e:  # noqa: BLE001 - recorded as the rank's failure
            return False, f"{type(e).__name__}: {e}"


def _scheduler_main(rank: int, tp_size: int, init_method: str, conn) -> None:
    """A scheduler process: join the TP world, then serve requests until the pipe closes."""
    import ctypes
    import signal

    import torch.distributed as dist
    from sglang.srt.utils import broadcast_pyobj

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server process
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=tp_size)
        r = _Rank(rank, tp_size)
    except Exception as e:  # noqa: BLE001 - reported to the server process
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    conn.send((True, "ready"))
    while True:
        if rank == 0:
            try:
                reqs = conn.recv()
            except EOFError:
                reqs = [(None, None)]
        else:
            reqs = None
        if tp_size > 1:  # scheduler rank 0 passes the requests to the other TP ranks
            reqs = broadcast_pyobj(reqs, rank, dist.group.WORLD, src=0)
        method, req = reqs[0]
        if method is None:
            return
        conn.send(r.handle(method, req))


class _Worker:
    """The TP worker's weight-update methods, as managers/tp_worker.py writes them (0.5.20 and 0.5.23)."""

    def __init__(self, rank, runner, common, patch):
        self.rank, self.model_runner, self.common, self.patch = rank, runner, common, patch

    def weight_update_runners(self):  # 0.5.23
        return [("target", self.model_runner)]

    def deserialize_own_rank(self, serialized_named_tensors):  # 0.5.23 tp_worker.deserialize_own_rank
        self.patch()
        return self.common.MultiprocessingSerializer.deserialize(serialized_named_tensors[self.rank])

    def init_weights_update_group(self, r):
        return self.model_runner.weight_updater.init_weights_update_group(
            r.master_address, r.master_port, r.rank_offset, r.world_size, r.group_name, r.backend)

    def destroy_weights_update_group(self, r):
        return self.model_runner.weight_updater.destroy_weights_update_group(r.group_name)

    def update_weights_from_distributed(self, r):  # 0.5.20
        return self.model_runner.weight_updater.update_weights_from_distributed(
            r.names, r.dtypes, r.shapes, r.group_name, r.load_format)

    def update_weights_from_tensor(self, r):  # 0.5.20
        return self.model_runner.weight_updater.update_weights_from_tensor(
            named_tensors=self.deserialize_own_rank(r.serialized_named_tensors), load_format=r.load_format)


def _release_has(route: str) -> bool:
    import pathlib

    import sglang

    src = pathlib.Path(sglang.__file__).parent / "srt" / "entrypoints" / "http_server.py"
    return f'"{route}"' in src.read_text()


def serve(site_dir: str, tp_size: int = 1, api_key: str | None = None) -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    install(site_dir)
    from sglang.version import __version__

    supported = tuple(int(x) for x in __version__.split(".")[:3] if x.isdigit()) >= (0, 5, 6)
    engine = Engine(tp_size, api_key) if supported else None
    routes = {r for r in ("/server_info", "/get_server_info", "/begin_weight_update", "/end_weight_update")
              if _release_has(r)}
    tensor_req = "UpdateWeightsFromTensorReqInput"
    posts = {  # route: (request type, manager method)
        "/update_weights_from_tensor": (tensor_req, "update_weights_from_tensor"),
        "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", "update_weights_from_distributed"),
        "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", "init_weights_update_group"),
        "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", "destroy_weights_update_group"),
        "/begin_weight_update": ("BeginWeightUpdateReqInput", "begin_weight_update"),
        "/end_weight_update": ("EndWeightUpdateReqInput", "end_weight_update"),
    }
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body, ctype="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _auth(self) -> bool:  # sglang utils/auth.py: "Authorization: Bearer <api_key>", 401 otherwise
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._send(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            if self.path != "/mcore2hf_state" and not self._auth():  # the test's own route needs no key
                return
            if self.path == "/mcore2hf_state":
                with lock:
                    ok, weights = engine.call(_STATE, None)
                return self._send(200 if ok else 500, {
                    "weights": {str(r): w for r, w in enumerate(weights)}, "versions": engine.versions,
                    "calls": engine.calls, "paused": engine.paused, "version": __version__})
            if self.path in routes and self.path.endswith("server_info"):
                if engine is not None:
                    engine.calls.append(self.path)
                return self._send(200, {"version": __version__, "tp_size": tp_size, "dp_size": 1,
                                        "internal_states": []})
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            if self.path != "/mcore2hf_reset" and not self._auth():  # the test's own route needs no key
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path = self.path
            if path == "/mcore2hf_reset" and engine is not None:  # the test's own route: forget what was recorded
                with lock:
                    ok, message = engine.call(_RESET, None)
                engine.versions.clear()
                engine.calls.clear()
                return self._send(200 if ok else 500, {"success": ok, "message": message})
            if engine is None or (path in posts and path.endswith("weight_update") and path not in routes):
                return self._send(404, {"detail": "Not Found"})
            engine.calls.append(path)
            if path == "/pause_generation":  # http_server.py pause_generation (0.5.6-0.5.23)
                engine.paused = True
                return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
            if path == "/continue_generation":
                engine.paused = False
                return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
            if path == "/flush_cache":  # plain text (http_server.py flush_cache); no request is queued here
                return self._send(200, "Cache flushed.\nPlease check backend logs for more details. (When there "
                                  "are running or waiting requests, the operation will not be performed.)\n",
                                  "text/plain")
            if path not in posts:
                return self._send(404, {"detail": "Not Found"})
            cls_name, method = posts[path]
            try:
                req = engine.request(cls_name, body)
            except Exception as e:  # noqa: BLE001 - FastAPI answers a validation error
                return self._send(422, {"detail": f"{type(e).__name__}: {e}"})
            if path == "/update_weights_from_tensor" and hasattr(engine.common,
                                                                  "normalize_serialized_named_tensor_payloads"):
                req.serialized_named_tensors = engine.common.normalize_serialized_named_tensor_payloads(
                    req.serialized_named_tensors)  # tokenizer side, >= 0.5.21
            with lock:  # the scheduler runs one request at a time
                ok, message = engine.call(method, req)
            if ok and getattr(req, "weight_version", None) is not None:
                engine.versions.append(req.weight_version)
            self._send(200 if ok else 400, {"success": ok, "message": message})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"PORT {server.server_address[1]} VERSION {__version__}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("site_dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--api-key")
    a = ap.parse_args()
    serve(a.site_dir, a.tp, a.api_key)
