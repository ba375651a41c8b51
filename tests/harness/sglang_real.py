"""SGLang's own code on CPU, for contract tests: one published release per process (its unpacked wheel first on
sys.path), with the GPU-only and heavy third-party imports it cannot load here replaced by permissive stubs.

Only sglang's modules run for real; a stub stands in for any module that is not installed (kernels, triton, CUDA
bindings, ...). `python -m harness.sglang_real SITE_DIR --tp N [--port P]` serves, on 127.0.0.1 port P
(0: one the OS picks; printed as `PORT <n>`), a small HTTP front end whose routes and replies follow the release's entrypoints/http_server.py (which
routes exist is read from it; API-key check as utils/auth.py) and which builds each request with the release's
request types (io_struct). As in SGLang, each engine TP rank is its own scheduler process: rank 0 gets the request
and passes it to the other ranks with the release's broadcast_pyobj; every rank runs the release's scheduler-side
code: the weight-updater component (session checks, >= 0.5.20 layout), the TP worker's deserialization (its
SafeUnpickler, patch_torch's UUID-aware CUDA rebuild), the model runner's flattened-bucket rebuild and its
weight-update group (init_weights_update_group at rank_offset + tp_rank, init_custom_process_group, gloo) with the
distributed receive; pause, continue, abort and /flush_cache run the release's Scheduler methods and flush
wrapper. A scheduler that raises or dies ends the server as SGLang's does (run_scheduler_process's SIGQUIT, the
release's SubprocessWatchdog and kill_process_tree). The model is a recorder: every tensor given to `load_weights`
is hashed and kept as the model's parameter of that name, which the release's weight checker reads: POST
/weights_checker (>= 0.5.20 here) runs the release's CheckWeightsReqInput, scheduler-side check_weights,
ModelRunner.check_weights and WeightChecker (utils/weight_checker.py, weight_checker_comparator.py: hashing,
snapshot, reset, comparison), the reply merged by its tokenizer-side check_weights. The harness' own routes (no API key): GET /mcore2hf_state (per rank: the hashes, the release's update
session, weight-update groups, paused flag, queued requests, flushes), POST /mcore2hf_reset (forget the hashes; {"parameters": true}: the model's parameters too),
POST /mcore2hf_fault (arm a fault in the model's load_weights: raise, hang until released or kill the scheduler
process, or "corrupt": load one named tensor with wrong bytes),
POST /mcore2hf_requests (queue requests in the scheduler, the release's Req and _add_request_to_queue).
`--draft mtp|separate` gives each rank's weight updater a speculative worker's draft runner (its own recorder model,
the release's WeightUpdater and WeightChecker), which the release's own fan-out (runner selectors, >= 0.5.21) loads
and checks; /server_info then reports the resolved speculative arguments of an MTP draft (EAGLE, draft path = the
model's) or of a draft model of its own (EAGLE3), and GET /mcore2hf_state the draft's record too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch

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

# Optional modules sglang probes with try/except ImportError and then checks what it got: a stub would pass the
# import and fail the check (0.5.20 layers/moe/token_dispatcher/nixl.py: `from nixl_ep import topk_idx_t`, else
# torch.int64, then asserts a torch.dtype), so these stay absent.
ABSENT = ("nixl_ep",)


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


class _StubBase(torch.nn.Module):
    """What `class X(stub.Base)` derives from. A torch module: sglang's layers subclass stubbed kernel bases and
    register buffers at import time (0.5.23 layers/activation.py: XIELU(BaseFusedOp), built in a module-level
    table that managers/scheduler.py imports)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

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
        if fullname.split(".")[0] in ABSENT:  # left missing: sglang's own `except ImportError` fallback runs
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


# Where the engine's ranks hold their parameters: "cpu" (CI: CPU shared memory stands in for CUDA IPC) or "cuda" /
# "cuda:N" (bench/gpu_ipc.py, bench/gpu_senders.py on lent GPUs: GPU 0 / N of this process; the handles are real
# CUDA IPC, rebuilt by the release's patch_torch; weight-update groups over NCCL there). Set by serve(). On a GPU
# the release's weight checker cannot run here: it hashes CUDA parameters with SGLang's Triton kernel
# (utils/weight_checker.py:255 _hash_tensor -> managers/mm_utils.py:922 tensor_hash -> kernels/ops/memory/
# gpu_tensor_hash.py, 0.5.23), and sglang.kernels stays stubbed: its JIT toolchain does not import from the
# releases' .py files alone (kernels/jit/utils/compile/loader.py:18, seen on an H200).
DEVICE = "cpu"
SITE_DIR = ""  # the release's unpacked wheel (serve())


def sha256_digest(t) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def fingerprint(t: torch.Tensor, chunk: int = 1 << 26) -> str:
    """A cheap digest computed where the tensor lives (GPU or CPU), for syncs too large to sha256 in a bench:
    the byte count, the sum of the bytes and their sum weighted by position (mod a prime), so any changed,
    missing or moved byte changes it (not cryptographic: no adversary here)."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    s1 = s2 = 0
    for start in range(0, b.numel(), chunk):
        x = b[start:start + chunk].to(torch.int64)
        w = torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64) % 1000003 + 1
        s1 += int(x.sum())
        s2 += int((x * w).sum())
    return f"{b.numel()}:{s1}:{s2}"


class Recorder(torch.nn.Module):
    """The model: an empty torch module whose load_weights hashes every tensor it is given (per TP rank), and
    where the harness injects faults (POST /mcore2hf_fault, armed per TP rank): on the `call`-th load_weights call
    after arming, "raise" (the model's loader raises), "hang" (it returns only once the file `release` exists,
    which the server's front end creates when the client's next request arrives, i.e. once the client gave up on
    this one; at the latest after `seconds`, default 600: an engine that does not answer a request before its
    client's timeout, however fast or slow the machine) or "exit" (the scheduler process dies there, as on a
    segfault or an OOM kill). What follows is the release's doing: whether it catches the error, and what its
    server does when a scheduler dies."""

    def __init__(self):
        super().__init__()
        self.store: dict = {}
        self.fault: dict | None = None
        self.corrupt: str | None = None
        self.calls = 0

    def arm(self, fault: dict) -> None:
        if fault["kind"] == "corrupt":  # the next load of tensor `name` writes wrong bytes (+1 on every element)
            self.corrupt = fault["name"]
            return
        self.fault, self.calls = fault, 0

    def _keep(self, name: str, t: torch.Tensor) -> None:
        """The model's parameter `name` (nested modules along the dots, created at its first load) takes the
        loaded bytes, as a model's weight loader copies into its parameter: the release's weight checker reads
        these (named_parameters)."""
        *path, leaf = name.split(".")
        m = self
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        p = m._parameters.get(leaf)
        if p is None or p.shape != t.shape or p.dtype != t.dtype:
            m._parameters[leaf] = torch.nn.Parameter(t.detach().clone(), requires_grad=False)
        else:
            p.data.copy_(t)

    def load_weights(self, weights):
        import os
        import time

        self.calls += 1
        if self.fault is not None and self.calls == self.fault["call"]:
            fault, self.fault = self.fault, None  # once
            kind = fault["kind"]
            if kind == "raise":
                raise RuntimeError(f"mcore2hf fault: load_weights call {self.calls} failed")
            if kind == "hang":
                deadline = time.monotonic() + fault.get("seconds", 600.0)
                while not os.path.exists(fault["release"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if kind == "exit":
                os._exit(17)
        for name, t in weights:
            if name == self.corrupt:
                t, self.corrupt = (t + 1) if t.is_floating_point() else t ^ 1, None
            if DEVICE == "cpu":
                self.store[name] = (sha256_digest(t), str(t.dtype).removeprefix("torch."), list(t.shape))
            else:  # as a model's loader: only the copy into the parameter (timed); hashed when the state is asked
                self.store[name] = None
            self._keep(name, t)

    def digests(self, how: str = "sha256") -> dict:
        """What was loaded since the last reset: name -> (digest, dtype, shape); on GPU taken from the parameters
        the loads copied into (sha256, or `fingerprint` for large syncs)."""
        if DEVICE == "cpu" and how == "sha256":
            return dict(self.store)
        params = dict(self.named_parameters())
        fn = fingerprint if how == "fingerprint" else sha256_digest
        return {n: (fn(params[n]), str(params[n].dtype).removeprefix("torch."), list(params[n].shape))
                for n in self.store}


class Engine:
    """One SGLang server of `tp_size` ranks laid out as SGLang runs them: this (HTTP / tokenizer-manager) process
    and one scheduler process per engine TP rank (forked once the release's code is loaded). The tokenizer side
    hands each request to scheduler rank 0, which passes it to the other TP ranks with the release's
    broadcast_pyobj over the TP CPU group (managers/scheduler_components/request_receiver.py, 0.5.23;
    scheduler.py recv_requests, 0.5.20); every rank runs the release's scheduler-side method. Each rank's default
    process group is the engine's TP world (gloo), so the release's barriers and its init_weights_update_group
    (one group per process, joined at rank_offset + tp_rank) run as in SGLang.

    A scheduler that dies takes the server with it, as in SGLang: the release's SubprocessWatchdog watches the
    scheduler processes and SIGQUITs this process (entrypoints/engine.py starts it over scheduler_procs, 0.5.20 /
    0.5.23), whose SIGQUIT handler is the release's kill_process_tree (serve())."""

    def __init__(self, tp_size: int = 1, api_key: str | None = None, timeout: float = 300.0):
        import multiprocessing
        import tempfile

        import sglang.srt.managers.scheduler  # noqa: F401 - imported once here, before the ranks fork
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import common
        from sglang.srt.utils.watchdog import SubprocessWatchdog
        from sglang.version import __version__

        self.version, self.tp_size, self.api_key, self.timeout = __version__, tp_size, api_key, timeout
        self.io, self.common = io_struct, common
        # fork: each rank starts with the release's code already imported (a spawned start re-imports it, ~10 s
        # a rank on this machine); no thread has been started in this process yet. On a GPU, spawn: importing the
        # release may have touched CUDA here (module-level device queries), which a forked child cannot use
        spawn = DEVICE != "cpu"
        ctx = multiprocessing.get_context("spawn" if spawn else "fork")
        init = f"file://{tempfile.mkdtemp(prefix='sglang-tp-')}/store"
        pipes = [ctx.Pipe() for _ in range(tp_size)]
        self.conns = [parent for parent, _ in pipes]
        target, extra = (_spawned_scheduler_main, (SITE_DIR, DEVICE)) if spawn else (_scheduler_main, ())
        self.procs = [ctx.Process(target=target, args=(*extra, r, tp_size, init, pipes[r][1]), daemon=True)
                      for r in range(tp_size)]
        for p in self.procs:
            p.start()
        for r, conn in enumerate(self.conns):
            ok, message = self._answer(r, conn, starting=True)
            if not ok:
                raise RuntimeError(f"engine TP rank {r} did not start: {message}")
        SubprocessWatchdog(processes=self.procs, process_names=[f"scheduler_{r}" for r in range(tp_size)]).start()

    def _answer(self, rank: int, conn, starting: bool = False) -> tuple[bool, object]:
        if not conn.poll(self.timeout):
            return False, f"engine TP rank {rank} did not answer within {self.timeout} s"
        try:
            return conn.recv()
        except EOFError:
            if starting:
                return False, f"engine TP rank {rank} exited (exit code {self.procs[rank].exitcode})"
        # a scheduler died: SGLang's tokenizer never gets this reply, and the watchdog ends the server (<= 1 s)
        import threading

        threading.Event().wait()
        raise AssertionError("unreachable")

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


# the harness' own requests (not SGLang's): per-rank state, forget the record, arm a fault, queue requests
_STATE, _RESET, _FAULT, _QUEUE = "mcore2hf_state", "mcore2hf_reset", "mcore2hf_fault", "mcore2hf_queue"


class _KVMemory(_Stub):
    """The scheduler's KV memory (radix tree, request-to-token pool, token allocator): accepts any call; the
    tree's reset() is what the release's flush_cache does first once it decided to flush, so it counts flushes."""

    def __init__(self, name: str):
        super().__init__(name)
        self.resets = 0

    def reset(self):
        self.resets += 1


def _scheduler(ps):
    """The release's Scheduler (managers/scheduler.py), made without its GPU __init__, with the state its pause,
    continue, abort, flush and idle-check methods read, as a server with default arguments has it when nothing
    runs: empty running batch, no chunked prefill, no overlap, no disaggregation, no hierarchical cache, PP 1
    (read in scheduler.py is_fully_idle / flush_cache / pause_generation / continue_generation / abort_request /
    _add_request_to_queue, 0.5.20 and 0.5.23). Requests in flight are queued requests (the release's Req, queued
    by its _add_request_to_queue): the queue is what the flush decision reads, and what a retract-mode pause
    leaves behind. Not emulated: requests in the running batch (retracting them releases KV through runtime
    context a real ServerArgs publishes). Metrics, KV events, grammar / dLLM / beam managers and the channel back to
    the tokenizer (abort outputs) are sinks."""
    import collections
    import types as _t

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import scheduler as sched
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    if hasattr(sched, "get_parallel"):  # 0.5.23 _pp_microbatches_drained: runtime_context.get_parallel().pp_size
        sched.get_parallel = lambda: ps
    # runtime_context.get_serving().weight_version, read by abort_request's _make_abort_req; ServerArgs' default
    # (arg_groups/fields/serving.py, 0.5.23), then the last version loaded
    serving = _t.SimpleNamespace(weight_version="default")
    if hasattr(sched, "get_serving"):
        sched.get_serving = lambda: serving

    class Scheduler(sched.Scheduler):
        def record_weight_version_change(self, new_version=None):
            """The release's also publishes it through the runtime context and stamps the live requests."""
            if new_version is not None:
                serving.weight_version = new_version

    s = Scheduler.__new__(Scheduler)
    s.__dict__.update(
        running_batch=ScheduleBatch(reqs=[]), waiting_queue=[], chunked_req=None, last_batch=None,
        cur_batch_for_debug=None, result_queue=collections.deque(), disaggregation_mode=DisaggregationMode.NULL,
        _engine_paused=False, _pause_started_at=None, _pause_intervals=[], ps=ps,  # ps: 0.5.20's PP size
        pp_size=1, running_mbs=[], cur_batch=None, _pending_flush=None,  # 0.5.10's names
        enable_overlap=False, enable_overlap_mlx=False, enable_hisparse=False, enable_hierarchical_cache=False,
        enable_lmcache=False, enable_hicache_storage=False, enable_continuous_input_polling=False,
        enable_priority_scheduling=False, max_queued_requests=None, processed_tokens_counter=0,
        decode_offload_manager=None, hisparse_coordinator=None, mm_receiver=None, dllm_config=None,
        draft_worker=None, rust_server=None, tree_cache=_KVMemory("tree_cache"), req_to_token_pool=_KVMemory("req_to_token_pool"),
        token_to_kv_pool_allocator=_KVMemory("token_to_kv_pool_allocator"),
        **{n: _Stub(n) for n in ("metrics_reporter", "kv_events_publisher", "grammar_manager", "dllm_manager",
                                 "beam_coordinator", "ipc_channels", "send_to_tokenizer")})
    return s


def _flush_wrapper(scheduler, components: bool):
    """What answers FlushCacheReqInput in scheduler.py's request dispatcher: the release's SchedulerFlushWrapper
    (0.5.20 / 0.5.23; its reply channel, send_output / ipc_channels, only serves a deferred flush, timeout_s > 0,
    which the front end never asks for), or before it the Scheduler's own flush_cache_wrapped (read in 0.5.10)."""
    import inspect

    if not components:
        return scheduler.flush_cache_wrapped
    from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper

    channel = {k: None for k in ("send_output", "ipc_channels") if k in inspect.signature(SchedulerFlushWrapper).parameters}
    return SchedulerFlushWrapper(flush_cache=scheduler.flush_cache, is_fully_idle=scheduler.is_fully_idle,
                                 **channel).handle


class _Rank:
    """One engine TP rank's scheduler-side objects, built from the release's code in the rank's own process: the
    release's Scheduler (_scheduler) and flush wrapper; >= 0.5.20: SchedulerWeightUpdaterManager over a TP worker
    (_Worker) over a model runner with the release's WeightUpdater; older: the Scheduler's own
    SchedulerUpdateWeightsMixin methods over TpModelWorker and ModelRunner (objects made without their GPU
    __init__). The model is a recorder."""

    def __init__(self, rank: int, tp_size: int):
        import importlib.util
        import types as _t

        import torch.distributed as dist

        group = dist.group.WORLD  # the engine's TP world: in SGLang the TP group's CPU (gloo) group
        self.rank, self.draft = rank, None  # the draft runner's model (serve(draft=...), >= 0.5.20 layout only)
        self.model = model = Recorder()
        ps = _t.SimpleNamespace(tp_rank=rank, tp_size=tp_size, dp_size=1, num_dp_ranks=1, pp_size=1,
                                dp_rank=0, attn_dp_size=1, pp_rank=0,  # the weight checker's placement
                                tp_group=_t.SimpleNamespace(cpu_group=group, rank=rank, ranks=list(range(tp_size))))
        self.scheduler = scheduler = _scheduler(ps)
        components = importlib.util.find_spec("sglang.srt.managers.scheduler_components") is not None  # >= 0.5.20
        self.flush = _flush_wrapper(scheduler, components)
        if not components:
            self.manager, self.groups = self._before_0_5_20(rank, group, model, scheduler)
            return
        import dataclasses

        from sglang.srt.managers.scheduler_components import weight_updater as sched_wu
        from sglang.srt.model_executor.model_runner_components import weight_updater as runner_wu
        from sglang.srt.utils import common
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        for m in (sched_wu, runner_wu):  # runtime_context.get_parallel(): this process's rank
            m.get_parallel = lambda: ps
        if hasattr(runner_wu, "get_model"):  # weight cache off (runtime_context.get_model().weight_cache_mode)
            runner_wu.get_model = lambda: _t.SimpleNamespace(weight_cache_mode="off")
        updater = runner_wu.WeightUpdater(
            tp_rank=rank, device=DEVICE.split(":")[0], gpu_id=torch.device(DEVICE).index or 0, model_config=None, custom_weight_loaders={},
            get_model=lambda: model, update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
        self.groups = updater._model_update_group
        worker = _Worker(rank, _model_runner(updater, model, ps), common, monkey_patch_torch_reductions)
        self.draft, draft_worker = self._draft_worker(runner_wu, ps)
        cls = sched_wu.SchedulerWeightUpdaterManager
        extra = {"tp_cpu_group": group} if any(f.name == "tp_cpu_group" and f.init
                                               for f in dataclasses.fields(cls)) else {}  # 0.5.20: an argument
        # as scheduler.py init_weight_updater builds it (0.5.20 / 0.5.23): the scheduler's own flush and idle check
        self.manager = cls(tp_worker=worker, draft_worker=draft_worker, memory_saver_adapter=None,
                           flush_cache=scheduler.flush_cache, is_fully_idle=scheduler.is_fully_idle,
                           scheduler=scheduler, **extra)
        self.lora = _LoRASide(rank, tp_size, worker, ps) if os.environ.get(_HF_CONFIG) else None
        self.lora_checked = 0  # adapter loads that carried expected_checksums and passed the release's check

    def _draft_worker(self, runner_wu, ps):
        """With serve(draft=...): a speculative worker's draft model runner (a recorder model of its own, its own
        release WeightUpdater and WeightChecker), as the release's weight updater reaches it: 0.5.23
        `draft_worker.weight_update_runners()` -> [("draft", runner)] (speculative/base_spec_worker.py:170-175),
        0.5.20 `draft_worker.draft_model_runner` (weight_updater.py:49-60). Without: (None, None)."""
        import types as _t

        if not os.environ.get(_DRAFT):
            return None, None
        draft = Recorder()
        updater = runner_wu.WeightUpdater(
            tp_rank=self.rank, device=DEVICE.split(":")[0], gpu_id=torch.device(DEVICE).index or 0, model_config=None,
            custom_weight_loaders={}, get_model=lambda: draft, update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
        runner = _model_runner(updater, draft, ps)
        return draft, _t.SimpleNamespace(weight_update_runners=lambda: [("draft", runner)], draft_model_runner=runner)

    @staticmethod
    def _before_0_5_20(rank: int, group, model, scheduler):
        """0.5.6-0.5.19 layout (read in 0.5.10): scheduler_update_weights_mixin.py (a base of Scheduler),
        tp_worker.py, model_runner.py."""
        import types as _t

        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.model_executor.model_runner import ModelRunner

        runner = ModelRunner.__new__(ModelRunner)
        runner.__dict__.update(model=model, device="cpu", tp_rank=rank, _model_update_group={},
                               server_args=_t.SimpleNamespace(custom_weight_loader=[]))
        worker = TpModelWorker.__new__(TpModelWorker)
        worker.__dict__.update(_model_runner=runner, tp_rank=rank)  # model_runner: a property
        scheduler.__dict__.update(tp_worker=worker, tp_cpu_group=group, memory_saver_adapter=None)
        return scheduler, runner._model_update_group

    def state(self, how: str | None = None) -> dict:
        """What the release's objects hold: update session (>= 0.5.21), weight-update groups, the scheduler's
        paused flag, queued requests, flushes; and what the model was given (digests: `Recorder.digests`); the LoRA
        adapters loaded (each per-TP-rank LoRA weight the release builds: digest, shape)."""
        s = self.scheduler
        lora = getattr(self, "lora", None)
        draft = self.draft
        return {"weights": self.model.digests(how or "sha256"),
                "draft_weights": None if draft is None else draft.digests(how or "sha256"),
                "session": getattr(self.manager, "_session", None) is not None,
                "groups": sorted(self.groups), "engine_paused": s._engine_paused, "queued": len(s.waiting_queue),
                "flushes": s.tree_cache.resets, "loras": lora.state() if lora else {},
                "lora_checked": self.lora_checked}

    def handle(self, method: str, req) -> tuple[bool, object]:
        """Run one request; an exception escapes (the scheduler process then fails as SGLang's does)."""
        if method == _STATE:
            return True, self.state(req)
        if method == _RESET:
            for model in (self.model, self.draft):
                if model is None:
                    continue
                model.store.clear()
                if (req or {}).get("parameters"):  # another model from now on (an engine started on another checkpoint)
                    model._modules.clear()
                    model._parameters.clear()
            return True, ""
        if method == _FAULT:  # {"model": "draft"}: the draft runner's model
            if req.get("rank") in (None, self.rank):
                (self.draft if req.get("model") == "draft" else self.model).arm(req)
            return True, ""
        if method == _QUEUE:
            from sglang.srt.managers.schedule_batch import Req
            from sglang.srt.sampling.sampling_params import SamplingParams

            for _ in range(req):
                rid = f"mcore2hf-{self.scheduler.processed_tokens_counter}-{len(self.scheduler.waiting_queue)}"
                self.scheduler._add_request_to_queue(Req(rid, "x", [1, 2, 3], SamplingParams()))
            return True, ""
        s = self.scheduler
        if method in ("load_lora_adapter_from_tensors", "unload_lora_adapter"):
            out = getattr(self.lora, method)(req)  # the release checks expected_checksums first (raises if any differ)
            if getattr(req, "expected_checksums", None) is not None and out.success:
                self.lora_checked += 1
            return bool(out.success), out
        target = {"pause_generation": s.pause_generation, "continue_generation": s.continue_generation,
                  "abort_request": s.abort_request, "flush_cache": self.flush}.get(method)
        out = (target or getattr(self.manager, method))(req)
        if out is None:  # pause / continue / abort answer nothing
            return True, ""
        if method == "check_weights":  # the tokenizer side reads the whole reply (its per-rank payload)
            return bool(out.success), out
        return bool(out.success), out.message


_HF_CONFIG = "MCORE2HF_SGLANG_HF_CONFIG"  # the served model's HF config directory (serve --hf-config)
_DRAFT = "MCORE2HF_SGLANG_DRAFT"  # serve --draft: "mtp" / "separate", the speculative draft the server runs
MODEL_PATH, EAGLE_PATH = "/models/target", "/models/eagle3"  # what server_info reports as the served paths


class _LoRASide:
    """A rank's LoRA adapter loading, the release's own code (0.5.20 / 0.5.23): TpModelWorker's
    load_lora_adapter_from_tensors / unload_lora_adapter (managers/tp_worker.py: own-rank deserialization,
    FlattenedTensorBucket rebuild, expected_checksums) over ModelRunner's methods over the release's LoRAManager
    (lora/lora_manager.py: LoRAConfig.from_dict, validate_new_adapter, LoRAAdapter.initialize_weights_from_tensors
    with its q/k/v and gate/up normalization, unload). The manager is made without its GPU __init__ (no memory
    pool, backend or wrapped base model: a pool that supports every adapter). Then what the memory pool does when
    it loads the adapter for a batch (lora/mem_pool.py:891 load_lora_weight_to_buffer: target module per weight,
    experts grouped by id, the layer's slice methods) runs with the release's LoRA layer classes
    (QKVParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA,
    FusedMoEWithLoRA; lora/layers.py) over stand-in base layers that carry the sizes SGLang's linears have at this
    TP rank (q/kv shard sizes, output partition sizes, input size per partition, MoE intermediate per partition)."""

    def __init__(self, rank: int, tp_size: int, worker, ps):
        import types as _t

        from sglang.srt.lora.lora_manager import LoRAManager
        from sglang.srt.managers import tp_worker
        from sglang.srt.model_executor.model_runner import ModelRunner
        from transformers import AutoConfig

        self.rank, self.tp = rank, tp_size
        self.hf = AutoConfig.from_pretrained(os.environ[_HF_CONFIG])
        if hasattr(tp_worker, "get_parallel"):  # 0.5.23: the checksum branch's rank
            tp_worker.get_parallel = lambda: ps
        worker.ps = ps  # 0.5.20
        mgr = LoRAManager.__new__(LoRAManager)
        mgr.__dict__.update(
            configs={}, loras={}, lora_refs={}, num_pinned_loras=0, base_hf_config=self.hf, load_config=None,
            lora_backend=None, base_model=torch.nn.Module(), attn_dp_enabled=False, max_loras_per_batch=8,
            speculative_algorithm=None, pending_lora_load_events={}, device=torch.device("cpu"),
            memory_pool=_t.SimpleNamespace(can_support=lambda config: True, remove_lora=lambda uid: None))
        mgr._notify_lora_slots_updated = lambda slots: None
        self.manager = mgr
        runner = worker.model_runner
        runner.lora_manager = mgr
        for m in ("load_lora_adapter_from_tensors", "unload_lora_adapter"):
            setattr(runner, m, _t.MethodType(getattr(ModelRunner, m), runner))
            setattr(self, m, _t.MethodType(getattr(tp_worker.TpModelWorker, m), worker))

    def _layers(self):
        """The release's LoRA layer objects over stand-in base layers with this rank's sizes (what
        get_lora_layer wraps in SGLang's Qwen3 / Qwen3-MoE: QKVParallelLinear, RowParallelLinear,
        MergedColumnParallelLinear, FusedMoE)."""
        import types as _t

        from sglang.srt.lora import layers

        cfg, tp, r = self.hf, self.tp, self.rank
        group = _t.SimpleNamespace(rank_in_group=r, world_size=tp)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_replicas = max(1, tp // cfg.num_key_value_heads)
        kv_group = _t.SimpleNamespace(rank_in_group=r, world_size=tp)

        def make(cls, **base):
            obj = cls.__new__(cls)
            torch.nn.Module.__init__(obj)
            # tp_group: 0.5.23 (get_group_rank_size); tp_rank / tp_size: 0.5.20 reads them from the base layer
            obj.__dict__["base_layer"] = _t.SimpleNamespace(tp_group=group, tp_rank=r, tp_size=tp, **base)
            return obj

        qkv = make(layers.QKVParallelLinearWithLoRA, q_proj_shard_size=cfg.num_attention_heads * hd // tp,
                   kv_proj_shard_size=max(1, cfg.num_key_value_heads // tp) * hd, num_kv_head_replicas=kv_replicas,
                   kv_tp_group=kv_group, total_num_heads=cfg.num_attention_heads, head_size=hd,
                   total_num_kv_heads=cfg.num_key_value_heads,
                   # QKVParallelLinear's output_sizes: [q, k, v] of every rank (kv heads replicated below TP)
                   output_sizes=[cfg.num_attention_heads * hd] + [max(1, cfg.num_key_value_heads // tp) * hd * tp] * 2)
        inter = cfg.intermediate_size
        gate_up = make(layers.MergedColumnParallelLinearWithLoRA, output_sizes=[inter, inter],
                       output_partition_sizes=[inter // tp, inter // tp])
        o = make(layers.RowParallelLinearWithLoRA, input_size_per_partition=cfg.num_attention_heads * hd // tp)
        down = make(layers.RowParallelLinearWithLoRA, input_size_per_partition=inter // tp)
        out = {"qkv_proj": qkv, "o_proj": o, "gate_up_proj": gate_up, "down_proj": down}
        moe_inter = getattr(cfg, "moe_intermediate_size", None)
        if moe_inter:  # FusedMoE at moe-TP = TP (no --ep-size)
            moe = make(layers.FusedMoEWithLoRA, moe_runner_config=_t.SimpleNamespace(is_gated=True))
            moe.__dict__.update(tp_size=tp, intermediate_size_per_partition=moe_inter // tp,
                                _uses_interleaved_gate_up=False)
            out["moe"] = moe
        return out

    def state(self) -> dict:
        """Per adapter (by name): each LoRA weight this rank's buffers take, as the memory pool slices it
        (mem_pool.py:1000-1145): "<layer>.<target module>[.<expert>].lora_{A,B}" -> [digest, shape]."""
        import re

        from sglang.srt.lora.utils import get_normalized_target_modules, get_target_module_name

        mods = self._layers()
        out = {}
        for uid, adapter in self.manager.loras.items():
            name = self.manager.lora_refs[uid].lora_name
            targets = get_normalized_target_modules(adapter.config.target_modules)
            got = {}
            for layer_id, layer in enumerate(adapter.layers):
                for wname, w in layer.weights.items():
                    target = get_target_module_name(wname, targets)
                    factor = "lora_A" if "lora_A" in wname else "lora_B"
                    expert = re.search(r"experts\.(\d+)\.", wname)
                    if expert:  # per-expert weights go to the FusedMoE buffers (<target>_moe)
                        canonical = target + "_moe"
                        slicer = mods["moe"].slice_moe_lora_a_weights if factor == "lora_A" else \
                            mods["moe"].slice_moe_lora_b_weights
                        w = slicer({int(expert[1]): w}, self.rank, canonical)[int(expert[1])]
                        key = f"{layer_id}.{target}.{expert[1]}.{factor}"
                    else:
                        m = mods[target]
                        w = m.slice_lora_a_weights(w) if factor == "lora_A" else m.slice_lora_b_weights(w)
                        key = f"{layer_id}.{target}.{factor}"
                    got[key] = [sha256_digest(w.contiguous()), list(w.shape)]
            out[name] = got
        return out


def _model_runner(updater, model, ps):
    """The model runner's weight-update side (its WeightUpdater) and its weight checker as model_runner.py builds
    and calls it (0.5.23 model_runner.py:478 WeightChecker(get_model=...), placement from
    runtime_context.get_parallel(); 0.5.20 model_runner.py:448 WeightChecker(get_model=..., ps=...)); check_weights
    is the release's ModelRunner.check_weights. GPU-only calls the checker makes are CPU no-ops here:
    torch.cuda.synchronize (0.5.20) and Tensor.cuda() (weight_checker_comparator.py iter_chunks: the chunks it
    compares stay on the CPU)."""
    import inspect
    import types as _t

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.utils import weight_checker

    if DEVICE == "cpu":
        torch.cuda.synchronize = lambda *a, **k: None
        torch.Tensor.cuda = lambda self, *a, **k: self
    if "ps" in inspect.signature(weight_checker.WeightChecker).parameters:  # 0.5.20
        checker = weight_checker.WeightChecker(get_model=lambda: model, ps=ps)
    else:
        weight_checker.get_parallel = lambda: ps
        checker = weight_checker.WeightChecker(get_model=lambda: model)
    runner = _t.SimpleNamespace(weight_updater=updater, model=model, _weight_checker=checker)
    runner.check_weights = _t.MethodType(ModelRunner.check_weights, runner)
    return runner


def _spawned_scheduler_main(site_dir: str, device: str, rank: int, tp_size: int, init_method: str, conn) -> None:
    """A scheduler process started by spawn (on a GPU): load the release as serve() did, then run as a forked one."""
    global DEVICE, SITE_DIR
    DEVICE, SITE_DIR = device, site_dir
    install(site_dir)
    _scheduler_main(rank, tp_size, init_method, conn)


def _scheduler_main(rank: int, tp_size: int, init_method: str, conn) -> None:
    """A scheduler process: join the TP world, then serve requests until the pipe closes. An exception out of
    the release's code ends it as sglang's run_scheduler_process does (managers/scheduler.py, 0.5.20 / 0.5.23):
    logged, SIGQUIT to the server process."""
    import ctypes
    import os
    import signal
    import traceback

    import torch.distributed as dist
    from sglang.srt.utils import broadcast_pyobj

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server process
    try:
        if DEVICE != "cpu":  # the engine's GPU (the trainer names it by UUID, the release maps it back)
            torch.cuda.set_device(torch.device(DEVICE).index or 0)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=tp_size)
        r = _Rank(rank, tp_size)
    except Exception as e:  # noqa: BLE001 - reported to the server process
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    conn.send((True, "ready"))
    try:
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
    except Exception:  # noqa: BLE001 - "Scheduler hit an exception", then parent_process.send_signal(SIGQUIT)
        print(f"scheduler TP rank {rank} hit an exception:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os.kill(os.getppid(), signal.SIGQUIT)


class _Worker:
    """The TP worker's weight-update methods, as managers/tp_worker.py writes them (0.5.20 and 0.5.23)."""

    def __init__(self, rank, runner, common, patch):
        self.rank, self.model_runner, self.common, self.patch = rank, runner, common, patch

    def weight_update_runners(self):  # 0.5.23
        return [("target", self.model_runner)]

    def deserialize_own_rank(self, serialized_named_tensors):  # 0.5.23 tp_worker.deserialize_own_rank
        self.patch()
        return self.common.MultiprocessingSerializer.deserialize(serialized_named_tensors[self.rank])

    _deserialize_own_rank = deserialize_own_rank  # 0.5.20's name

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


def serve(site_dir: str, tp_size: int = 1, api_key: str | None = None, port: int = 0, device: str = "cpu",
          hf_config: str | None = None, enable_lora: bool = False, draft: str | None = None) -> None:
    import ctypes
    import json
    import os
    import signal
    import tempfile
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with whoever started it (a test, a rank)
    global DEVICE, SITE_DIR
    DEVICE, SITE_DIR = device, site_dir
    install(site_dir)
    from sglang.srt.utils import kill_process_tree
    from sglang.version import __version__

    # a child's SIGQUIT ends the server and its schedulers (entrypoints/engine.py launch_phase_sigquit_handler,
    # tokenizer_manager.py running_phase_sigquit_handler: kill_process_tree(os.getpid()); 0.5.20 / 0.5.23)
    signal.signal(signal.SIGQUIT, lambda signum, frame: kill_process_tree(os.getpid()))
    supported = tuple(int(x) for x in __version__.split(".")[:3] if x.isdigit()) >= (0, 5, 6)
    if hf_config:  # the ranks (forked below) build the release's LoRA manager for this model
        os.environ[_HF_CONFIG] = hf_config
    if draft:  # the ranks (forked below) give their weight updater a draft runner
        os.environ[_DRAFT] = draft
    # the resolved speculative arguments server_info reports (0.5.23 arg_groups/speculative_hook.py: NEXTN becomes
    # EAGLE, an MTP draft's path the model's own, :109-115, :720-725)
    speculative = {"speculative_algorithm": None, "speculative_draft_model_path": None, "model_path": MODEL_PATH}
    if draft:
        speculative.update(speculative_algorithm="EAGLE3" if draft == "separate" else "EAGLE",
                           speculative_draft_model_path=EAGLE_PATH if draft == "separate" else MODEL_PATH)
    engine = Engine(tp_size, api_key) if supported else None
    lora_routes = {r for r in ("/load_lora_adapter_from_tensors", "/unload_lora_adapter") if _release_has(r)}
    routes = {r for r in ("/server_info", "/get_server_info", "/begin_weight_update", "/end_weight_update")
              if _release_has(r)}
    checker_route = {"/weights_checker"} if _release_has("/weights_checker") else set()
    tensor_req = "UpdateWeightsFromTensorReqInput"
    posts = {  # route: (request type, manager method)
        "/update_weights_from_tensor": (tensor_req, "update_weights_from_tensor"),
        "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", "update_weights_from_distributed"),
        "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", "init_weights_update_group"),
        "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", "destroy_weights_update_group"),
        "/begin_weight_update": ("BeginWeightUpdateReqInput", "begin_weight_update"),
        "/end_weight_update": ("EndWeightUpdateReqInput", "end_weight_update"),
    }
    # the harness' own routes (no API key): state, forget the record, arm a fault, queue requests
    harness = {"/mcore2hf_state", "/mcore2hf_reset", "/mcore2hf_fault", "/mcore2hf_requests"}
    # the tokenizer manager's side: is_pause (set by pause, cleared by continue), the calls and the versions of the
    # updates that succeeded
    front = types.SimpleNamespace(paused=False, calls=[], versions=[], loras={}, release=None, hangs=0)
    lock = threading.Lock()  # the scheduler runs one request at a time
    hangs = tempfile.mkdtemp(prefix="sglang-hang-")

    def run(method: str, req) -> tuple[bool, object]:
        if not lock.acquire(blocking=False):  # busy: a "hang" fault holds the scheduler until a next request comes
            if front.release is not None:
                open(front.release, "w").close()
                front.release = None
            lock.acquire()
        try:
            return engine.call(method, req)
        finally:
            lock.release()

    def run_each(method: str, req) -> tuple[bool, list]:
        """Every rank's reply (the LoRA routes merge them as the release's tokenizer does)."""
        with lock:
            engine.conns[0].send([(method, req)])
            outs = [engine._answer(r, c) for r, c in enumerate(engine.conns)]
        return all(o[0] for o in outs), [o[1] for o in outs]

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
            if api_key and self.path.split("?")[0] not in harness and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._send(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            if not self._auth():
                return
            if self.path.split("?")[0] == "/mcore2hf_state":  # ?digest=fingerprint: cheap digests (large syncs)
                how = "fingerprint" if self.path.endswith("digest=fingerprint") else None
                ok, ranks = run(_STATE, how) if engine is not None else (True, [])
                weights = {str(r): st.pop("weights") for r, st in enumerate(ranks)}
                drafts = {str(r): st.pop("draft_weights") for r, st in enumerate(ranks)}
                return self._send(200 if ok else 500, {
                    "weights": weights, "draft_weights": drafts, "ranks": ranks, "versions": front.versions, "calls": front.calls,
                    "paused": front.paused, "version": __version__})
            if self.path in routes and self.path.endswith("server_info"):
                front.calls.append(self.path)
                # build_server_info: the resolved server arguments (0.5.23 utils/common.py:3584), enable_lora among them
                return self._send(200, {"version": __version__, "tp_size": tp_size, "dp_size": 1,
                                        "enable_lora": enable_lora, "lora_paths": None, "internal_states": [],
                                        **speculative})
            self._send(404, {"detail": "Not Found"})

        def _control(self, path: str, body: dict):
            """pause / continue / flush as the release's tokenizer manager and http_server.py route them."""
            if path == "/pause_generation":  # tokenizer_manager.py pause_generation (0.5.20 / 0.5.23)
                req = engine.request("PauseGenerationReqInput", body)
                front.paused = True
                if req.mode == "abort":  # abort_request(abort_all=True) to the scheduler, not the pause itself
                    run("abort_request", engine.request("AbortReq", {"rid": "", "abort_all": True}))
                else:
                    run("pause_generation", req)
                return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
            if path == "/continue_generation":  # tokenizer_manager.py continue_generation
                req = engine.request("ContinueGenerationReqInput", body)
                front.paused = False
                run("continue_generation", req)
                return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
            # http_server.py flush_cache: FlushCacheReqInput(timeout_s=0.0) to the scheduler; plain text, HTTP 400
            # with the reply's message (or "Flush cache failed.") when it refused
            ok, message = run("flush_cache", engine.request("FlushCacheReqInput", {"timeout_s": 0.0}))
            if ok:
                return self._send(200, "Cache flushed.\nPlease check backend logs for more details. (When there "
                                  "are running or waiting requests, the operation will not be performed.)\n",
                                  "text/plain")
            return self._send(400, message or "Flush cache failed.\n", "text/plain")

        def _check_weights(self, body: dict):
            """http_server.py:1599 check_weights (0.5.23; 0.5.20 :1528): the release's CheckWeightsReqInput, the
            scheduler's reply merged by the release's TokenizerControlMixin.check_weights (its communicator
            answers the scheduler's one reply), HTTP 400 when the checker raised."""
            import asyncio

            from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin

            try:
                req = engine.request("CheckWeightsReqInput", body)
            except Exception as e:  # noqa: BLE001 - FastAPI answers a validation error
                return self._send(422, {"detail": f"{type(e).__name__}: {e}"})
            _, out = run("check_weights", req)
            if isinstance(out, str):  # a harness-level failure, not the checker's reply
                return self._send(500, {"success": False, "message": out})

            async def communicator(obj):
                return [out]

            tm = types.SimpleNamespace(auto_create_handle_loop=lambda: None, check_weights_communicator=communicator)
            success, message, ranks, per_engine = asyncio.run(TokenizerControlMixin.check_weights(tm, req))
            reply = {"success": success, "message": message}
            if ranks is not None:
                reply["ranks"] = ranks
            if per_engine is not None:
                reply["per_engine_checksum"] = per_engine
            return self._send(200 if success else 400, reply)

        def _lora(self, path: str, body: dict):
            """The tokenizer side of the LoRA routes (0.5.23 tokenizer_control_mixin.py:745-870, 0.5.20 the same
            checks): LoRA must be on; a load gets a new LoRARef id (its payloads normalized as for weights), an
            unload the registered id of its name (unknown: the registry's ValueError); every rank runs the
            release's worker method, the replies merged by the release's _merge_lora_update_results; HTTP 400
            when it failed (http_server.py:1663-1683)."""
            from sglang.srt.lora.lora_registry import LoRARef
            from sglang.srt.managers import tokenizer_control_mixin as tcm
            from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

            load = path == "/load_lora_adapter_from_tensors"
            cls_name = "LoadLoRAAdapterFromTensorsReqInput" if load else "UnloadLoRAAdapterReqInput"
            try:
                req = engine.request(cls_name, body)
            except Exception as e:  # noqa: BLE001 - FastAPI answers a validation error
                return self._send(422, {"detail": f"{type(e).__name__}: {e}"})
            out = engine.io.LoRAUpdateOutput
            if not enable_lora:
                result = out(success=False, error_message="LoRA is not enabled. Please set `--enable-lora` to "
                                                          "enable LoRA.")
            elif load:
                if hasattr(engine.common, "normalize_serialized_named_tensor_payloads"):
                    req.serialized_named_tensors = engine.common.normalize_serialized_named_tensor_payloads(
                        req.serialized_named_tensors)
                ref = LoRARef(lora_name=req.lora_name, lora_path="__tensor__", pinned=req.pinned)
                req.lora_id = ref.lora_id
                _, results = run_each("load_lora_adapter_from_tensors", req)
                result = tcm._merge_lora_update_results(results)
                if result.success:
                    front.loras[req.lora_name] = ref.lora_id
            elif req.lora_name not in front.loras:  # lora_registry.py:119
                result = out(success=False, error_message=f"LoRA with name {req.lora_name} does not exist. "
                                                          f"Loaded LoRAs: {front.loras.keys()}")
            else:
                req.lora_id = front.loras.pop(req.lora_name)
                _, results = run_each("unload_lora_adapter", req)
                result = tcm._merge_lora_update_results(results)
            return self._send(200 if result.success else 400, msgspec_to_builtins(result))

        def do_POST(self):
            if not self._auth():
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path = self.path
            if path in harness and engine is not None:
                if path == "/mcore2hf_reset":  # forget what was recorded
                    front.versions.clear()
                    front.calls.clear()
                if path == "/mcore2hf_fault" and body.get("kind") == "hang":  # released by the next request (run)
                    front.hangs += 1
                    body["release"] = front.release = os.path.join(hangs, str(front.hangs))
                ok, message = run({"/mcore2hf_reset": _RESET, "/mcore2hf_fault": _FAULT,
                                   "/mcore2hf_requests": _QUEUE}[path],
                                  body.get("queued", 0) if path == "/mcore2hf_requests" else body)
                return self._send(200 if ok else 500, {"success": ok, "message": message})
            front.calls.append(path)
            if engine is None or (path in posts and path.endswith("weight_update") and path not in routes):
                return self._send(404, {"detail": "Not Found"})
            if path in ("/pause_generation", "/continue_generation", "/flush_cache"):
                return self._control(path, body)
            if path == "/weights_checker" and path in checker_route:
                return self._check_weights(body)
            if path in lora_routes:
                return self._lora(path, body)
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
            ok, message = run(method, req)
            if ok and getattr(req, "weight_version", None) is not None:
                front.versions.append(req.weight_version)
            self._send(200 if ok else 400, {"success": ok, "message": message})

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"PORT {server.server_address[1]} VERSION {__version__}", flush=True)
    server.serve_forever()


class RealServer:
    """One release's server (`serve`) in its own process, started from the test or bench process: `site_dir` the
    release's unpacked wheel, `wanted` its version; `port` 0: one the OS picks; `device` "cuda": its ranks hold
    their parameters on this process's GPU 0 and open real CUDA IPC handles. With wait=False the caller starts
    several, then waits for each (`wait()`)."""

    def __init__(self, site_dir: str, wanted: str, tp: int = 1, api_key: str | None = None, port: int = 0,
                 wait: bool = True, device: str = "cpu", env: dict | None = None, extra: tuple[str, ...] = ()):
        import os
        import subprocess
        import tempfile

        cmd = [sys.executable, __file__, site_dir, "--tp", str(tp), "--port", str(port), "--device", device, *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        # stderr to a file, not a pipe nobody reads: a server never blocks on it
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
        self.wanted = wanted
        if wait:
            self.wait()

    def wait(self) -> RealServer:
        line = self.proc.stdout.readline()  # "PORT <n> VERSION <v>" once the release's code is loaded
        if not line.startswith("PORT"):
            self.proc.kill()
            self.log.seek(0)
            raise RuntimeError(f"sglang {self.wanted} server did not start: {self.log.read()[-3000:]}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = line.split()[3]
        return self

    def stop(self):
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("site_dir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--api-key")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--device", default="cpu", help='"cpu", "cuda" or "cuda:N"')
    ap.add_argument("--hf-config")  # the model's HF config directory: the LoRA routes need it
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--draft", choices=("mtp", "separate"))  # a speculative draft runner beside the target's
    a = ap.parse_args()
    serve(a.site_dir, a.tp, a.api_key, a.port, a.device, a.hf_config, a.enable_lora, a.draft)
