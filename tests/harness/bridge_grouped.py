"""An equivalent of Megatron-Bridge 0.6.2's grouped-expert LoRA, built from megatron-core layers.

Bridge 0.6.2's `GroupedExpertLinearAdapter` (peft/utils.py:1767-2359; `LoRA(share_expert_adapters=False)` picks it
for a grouped expert linear, lora.py:163-184) sits on Transformer Engine's TEColumnParallelGroupedLinear /
TERowParallelGroupedLinear: `get_adapter_attributes_from_linear` raises for any other base (utils.py:643), and its
constructor needs `num_local_experts=module.num_gemms` (lora.py:198-202). No machine here has Transformer Engine, so
the real class cannot run: the tests build what it holds, with its names, shapes, split attributes and forward, on
a model Bridge 0.3.1 has wrapped expert by expert (SequentialMLP, the local spec's), then give that model TE's
grouped names (`mcore2hf.runtime.te_naming`, as the base export of TEGroupedMLP is tested). What is Bridge's:

* wrapper: `LoRALinear(to_wrap, adapter)` (Bridge's own class, lora.py:218): the base at
  `mlp.experts.linear_fc{1,2}.to_wrap.weight{i}` (TE GroupedLinear's `weight{i}`, te_naming);
* `adapter.linear_in.weight` / `adapter.linear_out.weight`: one Parameter each, in a module of its own
  (`_GroupedExpertAdapterWeight`, utils.py:1750-1765, attached at :1879-1880);
* shapes (utils.py:1835-1851): column-parallel base (fc1, `input_is_parallel=False`): linear_in
  [E_local, r / ETP, in], row-parallel base (fc2): [E_local, r, in / ETP]; linear_out [E_local, out / ETP, r], where
  in / out are the whole base's (`get_adapter_attributes_from_linear` multiplies TE's local sizes by the TP size,
  utils.py:593-598 / :624-627, over the expert-TP group for experts, :574-582);
* split attributes (utils.py:1832-1833, :1881-1887): `set_tensor_model_parallel_attributes(weight, True, axis, 1)`, axis 1 for
  linear_out and for a column base's linear_in, 2 for a row base's linear_in;
* `dim`, `alpha`, `input_is_parallel`, `is_expert=True`, `num_local_experts`, an identity `activation`
  (utils.py:1794-1806; lora.py:187 activation="identity");
* `sharded_state_dict` (utils.py:2315-2359): each factor under `<prefix>linear_{in,out}.weight` as one ShardedTensor
  whose own leading axis (the local experts) is fragmented over EP and whose split axis over expert-TP
  (`_make_grouped_expert_sharded_tensor` :1702-1747, `_append_rank_offset` :1678-1699), replicated over expert-DP;
  fc1's linear_out of a gated MLP through a factory that saves its gate and up halves as the two halves of the global
  axis (`_apply_grouped_expert_swiglu_sharded_factory` :1588-1675). Under TEGroupedMLP (megatron-core
  transformer/moe/experts.py `sharded_state_dict`) the prefix is `...mlp.experts.experts.linear_fc{1,2}.adapter.`,
  so its keys and global shapes are the per-expert (SequentialMLP) adapters' stacked ones ([E, r, in] behind the
  layer axis): a checkpoint saved from grouped adapters reads as one saved from per-expert ones;
* forward (utils.py:2217-2313, per expert as `_forward_per_expert`, :2175-2215; the grouped_mm path computes the
  same products): for the tokens of local expert e, `h = x A_e^T`, gathered over expert-TP on its last axis when the
  base is column-parallel (:2199-2200, `_gather_along_last_dim` :1916-1934), `y = h B_e^T`, gathered the same way
  when the base is row-parallel (:2206-2207), times alpha / dim (:2243-2245). The padding of each expert's tokens to
  a multiple of expert-TP (:2194, :2210-2211) adds zero rows that are cut again: it changes no row, and is left out.
  Bridge's dropout (0 here) too.

The factors are the per-expert ParallelLinearAdapter factors Bridge 0.3.1 built and the test loaded, stacked:
the same local shapes per expert (ColumnParallelLinear(in, r) [r / ETP, in], RowParallelLinear(in, r)
[r, in / ETP], ColumnParallelLinear(r, out) [out / ETP, r], utils.py:481-528 of 0.3.1).
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn


class _GroupedExpertAdapterWeight(nn.Module):
    """Bridge 0.6.2 peft/utils.py:1750-1765: a module holding one `weight`, indexed by local expert."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, indices=None) -> torch.Tensor:
        return self.weight if indices is None else self.weight[indices]


class GroupedExpertLinearAdapter(nn.Module):
    """The equivalent of Bridge 0.6.2's class of this name (module docstring): its parameters, attributes and
    forward. Named as Bridge's, since exporters recognize adapters by class name."""

    def __init__(self, linear_in: torch.Tensor, linear_out: torch.Tensor, dim: int, alpha: float,
                 input_is_parallel: bool, base_linear_name: str = "", gated_linear_unit: bool = False) -> None:
        super().__init__()
        self.dim, self.alpha, self.input_is_parallel = dim, alpha, input_is_parallel
        # what Bridge's sharded_state_dict asks (utils.py:2349): the base's name and config.gated_linear_unit
        self.base_linear_name, self.gated_linear_unit = base_linear_name, gated_linear_unit
        self.is_expert = True
        self.num_local_experts = linear_in.shape[0]
        self.activation = nn.Identity()
        self.dropout = nn.Identity()
        self.linear_in = _GroupedExpertAdapterWeight(linear_in)
        self.linear_out = _GroupedExpertAdapterWeight(linear_out)
        for weight, axis in ((self.linear_in.weight, 2 if input_is_parallel else 1), (self.linear_out.weight, 1)):
            set_tensor_model_parallel_attributes(weight, True, axis, 1)
        self.expert_tp = ps.get_expert_tensor_parallel_world_size()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Bridge 0.6.2 utils.py:2315-2359 (module docstring); its groups are megatron-core's default ones (the
        pg_collection `use_mpu_process_groups` gives, utils.py:130-146), read here from parallel_state."""
        out = {}
        for name, weight in (("linear_in", self.linear_in.weight), ("linear_out", self.linear_out.weight)):
            key = f"{prefix}{name}.weight"
            out[key] = _grouped_expert_sharded_tensor(weight, key, weight.partition_dim, sharded_offsets)
        if "linear_fc1" in self.base_linear_name and self.gated_linear_unit:
            key = f"{prefix}linear_out.weight"
            out[key] = _grouped_expert_swiglu_factory(out[key], sharded_offsets,
                                                      (metadata or {}).get("singleton_local_shards", False))
        return out

    def _gather_along_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        if self.expert_tp == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.expert_tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=ps.get_expert_tensor_parallel_group())
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        a, b = self.linear_in(), self.linear_out()
        outputs, start = [], 0
        for e, n in enumerate(m_splits):
            h = nn.functional.linear(x.narrow(0, start, n), a[e])
            start += n
            if not self.input_is_parallel:
                h = self._gather_along_last_dim(h)
            y = nn.functional.linear(self.activation(h), b[e])
            if self.input_is_parallel:
                y = self._gather_along_last_dim(y)
            outputs.append(y)
        return torch.cat(outputs, dim=0) * (self.alpha / self.dim)


def _append_rank_offset(rank_offsets: list, axis: int, rank: int, fragments: int) -> None:
    """Bridge 0.6.2 utils.py:1678-1699: a (axis, rank, fragments) offset, combined with one already on that axis."""
    if fragments <= 1:
        return
    for i, (a, r, f) in enumerate(rank_offsets):
        if a == axis:
            rank_offsets[i] = (axis, r * fragments + rank, f * fragments)
            return
    rank_offsets.append((axis, rank, fragments))


def _grouped_expert_sharded_tensor(tensor: torch.Tensor, key: str, tp_axis: int, sharded_offsets: tuple) -> ShardedTensor:
    """Bridge 0.6.2 utils.py:1702-1747 `_make_grouped_expert_sharded_tensor`: the local experts axis (the tensor's
    axis 0, after the prepended `sharded_offsets` axes) over EP, `tp_axis` over expert-TP, replica = expert-DP rank."""
    prepend = len(sharded_offsets)
    rank_offsets = list(sharded_offsets)
    _append_rank_offset(rank_offsets, prepend, ps.get_expert_model_parallel_rank(),
                        ps.get_expert_model_parallel_world_size())
    _append_rank_offset(rank_offsets, prepend + tp_axis, ps.get_expert_tensor_parallel_rank(),
                        ps.get_expert_tensor_parallel_world_size())
    return ShardedTensor.from_rank_offsets(key, tensor, *rank_offsets, replica_id=(0, 0, ps.get_expert_data_parallel_rank()),
                                           prepend_axis_num=prepend)


def _grouped_expert_swiglu_factory(sh: ShardedTensor, sharded_offsets: tuple, singleton: bool) -> ShardedTensorFactory:
    """Bridge 0.6.2 utils.py:1588-1675 `_apply_grouped_expert_swiglu_sharded_factory`: fc1's linear_out [E, out, r]
    split on axis 1 into gate and up halves, saved as the two halves of the global axis (or `_w` / `_v` keys with
    singleton_local_shards), the other fragmented axes kept."""
    axis, prepend = 1, len(sharded_offsets)
    local = sh.local_shape[axis]
    global_axis = axis + prepend
    assert sh.global_offset[global_axis] % local == 0
    rank, frag = sh.global_offset[global_axis] // local, sh.axis_fragmentations[global_axis]
    kept = [(a + prepend, sh.global_offset[a + prepend] // n, sh.axis_fragmentations[a + prepend])
            for a, n in enumerate(sh.local_shape) if a != axis and sh.axis_fragmentations[a + prepend] > 1]

    @torch.no_grad()
    def build(key: str, tensor: torch.Tensor, replica_id, flattened_range) -> list[ShardedTensor]:
        del flattened_range
        if singleton:
            offsets, keys = ((global_axis, rank, frag),) * 2, (f"{key}_w", f"{key}_v")
        else:
            offsets, keys = ((global_axis, rank, frag * 2), (global_axis, rank + frag, frag * 2)), (key, key)
        return [ShardedTensor.from_rank_offsets(k, t, *sharded_offsets, *kept, o, replica_id=replica_id,
                                                prepend_axis_num=prepend)
                for k, t, o in zip(keys, torch.chunk(tensor, 2, dim=axis), offsets)]

    def merge(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=axis)

    return ShardedTensorFactory(sh.key, sh.data, build, merge, sh.replica_id, flattened_range=sh.flattened_range)


class _ExpertOfGroup(nn.Module):
    """For the forward only: SequentialMLP calls local expert e's linear with e's tokens; this calls the grouped
    adapter with them as expert e's split (the others empty), as TEGroupedMLP's grouped call would."""

    def __init__(self, group: GroupedExpertLinearAdapter, e: int) -> None:
        super().__init__()
        self.e = e
        self.__dict__["group"] = group  # not a submodule: the parameters stay the grouped module's

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # Bridge 0.6.2's LoRALinear passes the base's arguments on (adapter_wrapper.py:159-162 adapter_forward)
        del args, kwargs
        flat = x.reshape(-1, x.shape[-1])
        splits = [0] * self.group.num_local_experts
        splits[self.e] = flat.shape[0]
        return self.group(flat, splits)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Nothing: the factors are the grouped module's, saved by `grouped_sharded_state_dict` (Bridge's
        AdapterWrapper.sharded_state_dict asks every adapter, adapter_wrapper.py:216-221 of 0.6.2)."""
        return {}


class _GroupedLinear(nn.Module):
    """TE's GroupedLinear's names: weight0..weight{n-1} (mcore2hf/runtime/te_naming.py)."""


class _GroupedExperts(nn.Module):
    """TEGroupedMLP's names: `linear_fc1`, `linear_fc2` (Bridge-wrapped here)."""


def to_grouped_lora(chunks: list) -> list[tuple]:
    """Each MoE layer's experts, wrapped expert by expert by Bridge 0.3.1, given grouped adapters holding the same
    factors (stacked, new Parameters); each expert's adapter then runs its slice of the grouped one. Returns what
    `to_grouped_names` needs."""
    layers = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            local = list(experts.local_experts)
            groups = {}
            for fc in ("linear_fc1", "linear_fc2"):
                wrapped = [getattr(e, fc) for e in local]
                first = wrapped[0].adapter
                with torch.no_grad():
                    stack = [torch.stack([w.adapter.linear_in.weight for w in wrapped]),
                             torch.stack([w.adapter.linear_out.weight for w in wrapped])]
                group = GroupedExpertLinearAdapter(*stack, int(first.dim), float(first.alpha),
                                                   bool(first.input_is_parallel),
                                                   f"decoder.layers.{layer.layer_number - 1}.mlp.{fc}",
                                                   bool(layer.config.gated_linear_unit))
                for i, w in enumerate(wrapped):
                    w.adapter = _ExpertOfGroup(group, i)
                groups[fc] = (group, first)
            layers.append((layer, groups))
    return layers


def grouped_sharded_state_dict(chunk, layers: list[tuple], metadata: dict) -> dict:
    """What megatron-core's dist_checkpointing saves of `chunk` (after `to_grouped_lora`, before `to_grouped_names`)
    as a TEGroupedMLP model with grouped adapters: the experts' base weights under SequentialMLP's keys (TEGroupedMLP's
    are the same: megatron-core transformer/moe/experts.py TEGroupedMLP.sharded_state_dict "interchangable with
    SequentialMLP's", mcore2hf/checkpoint_keys.py), each grouped adapter's own `sharded_state_dict` under the prefix
    TEGroupedMLP gives it (`<layer>mlp.experts.experts.<fc>.` there, `adapter.` from Bridge's AdapterWrapper,
    adapter_wrapper.py:216-221) with its layer's offsets (transformer/transformer_block.py `sharded_state_dict`:
    stacked layers an axis (0, layer, num_layers), per-layer keys none)."""
    sd = chunk.sharded_state_dict(metadata=metadata)  # the per-expert adapters hold nothing now (_ExpertOfGroup)
    stacked = any(getattr(v, "key", "").startswith(("decoder.layers.mlp.", "decoder.layers.self_attention."))
                  for v in sd.values())
    own = {id(m) for m in chunk.decoder.layers}
    for layer, groups in layers:
        if id(layer) not in own:
            continue
        g = layer.layer_number - 1
        prefix, offsets = (("decoder.layers.", ((0, g, layer.config.num_layers),)) if stacked
                           else (f"decoder.layers.{g}.", ()))
        for fc, (group, _) in groups.items():
            part = group.sharded_state_dict(f"{prefix}mlp.experts.experts.{fc}.adapter.", offsets, metadata)
            # state-dict keys (unique per layer; the sharded keys are the ShardedTensors')
            sd.update({f"decoder.layers.{g}.mlp.experts.{fc}.adapter.{k.rsplit('.adapter.', 1)[1]}": v
                       for k, v in part.items()})
    return sd


def _saved(sd: dict) -> list[tuple]:
    """Each ShardedTensor a sharded state dict saves (factories built): key, global shape and offset,
    fragmentation, local shape, replica id, prepended axes."""
    out = []
    for v in sd.values():
        for t in v.build() if isinstance(v, ShardedTensorFactory) else [v]:
            out.append((t.key, tuple(t.global_shape), tuple(t.global_offset), tuple(t.axis_fragmentations),
                        tuple(t.local_shape), t.replica_id, t.prepend_axis_num))
    return sorted(out)


def share_first_expert(layers: list[tuple]) -> None:
    """Bridge 0.6.2's default for grouped experts (`share_expert_adapters=True`, lora.py:114, :163-184): one
    ParallelLinearAdapter (utils.py:896-1080, the class 0.3.1 builds per expert with the same shapes and splits)
    applied to every local expert's tokens. Here: local expert 0's adapter, as Bridge 0.3.1 built and the test loaded
    it, becomes each grouped linear's adapter (after `to_grouped_names`)."""
    for layer, groups in layers:
        for fc, (_, first) in groups.items():
            getattr(layer.mlp.experts, fc).adapter = first


def to_grouped_names(layers: list[tuple], wrapper_class: type) -> None:
    """TEGroupedMLP's names and TE's attributes (as te_naming gives the base: `weight{i}`, under explicit expert
    communication `partition_dim=0` on every expert weight, else fc1's stride 1), each grouped linear wrapped by
    `wrapper_class` (Bridge's LoRALinear) with its grouped adapter. Then `te_naming.to_te_names` renames the rest.
    The forward is not meant to run afterwards."""
    explicit = ps.get_expert_tensor_parallel_world_size() > 1 or ps.get_expert_model_parallel_world_size() > 1
    for layer, groups in layers:
        local = list(layer.mlp.experts.local_experts)
        grouped = _GroupedExperts()
        for fc, (adapter, _) in groups.items():
            base = _GroupedLinear()
            for i, e in enumerate(local):
                p = getattr(e, fc).to_wrap._parameters.pop("weight")
                if explicit:
                    p.partition_dim, p.partition_stride = 0, 1
                elif fc == "linear_fc1":
                    p.partition_stride = 1
                base.register_parameter(f"weight{i}", p)
            setattr(grouped, fc, wrapper_class(base, adapter))
        layer.mlp.experts = grouped


def real_class_diff(layers: list[tuple]) -> float | None:
    """Megatron-Bridge 0.6.2's own `GroupedExpertLinearAdapter` (its constructor and forward need no TE: only
    `LoRA.transform` and `get_adapter_attributes_from_linear` ask for TE's grouped base) built beside each
    equivalent above with the same in / out features (utils.py:1832-1851: its local shapes must equal the
    equivalent's), given its factors, and run on the same tokens split over every local expert: max |its forward
    - the equivalent's| (a collective over expert-TP, as both forwards are). Its `sharded_state_dict` (utils.py:
    2315-2359) must save what the equivalent's does (`_saved`: keys, global shapes and offsets, fragmentations,
    local shapes, replica ids; GLU factory built), at stacked and per-layer offsets, with and without
    singleton_local_shards (an assertion). None where Bridge has no such class."""
    import copy

    try:
        from megatron.bridge.peft.utils import GroupedExpertLinearAdapter as Real
    except ImportError:
        return None
    etp = ps.get_expert_tensor_parallel_world_size()
    gen = torch.Generator().manual_seed(7)
    worst = 0.0
    for layer, groups in layers:
        for fc, (group, _) in groups.items():
            a, b = group.linear_in.weight, group.linear_out.weight
            n, in_local = a.shape[0], a.shape[2]
            real = Real(in_local * (etp if group.input_is_parallel else 1), b.shape[1] * etp, group.dim,
                        num_local_experts=n, base_linear_name=f"decoder.layers.{layer.layer_number - 1}.mlp.{fc}",
                        activation="identity", input_is_parallel=group.input_is_parallel, alpha=group.alpha,
                        model_parallel_config=copy.copy(layer.config))  # it sets perform_initialization on it
            assert real.linear_in.weight.shape == a.shape and real.linear_out.weight.shape == b.shape, \
                f"{fc}: Bridge 0.6.2 holds {tuple(real.linear_in.weight.shape)} / {tuple(real.linear_out.weight.shape)}, " \
                f"the equivalent {tuple(a.shape)} / {tuple(b.shape)}"
            for ours, theirs in ((group.linear_in.weight, real.linear_in.weight),
                                 (group.linear_out.weight, real.linear_out.weight)):
                assert theirs.partition_dim == ours.partition_dim, f"{fc}: split axis {theirs.partition_dim}"
                with torch.no_grad():
                    theirs.copy_(ours)
            # their sharded state dicts (the checkpoint's keys, shapes, offsets, replicas), stacked layers and per layer
            g = layer.layer_number - 1
            for offsets in (((0, g, layer.config.num_layers),), ()):
                prefix = f"decoder.layers.mlp.experts.experts.{fc}.adapter."
                for md in ({}, {"singleton_local_shards": True}):
                    theirs, ours = _saved(real.sharded_state_dict(prefix, offsets, md)), \
                        _saved(group.sharded_state_dict(prefix, offsets, md))
                    assert theirs == ours, f"{fc} {offsets} {md}: Bridge 0.6.2 saves {theirs}, the equivalent {ours}"
            splits = [(3 + 2 * e) % 5 for e in range(n)]  # an expert with no token too
            x = torch.randn(sum(splits), in_local, generator=gen, dtype=a.dtype)
            with torch.no_grad():
                worst = max(worst, (real(x, splits) - group(x, splits)).abs().max().item())
    return worst
