"""The two ways to reach a vLLM engine for a weight sync: its HTTP server (VLLM_SERVER_DEV_MODE=1) and an in-process
`vllm.LLM`, with the same methods, so the senders in vllm.py drive either. Routes and methods read in vllm 0.33.0
(cited per method) and pinned by tests/test_vllm_contract.py and the LoRA tests.
"""

from __future__ import annotations

import json

from ..errors import EngineError
from .http import HTTPClient

VERIFIED_VLLM = "0.33.0"  # the release whose code the contract tests run


def vllm_module(name: str):
    """A vllm module when vllm is importable here, else None."""
    import importlib

    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - vllm absent (or unusable) on the trainer
        return None


class VLLMHTTPEngine(HTTPClient):
    """HTTP client of one vLLM server started with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config."""

    def __init__(self, url: str, timeout: float = 300.0, api_key: str | None = None):
        super().__init__(url, timeout, api_key)
        self.pickle_handles = True  # JSON carries IPC handles as `ipc_handles_pickled` (vllm clients.py)

    def _request(self, path: str, payload: dict | None = None, method: str = "POST",
                 ok_codes: tuple = ()) -> tuple[int, dict | str]:
        code, text = self.request(path, payload, method, ok_codes=ok_codes)  # no payload: no body
        try:
            return code, json.loads(text) if text.strip() else {}
        except ValueError:
            return code, text

    def check(self) -> None:
        """Raise EngineError unless the server has the native weight-transfer routes (sends no weights)."""
        _, ver = self._request("/version", method="GET", ok_codes=(404,))
        version = ver.get("version", "unknown") if isinstance(ver, dict) else "unknown"
        # an empty body fails validation (400/422) on a server that has the route, 404 where it has none
        code, _ = self._request("/init_weight_transfer_engine", {}, ok_codes=(400, 404, 405, 422))
        if code in (404, 405):
            raise EngineError(
                f"{self.url}: vLLM {version} has no native weight-transfer API (POST /init_weight_transfer_engine "
                f"answered {code}); it needs vLLM >= {VERIFIED_VLLM} (verified) started with VLLM_SERVER_DEV_MODE=1 "
                "and --weight-transfer-config '{\"backend\": \"ipc\" or \"nccl\"}'")

    def world_size(self) -> int:
        _, out = self._request("/get_world_size", method="GET")
        return int(out["world_size"])

    def server_version(self) -> str:
        _, ver = self._request("/version", method="GET", ok_codes=(404,))
        return str(ver.get("version", "unknown")) if isinstance(ver, dict) else "unknown"

    def draft_info(self) -> dict | None:
        """The speculative method, weight-transfer backend and TPs of the engine's config (GET
        /server_info?config_format=json, a dev-mode route: vllm 0.33.0 entrypoints/serve/dev/server_info/
        api_router.py:43-59, the VllmConfig dumped as JSON); None where the route is missing (404)."""
        code, out = self._request("/server_info?config_format=json", method="GET", ok_codes=(404,))
        if code == 404 or not isinstance(out, dict):
            return None
        return draft_fields(out.get("vllm_config") or {})

    def start_draft_weight_update(self) -> None:
        """POST /start_draft_weight_update (vllm 0.33.0 entrypoints/rl/online/api_router.py:188): this session's
        chunks load into the speculative draft model (v1/worker/gpu_worker.py:1552)."""
        self._request("/start_draft_weight_update")

    def weight_checksums(self) -> dict[str, str]:
        """{"dp{d}:pp{p}:pcp{c}:tp{t}:<parameter>": sha256} over every worker (POST /weight_checker checksum)."""
        _, out = self._request("/weight_checker", {"action": "checksum"})
        return dict(out["checksums"])

    def reset_weights(self) -> None:
        self._request("/weight_checker", {"action": "reset"})  # every worker zeroes its parameters

    def compare_weights(self, baseline: dict[str, str]) -> list[str]:
        """vLLM's comparison of its checksums now against `baseline`: the keys that differ."""
        _, out = self._request("/weight_checker", {"action": "compare", "baseline": baseline})
        return list(out["mismatches"])

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._request("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._request("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._request("/finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("/shutdown_weight_transfer_engine")

    def pause(self, mode: str = "abort") -> None:
        self._request(f"/pause?mode={mode}")

    def resume(self) -> None:
        self._request("/resume")

    def lora_refusal(self) -> str | None:
        """Why this server cannot load adapters at runtime, or None (sends no adapter): the routes exist only with
        VLLM_ALLOW_RUNTIME_LORA_UPDATING (vllm 0.33.0 entrypoints/serve/lora/api_router.py:30); an empty body
        fails validation (400/422) where the route exists."""
        code, _ = self._request("/v1/load_lora_adapter", {}, ok_codes=(400, 404, 405, 422))
        if code in (404, 405):
            return (f"vLLM {self.server_version()} has no /v1/load_lora_adapter (answered {code}): start it with "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (--max-lora-rank >= the adapter's r)")
        return None

    def load_lora_adapter(self, lora_name: str, lora_path: str, is_3d: bool = False) -> None:
        """POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace: true[, is_3d_lora_weight: true]}
        (LoadLoRAAdapterRequest, vllm 0.33.0 entrypoints/serve/lora/protocol.py:7-11): replaces an adapter of that
        name, keeping its id (entrypoints/openai/models/serving.py:167-231); 200 with plain text, an error status
        otherwise. `is_3d`: PEFT's stacked expert form (lora_experts="stacked")."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "load_inplace": True}
        if is_3d:
            body["is_3d_lora_weight"] = True
        self._request("/v1/load_lora_adapter", body)

    def reset_prefix_cache(self) -> bool:
        """POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE, entrypoints/serve/dev/cache/api_router.py:20):
        {"success": false} while blocks are still held by running requests."""
        _, out = self._request("/reset_prefix_cache")
        return bool(out.get("success")) if isinstance(out, dict) else False


class VLLMLocalEngine:
    """An in-process `vllm.LLM` (its RL methods, vllm/entrypoints/rl/offline.py). Calls reach the workers through
    collective_rpc (msgpack): IPC handles go pickled as for HTTP, which the worker opens only with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1. An LLM generates only when called, so pause/resume do nothing."""

    def __init__(self, llm):
        self.llm = llm
        self.pickle_handles = True

    def check(self) -> None:
        missing = [m for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                               "finish_weight_update") if not callable(getattr(self.llm, m, None))]
        if missing:
            version = getattr(vllm_module("vllm"), "__version__", "unknown")
            raise EngineError(f"this vLLM ({version}) LLM has no native weight-transfer API (missing {missing}); "
                              f"it needs vLLM >= {VERIFIED_VLLM} (verified) and LLM(..., weight_transfer_config=...)")

    def world_size(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp)

    def server_version(self) -> str:
        return str(getattr(vllm_module("vllm"), "__version__", "unknown"))

    def weight_checksums(self) -> dict[str, str]:
        """The workers' own checksums (LLM has no checker method: collective_rpc to gpu_worker.py:388), merged
        as api_router.py:249 merges them."""
        out: dict[str, str] = {}
        for worker in self.llm.collective_rpc("compute_weight_checksums"):
            if out.keys() & worker.keys():
                raise EngineError(f"duplicate weight checksum keys {sorted(out.keys() & worker.keys())[:5]}")
            out.update(worker)
        return out

    def reset_weights(self) -> None:
        self.llm.collective_rpc("reset_weights")

    def draft_info(self) -> dict:
        """As VLLMHTTPEngine.draft_info, from the LLM's own VllmConfig."""
        config = self.llm.llm_engine.vllm_config
        spec, transfer = getattr(config, "speculative_config", None), getattr(config, "weight_transfer_config", None)
        return draft_fields({"speculative_config": None if spec is None else {
                                 "method": spec.method, "draft_tensor_parallel_size": spec.draft_tensor_parallel_size},
                             "weight_transfer_config": None if transfer is None else {"backend": transfer.backend},
                             "parallel_config": {"tensor_parallel_size":
                                                 config.parallel_config.tensor_parallel_size}})

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()  # entrypoints/rl/offline.py:37

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def pause(self, mode: str = "abort") -> None:
        pass

    def resume(self) -> None:
        pass

    def lora_refusal(self) -> str | None:
        if getattr(self.llm.llm_engine.vllm_config, "lora_config", None) is None:
            return "this vllm.LLM was built without LoRA: build it with LLM(..., enable_lora=True, max_lora_rank=r)"
        return None

    def load_lora_adapter(self, lora_name: str, lora_path: str, is_3d: bool = False) -> None:
        """LLMEngine.add_lora(LoRARequest(..., load_inplace=True)) (vllm 0.33.0 v1/engine/llm_engine.py:471,
        lora/request.py:24-29), the adapter's id kept across versions as the server keeps it."""
        from vllm.lora.request import LoRARequest

        ids = self.__dict__.setdefault("_lora_ids", {})
        lora_id = ids.setdefault(lora_name, len(ids) + 1)
        if not self.llm.llm_engine.add_lora(LoRARequest(lora_name=lora_name, lora_int_id=lora_id,
                                                        lora_path=lora_path, load_inplace=True,
                                                        is_3d_lora_weight=is_3d)):
            raise EngineError(f"vllm.LLM did not load the LoRA adapter {lora_name!r} from {lora_path}")

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())


def draft_fields(config: dict) -> dict:
    """What the senders read of a VllmConfig (as /server_info dumps it, config/vllm.py field names): the
    speculative method (None: no speculative decoding), the weight-transfer backend, the draft's and the target's
    TP."""
    spec = config.get("speculative_config") or {}
    return {"method": spec.get("method"), "draft_tp": spec.get("draft_tensor_parallel_size"),
            "backend": (config.get("weight_transfer_config") or {}).get("backend"),
            "tp": (config.get("parallel_config") or {}).get("tensor_parallel_size")}


def as_engine(engine, timeout: float = 300.0, api_key: str | None = None):
    """A URL becomes a VLLMHTTPEngine, a vllm.LLM a VLLMLocalEngine; clients pass through."""
    if engine is None or isinstance(engine, VLLMHTTPEngine | VLLMLocalEngine):
        return engine
    if isinstance(engine, str):
        return VLLMHTTPEngine(engine, timeout, api_key)
    if hasattr(engine, "llm_engine"):
        return VLLMLocalEngine(engine)
    return engine  # anything with the client methods above
