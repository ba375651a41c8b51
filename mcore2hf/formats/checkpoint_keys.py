"""Megatron's checkpoint keys <-> the canonical names the converter tables use: the key scheme, written once.

The offline import writes keys (`KeyLayout.key`: canonical name -> key), the offline export and `verify` read them
(`canonical_parts`: keys -> canonical names); both are derived from the declarations below. The forms are the ones
megatron-core 0.16.1's `sharded_state_dict` gives (tests/test_import.py compares them with a checkpoint Megatron
itself saved; tests/test_checkpoint_keys.py checks the two directions are inverse over every form):

* `RENAMES`: names inside a layer saved under another key, per `transformer_impl` (Megatron-LM's
  `--transformer-impl`, default transformer_engine): Transformer Engine's fused norms (the input norm in linear_qkv
  / gated DeltaNet's in_proj, MLA's q/kv norms in the up projections, a dense MLP's norm in linear_fc1), or the
  local spec's `sharded_state_dict_keys_map` (input and pre-MLP norms under TE's names, not in MLA layers);
* decoder layers stacked under `decoder.layers.<name>` (the layer a leading axis, sharded over PP) or keyed per
  layer `decoder.layers.<i>.<name>` (transformer/transformer_block.py `sharded_state_dict`; which one: the
  import's `layer_keys`); MTP layers always per layer, their inner layer under `mtp.layers.<m>.transformer_layer.`
  (multi_token_prediction.py);
* routed experts (`mlp.experts.<e>.linear_fc{1,2}.*`) stacked as `mlp.experts.experts.linear_fc{1,2}.*` (the
  expert a leading axis) or, with `singleton_local_shards`, `mlp.experts.experts.<e>.linear_fc{1,2}.*`
  (transformer/moe/experts.py SequentialMLP / TEGroupedMLP `sharded_state_dict`, alike);
* `PARTS`: one tensor saved as several keys: a GLU fc1 with `singleton_local_shards` as `_w` (gate) and `_v` (up)
  (mlp.py `apply_swiglu_sharded_factory`), gated DeltaNet's in_proj / conv1d per component (`.query`, ...;
  ssm/gated_delta_net.py `sharded_state_dict`);
* hybrid stacks (0.16.1 MambaModel ssm/mamba_block.py, 0.19.2 HybridModel models/hybrid/hybrid_block.py): every
  layer under its Megatron index (an HF layer's mixer and MLP are two, `naming.HybridLayout`), the final norm
  `decoder.final_norm.`;
* every linear's `_extra_state` as a ShardedObject (`extra_state_key`; dist_checkpointing/mapping.py
  `ShardedObject.unique_key`);
* a vision-language wrapper (Megatron-Bridge's `Qwen3VLModel`, 0.3.1 and 0.6.2 models/qwen_vl/modelling_qwen3_vl/
  model.py: a MegatronModule without its own `sharded_state_dict`, so module.py `MegatronModule.sharded_state_dict`
  keys each child under its attribute name): the GPT model's keys under `language_model.`, the tower's under
  `vision_model.` (`VISION_TOWERS`): a native Megatron tower's blocks and deepstack mergers stacked like decoder
  layers (Bridge 0.6.2 transformer_block.py:393-465 `Qwen3VLVisionTransformerBlock.sharded_state_dict`), its
  linears with an `_extra_state`, the rest (patch / position embeddings, merger) under their module paths; an
  embedded transformers tower (Bridge 0.3.1) under its HF module paths, plain replicated tensors; alike the
  wrappers of GLM-4.5V (Bridge 0.3.1 GLM45VModel: the tower under `visual.`) and Kimi-K2.5 (Bridge 0.6.2
  KimiK25VLModel: `vision_tower.` and `mm_projector.`), their towers' keys under those children (`TOWER_PREFIXES`).

Reading accepts both impls' keys (a key names one canonical name, whatever the impl), and what other writers spell
differently: Transformer Engine's other fused-norm names (`naming.TE_RENAMES`), per-expert keys without
`experts.`, 0.19's `mtp_model_layer.`.
Megatron-LM's legacy `torch` format has per-rank local names instead (mcore2hf.formats.legacy), read into the same
`CkptSource`s.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import regex
import torch

from ..arch.mapping import NAME, ModelDims
from ..arch.naming import (
    FINAL_NORM,
    HYBRID_FINAL_NORM,
    HybridLayout,
    canonical_layer_name,
    hybrid_mtp_inner,
    mtp_inner,
    parse_name,
)
from ..errors import ConfigMismatchError, UsageError
from ..layouts.gdn import GDN_PARTS
from ..plan.export import natural_key

#: top-level modules of a GPT / hybrid model's weights; other keys are optimizer or RNG state
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
#: a vision-language wrapper's children (Megatron-Bridge 0.3.1 / 0.6.2 Qwen3VLModel `language_model`,
#: `vision_model`): the GPT model's keys under the first, the tower's under the second
WRAPPED_LANGUAGE_MODEL = "language_model."
VISION_MODEL = "vision_model."
#: how a wrapper's checkpoint holds its tower: "native" (Megatron layers, Bridge 0.6.2 / mbridge: layout 1 of
#: docs/vlm.md), "hf" (transformers' module embedded, Bridge 0.3.1: layout 2)
NATIVE, HF_TOWER = "native", "hf"
VISION_TOWERS = (NATIVE, HF_TOWER)
#: the children a wrapper holds its tower in, keyed (and named canonically) under their attribute names:
#: `vision_model` (Qwen3VLModel), `visual` (Bridge 0.3.1 models/glm_vl/modeling_glm_45v.py:126 GLM45VModel, a
#: MegatronModule without its own `sharded_state_dict`), `vision_tower` and `mm_projector` (Bridge 0.6.2
#: models/kimi_vl/modeling_kimi_k25_vl.py:215-216 KimiK25VLModel, alike); tests/test_checkpoint_keys.py checks
#: every table's pass-through tower rule is under one of them
TOWER_PREFIXES = (VISION_MODEL, "visual.", "vision_tower.", "mm_projector.")


def embedded_tower_rules(rules: Iterable) -> list:
    """The pass-through rules (`<child>.{NAME}`, converters.common.hf_tower) of a table's tower embedded in a wrapper
    under one of TOWER_PREFIXES: what a wrapper holding transformers' tower ("hf") holds of it."""
    return [r for r in rules if any(r.megatron == f"{p}{{{NAME}}}" for p in TOWER_PREFIXES)]


#: a native tower's blocks and deepstack mergers, canonical (per index) and as keys (stacked: no index)
_VISION_KEY = regex.compile(r"vision_model\.decoder\.(layers|deepstack_merger_list)\.(?:(\d+)\.)?(.+)")
#: a ViT block holds attention and a dense MLP: under Transformer Engine's ViT spec (megatron-core 0.16.1
#: models/vision/vit_layer_specs.py get_vit_layer_with_transformer_engine_spec, Bridge model.py:305) its norms are
#: fused into linear_qkv and linear_fc1; the local ViT spec has no keys map (its norms keep their names)
VISION_LAYER_KINDS = frozenset({"attention", "dense"})
#: a key (or local name) inside decoder or MTP layer <i>
LAYER_KEY = regex.compile(r"(decoder|mtp)\.layers\.(\d+)\.(.+)")
STACKED_LAYERS = "decoder.layers."
#: the MTP layer's inner transformer layer (multi_token_prediction.py; what the import writes)
MTP_INNER = "transformer_layer."
#: a hybrid model's MTP depth holds its layers as a HybridStack (megatron-core 0.19.2 multi_token_prediction.py:
#: 1018-1033, `mtp_model_layer`; its sharded_state_dict keeps that name for hybrid models, :1549-1558)
HYBRID_MTP_INNER = "mtp_model_layer.layers."

#: what a layer holds, which decides its renames: its attention (self-attention, gated DeltaNet, MLA) and its MLP
ATTENTION, GDN, MLA, DENSE, MOE = "attention", "gdn", "mla", "dense", "moe"
#: MLA with DeepSeek sparse attention's indexer: the indexer needs the normalized query latent, so TE's DSA spec keeps
#: q_layernorm / kv_layernorm separate (not fused into the up projections; runtime/te_naming.py does the same)
DSA = "dsa"

#: Megatron-LM's `--transformer-impl` (NVIDIA/Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553:
#: megatron/training/arguments.py derives it from megatron/core/transformer/transformer_config.py
#: `transformer_impl`, default "transformer_engine"; its third choice, inference_optimized, is not a training
#: spec): the layer spec the model is built with, which decides where its norms are keyed
TRANSFORMER_ENGINE, LOCAL = "transformer_engine", "local"
TRANSFORMER_IMPLS = (TRANSFORMER_ENGINE, LOCAL)
MEGATRON_LM_TRANSFORMER_IMPL = TRANSFORMER_ENGINE


@dataclass(frozen=True)
class Rename:
    """A name inside a layer (`canonical` prefix) saved under another key (`key` prefix) in layers holding any of
    `kinds` (ATTENTION / GDN / MLA, DENSE / MOE)."""

    canonical: str
    key: str
    kinds: frozenset[str]


#: {transformer_impl: the renames of the model built with it} (megatron-core 0.16.1):
#: * local: gpt_layer_specs.py get_gpt_layer_local_spec's (non-MLA) `sharded_state_dict_keys_map`, the norms under
#:   TE's fused names in dense and MoE layers alike; its MLA branch has no keys map; gated DeltaNet layers keep the
#:   input norm under in_proj (the experimental spec's TE fused norm, which model_specs/qwen3_next.py keeps);
#: * transformer_engine: the parameters themselves, where get_gpt_layer_with_transformer_engine_spec fuses a norm
#:   into the TELayerNormColumnParallelLinear after it (IdentityOp in its slot): the input norm into linear_qkv
#:   (not MLA, whose input norm is a TENorm), MLA's q/kv norms into linear_q_up_proj / linear_kv_up_proj, the
#:   pre-MLP norm into a dense MLP's linear_fc1 (MoE layers keep a TENorm `pre_mlp_layernorm`); gated DeltaNet
#:   (experimental_attention_variant_module_specs.py) the input norm into in_proj. runtime/te_naming.py renames
#:   live models by the same rules; tests/test_import.py checks this table against megatron-core's own TE spec.
RENAMES: dict[str, tuple[Rename, ...]] = {
    LOCAL: (
        Rename("input_layernorm.", "self_attention.linear_qkv.layer_norm_", frozenset({ATTENTION})),
        Rename("input_layernorm.", "self_attention.in_proj.layer_norm_", frozenset({GDN})),
        Rename("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_", frozenset({ATTENTION, GDN})),
    ),
    TRANSFORMER_ENGINE: (
        Rename("input_layernorm.", "self_attention.linear_qkv.layer_norm_", frozenset({ATTENTION})),
        Rename("input_layernorm.", "self_attention.in_proj.layer_norm_", frozenset({GDN})),
        Rename("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_", frozenset({MLA})),
        Rename("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_", frozenset({MLA})),
        Rename("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_", frozenset({DENSE})),
    ),
}
_FROM_KEY = {r.key: r.canonical for table in RENAMES.values() for r in table}
assert all(_FROM_KEY[r.key] == r.canonical for table in RENAMES.values() for r in table), \
    "a key must name one canonical prefix, whatever the transformer_impl"

#: routed experts: the canonical name, the stacked key (expert = a leading axis), the per-expert key
# a LoRA-wrapped expert linear saves its factors beside its weight (megatron-bridge 0.3.1 adapter_wrapper.py:187-217
# AdapterWrapper.sharded_state_dict: the base under the module's own prefix, the adapter under `adapter.`), stacked
# over experts like the weight: mlp.experts.experts.linear_fc1.adapter.linear_in.weight [E, r, in]
_PARAM = r"(?:adapter\.linear_(?:in|out)\.)?(?:weight|bias)"
_EXPERT = regex.compile(rf"mlp\.experts\.(\d+)\.(linear_fc[12]\.{_PARAM})")
_STACKED_EXPERTS = regex.compile(rf"mlp\.experts\.experts\.(linear_fc[12]\.{_PARAM})")
_SINGLETON_EXPERT = regex.compile(rf"mlp\.experts\.(?:experts\.)?(\d+)\.(linear_fc[12]\.{_PARAM})")

#: key suffixes of the parts one tensor is saved as, in the order that concatenates them into the tensor: whole,
#: GLU gate `_w` and up `_v`, gated DeltaNet components `.query` ... `.alpha`
GLU_PARTS = ("w", "v")
PARTS = ("", *GLU_PARTS, *GDN_PARTS)
_GDN_PART = regex.compile(rf"(.+\.self_attention\.(?:in_proj|conv1d)\.weight)\.({'|'.join(GDN_PARTS)})")

#: modules whose Megatron implementations (ColumnParallelLinear, RowParallelLinear, TE linears) carry an
#: `_extra_state` that their sharded state dict saves as a ShardedObject
LINEAR_MODULES = frozenset({"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj",
                            "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                            "eh_proj", "in_proj", "out_proj"})
#: modules of a TE-spec model that hold an `_extra_state` though not linears: TENorm (TE 2.x te.pytorch.RMSNorm /
#: LayerNorm are ops.BasicOperation, whose get_extra_state puts `_extra_state` in their state dict:
#: transformer_engine 2.11 pytorch/ops/op.py; megatron-core 0.16.1 transformer/utils.py sharded_state_dict_default
#: saves it as a ShardedObject) where the TE spec builds one, and TEDotProductAttention where it has a state (a
#: learnable softmax offset: extensions/transformer_engine.py `sharded_state_dict` saves its whole state dict)
TE_STATE_MODULES = frozenset({"input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "kv_layernorm",
                              "out_norm", "final_layernorm", "final_norm", "enorm", "hnorm", "core_attention",
                              # a native vision tower's patch mergers: TENorm (Bridge 0.6.2 model.py:306-310)
                              "patch_norm",
                              # DSA's indexer: TE linears built duplicated, and its TE LayerNorm k_norm
                              "linear_wq_b", "linear_wk", "linear_weights_proj", "k_norm"})
#: a hybrid model's output layer `_extra_state`: GPTModel.sharded_state_dict drops it, MambaModel / HybridModel keep
#: LanguageModule's (0.16.1 gpt_model.py, 0.19.2 hybrid_model.py)
HYBRID_OUTPUT_EXTRA_STATE = "output_layer._extra_state/shard_0_1"


def part_key(key: str, part: str) -> str:
    """The key of `part` (one of PARTS) of the tensor saved under `key`."""
    if not part:
        return key
    return f"{key}_{part}" if part in GLU_PARTS else f"{key}.{part}"


def split_part(key: str) -> tuple[str, str]:
    """(the tensor's key, part) of a checkpoint key: the inverse of `part_key`."""
    if key[-2:] in ("_w", "_v"):
        return key[:-2], key[-1]
    m = _GDN_PART.fullmatch(key)
    return (m.group(1), m.group(2)) if m is not None else (key, "")


def layer_kinds(mla: bool, gdn: bool, moe: bool, dsa: bool = False) -> frozenset[str]:
    """What a layer holds, for its renames: its attention and its MLP."""
    attention = (DSA if dsa else MLA) if mla else GDN if gdn else ATTENTION
    return frozenset({attention, MOE if moe else DENSE})


def check_transformer_impl(impl: str) -> str:
    if impl not in TRANSFORMER_IMPLS:
        raise UsageError(f"transformer_impl must be one of {', '.join(TRANSFORMER_IMPLS)} (Megatron-LM's "
                         f"--transformer-impl the model is built with), got {impl!r}")
    return impl


def rename_to_key(rest: str, kinds: frozenset[str], impl: str) -> str:
    """A name inside a layer holding `kinds` as the checkpoint of a model built with `impl` keys it (RENAMES)."""
    for r in RENAMES[impl]:
        if r.kinds & kinds and rest.startswith(r.canonical):
            return r.key + rest[len(r.canonical):]
    return rest


def rename_from_key(rest: str) -> str:
    """The inverse of `rename_to_key` (a key prefix names one canonical prefix, whatever the layer and the impl)."""
    for key, canonical in _FROM_KEY.items():
        if rest.startswith(key):
            return canonical + rest[len(key):]
    return rest


@dataclass(frozen=True)
class KeyLayout:
    """How one model's canonical names are keyed in its checkpoint: the forms megatron-core's sharded state dict
    chooses for it (`stacked` decoder layers, `singleton` experts, the `transformer_impl` it is built with, MLA, the
    gated DeltaNet and the MoE layers (MTP's inner layers numbered after the decoder's), a hybrid stack's layout)."""

    num_layers: int
    num_experts: int = 0
    stacked: bool = False
    singleton: bool = False
    mla: bool = False
    dsa: bool = False  # MLA with a sparse-attention indexer (DSA)
    gdn_layers: frozenset[int] = frozenset()
    hybrid: HybridLayout | None = None
    moe_layers: frozenset[int] = frozenset()
    transformer_impl: str = MEGATRON_LM_TRANSFORMER_IMPL
    #: names inside a layer of modules the architecture's TE spec builds without TE (no `_extra_state`)
    non_te: frozenset[str] = frozenset()
    #: a vision-language wrapper's checkpoint (None: a GPT model's): how it holds its tower (VISION_TOWERS), the
    #: native tower's depth and deepstack mergers, and whether its blocks are stacked (Bridge 0.6.2: unless the
    #: metadata flag `non_homogeneous_layers`)
    vision_tower: str | None = None
    vision_depth: int = 0
    vision_deepstack: int = 0
    vision_stacked: bool = True

    def extra_state(self, name: str) -> str | None:
        """The `_extra_state` ShardedObject key of the module holding canonical name `name`, or None: every linear;
        with transformer_engine also TE_STATE_MODULES under their own key (not fused into a linear). An embedded
        transformers tower has none (plain torch modules)."""
        if name.startswith(TOWER_PREFIXES) and self.vision_tower != NATIVE:
            return None
        key, lead, glob = self.key(name)
        found = extra_state_key(name, key, lead, glob)
        if found is not None or self.transformer_impl != TRANSFORMER_ENGINE:
            return found
        p = parse_name(name)
        if p.stack == "decoder" and p.rest.rsplit(".", 1)[0] in self.non_te:
            return None
        return extra_state_key(key, key, lead, glob, TE_STATE_MODULES)

    def key(self, name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(key, lead, dims) of a canonical Megatron name: its tensor is item `lead` of the key's tensor, whose
        leading dims are `dims` (stacked layers, stacked experts; both empty when the key holds it alone)."""
        if self.vision_tower is not None:  # a wrapper: the GPT model's keys under language_model.
            if name.startswith(TOWER_PREFIXES):
                return self._vision_key(name)
            key, lead, glob = replace(self, vision_tower=None).key(name)
            return WRAPPED_LANGUAGE_MODEL + key, lead, glob
        p = parse_name(name)
        if p.stack != "decoder":
            if self.hybrid is not None and name == FINAL_NORM:
                return HYBRID_FINAL_NORM, (), ()
            return name, (), ()
        layer = p.layer
        mtp = layer >= self.num_layers
        rest = rename_to_key(p.rest, layer_kinds(self.mla, layer in self.gdn_layers, layer in self.moe_layers, self.dsa),
                             self.transformer_impl)
        if self.hybrid is not None and not mtp:
            layer = self.hybrid.megatron_layer(layer, p.rest)
        lead, glob = (), ()
        e = _EXPERT.fullmatch(rest)
        if e is not None:
            if self.singleton:
                rest = f"mlp.experts.experts.{e.group(1)}.{e.group(2)}"
            else:
                rest = f"mlp.experts.experts.{e.group(2)}"
                lead, glob = (int(e.group(1)),), (self.num_experts,)
        if mtp and self.hybrid is not None:  # 0.19's hybrid MTP: the depth's inner stack, mixer then MLP layer
            inner = self.hybrid.mtp_layer(p.rest)
            return f"mtp.layers.{layer - self.num_layers}.{HYBRID_MTP_INNER}{inner}.{rest}", lead, glob
        if mtp:
            return f"mtp.layers.{layer - self.num_layers}.{MTP_INNER}{rest}", lead, glob
        if self.stacked and self.hybrid is None:
            return f"{STACKED_LAYERS}{rest}", (layer, *lead), (self.num_layers, *glob)
        return f"decoder.layers.{layer}.{rest}", lead, glob

    def _vision_key(self, name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """A tower tensor's key: a native tower's blocks (norms renamed as TE's ViT spec fuses them) and deepstack
        mergers stacked or per index; anything else under its own name."""
        p = parse_name(name)
        if p.stack not in ("layers", "deepstack_merger_list") or self.vision_tower != NATIVE:
            return name, (), ()
        part, index, rest = p.stack, p.layer, p.rest
        if part == "layers" and self.transformer_impl == TRANSFORMER_ENGINE:
            rest = rename_to_key(rest, VISION_LAYER_KINDS, TRANSFORMER_ENGINE)
        if not self.vision_stacked:
            return f"vision_model.decoder.{part}.{index}.{rest}", (), ()
        count = self.vision_depth if part == "layers" else self.vision_deepstack
        return f"vision_model.decoder.{part}.{rest}", (index,), (count,)


def extra_state_key(name: str, key: str, lead: tuple[int, ...], glob: tuple[int, ...],
                    modules: frozenset[str] = LINEAR_MODULES) -> str | None:
    """The `_extra_state` ShardedObject key saved beside the tensor `key` of canonical name `name`, or None when
    its module is not one of `modules` (a norm keyed into fc1 is not: the linear's own names the same object)."""
    if name.rsplit(".", 2)[-2] not in modules:
        return None
    return (f"{key.rsplit('.', 1)[0]}._extra_state/shard_{'.'.join(map(str, lead or (0,)))}_"
            f"{'.'.join(map(str, glob or (1,)))}")


def canonical_parts(keys: Iterable[str], shape: Callable[[str], tuple[int, ...]], num_layers: int,
                    hybrid: HybridLayout | None = None
                    ) -> tuple[dict[str, dict[str, tuple[str, tuple[int, ...]]]], list[str]]:
    """{canonical name: {part: (key, leading indices)}} of every model tensor among `keys` (`shape(key)`: its
    global shape), the inverse of `KeyLayout.key` and `part_key`; also the keys that are not model weights.
    `hybrid`: a hybrid model's checkpoint (naming.checkpoint_hybrid_layout), its layers renumbered to HF layers."""
    found: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    ignored = []

    def add(kind: str, number: int, rest: str, key: str, lead: tuple[int, ...], part: str) -> None:
        if hybrid is not None and kind == "decoder":
            number = hybrid.hf_layer[number]
        if kind == "mtp":
            rest = hybrid_mtp_inner(rest)
        kind, number, rest = mtp_inner(kind, number, rest, num_layers)
        rest = rename_from_key(rest)
        stacked = _STACKED_EXPERTS.fullmatch(rest)
        if stacked is not None:
            for e in range(shape(key)[len(lead)]):
                name = canonical_layer_name(kind, number, f"mlp.experts.{e}.{stacked.group(1)}", num_layers)
                found.setdefault(name, {})[part] = (key, (*lead, e))
            return
        one = _SINGLETON_EXPERT.fullmatch(rest)
        if one is not None:
            rest = f"mlp.experts.{one.group(1)}.{one.group(2)}"
        found.setdefault(canonical_layer_name(kind, number, rest, num_layers), {})[part] = (key, lead)

    for key in sorted(keys, key=natural_key):
        if key.startswith(TOWER_PREFIXES):
            _vision_names(key, shape, found)
            continue
        # a vision-language wrapper's language model: the GPT model's keys under `language_model.`
        inner = key.removeprefix(WRAPPED_LANGUAGE_MODEL)
        if not inner.startswith(MODEL_PREFIXES):
            ignored.append(key)
            continue
        base, part = split_part(inner)
        m = LAYER_KEY.fullmatch(base)
        if m is not None:
            add(m.group(1), int(m.group(2)), m.group(3), key, (), part)
        elif base.startswith(STACKED_LAYERS):
            for layer in range(shape(key)[0]):
                add("decoder", layer, base[len(STACKED_LAYERS):], key, (layer,), part)
        else:
            if hybrid is not None and base == HYBRID_FINAL_NORM:
                base = FINAL_NORM
            found.setdefault(base, {})[part] = (key, ())
    return found, ignored


def _vision_names(key: str, shape: Callable[[str], tuple[int, ...]],
                  found: dict[str, dict[str, tuple[str, tuple[int, ...]]]]) -> None:
    """A wrapper's tower key -> canonical names (the inverse of `KeyLayout._vision_key`): a native tower's stacked
    or per-index blocks and deepstack mergers (TE's fused norm keys read back to the local names), else the key."""
    m = _VISION_KEY.fullmatch(key)
    if m is None:
        found.setdefault(key, {})[""] = (key, ())
        return
    part, index, rest = m.group(1), m.group(2), m.group(3)
    if part == "layers":
        rest = rename_from_key(rest)
    for i in [int(index)] if index is not None else range(shape(key)[0]):
        found.setdefault(f"vision_model.decoder.{part}.{i}.{rest}", {})[""] = (key, () if index is not None else (i,))


#: Megatron-LM's `--moe-layer-freq` default (NVIDIA/Megatron-LM megatron/training/arguments.py `_add_moe_args`, commit
#: d98e8a64ddf34856e74b24714e3bedb2f5a39553), also TransformerConfig's (megatron-core 0.16.1 transformer_config.py)
MEGATRON_LM_MOE_LAYER_FREQ = 1
_MAX_PATTERN = 1 << 20  # layers a pattern expression may spell out (a bound on '[1]*10**...'-style input)


def _pattern_value(node: ast.AST, text: str):
    """The value of a pattern expression's node: ints, lists, + and * only."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e, text) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _pattern_value(node.left, text), _pattern_value(node.right, text)
        if isinstance(node.op, ast.Add) and type(a) is type(b):
            return a + b
        if isinstance(node.op, ast.Mult) and isinstance(a, int) != isinstance(b, int):
            if (len(a) * b if isinstance(a, list) else a * len(b)) > _MAX_PATTERN:
                raise UsageError(f"moe_layer_freq {text!r}: more than {_MAX_PATTERN} layers")
            return a * b
        if isinstance(node.op, ast.Mult) and isinstance(a, int) and isinstance(b, int):
            return a * b
    raise UsageError(f"moe_layer_freq {text!r}: expected an int or a Python list expression of 0s and 1s built "
                     f"with [], +, * and parentheses (Megatron-LM's --moe-layer-freq), found {ast.unparse(node)[:60]!r}")


def parse_moe_layer_freq(value: int | list[int] | str) -> int | list[int]:
    """Megatron-LM's `--moe-layer-freq` in any of its spellings (arguments.py `moe_freq_type`, commit above): an
    int N (an MoE layer every N layers), its string, or a Python list expression of 0 (dense) / 1 (MoE) such as
    '([1]*3+[0])*2' or '[0]+[1]*47'. Megatron-LM `eval`s the expression after allowing only `,` digits `[]()+*`
    (`_eval_pattern`); here it is evaluated from its syntax tree (ints, lists, + and *), never executed."""
    text = value
    if isinstance(value, str):
        try:
            tree = ast.parse(value.strip(), mode="eval")
        except SyntaxError:
            raise UsageError(f"moe_layer_freq {value!r}: not an int or a Python list expression "
                             "(e.g. 1, '[0]+[1]*47', '([1]*3+[0])*2')") from None
        value = _pattern_value(tree.body, text)
    if type(value) is int:
        if value < 1:
            raise UsageError(f"moe_layer_freq {text!r}: an int must be >= 1 (one MoE layer every N layers)")
        return value
    if isinstance(value, (list, tuple)) and value and all(type(v) is int and v in (0, 1) for v in value):
        return list(value)  # megatron-core's layer specs take 1 = MoE, 0 = dense, nothing else (gpt_layer_specs.py)
    raise UsageError(f"moe_layer_freq {text!r}: expected an int >= 1 or a non-empty list of 0 (dense) / 1 (MoE), "
                     f"got {value!r}")


def pattern_text(pattern: list[int]) -> str:
    """A list expression of `pattern` as Megatron-LM's --moe-layer-freq takes it, e.g. '[0]*3+[1]*58'."""
    runs: list[list[int]] = []
    for v in pattern:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "+".join(f"[{v}]*{n}" if n > 1 else f"[{v}]" for v, n in runs)


def layer_keys(spec, cfg, dims: ModelDims, moe_layer_freq: int | list[int] | str | None, *, singleton: bool,
               non_homogeneous: bool, hybrid: bool) -> tuple[bool, str]:
    """(stacked, why): whether the decoder layers are saved under one stacked key per parameter, decided as
    megatron-core 0.16.1 transformer_block.py `sharded_state_dict` decides `non_homogeneous_layers` (per-layer
    keys) for the model this HF config describes, built with `moe_layer_freq`:

    * the metadata flag `non_homogeneous_layers` (Megatron-LM's `_build_sharded_state_dict_metadata` never sets
      it), or `singleton_local_shards`;
    * `moe_layer_freq` an int > 1 or a list (any list, even all ones: `[1]*48` is per layer, `1` is stacked);
    * `linear_attention_freq` an int > 1 or a list: every value that gives gated DeltaNet layers is one
      (experimental_attention_variant_module_specs.py `get_linear_attention_pattern`: the int 1 means none), so
      models with GDN layers are always per layer;
    * hybrid stacks (MambaModel / HybridModel) key every layer by its index.

    `moe_layer_freq` is checked against the HF config's dense/MoE layers (the pattern megatron-core derives:
    gpt_layer_specs.py `get_gpt_decoder_layer_specs`, layer i is MoE iff i % N == 0 for an int N). None: Megatron-LM's
    default 1 where every layer is MoE; otherwise the HF config's pattern (only a list or an int > 1 builds it)."""
    if hybrid:
        if moe_layer_freq is not None:
            raise UsageError("moe_layer_freq with model_class='hybrid': a hybrid model's layer pattern decides its "
                             "MoE layers, and its stack keys every layer by its index (mamba_block.py / "
                             "hybrid_block.py); leave moe_layer_freq unset")
        return False, "per layer: a hybrid model (every Megatron layer under its own index)"
    want = [int(bool(spec.is_moe_layer(cfg, i))) for i in range(dims.num_layers)]
    if moe_layer_freq is None:
        freq = MEGATRON_LM_MOE_LAYER_FREQ if not dims.num_experts or all(want) else want
    else:
        freq = parse_moe_layer_freq(moe_layer_freq)
        if dims.num_experts:  # megatron-core builds MoE layers from it only for an MoE model
            have = [int(i % freq == 0) for i in range(dims.num_layers)] if isinstance(freq, int) else freq
            if have != want:
                raise ConfigMismatchError(
                    f"moe_layer_freq={moe_layer_freq!r} gives the dense (0) / MoE (1) layers {pattern_text(have)}, "
                    f"the HF config has {pattern_text(want)}: pass the value the Megatron model is built with "
                    f"({'1 (stacked keys) or ' if all(want) else ''}'{pattern_text(want)}' (per-layer keys))")
    shown = freq if isinstance(freq, int) else pattern_text(freq)
    if non_homogeneous:
        return False, "per layer: non_homogeneous_layers"
    if singleton:
        return False, "per layer: singleton_local_shards"
    if dims.linear_num_key_heads is not None:
        return False, "per layer: gated DeltaNet layers (linear_attention_freq is an int > 1 or a list)"
    if isinstance(freq, list):
        return False, f"per layer: moe_layer_freq is a list ({shown})"
    if freq > 1:
        return False, f"per layer: moe_layer_freq={freq} > 1"
    return True, f"stacked (decoder.layers.<name>, layer axis sharded over PP): moe_layer_freq={shown}"


@dataclass
class CkptSource:
    """One canonical Megatron tensor and how to read it from a checkpoint (torch_dist or legacy)."""

    name: str
    key: str
    # TP shards in rank order (one: the whole tensor), each read as (key, leading indices) parts concatenated
    # along dim 0 (GLU _w/_v); shape: of a shard until prepare_sources resolves the op, then the whole tensor's
    reads: list[list[tuple[str, tuple[int, ...]]]]
    shape: tuple[int, ...]
    dtype: torch.dtype
    hf: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    op: object = None
    n_out: int = 1
    keep_dtype: bool = False
    #: lora="merged": the adapter's (A, B) sources and alpha / r, added to this base weight as it is read
    merge: tuple | None = None
