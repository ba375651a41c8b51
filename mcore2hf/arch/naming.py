"""Global, canonical names for every local parameter (and `expert_bias` buffer) of a Megatron model.

Canonical names are local-spec names with global indices, whatever the layout and the spec:

* decoder layers: the index is the layer's own `layer_number - 1`, which Megatron sets from the PP / virtual-PP
  offset (uneven first/last stages and custom pipeline layouts included), so no offset arithmetic is repeated
  here and nothing depends on `get_transformer_layer_offset`'s signature in a given megatron-core release;
* routed experts: `mlp.experts.{E}.linear_fc{1,2}.weight` with E = ep_rank * num_local_experts + local index,
  from the local spec's `local_experts.{i}` and TE's grouped `linear_fc{1,2}.weight{i}` alike;
* TE's fused norms are renamed to the local spec's modules (`TE_RENAMES`), in a native vision tower's blocks
  (`vision_model.decoder.layers.{i}`, whole on the first pipeline stage) too;
* LoRA (Megatron-Bridge PEFT): a wrapped linear's base `<module>.to_wrap.weight` is named `<module>.weight`; its
  adapter factors keep their names, `<module>.adapter.linear_{in,out}.weight` (see `lora`);
* MTP layer m: `mtp.layers.{m}.{enorm,hnorm,eh_proj,final_layernorm}` and its inner transformer layer as decoder
  layer `num_layers + m` (where HF checkpoints put it);
* the last stage's copy of a tied embedding (and the MTP stage's) is the embedding itself, a replica;
* hybrid models (megatron-core 0.16's MambaModel, 0.19's HybridModel), whose stack holds a mixer (attention) and
  an MLP as separate Megatron layers: Megatron layer i belongs to HF layer `HybridLayout.hf_layer[i]`, read from
  the model's own layer pattern, so their names are the names a GPTModel of the same weights has;
* vision-language wrappers (Megatron-Bridge's `Qwen3VLModel`, `GLM45VModel`), which hold the GPT decoder as
  `language_model`: its parameters are named as that GPTModel's own (the prefix dropped, every rule above
  applied through it), the wrapper's other parameters (a vision tower, a projector) keep their wrapper-relative
  names (`vision_model.blocks.0.attn.qkv.weight`), which the architecture's table maps.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import regex
import torch

from ..errors import ConfigMismatchError, problem_list
from ..parallel import ParallelContext

# TE spec name -> local spec name (suffix inside a decoder layer)
TE_RENAMES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    # MLA without q_lora_rank: the input norm fused into the q and kv down projections' first linear
    "self_attention.linear_q_proj.layer_norm_weight": "input_layernorm.weight",
    # gated DeltaNet (megatron-core 0.16.1 experimental spec): the input norm fused into in_proj
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
}

#: Megatron-Bridge's PEFT wraps a linear as `<module>.to_wrap` (the frozen base) beside `<module>.adapter`
#: (megatron-bridge 0.3.1 and 0.6.2 peft/adapter_wrapper.py:101-102 AdapterWrapper.__init__)
LORA_BASE = ".to_wrap."
_LAYER = regex.compile(r"(decoder|mtp)\.layers\.(\d+)\.(.+)")
#: a native vision tower's blocks (Qwen3-VL: Megatron-Bridge 0.6.2 modelling_qwen3_vl/vision_model.py:156
#: `Qwen3VLVisionModel.decoder`), whole on the first pipeline stage: the local index is the block's index
_VISION_LAYER = regex.compile(r"(vision_model\.decoder\.layers\.\d+)\.(.+)")
_LOCAL_EXPERT = regex.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
#: TE's grouped expert weights (`weight{i}`), and Megatron-Bridge 0.6.2's LoRA factors of a grouped expert linear
#: split per local expert like them (`_GROUPED_ADAPTER`: `linear_fc1.adapter.linear_in.weight{i}`)
_GROUPED_EXPERT = regex.compile(r"mlp\.experts\.(linear_fc[12](?:\.adapter\.linear_(?:in|out))?)\.(weight|bias)(\d+)")
_MTP_INNER = ("transformer_layer.", "mtp_model_layer.")
# megatron-core 0.19 with moe_single_grouped_weight / _bias (TE >= 2.14): all local experts in one parameter
# `linear_fc{1,2}.weight` of TEGroupedLinear (extensions/transformer_engine.py, _split_grouped_checkpoint_tensor:
# item i is tensor[i] when dim 0 is num_gemms, else chunk i of dim 0); each item is named like TE's weight{i}
_SINGLE_GROUPED = regex.compile(r"(.+\.mlp\.experts\.linear_fc[12])\.(weight|bias)")
# Megatron-Bridge 0.6.2's LoRA on a grouped expert linear (`mlp.experts.linear_fc1`, not `local_experts.N`:
# peft/lora.py:163-184, utils.py:676-679), its factors beside the base (`to_wrap`): 3-D [num_local_experts, ...],
# item i expert i's (GroupedExpertLinearAdapter, peft/utils.py:1832-1851: linear_in [E, r/ETP, in] of a
# column-parallel base, [E, r, in/ETP] of a row-parallel one, linear_out [E, out/ETP, r]; partition_dim 1 or 2 of the
# 3-D tensor, :1881-1887), or 2-D, one factor every local expert applies (ParallelLinearAdapter under
# `share_expert_adapters`, lora.py:114 default True, utils.py:1267-1270). Each item is named and split like a
# SequentialMLP expert's adapter, so the adapter rules, the merge and the expert forms apply as they are
_GROUPED_ADAPTER = regex.compile(r"(.+\.mlp\.experts\.linear_fc[12])\.adapter\.(linear_in|linear_out)\.weight")
# layer symbols of hybrid patterns (megatron-core 0.19.2 models/hybrid/hybrid_layer_allocation.py `Symbols`;
# 0.16.1 ssm/mamba_hybrid_layer_allocation.py has M * - E): mamba, gated delta net, attention, DSA, MLA | MLP, MoE
HYBRID_MIXERS = frozenset("MG*D+")
HYBRID_MLPS = frozenset("-E")
_HYBRID_MTP_INNER = regex.compile(r"mtp_model_layer\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class HybridLayout:
    """A hybrid model's layer pattern in HF layers: each HF decoder layer is one mixer symbol followed by at most
    one MLP symbol."""

    pattern: str  # main decoder pattern, pipeline separators ('|') removed
    mtp_pattern: str | None  # one MTP depth's pattern (0.19: after '/')
    mtp_depths: int
    hf_layer: tuple[int, ...]  # HF layer of each Megatron layer of `pattern`

    @property
    def num_layers(self) -> int:
        return self.hf_layer[-1] + 1 if self.hf_layer else 0

    def hf_layers(self) -> list[str]:
        """The symbols of each HF layer, e.g. ['*-', '*E']."""
        out: list[str] = []
        for symbol, layer in zip(self.pattern, self.hf_layer):
            if layer == len(out):
                out.append("")
            out[layer] += symbol
        return out

    def megatron_layer(self, layer: int, rest: str) -> int:
        """The Megatron layer that holds `rest` (a name inside HF layer `layer`): the MLP layer for MLP parts, else
        the mixer layer (the inverse of `hf_layer`, used by the offline import)."""
        if layer not in self.hf_layer:
            raise ConfigMismatchError(f"hybrid layer pattern {self.pattern!r} has {self.num_layers} HF layers, "
                                      f"found a tensor of HF layer {layer} ({rest})")
        first = self.hf_layer.index(layer)
        if not rest.startswith(_MLP_PARTS):
            return first
        if first + 1 == len(self.hf_layer) or self.hf_layer[first + 1] != layer:
            raise ConfigMismatchError(f"hybrid layer pattern {self.pattern!r}: HF layer {layer} has no MLP layer "
                                      f"({self.hf_layers()[layer]!r}), found {rest}")
        return first + 1

    def mtp_layer(self, rest: str) -> int:
        """The layer of an MTP depth's inner stack (0.19: `mtp_model_layer.layers.<i>`, one HF layer) that holds
        `rest`: its MLP layer for MLP parts, else its mixer (the offline import's key of an MTP tensor)."""
        if self.mtp_pattern is None:
            raise ConfigMismatchError(f"hybrid layer pattern {self.pattern!r} has no MTP depth, found MTP tensor {rest}")
        if not rest.startswith(_MLP_PARTS):
            return 0
        if len(self.mtp_pattern) < 2:
            raise ConfigMismatchError(f"hybrid MTP pattern {self.mtp_pattern!r} has no MLP layer, found {rest}")
        return 1

    @classmethod
    def parse(cls, full_pattern: str) -> HybridLayout:
        main, *mtp = full_pattern.split("/")
        main = main.replace("|", "")
        mtp = [p for p in mtp if p]
        if len(set(mtp)) > 1:
            raise ConfigMismatchError(f"hybrid layer pattern {full_pattern!r}: MTP depths with different patterns")
        hf_layer = _hf_layers(main, full_pattern)
        if mtp and set(_hf_layers(mtp[0], full_pattern)) != {0}:
            raise ConfigMismatchError(f"hybrid layer pattern {full_pattern!r}: an MTP depth must be one HF decoder "
                                      f"layer (one mixer and at most one MLP), found {mtp[0]!r}")
        return cls(main, mtp[0] if mtp else None, len(mtp), hf_layer)


def _hf_layers(pattern: str, full_pattern: str) -> tuple[int, ...]:
    out, layer, has_mlp = [], -1, False
    for i, symbol in enumerate(pattern):
        if symbol in HYBRID_MIXERS:
            layer, has_mlp = layer + 1, False
        elif symbol in HYBRID_MLPS and layer >= 0 and not has_mlp:
            has_mlp = True
        else:
            raise ConfigMismatchError(
                f"hybrid layer pattern {full_pattern!r}: symbol {i} ({symbol!r}) does not fit an HF decoder layer; "
                f"each HF layer is one mixer ({''.join(sorted(HYBRID_MIXERS))}) followed by at most one MLP "
                f"({''.join(sorted(HYBRID_MLPS))})")
        out.append(layer)
    return tuple(out)


#: where a vision-language wrapper holds its GPT decoder (Megatron-Bridge 0.3.1 and 0.6.2
#: models/qwen_vl/modelling_qwen3_vl/model.py `Qwen3VLModel.language_model`, 0.3.1 glm_vl/modeling_glm_45v.py
#: `GLM45VModel.language_model`)
LANGUAGE_MODEL = "language_model"


def language_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPT (or hybrid) model of `chunk`: its `language_model` for a vision-language wrapper, else itself."""
    inner = getattr(chunk, LANGUAGE_MODEL, None)
    return inner if isinstance(inner, torch.nn.Module) and hasattr(inner, "decoder") else chunk


def hybrid_pattern_of(chunk: torch.nn.Module) -> str | None:
    """The full layer pattern a hybrid model chunk was built with (None for a GPTModel), read from the model:
    0.19 HybridModel.hybrid_layer_pattern (also set when built from the deprecated arguments), 0.16
    MambaModel.hybrid_override_pattern, else the allocation 0.16 computes from its ratios."""
    chunk = language_model(chunk)
    if not hasattr(chunk.decoder, "layer_type_list"):
        return None
    for attr in ("hybrid_layer_pattern", "hybrid_override_pattern"):
        pattern = getattr(chunk, attr, None)
        if pattern:
            return pattern
    from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

    return "".join(allocate_layers(chunk.config.num_layers, chunk.hybrid_attention_ratio, chunk.hybrid_mlp_ratio))


def hybrid_mtp_inner(rest: str) -> str:
    """A name inside an MTP depth as the GPT MTP layer has it: megatron-core 0.19's hybrid MTP holds its inner
    layers as a HybridStack (`mtp_model_layer.layers.<i>.`, multi_token_prediction.py:1018-1033, saved under
    that name), the GPT one a single `transformer_layer.`; both are one HF layer."""
    inner = _HYBRID_MTP_INNER.fullmatch(rest)
    return rest if inner is None else f"transformer_layer.{inner.group(2)}"


def hybrid_layout(chunk: torch.nn.Module) -> HybridLayout | None:
    pattern = hybrid_pattern_of(chunk)
    return None if pattern is None else HybridLayout.parse(pattern)


_MIXER_PARTS = ("input_layernorm.", "self_attention.")
_MLP_PARTS = ("pre_mlp_layernorm.", "mlp.")


#: the hybrid stack's final norm (0.16.1 mamba_block.py, 0.19.2 hybrid_block.py `final_norm`), GPTModel's name
HYBRID_FINAL_NORM, FINAL_NORM = "decoder.final_norm.weight", "decoder.final_layernorm.weight"


def checkpoint_hybrid_layout(keys, pattern: str) -> HybridLayout | None:
    """The hybrid layout of a torch_dist checkpoint (None when it is a GPTModel's): a hybrid stack saves
    `decoder.final_norm.weight` and its layers under their Megatron index (0.16.1 mamba_block.py,
    0.19.2 hybrid_block.py `sharded_state_dict`). The pattern is not saved; `pattern` (the HF config's) must
    agree with what each checkpoint layer holds: attention parts in mixer layers, MLP parts in MLP layers."""
    keys = list(keys)
    if HYBRID_FINAL_NORM not in keys:
        return None
    layout = HybridLayout.parse(pattern)
    held: dict[int, set[str]] = {}
    for key in keys:
        m = _LAYER.fullmatch(key)
        if m is not None and m.group(1) == "decoder":
            held.setdefault(int(m.group(2)), set()).add(m.group(3))
    problems = []
    if set(held) != set(range(len(layout.pattern))):
        problems.append(f"the HF config implies {len(layout.pattern)} Megatron layers ({layout.pattern!r}), the "
                        f"checkpoint has layers {sorted(held)}")
    for i, rests in sorted(held.items()):
        if i >= len(layout.pattern):
            continue
        mixer = layout.pattern[i] in HYBRID_MIXERS
        wrong = sorted(r for r in rests if r.startswith(_MLP_PARTS if mixer else _MIXER_PARTS))
        if wrong:
            problems.append(f"checkpoint layer {i} holds {wrong[0]}, the HF config's pattern {layout.pattern!r} has "
                            f"{layout.pattern[i]!r} there")
    if problems:
        raise ConfigMismatchError("hybrid-model checkpoint:\n  " + problem_list(problems))
    return layout


def model_config(chunks: list[torch.nn.Module]):
    """The chunks' TransformerConfig as an HF model has it: for a hybrid model a copy with `num_layers` in HF
    layers, `mtp_num_layers` in MTP depths, the per-layer fields a hybrid model holds per Megatron layer back in
    HF layers (each HF layer's mixer entry; DSA IndexShare's period and offset, the inverse of
    model_specs.hybrid.hybrid_layer_fields) and `hybrid_layout` set (None for other models)."""
    config = language_model(chunks[0]).config
    layout = hybrid_layout(chunks[0])
    if layout is None:
        return config
    view = copy.copy(config)  # not dataclasses.replace: that re-runs TransformerConfig's validation
    view.num_layers = layout.num_layers
    view.mtp_num_layers = layout.mtp_depths or None
    view.hybrid_layout = layout
    mixers = [layout.hf_layer.index(hf) for hf in range(layout.num_layers)]
    for name in ("window_attn_skip_freq", "linear_attention_freq"):
        value = getattr(config, name, None)
        if isinstance(value, list) and len(value) == len(layout.pattern):
            setattr(view, name, [value[i] for i in mixers])
    freq = getattr(config, "dsa_indexer_topk_freq", None) or 1
    if freq > 1:
        view.dsa_indexer_topk_freq = freq // 2
        view.dsa_indexer_skip_topk_offset = (config.dsa_indexer_skip_topk_offset + 1) // 2
    return view


@dataclass
class LocalTensor:
    """A parameter or buffer this rank holds, under its canonical global name."""

    name: str
    local_name: str
    get: Callable[[], torch.Tensor]  # read at every export: training may replace .data (offloading)
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_expert: bool
    sharded: bool  # tensor_model_parallel attribute (and not a TE 'duplicated' linear)
    dim: int | None  # partition_dim attribute
    stride: int  # partition_stride attribute
    is_buffer: bool = False
    param: torch.Tensor | None = None  # the Parameter itself (stays valid when training swaps its .data)
    #: a LoRA-merged base weight (`lora.Merge`): how it is computed, so the executor core merges a bucket's weights
    #: batched; `get` computes it alone
    merge: Any = None


def unwrap_model(model) -> list[torch.nn.Module]:
    """The model chunks (one per virtual-PP stage) without DDP / Float16Module wrappers (a vision-language
    wrapper is a chunk: its tower is part of the model)."""
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    out = []
    for m in chunks:
        while not hasattr(m, "decoder") and not hasattr(m, LANGUAGE_MODEL) and hasattr(m, "module"):
            m = m.module
        out.append(m)
    return out


def _param_getter(p: torch.nn.Parameter) -> Callable[[], torch.Tensor]:
    return lambda: p.data


def _buffer_getter(module: torch.nn.Module, attr: str) -> Callable[[], torch.Tensor]:
    return lambda: getattr(module, attr)


def _grouped_item_getter(p: torch.nn.Parameter, i: int, n: int) -> Callable[[], torch.Tensor]:
    if p.shape[0] == n:
        return lambda: p.data[i]
    rows = p.shape[0] // n
    return lambda: p.data[i * rows:(i + 1) * rows]


def _copy_tp_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    # the layout op decides the split; the attributes are only cross-checked (plan.shard_split)
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "parallel_mode"):
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))


def _submodule(root: torch.nn.Module, dotted: str) -> torch.nn.Module:
    m = root
    for part in dotted.split("."):
        m = getattr(m, part)
    return m


def mtp_inner(kind: str, number: int, rest: str, num_layers: int) -> tuple[str, int, str]:
    """MTP layer m's inner transformer layer is decoder layer num_layers + m (where HF checkpoints put it)."""
    if kind == "mtp":
        for inner in _MTP_INNER:
            if rest.startswith(inner):
                return "decoder", num_layers + number, rest[len(inner):]
    return kind, number, rest


def canonical_layer_name(kind: str, number: int, rest: str, num_layers: int, expert_offset: int = 0) -> str:
    """Canonical name of a parameter inside decoder (or MTP) layer `number` (global, 0-based).

    `expert_offset` turns local expert indices into global ones (0 when they are global already, as in
    distributed checkpoints)."""
    kind, number, rest = mtp_inner(kind, number, rest, num_layers)
    rest = TE_RENAMES.get(rest, rest)
    e = _LOCAL_EXPERT.fullmatch(rest)
    if e is not None:
        rest = f"mlp.experts.{expert_offset + int(e.group(1))}.{e.group(2)}"
    else:
        g = _GROUPED_EXPERT.fullmatch(rest)
        if g is not None:
            rest = f"mlp.experts.{expert_offset + int(g.group(3))}.{g.group(1)}.{g.group(2)}"
    return f"{kind}.layers.{number}.{rest}"


def canonical_name(name: str, chunk: torch.nn.Module, ctx_ep_rank: int, num_local_experts: int,
                   num_layers: int, hybrid: HybridLayout | None = None) -> str:
    """Canonical global name of `name` (a name in `chunk.named_parameters()`); `num_layers` counts HF layers."""
    name = name.replace(LORA_BASE, ".")  # a LoRA-wrapped linear's base weight keeps its own name
    m = _LAYER.fullmatch(name)
    if m is None:
        return FINAL_NORM if hybrid and name == HYBRID_FINAL_NORM else name
    kind, idx, rest = m.group(1), int(m.group(2)), m.group(3)
    number = getattr(chunk, kind).layers[idx].layer_number - 1
    if hybrid is not None:
        if kind == "decoder":  # layer_number: the global Megatron layer (0.16 TransformerLayer adds the PP offset)
            number = hybrid.hf_layer[number]
        else:  # 0.19 hybrid MTP: each depth's inner HybridStack is one HF layer (HybridLayout.parse checks)
            rest = hybrid_mtp_inner(rest)
    return canonical_layer_name(kind, number, rest, num_layers, ctx_ep_rank * num_local_experts)


def wrapper_part_name(name: str) -> str:
    """Canonical name of a vision-language wrapper's own parameter (tower, projector): its wrapper-relative name,
    a native tower's blocks with TE's fused norms under the local spec's names, as in the decoder."""
    name = name.replace(LORA_BASE, ".")
    v = _VISION_LAYER.fullmatch(name)
    return name if v is None else f"{v.group(1)}.{TE_RENAMES.get(v.group(2), v.group(2))}"


def local_tensors(chunks: list[torch.nn.Module], ctx: ParallelContext) -> list[LocalTensor]:
    """Every parameter and `expert_bias` buffer of this rank, canonically named."""
    out: list[LocalTensor] = []
    seen: set[str] = set()
    for vp, chunk in enumerate(chunks):
        lm = language_model(chunk)
        inner = "" if lm is chunk else LANGUAGE_MODEL + "."  # a wrapper's decoder parameters: named as lm's own
        cfg = lm.config
        hybrid = hybrid_layout(lm)
        num_layers = hybrid.num_layers if hybrid is not None else cfg.num_layers
        num_experts = getattr(cfg, "num_moe_experts", None) or 0
        num_local = num_experts // ctx.ep.size if num_experts else 0
        prefix = f"chunk{vp}." if len(chunks) > 1 else ""
        items: list[tuple[str, torch.Tensor, Callable[[], torch.Tensor], bool]] = []
        for name, p in chunk.named_parameters():
            single = _SINGLE_GROUPED.fullmatch(name) if num_local else None
            if single is not None and p.shape[0] % num_local == 0:
                for i in range(num_local):  # views of the one grouped parameter, read at every export
                    get = _grouped_item_getter(p, i, num_local)
                    view = get()
                    _copy_tp_attributes(p, view)
                    items.append((f"{single.group(1)}.{single.group(2)}{i}", view, get, True))
                continue
            grouped = _GROUPED_ADAPTER.fullmatch(name) if num_local else None
            if grouped is not None and (p.dim() == 2 or (p.dim() == 3 and p.shape[0] == num_local)):
                for i in range(num_local):  # expert i's factor: the one shared factor, or item i of a 3-D stack
                    item = f"{grouped.group(1)}.adapter.{grouped.group(2)}.weight{i}"
                    if p.dim() == 2:
                        items.append((item, p, _param_getter(p), False))
                        continue
                    get = _grouped_item_getter(p, i, num_local)  # read at every export, as the grouped weights
                    view = get()
                    _copy_tp_attributes(p, view)
                    if getattr(p, "partition_dim", None) is not None:
                        view.partition_dim = p.partition_dim - 1  # the 3-D tensor's axis, less the expert axis
                    items.append((item, view, get, True))
                continue
            items.append((name, p, _param_getter(p), False))
        for name, b in chunk.named_buffers():
            if name.endswith("expert_bias"):
                owner, _, attr = name.rpartition(".")
                items.append((name, b, _buffer_getter(_submodule(chunk, owner), attr), True))
        for name, t, getter, is_buffer in items:
            if name.startswith(inner):
                canon = canonical_name(name[len(inner):], lm, ctx.ep.rank, num_local, num_layers, hybrid)
            else:  # a wrapper's own part (vision tower, projector): its wrapper-relative name, mapped by the table
                canon = wrapper_part_name(name)
            if canon == "output_layer.weight" and getattr(t, "shared_embedding", False):
                canon = "embedding.word_embeddings.weight"  # the last (or MTP) stage's copy of a tied embedding
            if canon in seen:
                continue
            seen.add(canon)
            sharded = bool(getattr(t, "tensor_model_parallel", False)) and (
                getattr(t, "parallel_mode", None) != "duplicated")
            out.append(LocalTensor(
                name=canon,
                local_name=prefix + name,
                get=getter,
                shape=tuple(t.shape),
                dtype=t.dtype,
                is_expert=".mlp.experts." in f".{canon}",
                sharded=sharded,
                dim=getattr(t, "partition_dim", None) if sharded else None,
                stride=int(getattr(t, "partition_stride", 1) or 1),
                is_buffer=is_buffer,
                param=None if is_buffer else t,
            ))
    return out


#: a canonical name's parts: a decoder / MTP layer (decoder.layers.L / mtp.layers.M) or a native vision tower's
#: block / deepstack merger, then a routed expert (mlp.experts.E), then the rest
_CANONICAL = regex.compile(r"(?:(?P<stack>decoder|mtp)\.layers\.(?P<layer>\d+)\."
                           r"|vision_model\.decoder\.(?P<part>layers|deepstack_merger_list)\.(?P<block>\d+)\.)?"
                           r"(?P<rest>(?:mlp\.experts\.(?P<expert>\d+)\.)?.+)")


@dataclass(frozen=True)
class CanonicalName:
    """A canonical Megatron name taken apart, by the one parser of them (`parse_name`): the structure checks, the
    import, the checkpoint key scheme, the offline export and the dry run read names through it.

    `stack`: "decoder" or "mtp" (a decoder layer, MTP layers' inner layers included, or an MTP layer: index in
    `layer`), "layers" or "deepstack_merger_list" (a native vision tower's block or deepstack merger: index in
    `layer`), None (the model's own tensors: embedding, final norm, output layer, tower stems). `rest`: what follows
    the layer prefix (the whole name without one); `expert`: a routed expert's index (rest = mlp.experts.E...)."""

    name: str
    stack: str | None
    layer: int | None
    rest: str
    expert: int | None

    def with_expert(self, expert: int) -> str:
        """The same name for routed expert `expert`."""
        head = self.name[:len(self.name) - len(self.rest)]
        return head + self.rest.replace(f"mlp.experts.{self.expert}.", f"mlp.experts.{expert}.", 1)


@functools.lru_cache(maxsize=1 << 16)
def parse_name(name: str) -> CanonicalName:
    m = _CANONICAL.fullmatch(name)
    stack = m.group("stack") or m.group("part")
    index = m.group("layer") or m.group("block")
    expert = m.group("expert")
    return CanonicalName(name, stack, None if index is None else int(index), m.group("rest"),
                         None if expert is None else int(expert))


def shift_experts(local: list[LocalTensor], offset: int) -> list[LocalTensor]:
    """`local` (one rank's tensors) as a rank that differs only in its EP rank names them: the routed experts'
    global indices moved by `offset` (EP rank difference x local experts), everything else as it is. The dry run
    names the ranks of a stage from one model."""
    out = []
    for t in local:
        p = parse_name(t.name) if t.is_expert else None
        out.append(t if p is None or p.expert is None else
                   dataclasses.replace(t, name=p.with_expert(p.expert + offset)))
    return out


@dataclass(frozen=True)
class NameFilter:
    """Which HF tensors an export produces: names matching any `include` regex (all when empty) and no
    `exclude` regex (`re.search`). Applied to the plan, so filtered tensors cost no bytes."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __post_init__(self):
        for pattern in self.include + self.exclude:
            try:
                regex.compile(pattern)
            except regex.error as e:
                raise ValueError(f"name filter: {pattern!r} is not a regular expression ({e})") from None

    @classmethod
    def of(cls, include=None, exclude=None) -> NameFilter | None:
        include, exclude = tuple(include or ()), tuple(exclude or ())
        return cls(include, exclude) if include or exclude else None

    def __call__(self, hf_name: str) -> bool:
        if self.include and not any(regex.search(p, hf_name) for p in self.include):
            return False
        return not any(regex.search(p, hf_name) for p in self.exclude)


@dataclass(frozen=True)
class NameSet:
    """HF names in a fixed set (`inside=False`: not in it), among those `within` keeps: one pass of a sync (the
    target's tensors, or the draft's: senders/sync.py). Hashable, so plans and executors are cached per pass."""

    names: frozenset[str]
    inside: bool = True
    within: Callable[[str], bool] | None = None

    def __call__(self, hf_name: str) -> bool:
        return (hf_name in self.names) == self.inside and (self.within is None or self.within(hf_name))


def filter_outputs(keep: Callable[[str], bool], outputs, copies_alone: bool = False) -> dict:
    """Which outputs a name filter keeps. `outputs` yields (key, primary HF names, copy names) per Megatron tensor;
    returns {key: kept copy names} for the tensors kept at all. A layout op writes all its primary outputs together,
    so keeping some of them but not others is an error, as is keeping nothing. `copies_alone`: a tensor of one
    primary output may keep only copies of it (an MTP draft's embedding / head copies, without the target's)."""
    out, split = {}, []
    for key, primary, copies in outputs:
        kept = [keep(n) for n in primary]
        kept_copies = tuple(c for c in copies if keep(c))
        if not any(kept) and not kept_copies:
            continue
        if copies_alone and len(primary) == 1 and not kept[0]:
            out[key] = kept_copies
            continue
        if not all(kept):
            split.append(f"{key} -> {list(primary)} (kept: {[n for n, k in zip(primary, kept) if k]})")
            continue
        out[key] = kept_copies
    if split:
        raise ValueError("the name filter keeps only some of the HF tensors one Megatron tensor becomes; keep all "
                         "or none of them:\n  " + problem_list(split))
    if not out:
        raise ValueError("the name filter keeps no HF tensor")
    return out
