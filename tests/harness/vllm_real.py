"""vLLM's own receive code on CPU, for contract tests: run as `python -m harness.vllm_real OUT.json` in a
subprocess whose sys.path holds the unpacked vllm wheel (harness.wheels). Each scenario syncs buckets
through our senders into vLLM's real code and records "ok" or the traceback in OUT.json.

What is vLLM's (vllm 0.33.0, imported from the wheel, unmodified): the HTTP routes and their validation
(rl/online/api_router.py, with vLLM's exception handlers), AsyncLLM's and LLM's weight-transfer methods
(v1/engine/async_llm.py, entrypoints/rl/offline.py), msgpack of collective_rpc arguments (v1/serial_utils.py),
the worker's session methods (v1/worker/gpu_worker.py Worker.*_weight_update), the transfer engines from
WeightTransferEngineFactory (ipc_engine.py, nccl_engine.py: update-info parsing, packed IPC rebuild, packed and
unpacked NCCL receive), vLLM's StatelessProcessGroup rendezvous (nccl_common.py), and the layerwise-reload
lifecycle (model_loader/reload) that re-runs process_weights_after_loading.

What is stubbed (GPU-only): torch.cuda / torch.accelerator device, stream and event calls; torch's
rebuild_cuda_tensor (here it opens the CPU shared-memory handles of mcore2hf.senders.vllm.cpu_ipc_args, same
15-argument layout); vLLM's PyNcclCommunicator (here gloo over the same StatelessProcessGroup store); the engine
core under AsyncLLM / LLM (collective_rpc runs the real Worker methods after a msgpack round trip; pause/resume
only record that they happened); the model (a tiny nn.Module with vLLM's default_weight_loader and an FP8-style
layer whose quant method dequantizes in process_weights_after_loading).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import traceback
import types
from datetime import timedelta

import torch

GPU_UUID = "cpu"  # what mcore2hf.senders.vllm.device_uuid gives CPU tensors
_worker_gpu = threading.local()  # the "GPU" of the worker running in this thread (EngineCore sets it)
# the fields of vLLM's ModelConfig the load and reload paths read for this model
MODEL_CONFIG = types.SimpleNamespace(dtype=torch.float32, word_embeddings_untied_by_checkpoint=False,
                                     quantization=None)


# ---------------------------------------------------------------- stubs of GPU-only calls (before vllm imports)

class _Stream:
    def __init__(self, *a, **k) -> None: ...

    def synchronize(self) -> None: ...

    def wait_event(self, event) -> None: ...

    def wait_stream(self, stream) -> None: ...


class _Event:
    def __init__(self, *a, **k) -> None: ...

    def record(self, stream=None) -> None: ...

    def synchronize(self) -> None: ...

    def wait(self, stream=None) -> None: ...


def _rebuild_cpu_shared(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, storage_device,
                        storage_handle, storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
                        ref_counter_offset, event_handle, event_sync_required):
    """Stand-in for torch's rebuild_cuda_tensor (same parameters): opens a cpu_ipc_args handle."""
    manager, name, size = storage_handle
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
    t = torch.empty(0, dtype=dtype)
    t.set_(storage, tensor_offset, tensor_size, tensor_stride)
    return t


def install_gpu_stubs() -> None:
    import torch.multiprocessing.reductions as reductions

    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.synchronize = lambda *a, **k: None
    torch.accelerator.current_stream = lambda *a, **k: _Stream()
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        uuid=getattr(_worker_gpu, "uuid", GPU_UUID))
    torch.cuda.Stream = _Stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.ipc_collect = lambda: None
    torch.Event = _Event
    torch.Tensor.record_stream = lambda self, stream: None
    reductions.rebuild_cuda_tensor = _rebuild_cpu_shared


class GlooCommunicator:
    """vLLM's PyNcclCommunicator interface (broadcast(tensor, src, stream), destroy) over gloo, built on the
    StatelessProcessGroup vLLM's rendezvous made."""

    def __init__(self, group, device=None, library_path=None):
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.rank, self.world_size = group.rank, group.world_size
        self.device = torch.device("cpu")
        self.pg = ProcessGroupGloo(PrefixStore("gloo", group.store), group.rank, group.world_size,
                                   timedelta(seconds=60))

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        from torch.distributed import BroadcastOptions
        from vllm.distributed.device_communicators.pynccl_wrapper import ncclDataTypeEnum

        ncclDataTypeEnum.from_torch(tensor.dtype)  # PyNccl refuses dtypes NCCL lacks; gloo lacks more (fp8)
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor.view(-1).view(torch.uint8)], opts).wait()  # NCCL copies the bytes

    def destroy(self) -> None:
        self.pg = None


# ---------------------------------------------------------------- a tiny model vLLM's reload lifecycle can drive

def _dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return weight.float() * s[:weight.shape[0], :weight.shape[1]]


def tiny_model():
    """Linear layers with checkpoint-format parameters (vLLM's default_weight_loader), one FP8-style layer
    (float8_e4m3fn weight, float32 weight_scale_inv per 2x2 block) whose quant method writes the dequantized
    weight into a `kernel` buffer in process_weights_after_loading, as quantized engines repack."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class Dequant(QuantizeMethodBase):
        runs = 0

        def create_weights(self, layer, *args, **kwargs):
            pass

        def apply(self, layer, *args, **kwargs):
            raise NotImplementedError

        def process_weights_after_loading(self, layer) -> None:
            Dequant.runs += 1
            k = _dequant(layer.weight.data, layer.weight_scale_inv.data, 2)
            if "kernel" in layer._buffers:
                layer.kernel.copy_(k)
            else:
                layer.register_buffer("kernel", k)

    def param(*shape, dtype=torch.float32):
        p = torch.nn.Parameter(torch.zeros(*shape).to(dtype), requires_grad=False)
        p.weight_loader = default_weight_loader
        return p

    class Layer(torch.nn.Module):
        def __init__(self, fp8: bool):
            super().__init__()
            if fp8:
                self.weight = param(4, 6, dtype=torch.float8_e4m3fn)
                self.weight_scale_inv = param(2, 3)
                self.quant_method = Dequant()
            else:
                self.weight = param(3, 5, dtype=torch.bfloat16)
                self.bias = param(3)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(False), Layer(True), Layer(False)])

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            loaded = set()
            for name, t in weights:
                p = params[name]
                p.weight_loader(p, t)
                loaded.add(name)
            return loaded

    model = Model()
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    model.Dequant = Dequant
    return model


def named_model(tensors: dict[str, torch.Tensor], device: str = "cpu", keep_received: bool = True):
    """A model holding one parameter per HF name (zeros on `device`, shaped and typed as `tensors`, which may be
    meta tensors; nested modules along the dots, vLLM's default_weight_loader) whose load_weights also keeps a
    copy of every tensor vLLM's receive path hands it (`model.received[name]`: one per load, in order), to check
    what each engine rank got (`keep_received=False`: only the copy into the parameters, as a model's loader)."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            params = dict(self.named_parameters())
            loaded = set()
            for name, t in weights:
                if keep_received:
                    self.received.setdefault(name, []).append(t.clone())
                params[name].weight_loader(params[name], t)
                loaded.add(name)
            return loaded

    model = Model()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = model
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        p = torch.nn.Parameter(torch.zeros(t.shape, dtype=t.dtype, device=device), requires_grad=False)
        p.weight_loader = default_weight_loader
        m.register_parameter(leaf, p)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    model.received = {}
    return model


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-format tensors for tiny_model, different per seed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, fp8 in enumerate((False, True, False)):
        if fp8:
            out[f"layers.{i}.weight"] = (torch.randn(4, 6, generator=g) * 4).to(torch.float8_e4m3fn)
            out[f"layers.{i}.weight_scale_inv"] = torch.rand(2, 3, generator=g) + 0.5
        else:
            out[f"layers.{i}.weight"] = torch.randn(3, 5, generator=g).bfloat16()
            out[f"layers.{i}.bias"] = torch.randn(3, generator=g)
    return out


def initial_load(model, tensors) -> None:
    """The engine's first load: load_weights then vLLM's process_weights_after_loading."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model.load_weights(list(tensors.items()))
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))


def check_model(model, tensors) -> None:
    """Every parameter equals what was sent, byte for byte, and the FP8 layer's kernel was reprocessed."""
    params = dict(model.named_parameters())
    assert set(params) == set(tensors), (sorted(params), sorted(tensors))
    for name, t in tensors.items():
        p = params[name].data
        assert p.dtype == t.dtype and torch.equal(p.view(torch.uint8), t.contiguous().view(torch.uint8)), name
    layer = model.layers[1]
    assert torch.equal(layer.kernel, _dequant(tensors["layers.1.weight"], tensors["layers.1.weight_scale_inv"], 2))


# ---------------------------------------------------------------- vLLM workers, engine clients, servers

def make_worker(backend: str, rank: int = 0, tp: int = 1, tensors: dict[str, torch.Tensor] | None = None,
                device: str = "cpu", load: bool = True, draft: dict[str, torch.Tensor] | None = None,
                keep_received: bool = True):
    """vLLM's real Worker class (methods unmodified) around a tiny model (or a named_model of `tensors`), with the
    weight-transfer engine vLLM's factory creates for `backend`; nothing of the GPU worker's init runs. On
    `device` "cuda" the named_model's parameters and the transfer engine are on GPU 0 (real CUDA IPC); with
    load=False its parameters start as zeros (no initial load, nothing kept per load). `draft`: a speculative
    draft model too (a named_model of those tensors, zeros, keeping what it receives), which the worker's draft
    sessions (start_draft_weight_update) retarget the transfer engine at, as its model runner holds one
    (gpu_worker.py:1164 get_draft_model, :1180 _set_draft_weight_update_target); `keep_received=False`: only its
    parameters hold what it was sent."""
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.v1.worker.gpu_worker import Worker

    pc = ParallelConfig(tensor_parallel_size=tp)
    pc.rank = rank
    vc = VllmConfig(parallel_config=pc, device_config=DeviceConfig(device=device))
    model = tiny_model() if tensors is None else named_model(tensors, device, keep_received=load)
    if load:
        initial_load(model, model_tensors(0) if tensors is None else tensors)
    if tensors is not None:
        model.received.clear()
    w = Worker.__new__(Worker)
    w.vllm_config, w.parallel_config, w.rank, w.local_rank = vc, pc, rank, rank  # WorkerBase.__init__ sets both
    draft_model = None if draft is None else named_model(draft, device, keep_received=keep_received)
    # the draft's ModelConfig fields the reload reads (finalize_layerwise_reload): the target's here
    w.speculative_config = None if draft is None else types.SimpleNamespace(draft_model_config=MODEL_CONFIG)
    w.model_runner = types.SimpleNamespace(reset_lora_state=lambda: None, get_model=lambda: model,
                                           get_draft_model=lambda: draft_model)
    w.draft_model = draft_model
    w._weight_update_active, w._weight_update_is_draft = False, False
    vc.model_config = MODEL_CONFIG
    w.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=backend), vc, torch.device(device, 0) if device == "cuda" else torch.device(device),
        model)
    w.model = model
    _stub_worker_groups()
    return w


def _stub_worker_groups() -> None:
    """vLLM's process groups are not formed here: the worker's checksum prefix (gpu_worker.py:380) reads its rank
    in the TP group (the worker running in this thread) and PP / PCP rank 0."""
    from vllm.v1.worker import gpu_worker

    gpu_worker.get_tp_group = lambda: types.SimpleNamespace(rank_in_group=getattr(_worker_gpu, "rank", 0))
    gpu_worker.get_pp_group = gpu_worker.get_pcp_group = lambda: types.SimpleNamespace(rank_in_group=0)


def on_every_worker(fn, workers: list) -> list:
    """fn(worker) on every worker at once, one thread each (as vLLM's workers run a collective_rpc); their results
    in worker order, or the first error raised once all have finished."""
    results, errors = [None] * len(workers), []

    def run(i, w):
        try:
            results[i] = fn(w)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def msgpack_round_trip(obj):
    """collective_rpc arguments as the engine core receives them (vllm v1/serial_utils.py)."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder().decode(MsgpackEncoder().encode(obj))


class EngineCore:
    """The engine core under AsyncLLM / LLM: collective_rpc reaches each worker (concurrently, as vLLM's executor
    does) after a msgpack round trip; the weight version and pause state are recorded."""

    def __init__(self, workers: list):
        self.workers = workers
        self.version = None
        self.events: list[str] = []

    def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        kwargs = msgpack_round_trip(kwargs or {})
        self.events.append(method)
        def run(w):
            _worker_gpu.uuid = getattr(w, "gpu_uuid", GPU_UUID)
            _worker_gpu.rank = w.rank
            return getattr(w, method)(*args, **kwargs)

        return on_every_worker(run, self.workers)


def async_client(core: EngineCore):
    """An AsyncLLM whose weight-transfer methods are vLLM's own (v1/engine/async_llm.py), over `core`."""
    from vllm.v1.engine.async_llm import AsyncLLM

    class Client:
        pass

    for name in ("init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
                 "start_draft_weight_update", "update_weights", "finish_weight_update", "update_weight_version",
                 "compute_weight_checksums"):
        setattr(Client, name, getattr(AsyncLLM, name))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await asyncio.to_thread(core.collective_rpc, method, timeout, args, kwargs)

    async def pause_generation(self, mode="abort", clear_cache=True):
        core.events.append(f"pause:{mode}")

    async def resume_generation(self):
        core.events.append("resume")

    Client.collective_rpc = collective_rpc
    Client.pause_generation = pause_generation
    Client.resume_generation = resume_generation
    c = Client()
    c.engine_core = types.SimpleNamespace()

    async def set_version(v):
        core.version = v

    c.engine_core.set_weight_version_async = set_version

    async def checksums():  # v1/engine/core.py:1085 EngineCore.compute_weight_checksums, reached over its client
        return await asyncio.to_thread(core.collective_rpc, "compute_weight_checksums")

    c.engine_core.compute_weight_checksums_async = checksums
    c.vllm_config = core.workers[0].vllm_config
    return c


def local_llm(core: EngineCore):
    """An LLM whose weight-transfer methods are vLLM's own RLOfflineMixin (entrypoints/rl/offline.py)."""
    from vllm.entrypoints.llm import LLM as VLLM_LLM
    from vllm.entrypoints.rl.offline import RLOfflineMixin

    class LLM(RLOfflineMixin):
        collective_rpc = VLLM_LLM.collective_rpc  # llm.py:573, to llm_engine.collective_rpc

    llm = LLM.__new__(LLM)
    llm.llm_engine = types.SimpleNamespace(
        collective_rpc=lambda method, timeout=None, args=(), kwargs=None: core.collective_rpc(method, timeout, args,
                                                                                             kwargs),
        set_weight_version=lambda v: setattr(core, "version", v),
        vllm_config=core.workers[0].vllm_config)
    return llm


class Server:
    """vLLM's RL routes (and /version) with vLLM's exception handlers, served by uvicorn on a port it picks."""

    def __init__(self, client, rl_routes: bool = True, version: str | None = None, state=None,
                 config: dict | None = None):
        import uvicorn
        from fastapi import FastAPI
        from vllm.entrypoints.rl.factories import register_rl_api_routers
        from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

        app = FastAPI()
        if rl_routes:
            register_rl_api_routers(app)  # what VLLM_SERVER_DEV_MODE=1 adds (launchers/api_server/routers.py)
        init_exception_handler(app)

        @app.get("/version")
        async def show_version():  # vllm's entrypoints/serve/instrumentator/basic.py answer
            import vllm

            return {"version": version or vllm.__version__}

        @app.get("/get_world_size")
        async def world_size():  # api_router.get_world_size reads this config
            return {"world_size": client.vllm_config.parallel_config.world_size_across_dp}

        if config is not None:  # the dev-mode /server_info (entrypoints/serve/dev/server_info/api_router.py:43-59):
            @app.get("/server_info")  # the VllmConfig as JSON; here the fields the senders read, as vLLM names them
            async def server_info(config_format: str = "text"):
                return {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {},
                        "system_env": {}}

        if state is not None:  # the harness' own route: what the engine's parameters hold (serve())
            @app.get("/mcore2hf_state")
            async def harness_state(digest: str = "sha256"):
                return await asyncio.to_thread(state, digest)

        app.state.engine_client = client
        app.state.args = types.SimpleNamespace(log_error_stack=False)  # vLLM's server CLI args, read by its handlers
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            threading.Event().wait(0.05)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# ---------------------------------------------------------------- LoRA adapters (POST /v1/load_lora_adapter)

class LoRACore:
    """The engine side of add_lora, vLLM 0.33.0's own code per worker of an engine of TP `tp`: the LoRARequest
    after the msgpack round trip collective_rpc gives it, then the release's LRUCacheWorkerLoRAManager._load_adapter
    (lora/worker_manager.py:106: expected modules from the model's packed_modules_mapping, PEFTHelper.from_local_dir
    and validate_legal against the LoRAConfig, LoRAModel.from_local_checkpoint on CPU, the MoE-format and
    classification-head checks of LoRAModelManager) for Qwen3ForCausalLM's LoRA modules
    (model_executor/models/qwen3.py:284 packed_modules_mapping; supported modules: the packed names and the
    unpacked linears) or Qwen3MoeForCausalLM's (its qkv_proj, o_proj and the 2-D per-expert form). Each worker's cache keeps the LoRAModel by adapter id; load_inplace replaces it. Stand-in:
    the adapter manager's model (no hf_to_vllm_mapper, no skip prefixes) and its wrapped modules (none: the MoE
    format check has no FusedMoE wrapper to check against)."""

    def __init__(self, hf_config: str, tp: int, max_lora_rank: int = 8):
        from transformers import AutoConfig
        from vllm.config.lora import LoRAConfig
        from vllm.lora import lora_model
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.model_manager import LoRAModelManager
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
        from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

        lora_model.PIN_MEMORY = False  # GPU-only: pinning host memory needs an accelerator (lora_model.py:132)
        cfg = AutoConfig.from_pretrained(hf_config)
        self.workers, self.events = [], []
        if cfg.model_type == "qwen3_moe":
            from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
            from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

            # the 2-D MoE LoRA form (lora/utils.py:424-430 process_packed_modules_mapping): "experts" packs every
            # expert's gate/up/down as RoutedExperts.get_expert_mapping lists them (routed_experts.py:1107, the
            # checkpoint names Qwen3-MoE's experts load from)
            packed = dict(Qwen3MoeForCausalLM.packed_modules_mapping)
            packed["experts"] = [w.rstrip(".") for _, w, _, _ in RoutedExperts.build_expert_params_mapping(
                "gate_proj", "down_proj", "up_proj", num_experts=cfg.num_experts, routed_experts_prefix="")]
            supported = [*packed, "o_proj"]
        else:
            packed = Qwen3ForCausalLM.packed_modules_mapping
            supported = [*packed, "o_proj", "down_proj"]
        for rank in range(tp):
            adapters = types.SimpleNamespace(
                supported_lora_modules=supported, packed_modules_mapping=packed,
                model=types.SimpleNamespace(), moe_ep_load_spec=None, modules={}, _classification_head=None,
                _enable_mixed_moe_lora_format=False)
            for m in ("_validate_moe_lora_format", "_validate_classification_head_lora", "_get_lora_layer_weights"):
                setattr(adapters, m, types.MethodType(getattr(LoRAModelManager, m), adapters))
            w = LRUCacheWorkerLoRAManager.__new__(LRUCacheWorkerLoRAManager)
            w.__dict__.update(_adapter_manager=adapters, max_position_embeddings=cfg.max_position_embeddings,
                              lora_config=LoRAConfig(max_lora_rank=max_lora_rank, lora_dtype=torch.float32),
                              vocab_size=cfg.vocab_size, _lora_model_cls=LoRAModel)
            w.rank, w.loaded = rank, {}
            self.workers.append(w)

    def add_lora(self, lora_request) -> bool:
        self.events.append(f"add_lora:{lora_request.lora_name}:{lora_request.load_inplace}"
                           + (":3d" if lora_request.is_3d_lora_weight else ""))
        # the engine core's utility call: msgpack, then EngineCoreProc._convert_msgspec_args (v1/engine/core.py:1854)
        # back to the method's argument type
        from vllm.v1.engine.core import EngineCoreProc

        bound = EngineCoreProc.__new__(EngineCoreProc).add_lora  # the method as the core looks it up (bound)
        (req,) = EngineCoreProc._convert_msgspec_args(bound, (msgpack_round_trip([lora_request])[0],))
        def run(w):
            if req.lora_int_id in w.loaded and not req.load_inplace:
                return  # already loaded (worker_manager.add_adapter keeps the cached one)
            w.loaded[req.lora_int_id] = (req.lora_name, w._load_adapter(req))

        on_every_worker(run, self.workers)
        return True

    def state(self) -> list[dict]:
        """Per worker, per adapter name: each module's LoRALayerWeights (digest and shape of lora_a, lora_b;
        rank, scaling)."""
        import hashlib

        def digest(t):
            t = t.detach().contiguous()
            return [hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest(), list(t.shape)]

        return [{name: {m: {"a": digest(lw.lora_a), "b": digest(lw.lora_b), "rank": lw.rank,
                            "scaling": lw.scaling} for m, lw in model.loras.items()}
                 for name, model in w.loaded.values()} for w in self.workers]


def moe3d_slices(adapter_dir: str, hf_config: str, tps: list[int]) -> dict:
    """What each engine TP rank's 3-D MoE LoRA layer holds after loading PEFT's stacked expert form from
    `adapter_dir`, at each engine TP of `tps`: per TP, per rank, per layer, sha256 and shape of the slot's four
    stacked buffers (w13_lora_a [E, r, hidden], w13_lora_b [E, 2 inter/TP, r], w2_lora_a [E, r, inter/TP],
    w2_lora_b [E, hidden, r]).

    vLLM 0.33.0's own code from the LoRAModel on: `LoRACore`'s worker builds the LoRAModel with
    is_3d_lora_weight=True (worker_manager.py:106 _load_adapter), then LoRAModelManager._stack_moe_lora_weights
    (model_manager.py:954-1010: PEFT's [E*r, in] / [out, r*E] to [E, r, in] / [E, out, r]),
    FusedMoE3DWithLoRA.create_lora_weights, and its set_lora (lora/layers/fused_moe.py:586-622) with its
    _slice_w13_a / _slice_w13_b (:541-575: gate and up halves each cut to the rank's rows) / _slice_w2_a (cut to
    the rank's inter columns) / _slice_w2_b. Stand-in: FusedMoEWithLoRA.__init__ (fused_moe.py:31-88 needs a
    MoERunner with a Triton MoE kernel, GPU-only) is replaced by the attributes it sets from the runner's
    moe_config: tp_size / tp_rank of the MoE parallel config, no EP, intermediate_size_per_partition =
    moe_intermediate_size / TP (FusedMoE's own divide), hidden_dim, num_experts, device CPU, one slot; the
    manager by the attributes _stack_moe_lora_weights reads (a 3-D MoE model, not pooling)."""
    import hashlib

    from transformers import AutoConfig
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers.fused_moe import FusedMoE3DWithLoRA
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.request import LoRARequest

    cfg = AutoConfig.from_pretrained(hf_config)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        r = json.load(f)["r"]
    experts = cfg.num_experts
    layers = [i for i in range(cfg.num_hidden_layers)]

    def digest(t):
        t = t.detach().contiguous()
        return [hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest(), list(t.shape)]

    out = {}
    for tp in tps:
        core = LoRACore(hf_config, tp, max_lora_rank=r)
        ranks = []
        for w in core.workers:
            model = w._load_adapter(LoRARequest("moe3d", 1, adapter_dir, is_3d_lora_weight=True))
            manager = types.SimpleNamespace(_is_3d_moe_model=True, is_pooling_model=False)
            manager._get_lora_layer_weights = types.MethodType(LoRAModelManager._get_lora_layer_weights, manager)
            held = {}
            for i in layers:
                name = f"model.layers.{i}.mlp.experts"
                if model.get_lora(name) is None:
                    continue
                layer = FusedMoE3DWithLoRA.__new__(FusedMoE3DWithLoRA)
                torch.nn.Module.__init__(layer)
                layer.moe_config = types.SimpleNamespace(
                    hidden_dim=cfg.hidden_size, num_local_experts=experts, num_experts=experts,
                    intermediate_size_per_partition=cfg.moe_intermediate_size // tp,
                    intermediate_size_per_partition_unpadded=None,
                    moe_parallel_config=types.SimpleNamespace(tp_size=tp, tp_rank=w.rank, use_ep=False, ep_rank=0))
                layer.tp_size, layer.tp_rank, layer.device = tp, w.rank, torch.device("cpu")
                layer._w13_slices, layer.enable_moe_shared_loras = 1, False
                model_config = types.SimpleNamespace(architectures=list(cfg.architectures))
                layer.create_lora_weights(1, LoRAConfig(max_lora_rank=r, max_loras=1, lora_dtype=torch.float32),
                                          model_config)
                LoRAModelManager._stack_moe_lora_weights(manager, model, layer, name)
                lw = model.get_lora(name)
                layer.set_lora(0, lw.lora_a, lw.lora_b)
                held[name] = {k: digest(getattr(layer, k)[0][0]) for k in
                              ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked", "w2_lora_b_stacked")}
            ranks.append(held)
        out[str(tp)] = ranks
    return out


def serve_lora(hf_config: str, tp: int) -> None:
    """Four vLLM front ends on ports the OS picks (printed as `PORTS <with LoRA, TP tp> <without> <with LoRA, TP 1>
    <with LoRA, TP 1, max LoRA rank 1>`), each with the RL routes
    (/pause, /resume; VLLM_SERVER_DEV_MODE=1), /version and /reset_prefix_cache (dev cache router,
    entrypoints/serve/dev/cache/api_router.py); all but the second also with vLLM's LoRA routes (entrypoints/serve/lora/
    api_router.py, attached as with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) over the release's OpenAIServingModels,
    whose add_lora reaches LoRACore. Stub: SageMaker's adapter-handler registration
    (model_hosting_container_standards, not installed) as an identity decorator. GET /mcore2hf_lora: the
    workers' LoRA models and the engine events."""
    import uvicorn
    from fastapi import FastAPI

    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    install_gpu_stubs()
    sm = types.ModuleType("model_hosting_container_standards.sagemaker")
    sm.register_load_adapter_handler = sm.register_unload_adapter_handler = lambda **kw: (lambda f: f)
    sys.modules["model_hosting_container_standards"] = types.ModuleType("model_hosting_container_standards")
    sys.modules["model_hosting_container_standards.sagemaker"] = sm
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.lora.api_router import attach_router

    # the fourth: --max-lora-rank 1, below the tests' adapters' r (its load fails in PEFTHelper.validate_legal)
    cores = [LoRACore(hf_config, tp), None, LoRACore(hf_config, 1), LoRACore(hf_config, 1, max_lora_rank=1)]

    class Client:
        model_config = types.SimpleNamespace(max_model_len=128)
        renderer = input_processor = None

        def __init__(self, core):
            self.core = core

        async def add_lora(self, lora_request):
            return await asyncio.to_thread(self.core.add_lora, lora_request)

        async def reset_prefix_cache(self, reset_running_requests=False, reset_external=False):
            self.core.events.append("reset_prefix_cache")
            return True

        async def pause_generation(self, mode="abort", clear_cache=True):
            self.core.events.append(f"pause:{mode}")

        async def resume_generation(self):
            self.core.events.append("resume")

    urls = []
    for core in cores:
        lora = core is not None
        core = core or LoRACore(hf_config, 1)  # never reached: the app has no LoRA routes
        app = FastAPI()
        register_rl_api_routers(app)
        app.include_router(cache_router)
        if lora:
            attach_router(app)
        init_exception_handler(app)

        @app.get("/version")
        async def show_version():
            import vllm

            return {"version": vllm.__version__}

        def state_route(core):
            async def lora_state():
                return {"workers": core.state(), "events": core.events}

            return lora_state

        app.get("/mcore2hf_lora")(state_route(core))

        client = Client(core)
        app.state.engine_client = client
        app.state.openai_serving_models = OpenAIServingModels(client, [BaseModelPath(name="base", model_path=hf_config)])
        app.state.args = types.SimpleNamespace(log_error_stack=False)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            threading.Event().wait(0.05)
        urls.append(str(server.servers[0].sockets[0].getsockname()[1]))
    print("PORTS " + " ".join(urls), flush=True)
    threading.Event().wait()


# ---------------------------------------------------------------- trainer side

class ListExporter:
    """What sync() needs of an exporter, over prebuilt buckets (one list per sync round)."""

    def __init__(self, rounds: list[list]):
        self.rounds = list(rounds)

    def executor(self, bucket_bytes, receivers):
        buckets = self.rounds.pop(0)
        return types.SimpleNamespace(programs=buckets, stats={}, run=lambda timing=False: iter(buckets))


def make_bucket(index: int, tensors: dict[str, torch.Tensor]):
    from mcore2hf.plan.export import pack_tight
    from mcore2hf.transfer.buckets import Bucket

    entries = pack_tight([(n, tuple(t.shape), t.dtype, n) for n, t in tensors.items()])
    flat = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
    for e in entries:
        flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    return Bucket(index, flat, entries)


def buckets_of(tensors: dict[str, torch.Tensor], per_bucket: int = 2) -> list:
    names = list(tensors)
    return [make_bucket(i, {n: tensors[n] for n in names[s:s + per_bucket]})
            for i, s in enumerate(range(0, len(names), per_bucket))]


def init_trainer_world() -> None:
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


# ---------------------------------------------------------------- scenarios

def _expect_engine_error(fn, match: str) -> str:
    from mcore2hf.senders import EngineError

    try:
        fn()
    except EngineError as e:
        assert match in str(e), f"expected {match!r} in: {e}"
        return str(e)
    raise AssertionError(f"no EngineError (expected {match!r})")


def scenario_ipc(http: bool, packed: bool) -> None:
    from mcore2hf.senders import sync
    from mcore2hf.senders.vllm import VLLMColocatedSender

    init_trainer_world()
    core = EngineCore([make_worker("ipc")])
    server = Server(async_client(core)) if http else None
    try:
        engine = server.url if http else local_llm(core)
        sender = VLLMColocatedSender(engine, 1, packed=packed, timeout=60)
        for version, seed in ((1, 1), (2, 2)):
            tensors = model_tensors(seed)
            runs = core.workers[0].model.Dequant.runs
            sync(ListExporter([buckets_of(tensors)]), sender, progress=False)
            assert sender.version == version and core.version == str(version), (sender.version, core.version)
            check_model(core.workers[0].model, tensors)
            assert core.workers[0].model.Dequant.runs == runs + 1  # reprocessed once, inside vLLM's reload
            assert not core.workers[0]._weight_update_active
        calls = [e for e in core.events if e not in ("update_weights",)]
        expected = ["init_weight_transfer_engine", "pause:abort", "start_weight_update", "finish_weight_update",
                    "resume"] if http else ["init_weight_transfer_engine", "start_weight_update",
                                            "finish_weight_update"]
        assert calls[:len(expected)] == expected, calls

        # an exception inside sync() on this rank (here the exporter's, after one bucket went): the sender's abort()
        # closes the engine's session, so the next sync can open one (the worker refuses a second start)
        def one_bucket_then_fail():
            yield buckets_of(model_tensors(3))[0]
            raise RuntimeError("exporter failed (simulated)")

        failing = types.SimpleNamespace(executor=lambda bucket_bytes, receivers: types.SimpleNamespace(
            programs=[None, None], stats={}, run=lambda timing=False: one_bucket_then_fail()))
        try:
            sync(failing, sender, progress=False)
            raise AssertionError("sync did not raise the exporter's exception")
        except RuntimeError as e:
            assert "exporter failed" in str(e), e
        assert sender.version == 2 and not core.workers[0]._weight_update_active, sender.version
        tensors = model_tensors(4)
        sync(ListExporter([buckets_of(tensors)]), sender, progress=False)
        assert sender.version == 3 and core.version == "3", (sender.version, core.version)
        check_model(core.workers[0].model, tensors)

        # verified sync (sync(verify=...), vLLM's own /weight_checker or, for an LLM, its workers' checksums): the
        # engine holds model_tensors(4), as the trainer does, so a proof sync (baseline, reset to zeros, sync,
        # compare) brings every parameter, the FP8 layer's weight and scales included, back to the same bytes
        rep = sync(ListExporter([buckets_of(tensors)]), sender, progress=False, verify="proof")
        assert rep.verify == "proof" and sender.version == 4 and len(rep.checksums) == 1, rep
        assert list(next(iter(rep.checksums.values()))) == ["dp0:pp0:pcp0:tp0"], rep.checksums
        check_model(core.workers[0].model, tensors)
        assert "reset_weights" in core.events and "compute_weight_checksums" in core.events
        # a sync that writes one wrong tensor: the proof fails, naming the engine parameter and the HF tensor sent
        wrong = dict(tensors, **{"layers.2.bias": tensors["layers.2.bias"] + 1})
        msg = _expect_engine_error(lambda: sync(ListExporter([buckets_of(wrong)]), sender, progress=False,
                                                verify="proof"), "layers.2.bias")
        assert "1 engine parameters differ" in msg and "dp0:pp0:pcp0:tp0: layers.2.bias <- layers.2.bias" in msg, msg
        assert sender.version == 4
        # the cheap record: the engine's checksums of the same weights give the proof's digests again
        rep2 = sync(ListExporter([buckets_of(tensors)]), sender, progress=False, verify="checksum")
        assert sender.version == 5 and rep2.checksums == rep.checksums, (rep2.checksums, rep.checksums)
        check_model(core.workers[0].model, tensors)
    finally:
        if server:
            server.stop()


def scenario_ipc_tp2_by_uuid() -> None:
    """An engine with TP 2 on two "GPUs": the update carries both trainer ranks' handles of their own bucket copy
    (merged as the group's first rank merges them) and each vLLM worker opens the one keyed by its GPU's UUID."""
    from mcore2hf.senders.vllm import VLLMColocatedSender, VLLMHTTPEngine, ipc_args

    init_trainer_world()
    workers = [make_worker("ipc", r, 2) for r in range(2)]
    for r, w in enumerate(workers):
        w.gpu_uuid = f"GPU-{r}"
    core = EngineCore(workers)
    server = Server(async_client(core))
    try:
        sender = VLLMColocatedSender(server.url, 1, timeout=30)
        sender.begin(1)
        VLLMHTTPEngine(server.url).init_weight_transfer_engine({"packed": True})
        sender._start()
        per_rank = [model_tensors(20), model_tensors(21)]  # different, to see which handle each worker took
        for i, names in enumerate((list(per_rank[0])[:3], list(per_rank[0])[3:])):
            buckets = [make_bucket(i, {n: t[n] for n in names}) for t in per_rank]
            sender._bucket = buckets[0]
            sender._update([{f"GPU-{r}": ipc_args(b.flat)} for r, b in enumerate(buckets)])
        sender._finish()
        assert sender._error is None, sender._error
        for w, tensors in zip(workers, per_rank):
            check_model(w.model, tensors)
    finally:
        server.stop()


def _ipc_trainer(url: str) -> int:
    """A rank of a trainer world of 2 (one rank per engine "GPU"): two syncs of its own copy of the buckets,
    different per rank so each worker's bytes show which handle it opened."""
    import torch.distributed as dist

    from mcore2hf.senders import sync, vllm

    rank = dist.get_rank()
    # GPU-only fact stubbed: CPU tensors have no GPU UUID ("cpu" on every rank); here each rank has its own GPU
    vllm.device_uuid = lambda device: f"GPU-{rank}"
    sender = vllm.VLLMColocatedSender(url if rank == 0 else None, 2, timeout=60)
    for version in (1, 2):
        sync(ListExporter([buckets_of(model_tensors(30 + 10 * version + rank))]), sender, progress=False)
    return sender.version


def scenario_ipc_tp2_sync() -> None:
    """IPC into an engine of TP 2 through sync(): a trainer world of 2 processes (the engine's group), the first
    rank merging both ranks' handles into each update; two syncs, each worker holding its own rank's bytes and the
    weight version recorded."""
    from harness.vllm_real import _ipc_tp2_trainers  # by module name: this file may run as __main__
    from mcore2hf.runtime.world import run_world

    workers = [make_worker("ipc", r, 2) for r in range(2)]
    for r, w in enumerate(workers):
        w.gpu_uuid = f"GPU-{r}"
    core = EngineCore(workers)
    server = Server(async_client(core))
    ckpt, full, sharded_workers, sharded_server = _sharded_engine()
    try:
        # one trainer world for this case and the engine-sharded one (2 ranks, as this case needs)
        res = run_world(_ipc_tp2_trainers, _sharded_layout(), server.url, sharded_server.url, ckpt, timeout=300)
        _SHARDED_RUN.update(full=full, workers=sharded_workers, res=[r["sharded"] for r in res])
        versions = [r["version"] for r in res]
        assert versions == [2, 2] and core.version == "2", (versions, core.version)
        for r, w in enumerate(workers):
            check_model(w.model, model_tensors(50 + r))
            assert not w._weight_update_active
        calls = [e for e in core.events if e != "update_weights"]
        one = ["pause:abort", "start_weight_update", "finish_weight_update", "resume"]
        assert calls[0] == "init_weight_transfer_engine" and [c for c in calls if c in one] == one + one, calls
    finally:
        server.stop()
        sharded_server.stop()


SHARDED_BUCKET = 256 * 1024  # bytes: a few buckets per sync of the tiny qwen3_moe (~1 MiB)
_SHARDED_RUN: dict = {}  # the engine-sharded case's results, once scenario_ipc_tp2_sync ran it in its world


def _sharded_layout():
    from mcore2hf.runtime.world import Layout

    return Layout(tp=1, ep=2)  # the engine-sharded case's trainer world: qwen3_moe at EP 2


def _sharded_engine():
    """The engine-sharded case's tiny qwen3_moe checkpoint, and an engine of TP 2 (named_model workers) serving."""
    import tempfile

    from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config

    ckpt = make_hf_checkpoint(tiny_config("qwen3_moe"), tempfile.mkdtemp(prefix="vllm-sharded-"))
    full = read_hf_checkpoint(ckpt)
    workers = [make_worker("ipc", r, 2, full) for r in range(2)]
    for r, w in enumerate(workers):
        w.gpu_uuid = f"GPU-{r}"
    return ckpt, full, workers, Server(async_client(EngineCore(workers)))


def _ipc_tp2_trainers(url: str, sharded_url: str, ckpt: str) -> dict:
    return {"version": _ipc_trainer(url), "sharded": _sharded_ipc_trainer(sharded_url, ckpt, SHARDED_BUCKET)}


def _sharded_ipc_trainer(url: str, ckpt: str, bucket_bytes: int) -> dict:
    """A rank of a trainer world of 2 (real megatron-core model from `ckpt`, EP 2) feeding one vLLM engine of TP 2
    engine-sharded (debug NaN fill), first without engine EP, then with EP 2; bytes received over the wire vs what
    this rank receives in an all-ranks export."""
    import torch.distributed as dist

    from mcore2hf import HFExporter, build_model, load_hf_weights
    from mcore2hf.senders import sync, vllm

    rank = dist.get_rank()
    # GPU-only fact stubbed: CPU tensors have no GPU UUID ("cpu" on every rank); here each rank has its own GPU
    vllm.device_uuid = lambda device: f"GPU-{rank}"
    chunks = build_model(ckpt, use_te=False)
    load_hf_weights(chunks, ckpt)
    ex = HFExporter(chunks, ckpt)
    out = {"dims": ex.dims, "all_ranks_wire": sum((st.axis.size - 1) * st.slot
                                                  for p in ex.executor(bucket_bytes).programs for st in p.stages)}
    for ep in (1, 2):
        sender = vllm.VLLMColocatedSender(url if rank == 0 else None, 2, timeout=60, engine_sharding=True,
                                          engine_ep_size=ep)
        report = sync(ex, sender, progress=False, bucket_bytes=bucket_bytes, debug_nan=True)
        out[f"ep{ep}"] = {"version": sender.version, "wire": report.received_bytes, "seconds": report.seconds}
    return out


def scenario_ipc_tp2_engine_sharded() -> None:
    """Engine-sharded colocated sync (issue 15) through vLLM's IPC path into an engine of TP 2: a qwen3_moe trainer
    world at EP 2, synced engine-sharded without then with engine EP 2 (debug NaN fill). Every tensor vLLM's
    receive path handed worker r's model equals mask_to_engine of the checkpoint tensor to r's engine_regions
    (the checkpoint's values in exactly those regions, NaN elsewhere: nothing else was written), byte for byte;
    each trainer rank received fewer bytes than in an all-ranks export (none at all when engine EP = trainer EP)."""
    from harness.vllm_real import _sharded_ipc_trainer  # by module name: may run as __main__
    from mcore2hf.plan.engine_shards import EnginePlacement, engine_regions, mask_to_engine
    from mcore2hf.runtime.world import run_world

    if _SHARDED_RUN:  # ran in scenario_ipc_tp2_sync's world
        full, workers, res = _SHARDED_RUN["full"], _SHARDED_RUN["workers"], _SHARDED_RUN["res"]
    else:  # run alone (or that world failed): a world of its own
        ckpt, full, workers, server = _sharded_engine()
        try:
            res = run_world(_sharded_ipc_trainer, _sharded_layout(), server.url, ckpt, SHARDED_BUCKET, timeout=300)
        finally:
            server.stop()
    dims = res[0]["dims"]
    for r, w in enumerate(workers):
        assert set(w.model.received) == set(full), sorted(set(w.model.received) ^ set(full))[:5]
        for i, ep in enumerate((1, 2)):
            p = EnginePlacement("vllm", r, 2, ep)
            for name, t in full.items():
                want = mask_to_engine(t, engine_regions(name, t.shape, dims, p, "qwen3_moe"), debug=True)
                got = w.model.received[name][i]
                assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
                    (r, ep, name)
        assert all(len(v) == 2 for v in w.model.received.values())
        assert not w._weight_update_active
    for r in res:
        assert r["ep1"]["version"] == r["ep2"]["version"] == 1, r
        assert r["ep2"]["wire"] == 0 < r["ep1"]["wire"] < r["all_ranks_wire"], r
    print("vllm engine TP2 from qwen3_moe EP2, bytes received per trainer rank: all-ranks "
          + " ".join(str(r["all_ranks_wire"]) for r in res) + " | engine-sharded "
          + " | ".join(f"ep{ep}: " + " ".join(str(r[f'ep{ep}']['wire']) for r in res) for ep in (1, 2))
          + " (sync s: " + " ".join(f"{r[f'ep{ep}']['seconds']:.2f}" for ep in (1, 2) for r in res) + ")",
          file=sys.stderr)


def scenario_engine_sharding_refusals() -> None:
    """Engine sharding settings that cannot work are refused with a clear error before any engine call: engine
    EP the rules refuse, EP settings without engine sharding, engine sharding on a broadcast (distributed) sender,
    debug_nan on an all-ranks sync, an exporter that cannot plan engine shards."""
    import pytest

    from mcore2hf.errors import UsageError
    from mcore2hf.plan.engine_shards import EngineShardError
    from mcore2hf.senders import SGLangColocatedSender, SGLangDistributedSender, sync
    from mcore2hf.senders.vllm import VLLMColocatedSender, VLLMDistributedSender

    init_trainer_world()
    core = EngineCore([make_worker("ipc")])
    server = Server(async_client(core))
    try:
        for cls in (VLLMColocatedSender, SGLangColocatedSender):
            with pytest.raises(EngineShardError, match="ep_size: expected a divisor of tp_size=1, found 2"):
                cls(server.url, 1, timeout=30, engine_sharding=True, engine_ep_size=2)
            with pytest.raises(UsageError, match="expected engine_sharding=True"):
                cls(server.url, 1, timeout=30, engine_ep_size=2)
        with pytest.raises(UsageError, match="engine_sharding=True with a distributed sender"):
            VLLMDistributedSender([server.url], [1], engine_sharding=True)
        with pytest.raises(UsageError, match="engine_sharding=True with a distributed sender"):
            SGLangDistributedSender([server.url], [1], "127.0.0.1", 0, engine_sharding=True)
        before = len(core.events)
        with pytest.raises(UsageError, match="debug_nan: expected a sender with engine_sharding=True"):
            sync(ListExporter([buckets_of(model_tensors(5))]), VLLMColocatedSender(server.url, 1, timeout=30),
                 progress=False, debug_nan=True)
        with pytest.raises(UsageError, match="expected an HFExporter"):
            sync(ListExporter([buckets_of(model_tensors(5))]),
                 VLLMColocatedSender(server.url, 1, timeout=30, engine_sharding=True), progress=False)
        from mcore2hf import HFExporter
        from mcore2hf.plan.export import MTPTensors

        class Refusing(HFExporter):  # an exporter whose engine-shard plan the rules refuse (e.g. SGLang gpt-oss
            lora = None  # under EP); no model behind it

            def __init__(self):
                pass

            def draft_tensors(self, *args, **kwargs):
                return MTPTensors(frozenset(), frozenset())

            def engine_executor(self, *args, **kwargs):
                raise EngineShardError("refused by the rules")

        with pytest.raises(EngineShardError, match="refused by the rules"):
            sync(Refusing(), VLLMColocatedSender(server.url, 1, timeout=30, engine_sharding=True), progress=False)
        assert len(core.events) == before, core.events[before:]  # nothing reached the engine, not even a pause
    finally:
        server.stop()


def scenario_nccl(packed: bool) -> None:
    """Two engines (TP1 and TP2: 4 NCCL ranks with the trainer), vLLM's StatelessProcessGroup rendezvous, gloo
    in place of NCCL; packed chunks smaller than a bucket so each bucket spans several broadcasts."""
    from mcore2hf.senders import sync
    from mcore2hf.senders.vllm import VLLMDistributedSender

    init_trainer_world()
    cores = [EngineCore([make_worker("nccl")]), EngineCore([make_worker("nccl", r, 2) for r in range(2)])]
    servers = [Server(async_client(c)) for c in cores]
    try:
        sender = VLLMDistributedSender([s.url for s in servers], packed=packed, packed_buffer_size_bytes=40,
                                       timeout=60)
        assert sender.world_size == 4, sender.sizes
        for version, seed in ((1, 3), (2, 4)):
            tensors = model_tensors(seed)
            sync(ListExporter([buckets_of(tensors, 3)]), sender, progress=False)
            assert sender.version == version
            for c in cores:
                assert c.version == str(version)
                for w in c.workers:
                    check_model(w.model, tensors)
                    assert not w._weight_update_active
        sender.close()
    finally:
        for s in servers:
            s.stop()


def scenario_nccl_llm() -> None:
    """The NCCL backend into an in-process LLM (vLLM's RLOfflineMixin methods)."""
    from mcore2hf.senders import sync
    from mcore2hf.senders.vllm import VLLMDistributedSender

    init_trainer_world()
    core = EngineCore([make_worker("nccl")])
    sender = VLLMDistributedSender([local_llm(core)], timeout=60)
    tensors = model_tensors(8)
    sync(ListExporter([buckets_of(tensors, 3)]), sender, progress=False)
    assert sender.version == 1 and core.version == "1"
    check_model(core.workers[0].model, tensors)
    sender.close()


def scenario_nccl_failure_then_retry() -> None:
    """A dtype unpacked NCCL cannot carry is refused before its bucket moves; an engine that fails to load a bucket
    fails the sync on the trainer (no hang: one chunk per bucket), the session is closed and the group released,
    the engine stays paused; the retry forms a new group, succeeds and resumes the engine once."""
    from mcore2hf.senders import sync
    from mcore2hf.senders.vllm import VLLMDistributedSender

    init_trainer_world()
    core = EngineCore([make_worker("nccl")])
    server = Server(async_client(core))
    try:
        sender = VLLMDistributedSender([server.url], packed=False, timeout=60)
        bad = {"layers.0.mask": torch.ones(3, dtype=torch.bool), **model_tensors(9)}  # in the first bucket
        _expect_engine_error(lambda: sync(ListExporter([buckets_of(bad, 3)]), sender, progress=False),
                             "unpacked NCCL transfer cannot send ['torch.bool']")
        assert "update_weights" not in core.events and core.version is None, core.events
        assert sender.version == 0, sender.version
        sender.close()

        sender = VLLMDistributedSender([server.url], timeout=60)
        unknown = dict(model_tensors(10), **{"layers.7.weight": torch.ones(2)})
        _expect_engine_error(lambda: sync(ListExporter([buckets_of(unknown, 3)]), sender, progress=False),
                             "layers.7.weight")
        assert sender.version == 0 and core.version is None and not core.workers[0]._weight_update_active
        assert "shutdown_weight_transfer_engine" in core.events
        # the engine stays paused after a failed sync (layers may be mid-reload) until a sync succeeds
        last_pause = len(core.events) - 1 - core.events[::-1].index("pause:abort")
        assert "resume" not in core.events[last_pause:], core.events
        resumed = core.events.count("resume")
        tensors = model_tensors(11)
        sync(ListExporter([buckets_of(tensors, 3)]), sender, progress=False)
        assert sender.version == 1 and core.version == "1"
        assert core.events.count("resume") == resumed + 1 and core.events[-1] == "resume", core.events
        assert core.events.count("init_weight_transfer_engine") == 3  # the unpacked sender's, the first, the retry
        check_model(core.workers[0].model, tensors)
        sender.close()
    finally:
        server.stop()


def scenario_packed_chunks() -> None:
    """Our chunk boundaries are where vLLM's own packer (pack_tensors) cuts, for many sizes and budgets."""
    import random

    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from mcore2hf.senders.vllm import packed_chunk_ends

    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice((1, 2, 7, 64, 100, 513)) for _ in range(rng.randint(1, 12))]
        budget = rng.choice((1, 8, 64, 100, 600, 10_000))
        it = iter([(str(i), torch.zeros(s, dtype=torch.uint8)) for i, s in enumerate(sizes)])
        ends, total = [], 0
        with contextlib.suppress(Warning):
            import warnings

            warnings.simplefilter("ignore")
            while (chunk := pack_tensors(it, lambda item: item[1], budget)) is not None:
                total += chunk.packed_tensor.numel()
                ends.append(total)
        assert packed_chunk_ends(sizes, budget) == ends, (sizes, budget, ends)


def scenario_fp8_parsing() -> None:
    """An FP8 bucket's update infos pass vLLM's parsing for both backends (names and dtypes accepted)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from mcore2hf.senders.vllm import bucket_fields, ipc_args

    fp8 = {"model.layers.0.mlp.down_proj.weight": torch.randn(8, 4).to(torch.float8_e4m3fn),
           "model.layers.0.mlp.down_proj.weight_scale_inv": torch.rand(1, 1)}
    b = make_bucket(0, fp8)
    fields = bucket_fields(b)
    assert sorted(fields["dtype_names"]) == ["float32", "float8_e4m3fn"]
    for dn in fields["dtype_names"]:
        assert getattr(torch, dn) in (torch.float8_e4m3fn, torch.float32)
    NCCLWeightTransferUpdateInfo(**fields)
    IPCWeightTransferUpdateInfo(**fields, ipc_handles={GPU_UUID: ipc_args(b.flat)},
                                tensor_sizes=[e.nbytes for e in b.entries])


def scenario_refusals() -> None:
    """Unknown keys, out-of-session updates, insecure serialization off, an engine without the native API."""
    from mcore2hf.senders import sync
    from mcore2hf.senders.vllm import VLLMColocatedSender, VLLMHTTPEngine, VLLMLocalEngine

    init_trainer_world()
    core = EngineCore([make_worker("ipc")])
    server = Server(async_client(core))
    old = Server(async_client(core), rl_routes=False, version="0.10.0")
    try:
        e = VLLMHTTPEngine(server.url, timeout=30)
        e.check()
        _expect_engine_error(lambda: e.init_weight_transfer_engine({"packed": True, "bogus": 1}), "bogus")
        e.init_weight_transfer_engine({"packed": True})
        e.start_weight_update()
        _expect_engine_error(lambda: e.update_weights({"names": [], "dtype_names": [], "shapes": [],
                                                       "ipc_handles_pickled": "", "extra": 1}), "extra")
        assert not core.workers[0]._weight_update_active  # the worker closed the session on the failed update
        _expect_engine_error(lambda: e.update_weights({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]],
                                                       "ipc_handles": {}, "tensor_sizes": [4]}),
                             "start_weight_update must be called before update_weights")
        # an old engine: a clear error before any byte moves
        before = len(core.events)
        sender = VLLMColocatedSender(old.url, 1, timeout=30)
        msg = _expect_engine_error(lambda: sync(ListExporter([buckets_of(model_tensors(5))]), sender,
                                                progress=False), "no native weight-transfer API")
        assert "0.10.0" in msg and "VLLM_SERVER_DEV_MODE=1" in msg, msg
        assert len(core.events) == before and sender.version == 0
        _expect_engine_error(VLLMLocalEngine(object()).check, "no native weight-transfer API")
        # verify on a release without the weight checker: refused by version before anything is paused or sent
        v32 = Server(async_client(core), version="0.32.0")
        try:
            before = len(core.events)
            sender = VLLMColocatedSender(v32.url, 1, timeout=30)
            msg = _expect_engine_error(lambda: sync(ListExporter([buckets_of(model_tensors(5))]), sender,
                                                    progress=False, verify="checksum"), "verify needs vLLM >= 0.33.0")
            assert "0.32.0" in msg and core.events[before:] == [], (msg, core.events[before:])
        finally:
            v32.stop()
        # an engine started without --weight-transfer-config, and one configured for the other backend
        unconfigured = make_worker("ipc")
        unconfigured.weight_transfer_engine = None
        for worker, match in ((unconfigured, "Weight transfer not configured"), (make_worker("nccl"), "init_info")):
            other_core = EngineCore([worker])
            other = Server(async_client(other_core))
            try:
                sender = VLLMColocatedSender(other.url, 1, timeout=30)
                _expect_engine_error(lambda s=sender: sync(ListExporter([buckets_of(model_tensors(5))]), s,
                                                           progress=False), match)
                assert "update_weights" not in other_core.events and sender.version == 0, other_core.events
            finally:
                other.stop()
        # raw IPC handles do not pass collective_rpc's msgpack without VLLM_ALLOW_INSECURE_SERIALIZATION=1 ...
        from mcore2hf.senders.vllm import ipc_args

        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "0"
        b = make_bucket(0, {"x": torch.ones(2)})
        try:
            msgpack_round_trip({"update_info": {"ipc_handles": {GPU_UUID: ipc_args(b.flat)}}})
            raise AssertionError("msgpack encoded raw IPC handles without insecure serialization")
        except TypeError as err:
            assert "VLLM_ALLOW_INSECURE_SERIALIZATION" in str(err)
        # ... and the pickled ones we send are refused by the worker without it, with a clear error
        sender = VLLMColocatedSender(server.url, 1, timeout=30)
        _expect_engine_error(lambda: sync(ListExporter([buckets_of(model_tensors(6))]), sender, progress=False),
                             "VLLM_ALLOW_INSECURE_SERIALIZATION")
        assert sender.version == 0 and not core.workers[0]._weight_update_active
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        tensors = model_tensors(7)  # the retry succeeds
        sync(ListExporter([buckets_of(tensors)]), sender, progress=False)
        assert sender.version == 1 and core.version == "1"
        check_model(core.workers[0].model, tensors)
    finally:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        server.stop()
        old.stop()


# ---------------------------------------------------------------- speculative-decoding drafts (issue 37)

DRAFT_BUCKET = 64 * 1024  # bytes: several buckets per pass of the tiny deepseek_v3
_DRAFTS: dict = {}  # the draft world's results (scenario_mtp_draft runs it, scenario_mtp_draft_engine_sharded reads)


def _draft_config(method: str | None, backend: str = "ipc", tp: int = 1) -> dict:
    """The VllmConfig fields /server_info dumps that the senders read (vllm 0.33.0 config names): an MTP draft's
    speculative_config (method "mtp", draft TP = the target's), the weight-transfer backend, the TP."""
    return {"speculative_config": None if method is None else {"method": method, "draft_tensor_parallel_size": tp},
            "weight_transfer_config": {"backend": backend}, "parallel_config": {"tensor_parallel_size": tp}}


def _draft_trainers(urls: dict, ckpt: str) -> dict:
    """A rank of the draft world (deepseek_v3 tiny with its MTP layer, EP 2; 2 ranks): colocated into "mtp" (an
    engine with an MTP draft, rank 0) and "plain" (no draft, rank 1): draft="auto", then verify (refused for vLLM
    drafts), "keep"; into "m2n" (an MTP draft behind a backend without draft sessions, rank 0): refused, then
    "keep"; into "tp2" (an engine of TP 2 with an MTP draft, both ranks) engine-sharded; a model without MTP."""
    import torch.distributed as dist
    import worlds

    from mcore2hf import HFExporter, load_hf_weights
    from mcore2hf.errors import UsageError
    from mcore2hf.runtime.world import Layout
    from mcore2hf.senders import UnsupportedEngine, sync, vllm

    rank, out = dist.get_rank(), {}
    cfg, chunks = worlds.build(ckpt, Layout(tp=1, ep=2))
    load_hf_weights(chunks, ckpt)
    ex = HFExporter(chunks, cfg)
    mtp = ex.draft_tensors(DRAFT_BUCKET)
    out["layer"], out["copies"], out["dims"] = sorted(mtp.layer), sorted(mtp.copies), ex.dims
    full = ex.state_dict()  # collective: every rank
    out["full"] = full if rank == 0 else None
    col = vllm.VLLMColocatedSender(urls["mtp"] if rank == 0 else urls["plain"], 1, timeout=60)

    def report(**kw):
        rep = sync(ex, col, progress=False, bucket_bytes=DRAFT_BUCKET, **kw)
        return {"draft": rep.draft, "draft_buckets": rep.draft_buckets, "version": col.version}

    out["auto"] = report()
    try:
        report(verify="checksum")
        out["verify"] = None
    except UsageError as e:
        out["verify"] = str(e)
    out["keep"] = report(draft="keep")
    m2n = vllm.VLLMColocatedSender(urls["m2n"] if rank == 0 else urls["plain"], 1, timeout=60)
    try:
        sync(ex, m2n, progress=False, bucket_bytes=DRAFT_BUCKET)
        out["m2n"] = None
    except UnsupportedEngine as e:
        out["m2n"] = str(e)
    out["m2n_keep"] = sync(ex, m2n, progress=False, bucket_bytes=DRAFT_BUCKET, draft="keep").draft
    _, plain = worlds.build(ckpt, Layout(tp=1, ep=2), mtp=False)
    load_hf_weights(plain, ckpt)
    rep = sync(HFExporter(plain, cfg), col, progress=False, bucket_bytes=DRAFT_BUCKET)
    out["no_mtp"] = {"draft": rep.draft, "draft_buckets": rep.draft_buckets}
    # distributed (NCCL backend; gloo in PyNccl's place on CPU): every engine's workers join each broadcast inside a
    # session of the pass, so a group whose engines do not all serve an MTP draft is refused
    if rank == 0:
        import vllm.distributed.device_communicators.pynccl as pynccl

        pynccl.PyNcclCommunicator = GlooCommunicator
    nccl = vllm.VLLMDistributedSender([urls["nccl"]] if rank == 0 else None, timeout=60)
    rep = sync(ex, nccl, progress=False, bucket_bytes=DRAFT_BUCKET)
    nccl.close()
    out["nccl"] = {"draft": rep.draft, "draft_buckets": rep.draft_buckets, "version": nccl.version}
    mixed = vllm.VLLMDistributedSender([urls["nccl"], urls["nccl_plain"]] if rank == 0 else None, timeout=60)
    try:
        sync(ex, mixed, progress=False, bucket_bytes=DRAFT_BUCKET)
        out["nccl_mixed"] = None
    except UnsupportedEngine as e:
        out["nccl_mixed"] = str(e)
    out["nccl_mixed_keep"] = sync(ex, mixed, progress=False, bucket_bytes=DRAFT_BUCKET, draft="keep").draft
    mixed.close()
    # engine-sharded: each rank sends only what its engine TP rank loads, the draft's too (its TP is the target's)
    vllm.device_uuid = lambda device: f"GPU-{rank}"  # GPU-only fact stubbed: here each rank has its own GPU
    tp2 = vllm.VLLMColocatedSender(urls["tp2"] if rank == 0 else None, 2, timeout=60, engine_sharding=True)
    rep = sync(ex, tp2, progress=False, bucket_bytes=DRAFT_BUCKET, debug_nan=True)
    out["tp2"] = {"draft": rep.draft, "draft_buckets": rep.draft_buckets, "version": tp2.version}
    return out


def scenario_mtp_draft() -> None:
    """A model holding an MTP layer into vLLM's worker draft sessions (gpu_worker.py:1552-1590: the target's
    session, then start_draft_weight_update retargets the IPC transfer engine at the draft model): the target
    model loads every tensor but the MTP layer's (its named model has no parameter for them: a stray name fails
    the load), the draft model the MTP layer with its embedding / head copies (what vLLM's MTP drafts load,
    models/deepseek_mtp.py:359, :541-566), byte for byte; the version is set once, by the draft session's finish. An
    engine without a draft gets the target session only; verify= is refused (vLLM's checker covers the target
    only); draft="keep" opens no draft session; a backend without draft sessions is refused before anything moves
    (then synced with "keep"); a model without MTP layers opens none."""
    import tempfile

    from harness.vllm_real import _draft_trainers  # by module name: this file may run as __main__
    from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
    from mcore2hf.runtime.world import Layout, run_world

    ckpt = make_hf_checkpoint(tiny_config("deepseek_v3"), tempfile.mkdtemp(prefix="vllm-draft-"))
    full = read_hf_checkpoint(ckpt)
    layer = {n for n in full if n.startswith("model.layers.4.")}  # the tiny config's 4 layers, then the MTP layer
    target = {n: t for n, t in full.items() if n not in layer}
    draft = {n: t for n, t in full.items() if n in layer}
    engines = {"mtp": ("ipc", target, draft, _draft_config("mtp")), "plain": ("ipc", target, None, _draft_config(None)),
               "m2n": ("ipc", target, draft, _draft_config("mtp", "nccl_m2n")),
               "nccl": ("nccl", target, draft, _draft_config("mtp", "nccl")),
               "nccl_plain": ("nccl", target, None, _draft_config(None, "nccl"))}
    cores, servers = {}, {}
    for name, (backend, t, d, config) in engines.items():
        cores[name] = EngineCore([make_worker(backend, tensors=t, draft=d, load=False)])
        servers[name] = Server(async_client(cores[name]), config=config)
    tp2 = [make_worker("ipc", r, 2, target, load=False, draft=draft) for r in range(2)]
    for r, w in enumerate(tp2):
        w.gpu_uuid = f"GPU-{r}"
    cores["tp2"] = EngineCore(tp2)
    servers["tp2"] = Server(async_client(cores["tp2"]), config=_draft_config("mtp", tp=2))
    try:
        res = run_world(_draft_trainers, Layout(tp=1, ep=2), {n: s.url for n, s in servers.items()}, ckpt,
                        timeout=600)
    finally:
        for s in servers.values():
            s.stop()
    _DRAFTS.update(res=res, full=full, target=target, draft=draft, tp2=tp2)
    lead = res[0]
    assert sorted(lead["layer"] + lead["copies"]) == sorted(layer), (lead["layer"], lead["copies"])
    assert lead["copies"] == ["model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"]
    exported = lead["full"]
    assert set(exported) == set(full) and all(torch.equal(exported[n], full[n]) for n in full)
    for r in res:
        assert r["auto"]["draft"] == "updated on 1 of 2 engine(s)" and r["auto"]["draft_buckets"] > 0, r["auto"]
        assert r["auto"]["version"] == 1 and r["keep"]["version"] == 2, r
        assert r["verify"] and "its /weight_checker covers the target model only" in r["verify"], r["verify"]
        assert r["keep"]["draft"] == "left alone (draft='keep')" and r["keep"]["draft_buckets"] == 0
        assert r["m2n"] and "backend 'nccl_m2n' opens no draft sessions" in r["m2n"], r["m2n"]
        assert r["m2n_keep"] == "left alone (draft='keep')"
        assert r["tp2"]["draft"] == "updated on 1 of 1 engine(s)" and r["tp2"]["version"] == 1, r["tp2"]
        assert r["no_mtp"] == {"draft": "target only: the model holds no MTP layers", "draft_buckets": 0}
        assert r["nccl"]["draft"] == "updated on 1 of 1 engine(s)" and r["nccl"]["version"] == 1, r["nccl"]
        assert r["nccl_mixed"] and "serves no draft, and the draft's weights reach every engine" in r["nccl_mixed"]
        assert r["nccl_mixed_keep"] == "left alone (draft='keep')"
    mtp_worker = cores["mtp"].workers[0]
    for name, w in (("mtp", mtp_worker), ("plain", cores["plain"].workers[0])):
        got = dict(w.model.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in target.items()), name
        assert not w._weight_update_active
    # the draft got every MTP tensor in "auto" and nothing else afterwards ("keep", the model without MTP)
    received = mtp_worker.draft_model.received
    assert sorted(received) == sorted(draft) and all(len(v) == 1 for v in received.values()), \
        {n: len(v) for n, v in received.items()}
    assert all(torch.equal(received[n][0], t) for n, t in draft.items())
    calls = [e for e in cores["mtp"].events if e != "update_weights"]
    auto = ["pause:abort", "start_weight_update", "finish_weight_update", "start_draft_weight_update",
            "finish_weight_update", "resume"]
    assert calls[1:1 + len(auto)] == auto, calls
    assert "start_draft_weight_update" not in cores["plain"].events and \
        "start_draft_weight_update" not in cores["m2n"].events
    assert "pause:abort" in cores["m2n"].events and cores["m2n"].events.count("start_weight_update") == 1  # "keep"
    assert cores["mtp"].version == "3" and cores["plain"].version == "3", (cores["mtp"].version, cores["plain"].version)
    nccl = cores["nccl"].workers[0]  # the distributed sync: the draft session got the MTP layer over the broadcast
    assert all(torch.equal(t, nccl.draft_model.received[n][0]) for n, t in draft.items())
    assert sorted(nccl.draft_model.received) == sorted(draft) and all(len(v) == 1 for v in nccl.draft_model.received.values())
    assert all(torch.equal(dict(nccl.model.named_parameters())[n], t) for n, t in target.items())
    assert "start_draft_weight_update" not in cores["nccl_plain"].events


def scenario_mtp_draft_engine_sharded() -> None:
    """Engine-sharded colocated sync with the MTP draft (its TP the target's, 2): every tensor vLLM's receive path
    handed worker r's draft model is mask_to_engine of the checkpoint tensor to r's engine_regions (NaN
    elsewhere: nothing else written), byte for byte, the embedding / head copies vocab-split as the target's."""
    from mcore2hf.plan.engine_shards import EnginePlacement, engine_regions, mask_to_engine

    if not _DRAFTS:
        scenario_mtp_draft()
    full, draft, workers, dims = _DRAFTS["full"], _DRAFTS["draft"], _DRAFTS["tp2"], _DRAFTS["res"][0]["dims"]
    for r, w in enumerate(workers):
        received = w.draft_model.received
        assert sorted(received) == sorted(draft), sorted(set(received) ^ set(draft))
        place = EnginePlacement("vllm", r, 2)
        for n in draft:
            want = mask_to_engine(full[n], engine_regions(n, full[n].shape, dims, place, "deepseek_v3"), debug=True)
            got = received[n][-1]
            assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (r, n)
        assert not w._weight_update_active


SCENARIOS = {
    "ipc_http_packed": lambda: scenario_ipc(True, True),
    "ipc_http_unpacked": lambda: scenario_ipc(True, False),
    "ipc_llm_packed": lambda: scenario_ipc(False, True),
    "ipc_http_tp2_by_uuid": scenario_ipc_tp2_by_uuid,
    "ipc_http_tp2_sync": scenario_ipc_tp2_sync,
    "ipc_http_tp2_engine_sharded": scenario_ipc_tp2_engine_sharded,
    "engine_sharding_refusals": scenario_engine_sharding_refusals,
    "nccl_http_packed": lambda: scenario_nccl(True),
    "nccl_http_unpacked": lambda: scenario_nccl(False),
    "nccl_llm_packed": scenario_nccl_llm,
    "nccl_failure_then_retry": scenario_nccl_failure_then_retry,
    "packed_chunks": scenario_packed_chunks,
    "fp8_parsing": scenario_fp8_parsing,
    "refusals": scenario_refusals,
    "mtp_draft": scenario_mtp_draft,
    "mtp_draft_engine_sharded": scenario_mtp_draft_engine_sharded,
}


def serve(spec: str, device: str, draft_spec: str | None = None) -> None:
    """One vLLM engine of TP 1 with an IPC weight-transfer engine, serving vLLM's RL routes until stdin closes
    (bench/gpu_ipc.py runs it as its own process on the trainer's GPU): its model holds one parameter per entry of
    `spec` (a JSON list of [name, shape, dtype]), zeros on `device` ("cuda": GPU 0, real CUDA IPC rebuilt by
    vLLM's ipc_engine; "cpu": CPU shared memory as in the scenarios). Prints `URL <url> VERSION <v>`. GET
    /mcore2hf_state?digest=sha256|fingerprint: per parameter [digest, dtype, shape], the weight version, the
    engine calls. `draft_spec`: an MTP draft model too (its parameters in the state's "draft"), which the
    worker's draft sessions load; /server_info then reports speculative method "mtp" (tests/gpu)."""
    from harness.sglang_real import fingerprint, sha256_digest

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if device == "cpu":
        install_gpu_stubs()
    else:
        # vLLM's CUDA platform imports its compiled kernels at module level (vllm/platforms/cuda.py:23
        # `import vllm._C_stable_libtorch`), which the carried .py files lack: resolve the platform as on a
        # machine without CUDA (UnspecifiedPlatform, as in CI). The IPC receive path takes the worker's device.
        import vllm.platforms

        vllm.platforms.builtin_platform_plugins["cuda"] = lambda: None
        torch.cuda.set_device(0)
    import vllm

    def shapes(path: str | None) -> dict | None:
        if path is None:
            return None
        with open(path) as f:
            return {n: torch.empty(shape, dtype=getattr(torch, dt), device="meta") for n, shape, dt in json.load(f)}

    draft = shapes(draft_spec)
    worker = make_worker("ipc", tensors=shapes(spec), device=device, load=False, draft=draft, keep_received=False)
    core = EngineCore([worker])

    def digests(model, fn) -> dict:
        return {n: (fn(p), str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()}

    def state(digest: str) -> dict:
        fn = fingerprint if digest == "fingerprint" else sha256_digest
        if device == "cuda":
            torch.cuda.synchronize()
        return {"weights": digests(worker.model, fn), "version": core.version, "events": list(core.events),
                "draft": None if draft is None else digests(worker.draft_model, fn)}

    server = Server(async_client(core), state=state, config=_draft_config("mtp" if draft is not None else None))
    print(f"URL {server.url} VERSION {vllm.__version__}", flush=True)
    sys.stdin.read()  # until the bench closes our stdin (or dies)
    server.stop()


def main(out: str, names: list[str]) -> None:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    install_gpu_stubs()
    import vllm

    results = {"vllm": vllm.__version__, "vllm_file": vllm.__file__}
    import vllm.distributed.device_communicators.pynccl as pynccl

    pynccl.PyNcclCommunicator = GlooCommunicator
    for name in names or list(SCENARIOS):
        try:
            SCENARIOS[name]()
            results[name] = "ok"
        except BaseException:  # noqa: BLE001
            results[name] = traceback.format_exc()
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":  # --serve SPEC.json DEVICE [DRAFT_SPEC.json]
        serve(*sys.argv[2:5])
    elif sys.argv[1] == "--serve-lora":  # --serve-lora HF_CONFIG_DIR TP
        serve_lora(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "--moe3d-slices":  # --moe3d-slices ADAPTER_DIR HF_CONFIG_DIR TP,TP,...
        install_gpu_stubs()
        print("SLICES " + json.dumps(moe3d_slices(sys.argv[2], sys.argv[3], [int(t) for t in sys.argv[4].split(",")])),
              flush=True)
    else:
        main(sys.argv[1], sys.argv[2:])
