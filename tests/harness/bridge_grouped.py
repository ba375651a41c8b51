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
                 input_is_parallel: bool) -> None:
        super().__init__()
        self.dim, self.alpha, self.input_is_parallel = dim, alpha, input_is_parallel
        self.is_expert = True
        self.num_local_experts = linear_in.shape[0]
        self.activation = nn.Identity()
        self.dropout = nn.Identity()
        self.linear_in = _GroupedExpertAdapterWeight(linear_in)
        self.linear_out = _GroupedExpertAdapterWeight(linear_out)
        for weight, axis in ((self.linear_in.weight, 2 if input_is_parallel else 1), (self.linear_out.weight, 1)):
            set_tensor_model_parallel_attributes(weight, True, axis, 1)
        self.expert_tp = ps.get_expert_tensor_parallel_world_size()

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
                                                   bool(first.input_is_parallel))
                for i, w in enumerate(wrapped):
                    w.adapter = _ExpertOfGroup(group, i)
                groups[fc] = (group, first)
            layers.append((layer, groups))
    return layers


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
