"""Megatron-Bridge 0.6.2's own native Qwen3-VL vision tower (models/qwen_vl/modelling_qwen3_vl/vision_model.py
`Qwen3VLVisionModel`) on CPU beside megatron-core 0.16.1, so the tests export the module Bridge users train.

Bridge 0.6.2 as a package needs megatron-core 0.19 and Python 3.12 (the wheel is fetched with `--python-version
3.12`, harness.wheels), but the tower's modules import on 0.16.1 when, as in harness.bridge_vlm for 0.3.1,
`megatron.bridge`, `.models`, `.models.qwen_vl`, `.models.qwen_vl.modelling_qwen3_vl`, `.utils` and
`.training.utils` are registered as bare packages (their `__init__`s import every model bridge and Megatron-LM's
`megatron.training`) and Transformer Engine is stubbed after megatron-core is imported. Only the files in
`BRIDGE_VISION_FILES` are unpacked. What is built, with why:

* the layer spec: megatron-core's local ViT spec (vit_layer_specs.py `get_vit_layer_with_local_spec`) with Bridge's
  `Qwen3VLSelfAttention` as the attention module, as model.py:305-312 does with the TE spec (no TE here; the TE
  spec's fused norms are the local spec's under naming.TE_RENAMES);
* the merger spec: PatchMergerSubmodules of the local twins of model.py:306-310's TENorm / TEColumnParallelLinear /
  TERowParallelLinear (WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear);
* the config: Bridge's `get_vision_model_config(hf vision config, megatron_config=the language model's)`
  (transformer_config.py:63-158), TP from the language model.

Worker processes are reused across tests, and another Bridge release (0.3.1, harness.bridge_lora / bridge_vlm) may
already be `megatron.bridge` in them: its modules are set aside while 0.6.2's are imported and put back after.

Its forward does not run on CPU (it packs frames as `thd`, which only TE's attention takes): the tests load and
export it, and compare its parameters with mcore2hf's tower (model_specs/qwen3_vl_vision.py), which runs."""

from __future__ import annotations

import sys

from harness.wheels import bare_package

#: the Bridge release whose native tower the tests build (needs megatron-core >= 0.19 and Python 3.12 as a whole)
BRIDGE_VISION_VERSION = "0.6.2"
BRIDGE_VISION_FILES = ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/*", "megatron/bridge/utils/*",
                       "megatron/bridge/training/utils/packed_seq_utils.py",
                       "megatron/bridge/models/qwen_vl/qwen3_vl_bridge.py")


def bridge_vision_root() -> str:
    """The unpacked wheel's root (download once, cached); call in the test process, pass to the workers."""
    from harness.wheels import unpacked_wheel

    return str(unpacked_wheel("megatron-bridge", BRIDGE_VISION_VERSION, BRIDGE_VISION_FILES))


def build_bridge_tower(root: str, hf_config, lm_config):
    """Bridge 0.6.2's `Qwen3VLVisionModel` for `hf_config.vision_config`, TP as `lm_config` (in a worker with
    Megatron's parallel state initialized)."""
    import megatron
    import megatron.core  # noqa: F401 - before the TE stub: megatron-core must see no TE

    from mcore2hf.arch.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    import megatron.core.extensions.transformer_engine  # noqa: F401

    # worker processes are reused across tests: another Bridge release (0.3.1: harness.bridge_lora, bridge_vlm) may
    # be registered as `megatron.bridge` here; set it aside while 0.6.2's modules are imported, then put it back
    saved = {k: m for k, m in sys.modules.items() if k == "megatron.bridge" or k.startswith("megatron.bridge.")}
    for k in saved:
        del sys.modules[k]
    attr = megatron.__dict__.pop("bridge", None)
    try:
        return _build(root, hf_config, lm_config)
    finally:
        for k in [k for k in sys.modules if k == "megatron.bridge" or k.startswith("megatron.bridge.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        megatron.__dict__.pop("bridge", None)
        if attr is not None:
            megatron.bridge = attr


def _build(root: str, hf_config, lm_config):
    from harness.bridge_lora import _stub_transformer_engine

    bridge = f"{root}/megatron/bridge"
    for name, path in (("megatron.bridge", bridge), ("megatron.bridge.models", f"{bridge}/models"),
                       ("megatron.bridge.models.qwen_vl", f"{bridge}/models/qwen_vl"),
                       ("megatron.bridge.models.qwen_vl.modelling_qwen3_vl", f"{bridge}/models/qwen_vl/modelling_qwen3_vl"),
                       ("megatron.bridge.utils", f"{bridge}/utils"), ("megatron.bridge.training", f"{bridge}/training"),
                       ("megatron.bridge.training.utils", f"{bridge}/training/utils")):
        bare_package(name, path)
    _stub_transformer_engine()
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.attention import Qwen3VLSelfAttention
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_config import get_vision_model_config
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import PatchMergerSubmodules
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.vision_model import Qwen3VLVisionModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.module = Qwen3VLSelfAttention
    merger = PatchMergerSubmodules(patch_norm=WrappedTorchNorm, linear_fc1=ColumnParallelLinear,
                                   linear_fc2=RowParallelLinear)
    config = get_vision_model_config(hf_config.vision_config, megatron_config=lm_config)
    return Qwen3VLVisionModel(config, spec, merger, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
