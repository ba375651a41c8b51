"""vLLM 0.33.0's own name handling of Qwen3-VL and Qwen3.5 checkpoints, run on the names mcore2hf exports
(`python -m harness.vllm_vlm_names IN.json OUT.json`, in a subprocess with the unpacked wheel on sys.path and
VLLM_TARGET_DEVICE=cpu).

The mapper: each class's `hf_to_vllm_mapper` (vllm/model_executor/models/qwen3_vl.py
Qwen3VLForConditionalGeneration, qwen3_5.py Qwen3_5ForConditionalGeneration) is a literal `WeightsMapper(...)` in
the class body; it is read from the wheel's source (ast, the class's own assignment,
`A.hf_to_vllm_mapper | WeightsMapper(...)` followed) and built with the wheel's own `WeightsMapper`
(model_executor/models/utils.py), whose `_map_name` is what `AutoWeightsLoader.load_weights(weights, mapper=...)`
applies to every checkpoint name. The mapped names must land in the modules the class builds: `visual.`
(Qwen3_VisionTransformer), `language_model.model.` and `language_model.lm_head.` (Qwen3LLMForCausalLM's model and
lm_head, qwen3_vl.py:1910-1915, 2011, 2043), or be dropped (None: Qwen3.5's `mtp.`).

The classes (`load_check`, IN.json's "load"): vLLM's own Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE and GLM-4.5V
classes built on CPU as its model loader builds them, their `load_weights` run on an export's tensors by
harness.vlm_load's `load_contract` (the check SGLang's classes are held to); `_stub_for_model_building` lists what
is stubbed around vLLM's code for that, and why.

`fp8_skipped`: which layers vLLM keeps unquantized under an FP8 export's quantization_config (Qwen3-VL, GLM-4.5V,
Kimi-K2.5: the classes pass the FP8 config to their towers, kimi_k25.py:350-367, glm4_1v.py:1791-1795)."""

from __future__ import annotations

import ast
import json
import sys

#: what each class builds (qwen3_vl.py Qwen3VLForConditionalGeneration.__init__, Qwen3LLMForCausalLM.__init__)
MODULES = ("visual.", "language_model.model.", "language_model.lm_head.")


def _class_value(files: dict[str, str], cls: str, attr: str):
    """The expression assigned to `attr` in the body of class `cls` in the wheel's source, or inherited from its
    bases (glm4_1v.py Glm4vMoeForConditionalGeneration's mapper); None if absent."""
    for path in files.values():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == attr for t in stmt.targets):
                        return stmt.value
                for base in node.bases:
                    if isinstance(base, ast.Name):
                        value = _class_value(files, base.id, attr)
                        if value is not None:
                            return value
    return None


def _class_mapper(files: dict[str, str], cls: str):
    """The WeightsMapper expression assigned to `cls.hf_to_vllm_mapper`, evaluated with the wheel's WeightsMapper."""
    from vllm.model_executor.models.utils import WeightsMapper

    expr = _class_value(files, cls, "hf_to_vllm_mapper")
    if expr is None:
        raise LookupError(f"{cls}.hf_to_vllm_mapper not found in {list(files)}")
    return _evaluate(expr, files, WeightsMapper)


def _evaluate(expr, files, weights_mapper):
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        return _evaluate(expr.left, files, weights_mapper) | _evaluate(expr.right, files, weights_mapper)
    if isinstance(expr, ast.Attribute) and expr.attr == "hf_to_vllm_mapper":
        return _class_mapper(files, expr.value.id)
    if isinstance(expr, ast.Call) and getattr(expr.func, "id", "") == "WeightsMapper":
        return weights_mapper(**{k.arg: ast.literal_eval(k.value) for k in expr.keywords})
    raise ValueError(f"unexpected mapper expression: {ast.dump(expr)[:200]}")


def _class_literal(files: dict[str, str], cls: str, attr: str):
    """A literal class attribute (e.g. `packed_modules_mapping`) of `cls` in the wheel's source; None if absent."""
    value = _class_value(files, cls, attr)
    return None if value is None else ast.literal_eval(value)


def fp8_skipped(files: dict[str, str], cls: str, names: list[str], quantization_config: dict) -> dict[str, bool]:
    """Whether vLLM skips (keeps unquantized) the layer of each exported 2-D weight name under an FP8 export's
    `quantization_config`: the wheel's Fp8Config.from_config, its apply_vllm_mapper with the class's
    hf_to_vllm_mapper (as the model loader applies it), and its is_layer_skipped with the config's match mode and
    the class's packed_modules_mapping (layers/quantization/fp8.py get_quant_method). The layer's module path is
    the mapped checkpoint name, a packed shard's (gate_proj, ...) under its fused module's name: what the classes
    build (their load_weights maps names that way)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    mapper = _class_mapper(files, cls)
    packed = _class_literal(files, cls, "packed_modules_mapping") or {}
    shard_of = {shard: fused for fused, shards in packed.items() for shard in shards}
    config = Fp8Config.from_config(quantization_config)
    config.apply_vllm_mapper(mapper)
    out = {}
    for name in names:
        mapped = mapper._map_name(name)
        if mapped is None:
            continue
        *path, leaf = mapped.removesuffix(".weight").split(".")
        prefix = ".".join([*path, shard_of.get(leaf, leaf)])
        out[name] = is_layer_skipped(prefix, config.ignored_layers, packed, match_mode=config.ignored_layers_match_mode)
    return out


#: torchvision modules transformers' Qwen2-VL image processor imports at module level
#: (transformers 5.24 models/qwen2_vl/image_processing_qwen2_vl.py:26, `torchvision.transforms.v2.functional`), which
#: vLLM's qwen3_vl.py:37-40 imports: used only to preprocess images, never by a class's __init__ or load_weights
TORCHVISION_STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                     "torchvision.transforms.v2.functional")
#: packages vLLM imports that are not installed here, stubbed: compressed_tensors (quantization configs,
#: fused_moe/oracle/int_wna16.py:8 via qwen_gdn_linear_attn.py:55's AutoAWQConfig import; no tiny model is
#: quantized, so no code of it runs)
ABSENT = ("compressed_tensors",)
def _stub_for_model_building() -> None:
    """What building the model classes on CPU needs around vLLM's code (each stub listed above, and why):
    torchvision's and the absent packages' modules as harness.sglang_real's catch-all stubs, put in only after
    transformers decided torchvision is absent (its availability check is cached, so it keeps the PIL image
    processor); the registry's model inspection (registry.py `_LazyRegisteredModel.inspect_model_cls`, which runs
    `_ModelInfo.from_model_cls` in a fresh subprocess that would not have these stubs) run in this process; the
    CPU MoE kernel's width check (below)."""
    import importlib.abc
    import importlib.machinery

    from transformers.utils import is_torchvision_available

    from harness.sglang_real import _Stub

    torchvision = is_torchvision_available()  # cached: where False, transformers takes the PIL paths from here on

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return _Stub(spec.name)

        def exec_module(self, module) -> None:
            pass

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] not in ABSENT:
                return None
            return importlib.machinery.ModuleSpec(fullname, Loader(), is_package=True)

    for name in TORCHVISION_STUBS if not torchvision else ():  # an installed torchvision is used as it is
        sys.modules[name] = _Stub(name)
    sys.meta_path.append(Finder())
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()
    # the CPU MoE kernels take hidden / intermediate widths in multiples of 32 only (experts/cpu_moe.py:173-194
    # `_supports_grouped_gemm`), which the tiny odd widths are not, so FusedMoE finds no backend: that kernel runs
    # only in the forward, FusedMoE's parameters and weight_loader do not depend on it
    # (unquantized_fused_moe_method.py:68-130 create_weights), so it is accepted here
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    CPUUnquantizedExperts._supports_grouped_gemm = classmethod(lambda cls, moe_config: (True, None))


def _build(config_dir: str, dtype: str = "float32"):
    """vLLM's own class for `config_dir`'s config.json (the checkpoint's, as published), built by its model loader's
    own `initialize_model` (model_loader/utils.py: the registry's class, its quant config mapped, built under
    `set_current_vllm_config`) from a ModelConfig of the directory and a VllmConfig on the CPU platform, in a gloo
    world of one process (its model-parallel groups made anew for each model: an EP group only for MoE ones)."""
    import torch
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import initialize_model

    from harness.vlm_load import local_init_method

    model_config = ModelConfig(model=config_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vllm_config):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        else:
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=local_init_method())
        parallel_state.initialize_model_parallel(backend="gloo")
        torch.manual_seed(0)
        return initialize_model(vllm_config)


def load_check(config_dir: str, ckpt_dir: str) -> dict:
    """vLLM's own class for `config_dir`'s config.json (`_build`), then harness.vlm_load's `load_contract` with the
    checkpoint's tensors through the class's `load_weights`."""
    from harness.vlm_load import load_contract, read_tensors

    model = _build(config_dir)
    cls = type(model)
    return {"class": f"{cls.__module__}.{cls.__name__}", **load_contract(model, read_tensors(ckpt_dir))}


def fp8_params(config_dir: str) -> dict:
    """vLLM's own class for `config_dir`'s config.json, which holds an FP8 export's `quantization_config`, built by
    `initialize_model` as `load_check` builds it (the quant config mapped with the class's hf_to_vllm_mapper, each
    layer's quant method chosen by the wheel's Fp8Config.get_quant_method): which parameters it creates in float8
    (those the engine expects quantized). Stubbed: the FP8 GEMM kernel each FP8 linear picks at the end of
    create_weights (layers/quantization/fp8.py:347 `init_fp8_linear_kernel`; the CPU ones need vllm._C's
    `fp8_scaled_mm_cpu` or AMX-FP8 hardware): it runs only in the forward, the parameters exist before it."""
    import vllm.model_executor.layers.quantization.fp8 as fp8

    fp8.init_fp8_linear_kernel = lambda **kwargs: None
    import torch

    model = _build(config_dir, "bfloat16")  # vLLM's FP8 takes bf16 / fp16 models only (its config check)
    cls = type(model)
    return {"class": f"{cls.__module__}.{cls.__name__}",
            "float8": sorted(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn)}


def main(inp: str, out: str) -> None:
    import os

    import vllm

    root = os.path.join(os.path.dirname(vllm.__file__), "model_executor", "models")
    files = {m: os.path.join(root, f"{m}.py") for m in ("qwen3_vl", "qwen3_5", "qwen3_next", "glm4_1v", "kimi_k25")}
    with open(inp) as f:
        names = json.load(f)
    result = {"vllm": vllm.__version__, "file": files["qwen3_vl"]}
    for cls, key in (("Qwen3VLForConditionalGeneration", "qwen3_vl"), ("Qwen3_5ForConditionalGeneration", "qwen3_5")):
        mapper = _class_mapper(files, cls)
        result[key] = {n: mapper._map_name(n) for n in names[key]}
    for key, (cls, tensor_names, quantization_config) in names.get("fp8", {}).items():
        result[f"fp8:{key}"] = fp8_skipped(files, cls, tensor_names, quantization_config)
    if names.get("load"):
        _stub_for_model_building()
    for key, (config_dir, ckpt_dir) in names.get("load", {}).items():
        try:  # an FP8 config (no checkpoint): the parameters it builds in float8
            result[f"load:{key}"] = fp8_params(config_dir) if ckpt_dir is None else load_check(config_dir, ckpt_dir)
        except Exception:  # noqa: BLE001 - reported per model, the others still run
            import traceback

            result[f"load:{key}"] = {"error": traceback.format_exc()[-4000:]}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    from harness.vllm_real import install_gpu_stubs

    install_gpu_stubs()
    main(sys.argv[1], sys.argv[2])
