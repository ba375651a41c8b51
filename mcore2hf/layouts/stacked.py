"""Stacked layout ops: one Megatron tensor (an expert's) -> item e of a stacked HF tensor (`Stacked`, with any
inner op), and PEFT's stacked 3-D expert LoRA factors (`StackedRows` / `StackedCols`: items along rows, or
interleaved by column; `Fused`: an op's outputs as one tensor). The op machinery is in `layouts`."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import ShapeMismatchError
from .ops import (
    LayoutOp,
    Shape,
    StridedCopy,
    check_dim,
    full_shape_of_shard,
    materialized,
    numel_of,
    shape_of,
    take_range,
)


class _Part:
    """Item `index` along dim 0 of a stacked HF tensor or lazily read one, sliced lazily like one."""

    def __init__(self, x, index: int):
        self.x, self.index = x, index

    def get_shape(self) -> list[int]:
        return list(shape_of(self.x)[1:])

    def __getitem__(self, key) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        return self.x[(slice(self.index, self.index + 1), *key)][0]


class Stacked(LayoutOp):
    """One of `count` Megatron tensors (a layer's experts) that together make HF tensors stacked along a new
    dim 0 (gpt-oss's `experts.gate_up_proj` [E, ...]): `inner` converts it, into item `index` of each output.

    Every stacked piece has the same HF names; the planner keeps all `count` pieces of a name in one bucket
    and lets each write its item of the one output (its copies shifted by `index` items)."""

    def __init__(self, inner: LayoutOp, index: int, count: int):
        if not 0 <= index < count:
            raise ShapeMismatchError(f"stacked item {index} of {count}: expected 0 <= index < {count}")
        self.inner, self.index, self.count = inner, index, count
        self.tp_dim, self.strides, self.n_out = inner.tp_dim, inner.strides, inner.n_out
        self.check_attributes = inner.check_attributes

    def split(self, shard_shape: Shape, group: int) -> tuple[int, int | None]:
        return self.inner.split(shard_shape, group)

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        return [(self.count, *s) for s in self.inner.hf_shapes(full_shape)]

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        return self.inner.full_shape([tuple(s[1:]) for s in hf_shapes])

    def item_shapes(self, full_shape: Shape) -> list[Shape]:
        """The shapes of this piece's items (what it contributes to each output)."""
        return self.inner.hf_shapes(full_shape)

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        full = full_shape_of_shard(shard_shape, self.tp_dim, count)
        items = [numel_of(s) for s in self.inner.hf_shapes(full)]
        return [replace(c, dst_offset=c.dst_offset + self.index * items[c.out])
                for c in self.inner.copies(shard_shape, count)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        return self.inner.shard_from_hf([_Part(h, self.index) for h in hf], index, count, full_shape)

    def hf_tensors(self, shards):
        raise NotImplementedError("a stacked piece writes into its item of a shared output: use to_hf")


class _Rows:
    """Rows [index * n, (index + 1) * n) of a tensor stacked by rows, sliced like one (read whole: adapters)."""

    def __init__(self, x, index: int, count: int):
        self.x, self.index, self.count = x, index, count

    def get_shape(self) -> list[int]:
        shape = list(shape_of(self.x))
        return [shape[0] // self.count, *shape[1:]]

    def __getitem__(self, key) -> torch.Tensor:
        n = shape_of(self.x)[0] // self.count
        return materialized(self.x)[self.index * n:(self.index + 1) * n][key]


class _Cols:
    """Columns index, index + count, ... of a 2-D tensor whose columns interleave `count` items, sliced like one."""

    def __init__(self, x, index: int, count: int):
        self.x, self.index, self.count = x, index, count

    def get_shape(self) -> list[int]:
        rows, cols = shape_of(self.x)
        return [rows, cols // self.count]

    def __getitem__(self, key) -> torch.Tensor:
        return materialized(self.x)[:, self.index::self.count][key]


class StackedRows(Stacked):
    """Item `index` of `count` stacked along dim 0 of a 2-D output, rows [index * n, (index + 1) * n): PEFT's
    lora_A of a 3-D expert parameter, [E * r, in] with expert e's A at rows e * r (peft 0.21.2
    tuners/lora/layer.py:2534 ParamWrapper: `weight_A.reshape(num_experts, -1, in)`; vllm 0.33.0
    lora/model_manager.py:987 the same). The bytes are Stacked's; only the shape is flattened."""

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        return [(self.count * s[0], *s[1:]) for s in self.inner.hf_shapes(full_shape)]

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        return self.inner.full_shape([(s[0] // self.count, *s[1:]) for s in hf_shapes])

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        return self.inner.shard_from_hf([_Rows(h, self.index, self.count) for h in hf], index, count, full_shape)


class StackedCols(Stacked):
    """Item `index` of `count` interleaved by column into a 2-D output [out, r * count]: element (o, j) of the item
    at column j * count + index. PEFT's lora_B of a 3-D expert parameter (peft 0.21.2 tuners/lora/layer.py:2535:
    `weight_B.reshape(out, -1, num_experts)`, expert e's B = [..., e]; vllm 0.33.0 lora/model_manager.py:995 the
    same). Each of the inner op's copies keeps its element order, its destination strides scaled by `count`."""

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        out = []
        for s in self.inner.hf_shapes(full_shape):
            check_dim(len(s) == 2, "a column-stacked item", "2-D", s)
            out.append((s[0], s[1] * self.count))
        return out

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        return self.inner.full_shape([(s[0], s[1] // self.count) for s in hf_shapes])

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        # an item element at contiguous position p lands at p * count + index of the interleaved output
        return [replace(c, dst_strides=tuple(d * self.count for d in c.dst_strides),
                        dst_offset=c.dst_offset * self.count + self.index)
                for c in self.inner.copies(shard_shape, count)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        return self.inner.shard_from_hf([_Cols(h, self.index, self.count) for h in hf], index, count, full_shape)


class Fused(LayoutOp):
    """An op's outputs concatenated along dim 0 into one HF tensor: GatedColumn's gate and up as transformers 5's
    fused `experts.gate_up_proj` [gate; up] (modeling_qwen3_moe.py:219, `.chunk(2)` in its forward), the form
    PEFT's lora_B of that parameter takes."""

    def __init__(self, inner: LayoutOp):
        self.inner = inner
        self.tp_dim, self.strides = inner.tp_dim, inner.strides
        self.check_attributes = inner.check_attributes

    def split(self, shard_shape: Shape, group: int) -> tuple[int, int | None]:
        return self.inner.split(shard_shape, group)

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        shapes = self.inner.hf_shapes(full_shape)
        return [(sum(s[0] for s in shapes), *shapes[0][1:])]

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        return tuple(hf_shapes[0])  # the inner ops here (GatedColumn) concatenate rows: the same full shape

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        full = full_shape_of_shard(shard_shape, self.tp_dim, count)
        starts, n = [], 0
        for s in self.inner.hf_shapes(full):
            starts.append(n)
            n += numel_of(s)
        return [replace(c, out=0, dst_offset=c.dst_offset + starts[c.out]) for c in self.inner.copies(shard_shape, count)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        parts, start = [], 0
        for s in self.inner.hf_shapes(full_shape):
            parts.append(take_range(hf[0], 0, start, start + s[0]))
            start += s[0]
        return self.inner.shard_from_hf(parts, index, count, full_shape)
