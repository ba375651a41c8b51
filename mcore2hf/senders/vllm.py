"""vLLM senders: vLLM's native weight-transfer API (vllm 0.33.0), fed with our buckets.

Read in vllm 0.33.0 (published wheel), and pinned by tests/test_vllm_contract.py:
- vllm/entrypoints/rl/online/api_router.py: the HTTP routes, registered only with VLLM_SERVER_DEV_MODE=1
  (vllm/entrypoints/launchers/api_server/routers.py):
    POST /init_weight_transfer_engine  {"init_info": {...}}       POST /start_weight_update   (no body)
    POST /update_weights               {"update_info": {...}}     POST /finish_weight_update  {"weight_version": str}
    POST /shutdown_weight_transfer_engine                          POST /pause?mode=abort|wait|keep, POST /resume
    GET  /get_world_size               {"world_size": TP*PP*DP}   GET  /version               {"version": ...}
  Success answers are JSON ({"message"} / {"status"}); failures are HTTP 4xx/5xx.
- vllm/entrypoints/rl/offline.py: the same methods on `LLM` (init_weight_transfer_engine({"init_info": ...}),
  start_weight_update(), update_weights({"update_info": ...}), finish_weight_update(weight_version)).
- vllm/v1/worker/gpu_worker.py: a session is start -> update* -> finish; update without start, or start twice,
  raises; a failed update closes the session on the worker.
- vllm/distributed/weight_transfer/{ipc_engine,nccl_engine,nccl_common}.py: init/update infos are dataclasses built
  with `cls(**dict)`, so unknown keys raise. The worker loads inside its layerwise-reload lifecycle
  (initialize_layerwise_reload at start, finalize_layerwise_reload at finish), which re-runs
  process_weights_after_loading: quantized engines (FP8, ...) get correct kernels.
- vllm/distributed/weight_transfer/packed_tensor.py: packed chunks (see `packed_chunk_ends`).

Two backends, each matching the engine's `--weight-transfer-config '{"backend": ...}'`:
- `VLLMColocatedSender` (backend "ipc"): each trainer rank shares its bucket (on the GPU of its colocated vLLM
  worker) as a CUDA IPC handle keyed by the GPU's UUID; the first rank of each engine group sends one
  /update_weights per bucket holding every rank's handle. Packed (default): one handle for the bucket's flat
  buffer plus `tensor_sizes`, no copy on the trainer (the worker clones). Unpacked: one handle per tensor; the
  worker keeps views of trainer memory until finish, so every bucket stays alive until then.
  Engine side needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (handles are pickled; ipc_engine refuses otherwise).
- `VLLMDistributedSender` (backend "nccl"): trainer rank 0 is rank 0 of vLLM's NCCL group (vLLM's
  StatelessProcessGroup rendezvous + PyNcclCommunicator), so vllm must be importable on trainer rank 0. Each
  bucket is one /update_weights (names, dtype_names, shapes) while rank 0 broadcasts the bucket's flat buffer:
  packed (default), in vLLM's chunks, each a slice of the bucket (no copy); unpacked, tensor by tensor.

vLLM's trainer-side engines (TrainerWeightTransferEngine.send_weights) run a whole session over a WeightSource
per call; sync() streams buckets, so these senders open one session per sync and use vLLM's own pieces where
vllm is importable: its NCCL endpoint and rendezvous, and its update-info dataclasses to validate every payload
before it is sent. The engine groups, the weight-update group's forming and teardown (vLLM's rendezvous plugged
in), the framing of a sync and the HTTP client are shared with SGLang's senders (base.py, http.py). The engine clients
(HTTP server, in-process LLM) are in vllm_clients.py.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import shutil
import tempfile
import threading
import warnings

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ..errors import EngineError, UsageError
from ..formats.safetensors import SafetensorsWriter, TensorInfo
from ..transfer.buckets import Bucket
from . import drafts
from .base import BroadcastSender, ColocatedSender, call, check_pause_mode, quietly, refuse_broadcast_sharding
from .protocol import Passes
from .vllm_clients import VERIFIED_VLLM, VLLMHTTPEngine, VLLMLocalEngine, as_engine, vllm_module

__all__ = ["VERIFIED_VLLM", "VLLMColocatedSender", "VLLMDistributedSender", "VLLMHTTPEngine", "VLLMLocalEngine",
           "as_engine", "bucket_fields", "device_uuid", "ipc_args", "packed_chunk_ends"]

# verify (sync(verify=...)): /weight_checker (action checksum / reset / compare with a baseline,
# entrypoints/rl/online/api_router.py:232) over the workers' compute_weight_checksums / reset_weights
# (v1/worker/gpu_worker.py:388, model_loader/weight_checksum.py: sha256 of each parameter's bytes, zeroing);
# read in 0.33.0, the release the contract tests run
CHECKER_VLLM = (0, 33, 0)
PAUSE_MODES = ("abort", "wait", "keep")  # /pause?mode=, vllm/entrypoints/rl/online/api_router.py
#: speculative methods without draft weights (vllm 0.33.0 config/speculative.py:74-80 SpeculativeMethod); every MTP
#: method is normalized to "mtp" (:1246-1250), any other names a draft model of its own (eagle, eagle3, dflash, ...)
NO_DRAFT_WEIGHTS = (None, "ngram", "ngram_gpu", "suffix")
#: which weight-transfer backends open draft sessions (`supports_draft_weight_update`, vllm 0.33.0
#: distributed/weight_transfer/base.py:451 True by default; False in sparse_nccl_engine.py:125,
#: sharded_rdt_engine.py:296, m2n_engine.py:225); the worker refuses the others (v1/worker/gpu_worker.py:1563)
DRAFT_SESSIONS = {"ipc": True, "nccl": True, "sparse_nccl": False, "sharded_rdt": False, "nccl_m2n": False}


def device_uuid(device: torch.device) -> str:
    """The key vLLM's IPC backend looks a worker's handle up by: str(get_device_properties(i).uuid)
    (vllm 0.33.0 ipc_engine.py / packed_tensor.py). CPU tensors (CI) use "cpu"."""
    if device.type == "cpu":
        return "cpu"
    return str(torch.cuda.get_device_properties(device.index).uuid)


def cpu_ipc_args(t: torch.Tensor) -> tuple:
    """A CPU tensor's shared-memory handle laid out like `reduce_tensor`'s CUDA args (the 15 arguments of
    torch's rebuild_cuda_tensor; slot 6 the device, which vLLM overwrites with the worker's index; slot 7 the
    storage handle, here (manager, filename, size) of torch's file_system sharing). Only for CI, where the
    engine side opens it with a CPU stand-in for rebuild_cuda_tensor (tests/harness/vllm_real.py)."""
    storage = t.untyped_storage()
    handle = storage._share_filename_cpu_()
    return (type(t), t.size(), t.stride(), t.storage_offset(), type(storage), t.dtype, -1, handle,
            storage.nbytes(), 0, False, b"", 0, b"", False)


def ipc_args(t: torch.Tensor) -> tuple:
    """rebuild_cuda_tensor arguments of a tensor (what vLLM's IPC backend expects under each GPU UUID)."""
    if t.device.type == "cpu":
        return cpu_ipc_args(t)
    return reduce_tensor(t)[1]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # vLLM reads getattr(torch, name)


def bucket_fields(bucket: Bucket) -> dict:
    """names / dtype_names / shapes of a bucket in flat-buffer order."""
    return {"names": [e.name for e in bucket.entries], "dtype_names": [_dtype_name(e.dtype) for e in bucket.entries],
            "shapes": [list(e.shape) for e in bucket.entries]}


def packed_chunk_ends(tensor_sizes: list[int], buffer_size_bytes: int) -> list[int]:
    """Byte offsets where vLLM's packed NCCL stream cuts a run of tensors into broadcasts: a chunk takes tensors
    until its size exceeds buffer_size_bytes (the tensor that crosses stays in), the rest is a last chunk
    (packed_nccl_broadcast_consumer / pack_tensors, vllm 0.33.0 packed_tensor.py)."""
    ends, total, n = [], 0, 0
    for size in tensor_sizes:
        total += size
        n += 1
        if total - (ends[-1] if ends else 0) > buffer_size_bytes:
            ends.append(total)
            n = 0
    if n:
        ends.append(total)
    return ends


def _validated(module: str, cls: str, fields: dict) -> dict:
    """The payload, after vLLM's own dataclass accepted it when vllm is importable here: refused as the worker
    would refuse it (unknown keys, mismatched lengths), before it is sent."""
    mod = vllm_module(module)
    if mod is not None:
        try:
            getattr(mod, cls)(**fields)
        except Exception as e:  # noqa: BLE001
            version = getattr(vllm_module("vllm"), "__version__", "unknown")
            raise EngineError(f"vLLM {version} on the trainer refuses {cls}{sorted(fields)}: {e} (these senders "
                              f"follow vLLM {VERIFIED_VLLM})") from e
    return fields


class _Session:
    """vLLM's side of SenderBase's hooks: one weight-update session per sync on each engine, started at the first
    bucket, finished with the version after the last. After a failure the session is closed without a version
    (the worker may have closed it already)."""

    _pause_route = "pause"
    # layers may still be mid-reload after a failed sync: the engine generates again only after one succeeds
    # (docs/engines.md, vLLM points to know)
    _resume_on_failure = False

    draft_copies = True  # vLLM's MTP drafts load the embedding / head copies (models/deepseek_mtp.py:359, :541-566)

    def _engine_draft(self, engine) -> drafts.EngineDraft:
        """From the engine's config (GET /server_info?config_format=json, or an LLM's vllm_config): its speculative
        method, its weight-transfer backend, its draft's TP (an engine-sharded sync plans for the target's)."""
        where = getattr(engine, "url", type(engine).__name__)
        info = call(engine.draft_info)
        if info is None:
            return drafts.EngineDraft(where, "unknown", "GET /server_info answered 404")
        method, backend = info.get("method"), info.get("backend")
        if method in NO_DRAFT_WEIGHTS:
            return drafts.EngineDraft(where, None, f"speculative method {method}")
        if method != "mtp":
            return drafts.EngineDraft(where, "separate", f"speculative method {method}")
        refusal = None
        if not DRAFT_SESSIONS.get(backend, False):
            refusal = (f"its weight-transfer backend {backend!r} opens no draft sessions (supports_draft_weight_update "
                       "is False; vLLM 0.33.0: only ipc and nccl do)")
        elif getattr(self, "engine_sharding", False) and info.get("draft_tp") not in (None, info.get("tp")):
            refusal = (f"its draft runs at TP {info.get('draft_tp')}, the target at TP {info.get('tp')}: an "
                       "engine-sharded sync plans for one TP")
        return drafts.EngineDraft(where, "mtp", f"speculative method mtp, backend {backend}", refusal)

    def passes(self) -> Passes:
        passes = super().passes()
        if self.verify and "draft" in passes.roles:  # decided from every engine: every rank raises the same
            raise UsageError(f"verify={self.verify!r} with a draft update into vLLM: its /weight_checker covers the "
                             "target model only (v1/worker/gpu_worker.py:388 compute_weight_checksums over "
                             "model_runner.get_model()), so the draft's weights cannot be verified; pass "
                             "draft='keep' (the target verified, the draft left as it is) or verify=None")
        return passes

    def start_role(self, role: str) -> None:
        """vLLM loads one session's chunks into one model: the target's session ends (without the version) before
        the draft's opens (start_draft_weight_update at its first bucket), which ends with the version."""
        if role == "draft" and self._role != "draft":
            self._finish(version=False)
        super().start_role(role)

    def _check_engines(self) -> None:
        errors = []
        for e in self._driven():
            try:
                call(e.check)
            except EngineError as err:
                errors.append(str(err))
        if errors:
            raise EngineError("; ".join(errors))

    _open: list | None = None  # engines with an open session this sync (None: not started yet)
    # adapter-only sync: rank 0 writes the PEFT directory <adapter_dir>/mcore2hf-lora-*/<lora_name>-v<version>
    # (the same SafetensorsWriter as save_pretrained), every engine loads it from there
    adapter_dir: str | None = None
    _adapter_root: str | None = None
    _writer = None
    adapter_path: str | None = None  # the directory the engines loaded the adapter from (kept until the next)
    cache_reset = True  # False when an engine kept its prefix cache after the last adapter load

    def _adapter_refusal(self, engine) -> str | None:
        return call(engine.lora_refusal)

    def _version_dir(self) -> str:
        return os.path.join(self._adapter_root, f"{self.lora_name}-v{self._pending}")

    def _write(self, bucket: Bucket) -> None:
        """Adapter sync, rank 0 (the only receiver): the bucket into the PEFT directory being written."""
        self._note_sent(bucket)
        if bucket.flat is None or self._error is not None:
            return
        try:
            if self._writer is None:
                if self._adapter_root is None:
                    base = self.adapter_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
                    self._adapter_root = tempfile.mkdtemp(prefix="mcore2hf-lora-", dir=base)
                shutil.rmtree(self._version_dir(), ignore_errors=True)  # ours, from an attempt that failed later
                infos = [TensorInfo(e.name, e.shape, e.dtype) for e in self._adapter_entries]
                self._writer = SafetensorsWriter(self._version_dir(), infos, None, adapter_config=self.adapter)
            self._writer.send(bucket)
        except Exception as e:  # noqa: BLE001
            self._fail(f"writing the adapter directory: {type(e).__name__}: {e}")

    def _finish_adapter(self) -> None:
        """Collective: rank 0 completes the directory, every rank learns its path, then each engine this rank
        drives loads it in place and resets its prefix cache (KV computed with the previous adapter would be
        reused otherwise: vllm#42125)."""
        import torch.distributed as dist

        box: list = [None]
        if dist.get_rank() == 0:
            writer, self._writer = self._writer, None
            if writer is not None and self._error is None:
                try:
                    writer.finish()
                    box = [self._version_dir()]
                except Exception as e:  # noqa: BLE001
                    self._fail(f"writing the adapter directory: {type(e).__name__}: {e}")
            elif writer is not None:
                quietly(writer.abort)
            elif self._error is None:
                self._fail("no adapter tensor reached rank 0")
        dist.broadcast_object_list(box, src=0, group=self._status_group)
        path = box[0]
        if path is None or self._error is not None:
            return
        self.cache_reset = True
        for e in self._driven():
            try:
                # PEFT's stacked expert form (adapter_config.json's target_parameters) goes as vLLM's 3-D form
                call(e.load_lora_adapter, lora_name=self.lora_name, lora_path=path,
                     is_3d=bool(self.adapter.get("target_parameters")))
                reset = call(e.reset_prefix_cache)
            except EngineError as err:
                self._fail(f"loading the LoRA adapter {self.lora_name!r} from {path}: {err}")
                return
            if not reset:
                self.cache_reset = False
                warnings.warn(f"{getattr(e, 'url', type(e).__name__)}: vLLM refused /reset_prefix_cache after "
                              f"loading the adapter {self.lora_name!r} (blocks still held, pause_mode="
                              f"{self.pause_mode!r}): its prefix cache may hold KV of the previous adapter",
                              stacklevel=2)
        self.adapter_path = path

    def commit(self) -> None:
        super().commit()
        if self.adapter is not None and self._adapter_root is not None:  # rank 0: earlier versions' directories
            for name in os.listdir(self._adapter_root):
                if os.path.join(self._adapter_root, name) != self.adapter_path:
                    shutil.rmtree(os.path.join(self._adapter_root, name), ignore_errors=True)

    def remove_adapters(self) -> None:
        """Remove the adapter directories this sender wrote (rank 0; the engines must not reload from them)."""
        root, self._adapter_root = self._adapter_root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def begin(self, version: int) -> None:
        super().begin(version)
        self._open = None
        for e in self._driven() if self.verify else []:
            try:
                found = call(e.server_version)
            except EngineError as err:
                self._fail(f"verify: asking the vLLM version: {err}")
                return
            parts = [int(x) for x in found.split(".")[:3] if x.isdigit()]
            if len(parts) < 3 or tuple(parts) < CHECKER_VLLM:
                self._fail(f"{getattr(e, 'url', type(e).__name__)}: vLLM {found} cannot verify a sync: verify "
                           f"needs vLLM >= {'.'.join(map(str, CHECKER_VLLM))} (/weight_checker and the workers' "
                           "compute_weight_checksums)")
                return

    @staticmethod
    def _split(key: str) -> tuple[str, str]:
        """("dp0:pp0:pcp0:tp0", parameter) of a worker's checksum key "dp0:pp0:pcp0:tp0:<parameter>"
        (gpu_worker.py:380 _weight_checksum_prefix)."""
        rank, _, rest = key.partition(":tp")
        tp, _, name = rest.partition(":")
        return f"{rank}:tp{tp}", name

    def _checksums(self, engine) -> dict[str, dict[str, str]]:
        ranks: dict[str, dict[str, str]] = {}
        for key, digest in call(engine.weight_checksums).items():
            rank, name = self._split(key)
            ranks.setdefault(rank, {})[name] = digest
        return ranks

    def _snapshot_and_reset(self, engine) -> None:
        call(engine.reset_weights)

    def _engine_compare(self, engine, baseline: dict) -> list[str]:
        """vLLM's compare against the baseline checksums (an LLM has none: the checksum diff after it decides)."""
        if not hasattr(engine, "compare_weights"):
            return []
        flat = {f"{rank}:{name}": d for rank, named in baseline.items() for name, d in named.items()}
        return ["{}: {}".format(*self._split(k)) for k in call(engine.compare_weights, baseline=flat)]

    def _start(self) -> None:
        """Open the session of the current pass on every engine it reaches, at its first bucket: after pause(),
        since vLLM's layerwise reload moves the layers' weights off the device until they are reloaded."""
        if self._open is not None or self._error is not None:
            return
        self._open = []
        draft = self._role == "draft"
        for e in self._driven():
            if draft and not self._takes_draft(e):
                continue
            try:
                call(e.start_draft_weight_update if draft else e.start_weight_update)
            except EngineError as err:
                self._fail(f"{'start_draft_weight_update' if draft else 'start_weight_update'}: {err}")
                return
            self._open.append(e)

    def _pause_engine(self, engine) -> None:
        call(engine.pause, mode=self.pause_mode)

    def _resume_engine(self, engine) -> None:
        call(engine.resume)

    @property
    def adapter_root(self) -> str | None:
        """The directory holding this sender's adapter versions (rank 0; None before the first adapter sync)."""
        return self._adapter_root

    def _close_sessions(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:  # an adapter sync that failed before its directory was complete: nothing left
            quietly(writer.abort)
        if self.adapter is not None and self._adapter_root is not None and self._pending is not None:
            failed = self._version_dir()  # written, but the sync failed: no engine is to load from it
            if failed != self.adapter_path:
                shutil.rmtree(failed, ignore_errors=True)
        for e in self._open or []:
            quietly(e.finish_weight_update, weight_version=None)
        self._open = None

    def _finish(self, version: bool = True) -> None:
        for e in self._open or []:
            try:
                if self._error is None:
                    call(e.finish_weight_update, weight_version=str(self._pending) if version else None)
                else:  # close the session; the worker may have closed it on the failed update
                    call(e.finish_weight_update, weight_version=None)
            except EngineError as err:
                if self._error is None:
                    self._fail(f"finish_weight_update: {err}")
        self._open = None


class VLLMColocatedSender(_Session, ColocatedSender):
    """Trainer and vLLM share GPUs; vLLM started with --weight-transfer-config '{"backend": "ipc"}'.

    Trainer ranks form consecutive groups of `engine_tp_size` (the engine's TP*PP) ranks; group i feeds engine i.
    `engine` on the first rank of a group: a URL, a VLLMHTTPEngine, or an in-process `vllm.LLM`; None elsewhere.
    `packed` must not change between syncs of one engine (it is sent once, at init). Grouping, bucket lifetime
    and errors: see ColocatedSender.

    `engine_sharding=True`: each rank receives and sends only what its engine TP rank loads (full-shaped
    tensors, the rest unwritten; vLLM's weight loaders narrow to exactly that); `engine_tp_size` is then the
    engine's TP size (engine PP is not supported). `engine_ep_size`: 1 or engine_tp_size
    (`--enable-expert-parallel`); `engine_placement`: other EnginePlacement fields
    (`replicated_shared_experts=True` with sequence-parallel MoE). Settings the rules refuse raise
    EngineShardError here."""

    engine_kind = "vllm"

    def __init__(self, engine, engine_tp_size: int, *, packed: bool = True, timeout: float = 300.0,
                 pause_mode: str = "abort", api_key: str | None = None, engine_sharding: bool = False,
                 engine_ep_size: int = 1, engine_placement: dict | None = None, lora_name: str | None = None,
                 adapter_dir: str | None = None):
        check_pause_mode(pause_mode, PAUSE_MODES)
        super().__init__(as_engine(engine, timeout, api_key), engine_tp_size, timeout, engine_sharding, engine_ep_size,
                         engine_placement)
        self.packed, self.pause_mode = packed, pause_mode
        self.lora_name, self.adapter_dir = lora_name, adapter_dir
        self._initialized = False
        self._keep: list = []  # unpacked: the worker holds views of our buckets until finish

    def _driven(self) -> list:
        return [self.engine] if self.is_first else []

    @property
    def receivers(self):
        return (0,) if self.adapter is not None else "all"  # adapter sync: rank 0 writes the PEFT directory

    def close(self) -> None:
        """Remove the adapter directories written by adapter syncs (call when done syncing)."""
        self.remove_adapters()

    def begin(self, version: int) -> None:
        super().begin(version)
        if self.is_first and not self._initialized and self._error is None and self.adapter is None:
            try:
                self._check_engines()
                info = _validated("vllm.distributed.weight_transfer.ipc_engine", "IPCWeightTransferInitInfo",
                                  {"packed": self.packed})
                call(self.engine.init_weight_transfer_engine, init_info=info)
                self._initialized = True
            except EngineError as e:
                self._fail(str(e))

    def _payload(self, bucket: Bucket):
        uuid = device_uuid(bucket.flat.device)
        if self.packed:
            return {uuid: ipc_args(bucket.flat)}
        return [{uuid: ipc_args(t)} for _, t in bucket]

    def _update(self, payloads: list) -> None:
        if self._role == "draft" and not self._takes_draft(self.engine):  # its engine serves no MTP draft
            return
        if self.packed:
            handles: dict | list = {}
            for p in payloads:
                handles.update(p)
        else:
            handles = [{} for _ in payloads[0]]
            for p in payloads:
                for merged, h in zip(handles, p):
                    merged.update(h)
        self._send_update(handles)

    def send(self, bucket: Bucket) -> None:
        if self.adapter is not None:
            return self._write(bucket)
        if self.is_first:
            self._start()
        self._bucket = bucket
        if not self.packed:
            self._keep.append(bucket.flat)
        super().send(bucket)

    def _send_update(self, handles) -> None:
        fields = bucket_fields(self._bucket)
        if self.packed:
            fields["tensor_sizes"] = [e.nbytes for e in self._bucket.entries]
        if self.engine.pickle_handles:  # as vllm clients.py _json_safe_update_info does
            fields["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
        else:
            fields["ipc_handles"] = handles
        call(self.engine.update_weights, update_info=fields)

    def _finish_sessions(self) -> None:
        if self.adapter is not None:
            return self._finish_adapter()
        if self.is_first:
            self._start()  # a sync without buckets still opens and closes a session
            self._finish()
        self._keep.clear()
        if self._error is not None:
            self._initialized = False  # a restarted engine has forgotten the init: send it again on the retry
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free exported buffers the workers released (vllm ipc_engine _post_send_sync)


class VLLMDistributedSender(_Session, BroadcastSender):
    """vLLM on other GPUs or nodes; started with --weight-transfer-config '{"backend": "nccl"}'. Trainer rank 0
    (which needs vllm importable) is rank 0 of vLLM's NCCL group; engine i's workers join at rank_offset 1 + the
    earlier engines' sizes. `engines` on rank 0: URLs, VLLMHTTPEngine or vllm.LLM objects; `engine_world_sizes`
    defaults to each engine's /get_world_size (TP*PP*DP). `master_port=0` binds a free port and tells the
    engines the port it got. Only rank 0 receives full tensors (`receivers = (0,)`)."""

    _join_failed = "init_weight_transfer_engine failed: "
    _draft_every_engine = True  # every engine's workers receive each broadcast, inside a session of the pass

    def __init__(self, engines, engine_world_sizes: list[int] | None = None, master_address: str = "127.0.0.1",
                 master_port: int = 0, *, packed: bool = True, packed_buffer_size_bytes: int = 1 << 30,
                 packed_num_buffers: int = 2, timeout: float = 300.0, pause_mode: str = "abort",
                 api_key: str | None = None, engine_sharding: bool = False, lora_name: str | None = None,
                 adapter_dir: str | None = None):
        refuse_broadcast_sharding(engine_sharding)
        check_pause_mode(pause_mode, PAUSE_MODES)
        import torch.distributed as dist

        clients = [as_engine(e, timeout, api_key) for e in (engines or [])] if dist.get_rank() == 0 else []
        box: list = [engine_world_sizes]
        if dist.get_rank() == 0 and engine_world_sizes is None:
            try:
                box = [[call(e.world_size) for e in clients]]
            except EngineError as e:
                box = [f"asking the engines' world sizes: {e}"]
        dist.broadcast_object_list(box, src=0)  # every rank builds the same sender, or raises the same error
        if isinstance(box[0], str):
            raise EngineError(box[0])
        super().__init__(clients, box[0], master_address, master_port, "vllm", "nccl", timeout)
        self.packed, self.pause_mode = packed, pause_mode
        self.buffer_size, self.num_buffers = packed_buffer_size_bytes, packed_num_buffers
        self._listen = None
        self.lora_name, self.adapter_dir = lora_name, adapter_dir  # adapter_dir: readable by every engine

    def _driven(self) -> list:
        return self.engines

    def connect(self) -> None:
        if not self.is_source or self.pg is not None:
            return
        self._check_engines()
        if vllm_module("vllm.distributed.utils") is None:
            raise EngineError("vLLM's NCCL weight transfer needs vllm importable on trainer rank 0 (its "
                              "StatelessProcessGroup + PyNcclCommunicator form the group); use the IPC backend "
                              "(VLLMColocatedSender) otherwise")
        super().connect()

    def _prepare_rendezvous(self) -> None:
        import socket

        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # bound now: its port goes to the engines
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((self.master_address, self.master_port))
        self._listen.listen()
        self.port = self._listen.getsockname()[1]

    def _init_calls(self, offsets: list[int]) -> list[tuple]:
        calls = []
        for e, off in zip(self.engines, offsets):
            info = {"master_address": self.master_address, "master_port": self.port, "rank_offset": off,
                    "world_size": self.world_size, "packed": self.packed,
                    "packed_buffer_size_bytes": self.buffer_size, "packed_num_buffers": self.num_buffers}
            info = _validated("vllm.distributed.weight_transfer.nccl_common", "NCCLWeightTransferInitInfo", info)
            calls.append((e.init_weight_transfer_engine, {"init_info": info}))
        return calls

    def _join(self) -> None:
        # what vllm 0.33.0 nccl_common.trainer_init does, with our bound listen socket
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        listen, self._listen = self._listen, None
        pg = StatelessProcessGroup.create(host=self.master_address, port=self.port, rank=0,
                                          world_size=self.world_size, store_timeout=int(self.timeout.total_seconds()),
                                          listen_socket=listen)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        with unpinned_nccl_env():
            self.pg = PyNcclCommunicator(pg, device=device)

    def _update_calls(self, bucket: Bucket) -> list[tuple]:
        fields = _validated("vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferUpdateInfo",
                            bucket_fields(bucket))
        return [(e.update_weights, {"update_info": fields}) for e in self.engines]

    def _unsendable(self, bucket: Bucket) -> str | None:
        """Unpacked, each tensor goes in its own dtype, and PyNccl takes only NCCL's (vllm 0.33.0
        pynccl_wrapper.ncclDataTypeEnum); packed chunks are uint8."""
        wrapper = vllm_module("vllm.distributed.device_communicators.pynccl_wrapper")
        if self.packed or wrapper is None:
            return None
        bad = sorted({str(e.dtype) for e in bucket.entries if wrapper.ncclDataTypeEnum.try_from_torch(e.dtype) is None})
        return f"bucket {bucket.index}: unpacked NCCL transfer cannot send {bad}; use packed=True" if bad else None

    def _timed_broadcast(self, bucket: Bucket) -> None:
        """The broadcasts, given up after the timeout: PyNccl has none, and an engine that failed mid-bucket never
        joins the next chunk (the group is then aborted by _teardown)."""
        stream = torch.cuda.current_stream(bucket.flat.device) if bucket.flat.is_cuda else None
        done, errors = threading.Event(), []

        def run():
            try:
                self._broadcast(bucket, stream)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        if not done.wait(self.timeout.total_seconds()):
            raise TimeoutError(f"broadcast of bucket {bucket.index} did not complete within {self.timeout}")
        if errors:
            raise errors[0]

    def _broadcast(self, bucket: Bucket, stream) -> None:
        if self.packed:
            start = 0
            for end in packed_chunk_ends([e.nbytes for e in bucket.entries], self.buffer_size):
                self.pg.broadcast(bucket.flat[start:end], src=0, stream=stream)
                start = end
        else:
            for _, t in bucket:
                self.pg.broadcast(t, src=0, stream=stream)
        if stream is not None:
            stream.synchronize()

    def send(self, bucket: Bucket) -> None:
        if self.adapter is not None:
            return self._write(bucket)
        if not self.is_source:
            return
        self._note_sent(bucket)
        self._start()
        if self._error is None and (bad := self._unsendable(bucket)):
            self._fail(bad)
        if self._error is not None:
            return
        errors = self._parallel(self._update_calls(bucket), lambda: self._timed_broadcast(bucket))
        if errors:
            self._fail(f"bucket {bucket.index}: " + "; ".join(errors))
            self._teardown()

    def _teardown(self) -> None:
        if self.pg is not None:
            with contextlib.suppress(Exception):  # best effort: the peer may be gone already
                self.pg.destroy()
            self.pg = None
            self._release = True

    def _release_engines(self) -> None:
        """After a failure (sessions closed): release the workers' end of the group, so a retry forms a new one."""
        if getattr(self, "_release", False):
            self._release = False
            for e in self.engines:
                with contextlib.suppress(EngineError):
                    call(e.shutdown_weight_transfer_engine)

    def _finish_sessions(self) -> None:
        if self.adapter is not None:
            return self._finish_adapter()
        if self.is_source:
            self._start()  # a sync without buckets still opens and closes a session
            self._finish()
            self._release_engines()

    def close(self) -> None:
        """Tear the NCCL group down on both sides (between syncs); remove the adapter directories written."""
        if self.is_source:
            self._teardown()
            self._release_engines()
        self.remove_adapters()
