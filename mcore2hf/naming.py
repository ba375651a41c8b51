"""Global, canonical names for every local parameter (and `expert_bias` buffer) of a Megatron model.

Canonical names are local-spec names with global indices, whatever the layout and the spec:

* decoder layers: the index is the layer's own `layer_number - 1`, which Megatron sets from the PP / virtual-PP
  offset (uneven first/last stages and custom pipeline layouts included), so no offset arithmetic is repeated
  here and nothing depends on `get_transformer_layer_offset`'s signature in a given megatron-core release;
* routed experts: `mlp.experts.{E}.linear_fc{1,2}.weight` with E = ep_rank * num_local_experts + local index,
  from the local spec's `local_experts.{i}` and TE's grouped `linear_fc{1,2}.weight{i}` alike;
* TE's fused norms are renamed to the local spec's modules (`TE_RENAMES`);
* MTP layer m: `mtp.layers.{m}.{enorm,hnorm,eh_proj,final_layernorm}` and its inner transformer layer as decoder
  layer `num_layers + m` (where HF checkpoints put it);
* the last stage's copy of a tied embedding (and the MTP stage's) is the embedding itself, a replica.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import regex
import torch

from .parallel import ParallelContext

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

_LAYER = regex.compile(r"(decoder|mtp)\.layers\.(\d+)\.(.+)")
_LOCAL_EXPERT = regex.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
_GROUPED_EXPERT = regex.compile(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)")
_MTP_INNER = ("transformer_layer.", "mtp_model_layer.")
# megatron-core 0.19 with moe_single_grouped_weight / _bias (TE >= 2.14): all local experts in one parameter
# `linear_fc{1,2}.weight` of TEGroupedLinear (extensions/transformer_engine.py, _split_grouped_checkpoint_tensor:
# item i is tensor[i] when dim 0 is num_gemms, else chunk i of dim 0); each item is named like TE's weight{i}
_SINGLE_GROUPED = regex.compile(r"(.+\.mlp\.experts\.linear_fc[12])\.(weight|bias)")


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


def unwrap_model(model) -> list[torch.nn.Module]:
    """The model chunks (one per virtual-PP stage) without DDP / Float16Module wrappers."""
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    out = []
    for m in chunks:
        while not hasattr(m, "decoder") and hasattr(m, "module"):
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
    # the layout op decides the split; the attributes are only cross-checked (plan._shard_split)
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
                   num_layers: int) -> str:
    """Canonical global name of `name` (a name in `chunk.named_parameters()`)."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return name
    kind, idx, rest = m.group(1), int(m.group(2)), m.group(3)
    number = getattr(chunk, kind).layers[idx].layer_number - 1
    return canonical_layer_name(kind, number, rest, num_layers, ctx_ep_rank * num_local_experts)


def local_tensors(chunks: list[torch.nn.Module], ctx: ParallelContext) -> list[LocalTensor]:
    """Every parameter and `expert_bias` buffer of this rank, canonically named."""
    out: list[LocalTensor] = []
    seen: set[str] = set()
    for vp, chunk in enumerate(chunks):
        cfg = chunk.config
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
            items.append((name, p, _param_getter(p), False))
        for name, b in chunk.named_buffers():
            if name.endswith("expert_bias"):
                owner, _, attr = name.rpartition(".")
                items.append((name, b, _buffer_getter(_submodule(chunk, owner), attr), True))
        for name, t, getter, is_buffer in items:
            canon = canonical_name(name, chunk, ctx.ep.rank, num_local, cfg.num_layers)
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


def filter_outputs(keep: Callable[[str], bool], outputs) -> dict:
    """Which outputs a name filter keeps. `outputs` yields (key, primary HF names, copy names) per Megatron tensor;
    returns {key: kept copy names} for the tensors kept at all. A layout op writes all its primary outputs together,
    so keeping some of them but not others is an error, as is keeping nothing."""
    out, split = {}, []
    for key, primary, copies in outputs:
        kept = [keep(n) for n in primary]
        kept_copies = tuple(c for c in copies if keep(c))
        if not any(kept) and not kept_copies:
            continue
        if not all(kept):
            split.append(f"{key} -> {list(primary)} (kept: {[n for n, k in zip(primary, kept) if k]})")
            continue
        out[key] = kept_copies
    if split:
        raise ValueError("the name filter keeps only some of the HF tensors one Megatron tensor becomes; keep all "
                         "or none of them:\n  " + "\n  ".join(split))
    if not out:
        raise ValueError("the name filter keeps no HF tensor")
    return out
