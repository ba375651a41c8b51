"""SGLang's own multimodal model classes on CPU, loading the names and tensors mcore2hf exports
(`python -m harness.sglang_vlm_load SITE_DIR IN.json OUT.json`, one release per process, harness.sglang_real's
stubs for what does not import here).

What runs is the release's: its config parser (utils/hf_transformers/config.py `get_config`, which maps
`qwen3_5` / `qwen3_5_moe` to SGLang's own config classes), the model classes' `__init__` (Qwen3-VL
`models/qwen3_vl.py` Qwen3VLForConditionalGeneration, Qwen3-VL-MoE `models/qwen3_vl_moe.py`, Qwen3.5 and
Qwen3.5-MoE `models/qwen3_5.py`, GLM-4.5V `models/glm4v_moe.py`: the vision tower, the language model with its
fused qkv / gate_up, FusedMoE and gated-DeltaNet parameters) and their `load_weights` with every parameter's own
weight_loader. Around them, as a
scheduler process sets them up before building the model: a dummy ServerArgs published with the release's test
hook (runtime_context.py `RuntimeContext.override_server_args`), a gloo world of one process
(distributed/parallel_state.py `init_distributed_environment`, `initialize_model_parallel`) and the process' ranks
(0) stated with `get_parallel().override_permanently`. Two things differ from stubbing: models/utils.py registers
kernels of the (stubbed) sgl_kernel as torch custom ops at import, and `direct_register_custom_op` skips those stubs
(nothing calls them when loading); the kernel modules in REAL_KERNEL_MODULES, which define layers holding
parameters, are the wheel's own files.

The check, per model (TP 1; the engines' TP slicing is tests/test_engine_shards.py's), is harness.vlm_load's
`load_contract`, shared with vLLM's classes (harness.vllm_vlm_names).

With a quantization config instead of a checkpoint (`fp8_params`), the class is built with SGLang's Fp8Config of
an FP8 export's `quantization_config`, and the float8 parameters it creates are reported: the tower must have none
(our FP8 exports keep it unquantized, so the engine must expect it so)."""

from __future__ import annotations

import json
import os
import sys

#: (module, class) SGLang resolves for each HF architecture (models/registry.py, EntryClass of each module)
CLASSES = {"Qwen3VLForConditionalGeneration": "sglang.srt.models.qwen3_vl",
           "Glm4vMoeForConditionalGeneration": "sglang.srt.models.glm4v_moe",
           "Qwen3VLMoeForConditionalGeneration": "sglang.srt.models.qwen3_vl_moe",
           "Qwen3_5ForConditionalGeneration": "sglang.srt.models.qwen3_5",
           "Qwen3_5MoeForConditionalGeneration": "sglang.srt.models.qwen3_5"}

#: modules under sglang.kernels (stubbed as a whole by harness.sglang_real) that define parameter-holding layers the
#: models build: loaded from the wheel for real, or the layer would be a stub without its weight (Qwen3.5's gated
#: DeltaNet norm, models/qwen3_5.py:28 and :507, `linear_attn.norm.weight`)
REAL_KERNEL_MODULES = ("sglang.kernels.ops.attention.fla.layernorm_gated",)


def _setup(site: str) -> None:
    """The release imported with harness.sglang_real's stubs, a published dummy config and a gloo world of 1."""
    import importlib.util

    from harness.sglang_real import _Stub, install
    from harness.vlm_load import local_init_method

    install(site)
    import sglang.srt.distributed.parallel_state as dps
    import sglang.srt.utils.common as common
    from sglang.srt.runtime_context import _parallel_fields, get_context, get_parallel

    real = common.direct_register_custom_op

    def register(op_name, op_func, *args, **kwargs):  # a stubbed kernel: nothing to register
        return None if isinstance(op_func, _Stub) else real(op_name, op_func, *args, **kwargs)

    common.direct_register_custom_op = register
    for name in REAL_KERNEL_MODULES:  # after install(): their own triton / kernel imports are stubs
        path = os.path.join(site, *name.split(".")) + ".py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    get_context().override_server_args(device="cpu").install()
    dps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=local_init_method())
    dps.initialize_model_parallel(backend="gloo")
    get_parallel().override_permanently(**{f: 0 for f in _parallel_fields() if f.endswith("_rank")})


def check(config_dir: str, ckpt_dir: str) -> dict:
    """Build the release's class for the checkpoint's config and load its tensors (see the module docstring)."""
    import importlib

    import torch
    from sglang.srt.utils.hf_transformers.config import get_config

    from harness.vlm_load import load_contract, read_tensors

    cfg = get_config(config_dir, trust_remote_code=False)
    arch = cfg.architectures[0]
    cls = getattr(importlib.import_module(CLASSES[arch]), arch)
    tensors = read_tensors(ckpt_dir)
    torch.manual_seed(0)
    return {"class": f"{cls.__module__}.{arch}", **load_contract(cls(cfg), tensors)}


def fp8_params(config_dir: str, quantization_config: dict) -> dict:
    """The release's class for the config built with SGLang's Fp8Config of `quantization_config` (an FP8 export's
    config.json entry; layers/quantization/fp8.py Fp8Config.from_config and get_quant_method decide per layer from
    its modules_to_not_convert): which parameters it creates in float8 (those the engine expects quantized).
    The tiny models' odd widths are not multiples of the 128 x 128 blocks, which the FP8 linear refuses: blocks of
    1 x 1 here (the block size plays no part in which layers are skipped)."""
    import importlib

    import torch
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.utils.hf_transformers.config import get_config

    cfg = get_config(config_dir, trust_remote_code=False)
    arch = cfg.architectures[0]
    cls = getattr(importlib.import_module(CLASSES[arch]), arch)
    model = cls(cfg, quant_config=Fp8Config.from_config(dict(quantization_config, weight_block_size=[1, 1])))
    return {"class": f"{cls.__module__}.{arch}",
            "float8": sorted(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn)}


def main(site: str, inp: str, out: str) -> None:
    _setup(site)
    import sglang

    with open(inp) as f:
        cases = json.load(f)
    result = {"sglang": sglang.__version__, "file": sglang.__file__}
    for key, (config_dir, second) in cases.items():
        try:
            result[key] = fp8_params(config_dir, second) if isinstance(second, dict) else check(config_dir, second)
        except Exception:  # noqa: BLE001 - reported per model, the others still run
            import traceback

            result[key] = {"error": traceback.format_exc()[-4000:]}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
