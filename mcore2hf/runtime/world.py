"""Run a function on every rank of a gloo world with Megatron's parallel state initialized (CPU).

    results = run_world(fn, Layout(tp=2, pp=2, ep=2), *args)   # fn(*args) on each rank; a list of returns

`fn` must be importable by module and name (a module-level function). A failure on any rank raises
`WorldError` with that rank's traceback (or that rank's own `Mcore2HFError`, chained to it); a rank that dies or
a hang is cut (`timeout` seconds). Each call gets fresh process groups and parallel state; with use_pool() (the
test session) the worker processes of a world size are started once and reused.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pickle
import queue as queue_mod
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch.multiprocessing as mp

from ..errors import WorldError


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None  # None: Megatron's default (= tp)
    first_stage_layers: int | None = None  # uneven pipeline: layers on the first / last stage
    last_stage_layers: int | None = None
    world_size: int | None = None  # None: the smallest world both the dense and the expert grids fit

    @property
    def expert_tp(self) -> int:
        """The expert-TP size Megatron uses (its default: TP)."""
        return self.etp or self.tp

    @property
    def size(self) -> int:
        if self.world_size:
            return self.world_size
        return math.lcm(self.tp * self.pp, self.ep * self.expert_tp * self.pp)

    def config_overrides(self) -> dict:
        """TransformerConfig fields for an uneven pipeline split."""
        out = {}
        if self.first_stage_layers is not None:
            out["num_layers_in_first_pipeline_stage"] = self.first_stage_layers
        if self.last_stage_layers is not None:
            out["num_layers_in_last_pipeline_stage"] = self.last_stage_layers
        return out

    def check(self, hf_config, processes: bool = True) -> None:
        """Every way this layout cannot hold the model of `hf_config`, at once (UsageError), before any process
        starts: Megatron would fail inside the workers with an assertion. `processes`: one worker process per
        rank will run (at most 64 on one machine); the dry run needs none."""
        from ..arch.registry import get_model_spec
        from ..errors import UsageError

        dims = get_model_spec(hf_config.model_type).dims(hf_config)
        problems = []
        if dims.num_attention_heads % self.tp:
            problems.append(f"--tp {self.tp} does not divide num_attention_heads {dims.num_attention_heads}")
        if dims.kv_lora_rank is None and dims.num_query_groups % self.tp:
            problems.append(f"--tp {self.tp} does not divide the {dims.num_query_groups} KV heads "
                            "(num_key_value_heads)")
        if dims.num_experts and dims.num_experts % self.ep:
            problems.append(f"--ep {self.ep} does not divide the {dims.num_experts} experts")
        layers = dims.num_layers
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if uneven and self.pp == 1:
            problems.append("--first-stage-layers / --last-stage-layers need --pp >= 2")
        elif uneven:
            first, last = self.first_stage_layers, self.last_stage_layers
            fixed = [n for n in (first, last) if n is not None]
            middle = self.pp - len(fixed)
            rest = layers - sum(fixed)
            if rest < 0 or (middle and rest % middle) or (not middle and rest):
                problems.append(f"{layers} layers do not split as first {first}, last {last} and {middle} "
                                f"other stage(s) of equal size")
        elif layers % self.pp:
            problems.append(f"--pp {self.pp} does not divide the {layers} layers: give an uneven split with "
                            "--first-stage-layers / --last-stage-layers")
        if self.vpp is not None:
            if self.pp == 1:
                problems.append("--vpp needs --pp >= 2")
            elif not uneven and layers % self.pp == 0 and (layers // self.pp) % self.vpp:
                problems.append(f"--vpp {self.vpp} does not divide the {layers // self.pp} layers of each stage")
        problems += get_model_spec(hf_config.model_type).layout_problems(hf_config, self.expert_tp)
        if processes and self.size > 64:
            problems.append(f"the layout needs {self.size} worker processes; at most 64 run on one machine")
        if problems:
            raise UsageError(f"layout {self} cannot hold this {hf_config.model_type} model: " + "; ".join(problems))

    def __str__(self) -> str:
        s = f"tp{self.tp}-pp{self.pp}"
        if self.vpp:
            s += f"-vpp{self.vpp}"
        s += f"-ep{self.ep}-etp{self.expert_tp}"
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            s += f"-uneven{self.first_stage_layers}.{self.last_stage_layers}"
        return s + f"-w{self.size}"



#: what a worker reports as it prepares a job (World.run's on_progress): torch imported (it is, when the job
#: arrives), megatron-core imported, Megatron's parallel state initialized (after the world's rendezvous)
STAGES = ("torch imported", "megatron-core imported", "parallel state initialized")


def init_megatron(layout: Layout, gloo_groups: bool = True) -> None:
    """Initialize Megatron's parallel state (and the CPU shims) in an already-initialized gloo world.
    `gloo_groups=False`: no gloo data-parallel groups (a `fake` world, where gloo cannot rendezvous)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random

    from ..arch.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, create_gloo_process_groups=gloo_groups)
    torch.manual_seed(1234)
    if not torch.cuda.is_available():
        tp_random.get_cuda_rng_tracker().reset()
    else:
        tp_random.model_parallel_cuda_manual_seed(1234)


#: what every gloo worker imports anyway (~15 CPU-s a process): imported once in the forkserver the workers are
#: forked from, so a world of any size starts in about a second after the first (spawn: each worker imports all)
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "transformers", "mcore2hf", "mcore2hf.arch.build",
           "mcore2hf.arch.cpu_shims")
_preload: tuple[str, ...] | None = None


def worker_context(preload: tuple[str, ...] = ()):
    """The multiprocessing context every CPU worker process is started from: a forkserver that imported PRELOAD
    (and `preload`, e.g. the test suite's modules) once, before any thread, torch.distributed state or CPU shim
    existed in it, so each forked worker starts as a fresh process would, without the imports. The preload is
    fixed at the forkserver's start (the first call that starts a process); later calls add nothing."""
    global _preload
    ctx = mp.get_context("forkserver")
    if _preload is None:
        _preload = tuple(dict.fromkeys(PRELOAD + tuple(preload)))
        # the forkserver skips a preload it cannot import without a word: a moved module of ours (or a test module)
        # would only cost time; third-party packages are not probed here (their parents would import in this process)
        missing = [m for m in _preload if (m.startswith("mcore2hf") or "." not in m)
                   and importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"worker preload: no module {missing}")
        ctx.set_forkserver_preload(list(_preload))
    return ctx


def _serve(rank: int, size: int, port: int, backend: str, jobs, out, env: dict[str, str]) -> None:
    """A worker: runs jobs (job id, layout, fn, args) until None. Each job gets a fresh process group (on its own
    prefix of the world's store) and a fresh Megatron parallel state, both destroyed after it, so a job finds the
    worker as a new process would (imported modules aside). `env`: the starting process' environment when the
    world started (a forked worker has the forkserver's)."""
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # megatron-core warns about apex, TE and fusions on every rank
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the parent's store
    while (job := jobs.get()) is not None:
        job_id, layout, fn, args = job
        try:  # progress (World.run's on_progress): each stage as this rank reaches it, the imports first
            out.put((job_id, rank, None, STAGES[0]))
            import megatron.core  # noqa: F401 - before the rendezvous, so its import shows on its own

            out.put((job_id, rank, None, STAGES[1]))
            dist.init_process_group(backend, store=dist.PrefixStore(f"job{job_id}", store), rank=rank,
                                    world_size=size)
            init_megatron(Layout(**layout))
            out.put((job_id, rank, None, STAGES[2]))
            out.put((job_id, rank, True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out.put((job_id, rank, False, (traceback.format_exc(), _portable_error(e))))
        finally:
            try:
                from megatron.core import parallel_state as ps

                ps.destroy_model_parallel()
                if dist.is_initialized():
                    dist.destroy_process_group()  # every group of the job, the default one included
            except Exception:  # noqa: BLE001
                pass


def _portable_error(e: BaseException):
    """The rank's own error if it is one of ours and survives pickling (else None: the traceback says it)."""
    from ..errors import Mcore2HFError

    if not isinstance(e, Mcore2HFError):
        return None
    try:
        return pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - e.g. a custom __init__: keep the message and the base class
        return Mcore2HFError(str(e))


class World:
    """`size` worker processes in one gloo (or NCCL) world that run jobs one at a time, every rank the same job.
    The world's rendezvous store is created here on a port the OS picks, so no port is ever chosen first and
    bound later (another process could take it in between)."""

    def __init__(self, size: int, backend: str = "gloo"):
        import torch.distributed as dist

        # NCCL workers are spawned: a process forked after CUDA was touched anywhere cannot use it
        ctx = worker_context() if backend == "gloo" else mp.get_context("spawn")
        self.size, self.backend, self._next = size, backend, 0
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._jobs = [ctx.Queue() for _ in range(size)]
        self._out = ctx.Queue()
        # not daemonic: dist_checkpointing.save writes files from child processes of its own
        self._procs = [ctx.Process(target=_serve, args=(r, size, self._store.port, backend, self._jobs[r],
                                                        self._out, dict(os.environ)), daemon=False)
                       for r in range(size)]
        for p in self._procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, layout: Layout, args: tuple, timeout: float,
            on_progress: Callable[[str, int, int], None] | None = None) -> list:
        """fn(*args) on every rank with Megatron at `layout`; the per-rank results. Raises WorldError (the world is
        then unusable: close it) if a rank fails, dies or the job outlasts `timeout` seconds. `on_progress(stage,
        rank, count)` as each rank reaches each of STAGES (`count`: how many ranks have reached it)."""
        job, self._next = self._next, self._next + 1
        for q in self._jobs:
            q.put((job, asdict(layout), fn, args))
        results: dict[int, object] = {}
        errors: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        reached: dict[str, int] = {}
        while len(results) + len(errors) < self.size and not errors:  # after a failure the others may be blocked
            try:
                job_id, rank, ok, value = self._out.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    raise WorldError(f"world {layout}: rank(s) {dead} died (exit codes "
                                     f"{[self._procs[r].exitcode for r in dead]}); finished ranks: "
                                     f"{sorted(results)}") from None
                if time.monotonic() > deadline:
                    raise WorldError(f"world {layout} timed out after {timeout}s; finished ranks: "
                                     f"{sorted(results)}") from None
                continue
            if job_id == job and ok is None:
                reached[value] = reached.get(value, 0) + 1
                if on_progress is not None:
                    on_progress(value, rank, reached[value])
            elif job_id == job:
                (results if ok else errors)[rank] = value
        if errors:
            rank = min(errors)
            text, error = errors[rank]
            failure = WorldError(f"rank {rank} of world {layout} failed:\n{text}")
            if error is not None:
                raise error from failure
            raise failure
        for r in range(self.size):  # a rank that returned a failure as a value has failed too
            caught = _exception_in(results[r])
            if caught is not None:
                raise WorldError(f"rank {r} of world {layout} returned a failure:\n{caught}")
        return [results[r] for r in range(self.size)]

    def stop(self) -> None:
        """Ask the workers to exit after their current job (they hold nothing between jobs)."""
        for q in self._jobs:
            q.put(None)

    def close(self, kill: bool = False, grace: float = 3.0) -> None:
        """Stop the workers (unless `kill`: they may be stuck in a job), then kill what is still there after
        `grace` seconds (an interpreter's shutdown can linger in torch's teardown)."""
        if not kill:
            self.stop()
        deadline = time.monotonic() + grace
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        del self._store


class WorldPool:
    """Live worlds kept between run_world calls (one per size and backend, at most `max_procs` worker processes,
    the least recently used closed first), so a test session starts each world size once. A world whose job
    failed is closed, never reused."""

    def __init__(self, max_procs: int):
        self.max_procs = max_procs
        self._worlds: dict[tuple[int, str], World] = {}

    def world(self, size: int, backend: str) -> World:
        key = (size, backend)
        w = self._worlds.pop(key, None)
        if w is not None and not w.alive():
            w.close(kill=True)
            w = None
        while w is None and self._worlds and sum(x.size for x in self._worlds.values()) + size > self.max_procs:
            self._worlds.pop(next(iter(self._worlds))).close()
        self._worlds[key] = w = w or World(size, backend)  # most recently used last
        return w

    def discard(self, world: World) -> None:
        self._worlds = {k: w for k, w in self._worlds.items() if w is not world}
        world.close(kill=True, grace=0.5)

    def close(self) -> None:
        for w in self._worlds.values():  # every world's workers exit at once, then one grace period for all
            w.stop()
        deadline = time.monotonic() + 3.0
        for w in self._worlds.values():
            w.close(kill=True, grace=max(0.0, deadline - time.monotonic()))
        self._worlds.clear()


_pool: WorldPool | None = None


def use_pool(max_procs: int, preload: tuple[str, ...] = ()) -> WorldPool:
    """Keep worlds alive between run_world calls from now on (tests); close_pool() ends them. `preload`: modules
    the workers' forkserver imports besides PRELOAD (worker_context)."""
    global _pool
    worker_context(preload)
    _pool = _pool or WorldPool(max_procs)
    return _pool


def close_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def run_world(fn: Callable, layout: Layout, *args, timeout: float = 600, backend: str = "gloo",
              on_progress: Callable[[str, int, int], None] | None = None) -> list:
    """fn(*args) on every rank of a world with `layout`; returns the per-rank results.

    backend "gloo" (CPU) or "nccl" (one GPU per rank). Without a pool (use_pool) the world is started for this
    call and closed after it. `on_progress(stage, rank, count)`: as each rank reaches each of STAGES (World.run)."""
    world = _pool.world(layout.size, backend) if _pool is not None else World(layout.size, backend)
    try:
        results = world.run(fn, layout, args, timeout, on_progress)
    except BaseException:
        if _pool is not None:
            _pool.discard(world)
        else:
            world.close(kill=True, grace=0.5)
        raise
    if _pool is None:
        world.close()
    return results


def _exception_in(value) -> BaseException | None:
    """The first exception inside a (nested dict/list/tuple) return value, else None."""
    if isinstance(value, BaseException):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for v in items:
        found = _exception_in(v)
        if found is not None:
            return found
    return None


def same_on_every_rank(results: list):
    """The one value every rank returned (tensors compared bit for bit); a rank that differs fails the test."""
    import torch

    def equal(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
                a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return a == b

    differ = [r for r in range(1, len(results)) if not equal(results[0], results[r])]
    if differ:
        raise WorldError(f"ranks {differ} returned other values than rank 0")
    return results[0]
