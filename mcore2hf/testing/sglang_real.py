"""SGLang's own code on CPU, for contract tests: one published release per process (its unpacked wheel first on
sys.path), with the GPU-only and heavy third-party imports it cannot load here replaced by permissive stubs.

Only sglang's modules run for real; a stub stands in for any module that is not installed (kernels, triton, CUDA
bindings, ...). `python -m mcore2hf.testing.sglang_real SITE_DIR` serves the release's own FastAPI app
(entrypoints/http_server.py: its routes, request validation, reply formats, API-key middleware) on 127.0.0.1 port 0
(the port is printed as `PORT <n>`), behind a tokenizer manager that hands each request to the release's own
scheduler-side code: the weight-updater component (session checks, >= 0.5.20 layout) or scheduler mixin (older),
the TP worker's deserialization (its SafeUnpickler, patch_torch's UUID-aware CUDA rebuild), the model runner's
flattened-bucket rebuild and its weight-update group (init_custom_process_group, gloo) with the distributed receive.
The model is a recorder: every tensor given to `load_weights` is hashed; GET /mcore2hf_state returns the hashes.
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


def install(site_dir: str) -> None:
    """Put one release's unpacked wheel first on sys.path and stub what it cannot import here."""
    if any(m == "sglang" or m.startswith("sglang.") for m in sys.modules):
        raise RuntimeError("sglang is already imported in this process: one release per process")
    sys.path.insert(0, site_dir)
    # load what torch and transformers import lazily while triton & co are still absent: with stubs in
    # sys.modules they would take them for the real packages
    import torch._dynamo  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.utils  # noqa: F401
    import transformers

    for name in ("AutoProcessor", "AutoImageProcessor", "AutoTokenizer", "AutoConfig", "PretrainedConfig",
                 "AutoModel", "AutoFeatureExtractor"):
        getattr(transformers, name)
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
    """One SGLang server of `tp_size` ranks, each rank's scheduler-side objects built from the release's code."""

    def __init__(self, tp_size: int = 1, api_key: str | None = None):
        import types as _t

        import torch.distributed as dist
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.scheduler_components import weight_updater as sched_wu
        from sglang.srt.model_executor.model_runner_components import weight_updater as runner_wu
        from sglang.srt.utils import common
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.version import __version__

        if not dist.is_initialized():  # WeightUpdater.init_weights_update_group asserts a default group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.version, self.tp_size, self.api_key = __version__, tp_size, api_key
        self.io, self.common = io_struct, common
        self.weights: dict[int, dict] = {r: {} for r in range(tp_size)}
        self.versions: list[str] = []
        self.calls: list[str] = []
        self.paused = False
        self.ranks = []
        for rank in range(tp_size):
            ps = _t.SimpleNamespace(tp_rank=rank, tp_size=tp_size, dp_size=1, num_dp_ranks=1,
                                    tp_group=_t.SimpleNamespace(cpu_group=None))
            model = _recorder(self.weights[rank])
            updater = runner_wu.WeightUpdater(
                tp_rank=rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                get_model=lambda m=model: m, update_model_fields=lambda *a, **k: None,
                recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
            runner = _t.SimpleNamespace(weight_updater=updater, model=model)
            worker = _Worker(rank, runner, common, monkey_patch_torch_reductions)
            scheduler = _t.SimpleNamespace(record_weight_version_change=lambda new_version: None)
            import dataclasses

            cls = sched_wu.SchedulerWeightUpdaterManager
            extra = {"tp_cpu_group": None} if any(f.name == "tp_cpu_group" and f.init
                                                  for f in dataclasses.fields(cls)) else {}  # 0.5.20: an argument
            manager = _with_parallel(sched_wu, ps, lambda w=worker, s=scheduler, cls=cls, extra=extra: cls(
                tp_worker=w, draft_worker=None, memory_saver_adapter=None, flush_cache=lambda **k: True,
                is_fully_idle=lambda **k: True, scheduler=s, **extra))
            self.ranks.append((ps, manager, runner_wu))
        self._patch_runtime(runner_wu)

    @staticmethod
    def _patch_runtime(runner_wu):
        import types as _t

        if hasattr(runner_wu, "get_model"):  # weight cache off (runtime_context.get_model().weight_cache_mode)
            runner_wu.get_model = lambda: _t.SimpleNamespace(weight_cache_mode="off")

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

    def call(self, method: str, req):
        """Run `method` of every rank's scheduler-side manager; merge as FanOutCommunicator.merge_results does."""
        import threading

        import sglang.srt.managers.scheduler_components.weight_updater as sched_wu

        outs: list = [None] * len(self.ranks)

        def run(i, ps, manager, runner_wu):  # ranks run concurrently, as a group rendezvous and broadcast need
            try:
                outs[i] = getattr(manager, method)(req)
            except Exception as e:  # noqa: BLE001 - recorded as the rank's failure
                import types as _t

                outs[i] = _t.SimpleNamespace(success=False, message=f"{type(e).__name__}: {e}")

        parallel = _RankLocal(sched_wu, self.ranks[0][2])
        threads = []
        for i, (ps, manager, runner_wu) in enumerate(self.ranks):
            t = threading.Thread(target=parallel.run, args=(ps, run, i, ps, manager, runner_wu))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        ok = all(o.success for o in outs)
        return ok, next((o.message for o in outs if not o.success), outs[0].message)


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


class _RankLocal:
    """`get_parallel` of the release's modules answering the calling thread's rank."""

    def __init__(self, *modules):
        import threading

        self.local = threading.local()
        for m in modules:
            m.get_parallel = lambda: self.local.ps

    def run(self, ps, fn, *args):
        self.local.ps = ps
        fn(*args)


def _with_parallel(module, ps, fn, extra=()):
    """Run fn with the modules' `get_parallel` answering this rank's parallel state."""
    mods = (module, *extra)
    saved = [getattr(m, "get_parallel", None) for m in mods]
    for m in mods:
        m.get_parallel = lambda: ps
    try:
        return fn()
    finally:
        for m, s in zip(mods, saved):
            if s is not None:
                m.get_parallel = s


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
                return self._send(200, {"weights": {str(r): w for r, w in engine.weights.items()},
                                        "versions": engine.versions, "calls": engine.calls, "paused": engine.paused,
                                        "version": __version__})
            if self.path in routes and self.path.endswith("server_info"):
                if engine is not None:
                    engine.calls.append(self.path)
                return self._send(200, {"version": __version__, "tp_size": tp_size, "dp_size": 1,
                                        "internal_states": []})
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            if not self._auth():
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path = self.path
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
