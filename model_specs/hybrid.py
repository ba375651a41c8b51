"""Hybrid models: megatron-core 0.19's HybridModel (0.16: MambaModel) holding a registered architecture. A layer's
pattern symbols come from its spec (`ModelSpec.hybrid_layer_symbols`); here the pattern is joined and checked,
fitted to what the installed release's stack can build, and the model chunks are built (`build_hybrid_model`)."""

from __future__ import annotations

import torch

from mcore2hf.arch.hf_config import text_config

from .common import ModelSpec, stage_ends, supported_kwargs

#: the stack submodule each pattern symbol is built from (megatron-core 0.19.2 models/hybrid/hybrid_block.py
#: `HybridStackSubmodules`, `HybridStack.__init__`); 0.16.1's MambaStack (ssm/mamba_block.py) has only the
#: attention, MLP and MoE slots, so there every attention kind is its one attention slot ('*')
HYBRID_SLOTS = {"*": "attention_layer", "+": "mla_layer", "D": "dsa_layer", "G": "gdn_layer", "-": "mlp_layer",
                "E": "moe_layer"}
#: one HF attention layer, whatever its kind (GQA, MLA, DSA): a model's pattern is checked against the HF
#: config's with these as one (the layer's tensors then say which kind it is)
ATTENTION_MIXERS = frozenset("*+D")


def _join_pattern(layers: list[str], segments: int, mtp: str | None, depths: int) -> str:
    from mcore2hf.errors import ConfigMismatchError

    if len(layers) % segments:
        raise ConfigMismatchError(f"a hybrid pattern of {len(layers)} HF layers cannot be split into {segments} "
                                  "equal pipeline segments")
    n = len(layers) // segments
    main = "|".join("".join(layers[s * n:(s + 1) * n]) for s in range(segments))
    return main + f"/{mtp}" * depths if depths else main


def hybrid_layers(spec: ModelSpec, cfg) -> list[str]:
    """The hybrid-pattern symbols of each HF layer (`ModelSpec.hybrid_layer_symbols`)."""
    return [spec.hybrid_layer_symbols(cfg, i) for i in range(text_config(cfg).num_hidden_layers)]


def hybrid_pattern(spec: ModelSpec, cfg, segments: int = 1, mtp_depths: int = 0) -> str:
    """The hybrid layer pattern of the HF model, split into `segments` pipeline segments ('|') of whole HF layers,
    with `mtp_depths` MTP depths ('/'; megatron-core >= 0.19)."""
    return _join_pattern(hybrid_layers(spec, cfg), segments, spec.hybrid_mtp_symbols(cfg) if mtp_depths else None,
                         mtp_depths)


def _mixer_kinds(symbols: str) -> str:
    return "".join("A" if c in ATTENTION_MIXERS else c for c in symbols)


def hybrid_pattern_problems(layout, spec: ModelSpec, cfg) -> list[str]:
    """How a hybrid model's pattern (naming.HybridLayout) differs from what the HF config implies, per HF layer
    (the attention kinds '*', '+', 'D' counted as one: 0.16's MambaStack builds all of them as '*')."""
    want_layers = hybrid_layers(spec, cfg)
    have = layout.hf_layers()
    if _mixer_kinds(layout.pattern) == _mixer_kinds("".join(want_layers)) and len(have) == len(want_layers):
        return []
    want = "".join(want_layers)
    if len(have) != len(want_layers):
        return [f"hybrid layer pattern: HF config implies {want!r} ({len(want_layers)} layers), the model has "
                f"{layout.pattern!r} ({len(have)} layers)"]
    return [f"hybrid layer pattern, HF layer {i}: HF config implies {w!r}, the model has {h!r}"
            for i, (w, h) in enumerate(zip(want_layers, have)) if _mixer_kinds(w) != _mixer_kinds(h)]


def release_symbols(layers: list[str], hybrid_model: bool) -> list[str]:
    """`layers` (symbols per HF layer) as the installed megatron-core's stack can build them: all of them on 0.19's
    HybridStack; on 0.16's MambaStack every attention kind as its one attention slot '*' (one kind per model), no
    gated DeltaNet."""
    from mcore2hf.errors import ConfigMismatchError

    if hybrid_model:
        return layers
    mixers = sorted({s[0] for s in layers})
    if "G" in mixers:
        raise ConfigMismatchError("gated DeltaNet layers in a hybrid model need megatron-core >= 0.19 (HybridModel's "
                                  "'G' layers); 0.16-0.18's MambaStack builds mamba, attention, MLP and MoE layers "
                                  "only (ssm/mamba_hybrid_layer_allocation.py): build a GPTModel, or use 0.19")
    if len(mixers) > 1:
        raise ConfigMismatchError(f"attention layers of several kinds ({mixers}) in one hybrid model need "
                                  "megatron-core >= 0.19: 0.16-0.18's MambaStack has one attention layer spec")
    return ["*" + s[1:] for s in layers]


def hybrid_layer_fields(gpt_config, layout) -> dict:
    """The TransformerConfig fields a hybrid model needs in its own layer numbering (1 .. Megatron layers, each HF
    layer's mixer and MLP two of them), from the GPT config's (HF layers): per-layer lists repeat each HF layer's
    entry over its Megatron layers (`window_attn_skip_freq`, `linear_attention_freq`; transformer/utils.py
    `is_layer_window_attention` indexes by layer_number); DSA IndexShare's period and offset count the DSA layers'
    Megatron numbers (experimental_attention_variant/dsa.py `is_dsa_skip_topk_layer`, `source_dsa_compute_layer`:
    HF layer l is Megatron layer 2l - 1, so period 2f and offset 2 max(offset, 1) - 1 select the same layers)."""
    from mcore2hf.errors import ConfigMismatchError

    out: dict = {}
    for name in ("window_attn_skip_freq", "linear_attention_freq"):
        value = getattr(gpt_config, name, None)
        if isinstance(value, list):
            out[name] = [value[hf] for hf in layout.hf_layer]
        elif name == "window_attn_skip_freq" and isinstance(value, int) and getattr(gpt_config, "window_size", None):
            out[name] = [int((hf + 1) % value != 0) for hf in layout.hf_layer]
    freq = getattr(gpt_config, "dsa_indexer_topk_freq", None) or 1
    if freq > 1:
        mixers = [i for i, hf in enumerate(layout.hf_layer) if i == 0 or layout.hf_layer[i - 1] != hf]
        if mixers != [2 * hf for hf in range(layout.num_layers)]:
            raise ConfigMismatchError(f"DSA IndexShare in the hybrid pattern {layout.pattern!r}: every HF layer must "
                                      "be one mixer and one MLP layer, so that its top-k source is found by period")
        offset = max(getattr(gpt_config, "dsa_indexer_skip_topk_offset", 0) or 0, 1)
        out.update(dsa_indexer_topk_freq=2 * freq, dsa_indexer_skip_topk_offset=2 * offset - 1)
    return out


_LOCAL_NORM_STACKS: dict[type, type] = {}


def _local_norm_stack(base: type) -> type:
    """`base` (MambaStack / HybridStack) with the GPT block's final norm: both build Transformer Engine's TENorm,
    which raises without TE; built without it (post_layer_norm=False), then given `final_norm` where the caller
    asked for a final norm (an MTP depth's inner stack does not: MultiTokenPredictionLayer has its own)."""
    if base not in _LOCAL_NORM_STACKS:
        def __init__(self, config, submodules, *args, final_norm=None, post_process=True, **kwargs):
            from megatron.core.transformer.spec_utils import build_module

            wanted = kwargs.get("post_layer_norm", True)
            kwargs["post_layer_norm"] = False
            base.__init__(self, config, submodules, *args, post_process=post_process, **kwargs)
            self.post_layer_norm = wanted  # forward applies final_norm when post_process and post_layer_norm
            if post_process and wanted:
                self.final_norm = build_module(final_norm, config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)

        _LOCAL_NORM_STACKS[base] = type(f"Local{base.__name__}", (base,), {"__init__": __init__})
    return _LOCAL_NORM_STACKS[base]


def hybrid_stack_spec(block, layers: list[str], stack: type, submodules_cls: type, mtp_layer=None):
    """A hybrid stack spec whose layers are the GPT block spec's layers cut in two: the mixer layer keeps the
    input norm and attention (or gated DeltaNet), the MLP / MoE layer the pre-MLP norm and MLP (the same modules,
    so the same names); each symbol's slot (HYBRID_SLOTS) from the first HF layer of that kind. `mtp_layer`: the
    MTP depth's layer spec without its inner layer (0.19: built from the pattern after '/')."""
    import dataclasses

    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    empty = TransformerLayerSubmodules()

    def attention_part(layer):
        return ModuleSpec(module=layer.module, params=layer.params, submodules=dataclasses.replace(
            layer.submodules, pre_mlp_layernorm=empty.pre_mlp_layernorm, mlp=empty.mlp, mlp_bda=empty.mlp_bda))

    def mlp_part(layer, module):
        return ModuleSpec(module=module, params=layer.params, submodules=dataclasses.replace(
            layer.submodules, input_layernorm=empty.input_layernorm, self_attention=empty.self_attention,
            self_attn_bda=empty.self_attn_bda))

    parts: dict = {}
    for symbols, layer in zip(layers, block.layer_specs):
        mixer, mlp = symbols[0], symbols[1:]
        if HYBRID_SLOTS[mixer] not in parts:
            parts[HYBRID_SLOTS[mixer]] = attention_part(layer)
        if mlp and HYBRID_SLOTS[mlp] not in parts:
            parts[HYBRID_SLOTS[mlp]] = mlp_part(layer, MLPLayer if mlp == "-" else layer.module)
    if mtp_layer is not None:
        from megatron.core.transformer.multi_token_prediction import (
            MultiTokenPredictionBlock,
            MultiTokenPredictionBlockSubmodules,
        )

        parts["mtp_block_spec"] = ModuleSpec(module=MultiTokenPredictionBlock,
                                             submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]))
    return ModuleSpec(module=_local_norm_stack(stack), submodules=submodules_cls(**parts),
                      params={"final_norm": block.layer_norm})


def _hybrid_mtp_layer(spec: ModelSpec, config, use_te: bool):
    """An MTP depth's layer spec for a hybrid model (enorm, hnorm, eh_proj, final norm from the architecture's
    backend, as its GPT MTP block's; no inner layer: megatron-core 0.19.2 multi_token_prediction.py:1018-1033
    builds it as a HybridStack of the MTP pattern), the spec hybrid_layer_specs.py `_hybrid_mtp_block_spec` has."""
    import dataclasses

    from megatron.core.transformer.multi_token_prediction import get_mtp_layer_spec_for_backend
    from megatron.core.transformer.spec_utils import ModuleSpec

    backend = spec.spec_backend(config, use_te)
    if backend is None:
        if use_te:
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            backend = TESpecProvider()
        else:
            from megatron.core.models.backends import LocalSpecProvider

            backend = LocalSpecProvider()
    layer = get_mtp_layer_spec_for_backend(mtp_model_layer_spec=None, backend=backend)
    return ModuleSpec(module=layer.module, params=layer.params,
                      submodules=dataclasses.replace(layer.submodules, mtp_model_layer=None))


def _hybrid_classes():
    """(model class, stack class, stack submodules class, pattern argument) of this megatron-core release."""
    try:  # 0.19: models/hybrid
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel, HybridStack, HybridStackSubmodules, "hybrid_layer_pattern"
    except ImportError:  # 0.16: the MambaModel predecessor
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        return MambaModel, MambaStack, MambaStackSubmodules, "hybrid_override_pattern"


def build_hybrid_model(spec: ModelSpec, hf_config, *, vocab_size: int | None = None, use_te: bool = False,
                       **overrides) -> list[torch.nn.Module]:
    """Hybrid-model chunks (megatron-core 0.19 HybridModel, 0.16 MambaModel; one per virtual-PP stage of this
    rank) for `hf_config`, with the pattern `hybrid_pattern` derives from it: each HF layer is a mixer layer
    (attention, MLA, DSA or gated DeltaNet) followed by an MLP or MoE layer, the layers of the architecture's GPT
    block spec; on 0.19 the HF config's MTP layers as '/' depths. Needs an initialized Megatron parallel state."""
    import copy

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mcore2hf.arch.naming import HybridLayout
    from mcore2hf.errors import ConfigMismatchError

    model_cls, stack, submodules_cls, pattern_arg = _hybrid_classes()
    hybrid_model = pattern_arg == "hybrid_layer_pattern"
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    gpt_config = spec.transformer_config(hf_config, **overrides)
    depths = int(getattr(gpt_config, "mtp_num_layers", None) or 0)
    if depths and not hybrid_model:
        raise ConfigMismatchError(f"{depths} MTP layer(s) in a hybrid model need megatron-core >= 0.19 (HybridModel's "
                                  "'/' MTP depths; 0.16-0.18's MambaModel has none): pass mtp_num_layers=None "
                                  "(mcore2hf plan: --no-mtp)")
    kwargs = dict(spec.gpt_kwargs(hf_config))
    if not hybrid_model and kwargs.get("position_embedding_type") not in (None, "rope", "none"):
        raise ConfigMismatchError(f"position_embedding_type {kwargs['position_embedding_type']!r} in a hybrid model "
                                  "needs megatron-core >= 0.19 (0.16-0.18's MambaModel: learned_absolute, rope, none)")
    if not hybrid_model and gpt_config.multi_latent_attention:  # MLA rotates inside its attention, as GPTModel has it
        kwargs["position_embedding_type"] = "none"
    num_hf = text_config(hf_config).num_hidden_layers
    layers = release_symbols(hybrid_layers(spec, hf_config), hybrid_model)
    mtp = release_symbols([spec.hybrid_mtp_symbols(hf_config)], hybrid_model)[0] if depths else None
    uneven = overrides.get("num_layers_in_first_pipeline_stage") or overrides.get("num_layers_in_last_pipeline_stage")
    if not hybrid_model:
        if vpp > 1:
            raise ConfigMismatchError("megatron-core < 0.19 MambaModel has no virtual pipeline parallelism")
        pattern = _join_pattern(layers, 1, None, 0)  # 0.16 splits the Megatron layers evenly over PP itself
    else:  # 0.19: one '|'-separated segment per pipeline stage (uneven stages: its own split, no separators)
        segments = 1 if uneven else pp * vpp
        pattern = _join_pattern(layers, segments, mtp, depths)
        per = num_hf // segments  # a shared DSA layer beside its top-k source
        problems = spec.index_share_stage_problems(hf_config, [list(range(i * per, (i + 1) * per))
                                                               for i in range(segments)])
        if problems:
            raise ConfigMismatchError(f"GLM-5.2 IndexShare in the hybrid pattern {pattern!r}: a shared layer and the "
                                      "layer whose top-k it reuses must sit in one pipeline segment (megatron-core does "
                                      "not send top-k indices between stages):\n  " + "\n  ".join(problems))
    layout = HybridLayout.parse(pattern)
    # the GPT block spec of every layer (one pipeline stage holding all), to take each layer type's modules from
    whole = copy.copy(gpt_config)
    for name, value in dict(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                            num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                            pipeline_model_parallel_layout=None).items():
        if hasattr(whole, name):
            setattr(whole, name, value)
    block = spec.layer_spec(whole, hf_config, vp_stage=None, use_te=use_te)
    if block is None:
        block = get_gpt_decoder_block_spec(**supported_kwargs(
            get_gpt_decoder_block_spec, config=whole, use_transformer_engine=use_te, normalization="RMSNorm",
            vp_stage=None, pp_rank=0))
    mtp_layer = _hybrid_mtp_layer(spec, whole, use_te) if depths else None
    stack_spec = hybrid_stack_spec(block, layers, stack, submodules_cls, mtp_layer)
    config = spec.transformer_config(hf_config, **{**overrides, **hybrid_layer_fields(gpt_config, layout),
                                                   "num_layers": len(layout.pattern), "moe_layer_freq": 1,
                                                   "is_hybrid_model": True})
    chunks = []
    for vp in range(vpp):
        vp_stage = vp if vpp > 1 else None
        pre, post = stage_ends(vp_stage)
        chunks.append(model_cls(**supported_kwargs(
            model_cls.__init__, config=config, mamba_stack_spec=stack_spec, hybrid_stack_spec=stack_spec,
            vocab_size=vocab_size or text_config(hf_config).vocab_size, pre_process=pre, post_process=post,
            vp_stage=vp_stage, **{pattern_arg: pattern}, **kwargs)))
    return chunks
