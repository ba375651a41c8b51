"""Megatron-Bridge 0.3.1's own `Qwen3VLModel` (models/qwen_vl/modelling_qwen3_vl/model.py) and `GLM45VModel`
(models/glm_vl/modeling_glm_45v.py: transformers' Glm4vVisionModel at `visual`, build_glm45v_model) on CPU beside
megatron-core 0.16.1: the "HF tower embedded in the Megatron model" layout (docs/vlm.md, layout 2). It holds
transformers' `Qwen3VLVisionModel` at `vision_model` (built only where `pre_process`, i.e. on the first pipeline
stage, replicated on every TP rank, `hook_hf_module_setattr_for_tp_grad_sync` marking its parameters for a TP
gradient all-reduce) beside `language_model`, its `Qwen3VLGPTModel` (a GPTModel subclass with Qwen3-VL's
interleaved mRoPE), so the tests export the module tree Bridge users train.

Imported as harness.bridge_lora imports Bridge's PEFT (read its docstring): the wheel unpacked without its
dependencies, `megatron.bridge`, `.models`, `.models.qwen_vl`, `.qwen_vl.modelling_qwen3_vl` registered as bare
packages (their `__init__`s import every model bridge, which needs transformers < 5), Transformer Engine stubbed after megatron-core is imported.
Only `modelling_qwen3_vl/*`, `models/transformer_config.py` and `utils/*` are imported; they need transformers'
Qwen3-VL classes, which 5.24 has. The language model is built with mcore2hf's local layer spec for the HF config
(the provider's TE spec needs Transformer Engine), in the config class Bridge's model expects."""

from __future__ import annotations

import dataclasses

from harness.bridge_lora import BRIDGE_VERSION
from harness.wheels import bare_package

#: what is unpacked from the wheel for the vision-language model (besides bridge_lora's)
BRIDGE_VLM_FILES = ("megatron/bridge/models/qwen_vl/modelling_qwen3_vl/*", "megatron/bridge/models/transformer_config.py",
                    "megatron/bridge/utils/*", "megatron/bridge/models/glm_vl/modeling_glm_45v.py")


def bridge_vlm_root() -> str:
    """The unpacked wheel's root (download once, cached); call in the test process, pass to the workers."""
    from harness.wheels import unpacked_wheel

    return str(unpacked_wheel("megatron-bridge", BRIDGE_VERSION, BRIDGE_VLM_FILES))


def import_qwen3_vl_model(root: str):
    """Bridge's `Qwen3VLModel` and `Qwen3VLTransformerConfig` from the unpacked wheel at `root` (in a worker)."""
    import megatron
    import megatron.core  # noqa: F401 - before the TE stub: megatron-core must see no TE

    from mcore2hf.arch.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    import megatron.core.extensions.transformer_engine  # noqa: F401

    from harness.bridge_lora import _stub_transformer_engine

    bare_package("megatron.bridge", f"{root}/megatron/bridge")
    bare_package("megatron.bridge.models", f"{root}/megatron/bridge/models")
    bare_package("megatron.bridge.models.qwen_vl", f"{root}/megatron/bridge/models/qwen_vl")
    bare_package("megatron.bridge.models.qwen_vl.modelling_qwen3_vl",  # its __init__ imports the bridges too
                  f"{root}/megatron/bridge/models/qwen_vl/modelling_qwen3_vl")
    _stub_transformer_engine()
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_config import Qwen3VLTransformerConfig

    return Qwen3VLModel, Qwen3VLTransformerConfig


def build_qwen3_vl_model(root: str, cfg, vocab_size: int, **overrides):
    """Bridge's Qwen3VLModel for the HF Qwen3VLConfig `cfg` at the initialized parallel layout (no virtual PP:
    0.3.1's model takes no vp_stage), the language model's TransformerConfig being mcore2hf's for `cfg`."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore2hf.arch.registry import get_model_spec
    from mcore2hf.model_specs.common import block_specs, stage_ends

    model_cls, config_cls = import_qwen3_vl_model(root)
    spec = get_model_spec(cfg.model_type)
    base = spec.transformer_config(cfg, **overrides)
    text, vision = cfg.text_config, cfg.vision_config
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
    kwargs = spec.gpt_kwargs(cfg)
    vl = dict(vocab_size=vocab_size, language_max_sequence_length=kwargs["max_sequence_length"],
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
        spatial_merge_size=vision.spatial_merge_size, num_position_embeddings=vision.num_position_embeddings,
        out_hidden_size=vision.out_hidden_size, deepstack_visual_indexes=list(vision.deepstack_visual_indexes),
        share_embeddings_and_output_weights=kwargs["share_embeddings_and_output_weights"],
        rotary_percent=kwargs["rotary_percent"], rotary_base=kwargs["rotary_base"],
        mrope_section=list(text.rope_parameters["mrope_section"]), hf_text_config=text,
        image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
        vision_start_token_id=cfg.vision_start_token_id)
    config = config_cls(**{**fields, **vl})
    block, _ = block_specs(spec, cfg, config, use_te=False)
    pre, post = stage_ends(None)
    assert ps.get_virtual_pipeline_model_parallel_world_size() in (None, 1)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return [model_cls(config, block, vision, pre_process=pre, post_process=post, pg_collection=pgs)]



def transformers_5_forward(chunk) -> None:
    """Let Bridge 0.3.1's own `Qwen3VLModel.forward` run beside transformers 5.24, whose classes it calls in their
    4.57 form (Bridge 0.3.1 pins transformers < 5); the same math, two call forms restored on this chunk's modules:

    * its tower's output, unpacked as `vision_embeds, deepstack_feature_lists` (model.py:274-277), what 4.57's
      `Qwen3VLVisionModel.forward` returned: 5.24 returns `BaseModelOutputWithDeepstackFeatures`, whose
      `pooler_output` is that merger output and `deepstack_features` those features;
    * its rope (rope.py:83-93 `Qwen3VLTextRotaryEmbedding`, a subclass of transformers') calls 4.57's
      `apply_interleaved_mrope(freqs, mrope_section)`, which 5.24 folded into `recomposition_frequencies` (with
      the cos/sin concatenation): 4.57's method is given back (transformers 4.57.1 models/qwen3_vl/
      modeling_qwen3_vl.py, the temporal frequencies overwritten by height / width ones at every third index)."""
    tower = getattr(chunk, "vision_model", None)
    if tower is not None:
        forward = tower.forward

        def as_tuple(hidden_states, grid_thw, **kwargs):
            out = forward(hidden_states=hidden_states, grid_thw=grid_thw, **kwargs)
            return out.pooler_output, out.deepstack_features

        tower.forward = as_tuple
    rope = chunk.language_model.rotary_pos_emb
    if not hasattr(rope, "apply_interleaved_mrope"):
        def apply_interleaved_mrope(freqs, mrope_section):
            freqs_t = freqs[0]
            for dim, offset in enumerate((1, 2), start=1):
                idx = slice(offset, mrope_section[dim] * 3, 3)
                freqs_t[..., idx] = freqs[dim, ..., idx]
            return freqs_t

        rope.apply_interleaved_mrope = apply_interleaved_mrope


def import_glm45v_model(root: str):
    """Bridge 0.3.1's `GLM45VModel` (models/glm_vl/modeling_glm_45v.py) from the unpacked wheel at `root`.

    Its module imports `megatron.bridge.models.gpt_provider` only for the annotation `config: GPTModelProvider`
    (modeling_glm_45v.py:36, :103); that module pulls Bridge's whole provider stack (model_provider.py -> config.py
    -> omegaconf, not installed), so it is registered as a module holding megatron-core's TransformerConfig under
    that name (GPTModelProvider is a TransformerConfig dataclass, gpt_provider.py)."""
    import sys
    import types

    import megatron
    import megatron.core  # noqa: F401 - before the TE stub: megatron-core must see no TE

    from mcore2hf.arch.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    import megatron.core.extensions.transformer_engine  # noqa: F401
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.bridge_lora import _stub_transformer_engine

    bare_package("megatron.bridge", f"{root}/megatron/bridge")
    bare_package("megatron.bridge.models", f"{root}/megatron/bridge/models")
    bare_package("megatron.bridge.models.glm_vl", f"{root}/megatron/bridge/models/glm_vl")  # __init__: the bridge
    if "megatron.bridge.models.gpt_provider" not in sys.modules:
        provider = types.ModuleType("megatron.bridge.models.gpt_provider")
        provider.GPTModelProvider = TransformerConfig
        sys.modules[provider.__name__] = provider
    _stub_transformer_engine()
    from megatron.bridge.models.glm_vl.modeling_glm_45v import GLM45VModel

    return GLM45VModel


def build_glm45v_model(root: str, cfg, **overrides):
    """Bridge's GLM45VModel for the HF Glm4vMoeConfig `cfg` at the initialized parallel layout (no virtual PP), as
    its provider builds it (glm_45v_provider.py:56-70 `provide`, `provide_language_model`): the config object is
    the language model's TransformerConfig (mcore2hf's for `cfg`) carrying what the wrapper reads of the provider,
    `vision_config` (the HF tower built from it: transformers' Glm4vVisionModel, first stage only) and
    `provide_language_model`, which hands over mcore2hf's GPTModel for `cfg` (Bridge's provider builds a GPTModel
    with its own spec, which needs Transformer Engine)."""
    from megatron.core import parallel_state as ps

    from mcore2hf.arch.build import build_model
    from mcore2hf.model_specs.common import stage_ends

    model_cls = import_glm45v_model(root)
    assert ps.get_virtual_pipeline_model_parallel_world_size() in (None, 1)
    (language_model,) = build_model(cfg, use_te=False, **overrides)
    base = language_model.config

    @dataclasses.dataclass
    class Provider(type(base)):
        vision_config: object = None

        def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
            assert (pre_process, post_process, vp_stage) == (*stage_ends(None), None)
            return language_model

    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(type(base)) if f.init}
    config = Provider(**fields, vision_config=cfg.vision_config)
    config.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights
    pre, post = stage_ends(None)
    return [model_cls(config, pre_process=pre, post_process=post, vp_stage=None)]


def build_kimi_k25_equivalent(cfg, **overrides):
    """Megatron-Bridge 0.6.2's KimiK25VLModel (models/kimi_vl/modeling_kimi_k25_vl.py), rebuilt here: it cannot
    be built on this machine nor on the GPU machines. Its tower classes are the checkpoint's remote code
    (`get_class_from_dynamic_module("modeling_kimi_k25.MoonViT3dPretrainedModel", config.hf_model_path)`,
    modeling_kimi_k25_vl.py:152-188: MoonViT3dPretrainedModel, PatchMergerMLP, their configs), which is on the hub
    only, and the module imports megatron.bridge.utils.common_utils, which needs Megatron-LM's megatron.training and
    megatron-core 0.19's _rank_utils. What it builds, line by line:

    * `super().__init__(config=config)` (:139), the provider config being the language model's TransformerConfig;
    * on the first stage only (`if pre_process:`, :148): `self.vision_tower` (:215) and `self.mm_projector` (:216),
      the remote MoonViT3d / PatchMergerMLP modules: here modules holding exactly the parameters the published
      checkpoint stores under `vision_tower.` / `mm_projector.` (names and shapes: hf_config.hf_tensor_shapes),
      every parameter marked `average_gradients_across_tp_domain` as hook_hf_module_setattr_for_tp_grad_sync
      does (:218-219; Bridge utils/common_utils.py), replicated on every TP rank;
    * `self.language_model = self.config.provide_language_model(...)` (:220), KimiK25VLModelProvider's
      (kimi_k25_vl_provider.py:86-88: the MLA GPTModel; here mcore2hf's DeepSeek-V3 GPTModel for `cfg`);
    * `share_embeddings_and_output_weights` and `shared_embedding_or_output_weight` from it (:225-226)."""
    import torch
    from megatron.core.transformer.module import MegatronModule

    from mcore2hf.arch.build import build_model
    from mcore2hf.arch.hf_config import hf_tensor_shapes
    from mcore2hf.model_specs.common import stage_ends

    (language_model,) = build_model(cfg, use_te=False, **overrides)
    shapes = hf_tensor_shapes(cfg)

    def remote_module(prefix: str) -> torch.nn.Module:
        root = torch.nn.Module()
        for name, shape in shapes.items():
            if not name.startswith(prefix):
                continue
            *path, leaf = name[len(prefix):].split(".")
            module = root
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            param = torch.nn.Parameter(torch.empty(tuple(shape)))
            param.average_gradients_across_tp_domain = True  # hook_hf_module_setattr_for_tp_grad_sync
            module.register_parameter(leaf, param)
        return root

    class KimiK25VLModel(MegatronModule):
        def __init__(self, config, pre_process: bool, post_process: bool, vp_stage=None):
            super().__init__(config=config)
            self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
            if pre_process:
                self.vision_tower = remote_module("vision_tower.")
                self.mm_projector = remote_module("mm_projector.")
            self.language_model = language_model
            self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights
            self.shared_embedding_or_output_weight = language_model.shared_embedding_or_output_weight

    pre, post = stage_ends(None)
    return [KimiK25VLModel(language_model.config, pre_process=pre, post_process=post)]
