"""Layout ops: small pure functions between one Megatron tensor, held as its tensor-parallel shards, and
the HF tensor(s) it becomes.

Every op works on the TP shards in rank order (one shard when the tensor is not sharded), so gathers never
build an intermediate "full Megatron tensor". Each op is declared once, as data:

    copies(shard_shape, count)          the permutation as a few strided copies from the stacked shards (shard i
                                        at i * S elements, S the shard step) into the HF tensors; the engine
                                        compiles them once per plan and merges same-shaped runs into batched copies
    shard_from_hf(hf, index, count, full_shape) -> the shard `index` of `count`, reading only the slices it needs
    hf_shapes(full_shape)               the HF shapes, validating the Megatron shape against the config

and `to_hf(shards, outs)` (the pure function) executes `copies` directly.

`hf` items may be torch tensors or lazily read ones (hf_dir's `slice(name)`: anything with `[a:b]` / `[:, a:b]`
indexing and `get_shape()`), which is how loading reads only the bytes a rank's shard needs. Each op is the exact inverse of the other direction:
the round trip is a permutation, tested bit for bit for every shard count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..errors import ShapeMismatchError

Shape = tuple[int, ...]


def shape_of(x) -> Shape:
    """Shape of a torch tensor or of a lazily read one (hf_dir)."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x.get_shape())


def take_range(x, dim: int, start: int, stop: int) -> torch.Tensor:
    """x[start:stop] along `dim` (0 or 1), for tensors and lazily read ones alike."""
    if dim == 0:
        return x[start:stop]
    if dim == 1:
        return x[:, start:stop]
    raise ValueError(f"slicing along dim {dim} is not supported")


def materialized(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x[:]


S = "S"  # in a source stride: the step between consecutive shards (known when the shards are placed)


@dataclass(frozen=True)
class StridedCopy:
    """dst = out[c.out] viewed (sizes, dst_strides, dst_offset); src = stacked shards viewed (sizes, src_strides,
    src_offset + src_shards * S), all in elements; S in src_strides is the shard step."""

    out: int
    sizes: tuple[int, ...]
    dst_strides: tuple[int, ...]
    src_strides: tuple
    dst_offset: int = 0
    src_offset: int = 0
    src_shards: int = 0
    #: a constant added to the destination after the copy (ZeroCentered: the only op that changes values)
    add: float = 0.0

    def resolve(self, step: int) -> tuple[tuple[int, ...], int]:
        """(source strides, source offset) once the shard step is known."""
        return tuple(step if st == S else st for st in self.src_strides), self.src_offset + self.src_shards * step


def numel_of(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_dim(cond: bool, what: str, expected, actual) -> None:
    if not cond:
        raise ShapeMismatchError(f"{what}: expected {expected}, got {actual}")


class LayoutOp:
    """Base: a Megatron tensor <-> HF tensors. Subclasses set `tp_dim` and `n_out` and implement the three methods."""

    #: dim along which Megatron shards the tensor over TP ranks; None: every TP rank holds all of it.
    tp_dim: int | None = None
    #: values of Megatron's `partition_stride` attribute that mean this layout.
    strides: tuple[int, ...] = (1,)
    n_out: int = 1

    #: whether the parameter's TP attributes may be cross-checked against this op (see LatentDown)
    check_attributes: bool = True

    def checkpoint_parts(self) -> list[tuple[str, int]]:
        """(key suffix, rows) of the parts megatron-core saves the tensor as in torch_dist; [] when saved whole."""
        return []

    def split(self, shard_shape: Shape, group: int) -> tuple[int, int | None]:
        """(shard count, dim) of a tensor whose local shard has `shard_shape`, over a TP group of `group` ranks."""
        if group == 1 or self.tp_dim is None:
            return 1, None
        return group, self.tp_dim

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        raise NotImplementedError

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        """The inverse of `hf_shapes` (what the offline import needs): several outputs concatenate rows; Megatron's
        vocab padding is not in HF shapes (VocabRows gives the unpadded shape)."""
        if len(hf_shapes) == 1:
            return tuple(hf_shapes[0])
        return (sum(s[0] for s in hf_shapes), *hf_shapes[0][1:])

    def copies(self, shard_shape: Shape, count: int) -> list[StridedCopy]:
        raise NotImplementedError

    def to_hf(self, shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Write the HF tensors into `outs` (contiguous) from the shards: `copies` executed directly."""
        shard = shards[0]
        src = shard.contiguous() if len(shards) == 1 else torch.stack([s.contiguous() for s in shards])
        step = shard.numel()
        for c in self.copies(tuple(shard.shape), len(shards)):
            strides, offset = c.resolve(step)
            dst = outs[c.out].as_strided(c.sizes, c.dst_strides, outs[c.out].storage_offset() + c.dst_offset)
            dst.copy_(src.as_strided(c.sizes, strides, src.storage_offset() + offset))
            if c.add:
                dst.add_(c.add)

    def shard_from_hf(self, hf: Sequence, index: int, count: int, full_shape: Shape) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def from_dims(cls, dims) -> LayoutOp:
        """Build the op for a model's dimensions (`ModelDims`); ops without parameters ignore them."""
        return cls()

    # Convenience for tests and offline tools: allocate and return the HF tensors.
    def hf_tensors(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        full = full_shape_of(shards, self.tp_dim)
        outs = [torch.empty(s, dtype=shards[0].dtype, device=shards[0].device) for s in self.hf_shapes(full)]
        self.to_hf(shards, outs)
        return outs

    def shards_from_hf(self, hf: Sequence, count: int, full_shape: Shape) -> list[torch.Tensor]:
        return [self.shard_from_hf(hf, i, count, full_shape) for i in range(count)]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def full_shape_of(shards: Sequence[torch.Tensor], tp_dim: int | None) -> Shape:
    """Shape of the whole Megatron tensor that `shards` partition along `tp_dim`."""
    shape = list(shards[0].shape)
    if tp_dim is not None and len(shards) > 1:
        shape[tp_dim] *= len(shards)
    return tuple(shape)


class Replicated(LayoutOp):
    """Same tensor on every TP rank (norms, routers, biases of row-parallel layers): a plain copy."""

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        return [tuple(full_shape)]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        return [StridedCopy(0, (numel_of(shard_shape),), (1,), (1,))]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        return materialized(hf[0])


class Concat(LayoutOp):
    """Sharded along `tp_dim` and otherwise identical to HF: column- (dim 0) or row-parallel (dim 1) linears."""

    def __init__(self, tp_dim: int | None = None):
        if tp_dim is not None:
            self.tp_dim = tp_dim

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        return [tuple(full_shape)]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        n = numel_of(shard_shape)
        if count == 1:
            return [StridedCopy(0, (n,), (1,), (1,))]
        if self.tp_dim == 0:  # shard i is rows [i*r, (i+1)*r)
            return [StridedCopy(0, (count, n), (n, 1), (S, 1))]
        r, c = shard_shape  # dim 1: out[row, i*c + j] = shard_i[row, j]
        return [StridedCopy(0, (count, r, c), (c, count * c, 1), (S, c, 1))]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        n = full_shape[self.tp_dim] // count
        return take_range(hf[0], self.tp_dim, index * n, (index + 1) * n)


class Column(Concat):
    """Column-parallel linear (weight rows / bias split over TP)."""

    tp_dim = 0


class Row(Concat):
    """Row-parallel linear (weight columns split over TP)."""

    tp_dim = 1


class VocabRows(LayoutOp):
    """Vocab-parallel embedding / output layer: shards along rows, and Megatron pads the vocab.

    HF keeps the first `vocab_size` rows; loading fills the padding rows with zeros."""

    tp_dim = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    @classmethod
    def from_dims(cls, dims) -> VocabRows:
        return cls(dims.vocab_size)

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        check_dim(full_shape[0] >= self.vocab_size, "padded vocab rows >= HF vocab_size",
               f">= {self.vocab_size}", full_shape[0])
        return [(self.vocab_size, *full_shape[1:])]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        rows, rest = shard_shape[0], numel_of(shard_shape[1:])
        out = []
        for i in range(count):  # each shard's rows that are real vocabulary
            keep = min(rows, self.vocab_size - i * rows)
            if keep <= 0:
                break
            out.append(StridedCopy(0, (keep * rest,), (1,), (1,), dst_offset=i * rows * rest, src_shards=i))
        return out

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        rows = full_shape[0] // count
        start, stop = index * rows, (index + 1) * rows
        real = take_range(hf[0], 0, min(start, self.vocab_size), min(stop, self.vocab_size))
        if real.shape[0] == rows:
            return real
        pad = torch.zeros((rows - real.shape[0], *real.shape[1:]), dtype=real.dtype, device=real.device)
        return torch.cat([real, pad], dim=0)


class GatedColumn(LayoutOp):
    """GLU `linear_fc1`: the full tensor is [gate; up], and TP shard i holds [gate_i; up_i].

    Megatron marks this with partition_stride=2 (local spec, TE dense) or 1 (TE grouped experts); both mean
    this layout, so re-chunking the shards gives HF's separate gate_proj and up_proj."""

    tp_dim = 0
    strides = (1, 2)
    n_out = 2

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        check_dim(full_shape[0] % 2 == 0, "GLU linear_fc1 rows (gate + up) even", "an even count", full_shape[0])
        half = (full_shape[0] // 2, *full_shape[1:])
        return [half, half]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        block = shard_shape[0] // 2 * numel_of(shard_shape[1:])  # gate_i, then up_i, in each shard
        return [StridedCopy(j, (count, block), (block, 1), (S, 1), src_offset=j * block) for j in (0, 1)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        n = full_shape[0] // 2 // count
        return torch.cat([take_range(h, 0, index * n, (index + 1) * n) for h in hf], dim=0)


class QKV(LayoutOp):
    """Fused `linear_qkv` (weight or bias) -> q, k, v.

    Megatron interleaves per query group: [q_g (heads_per_group * d); k_g (d); v_g (d)] for each group g, and
    TP splits whole groups, so each shard is the same interleave over its own groups.

    `fused=True`: one HF tensor [q; k; v] (the three outputs concatenated by rows): the Qwen3-VL vision tower's
    `attn.qkv` (transformers 5.24 modeling_qwen3_vl.py Qwen3VLVisionAttention: `qkv(x).reshape(seq, 3, heads,
    -1)`), whose Megatron `linear_qkv` is the per-head [q_h; k_h; v_h] interleave (groups == heads; Megatron-Bridge
    0.6.2 qwen3_vl_bridge.py maps it with ConcatenatedQKVMapping)."""

    tp_dim = 0
    n_out = 3

    def __init__(self, num_heads: int, num_groups: int, head_dim: int, fused: bool = False):
        if num_heads % num_groups:
            raise ShapeMismatchError(f"num_attention_heads {num_heads} is not a multiple of num_query_groups {num_groups}")
        self.num_heads, self.num_groups, self.head_dim = num_heads, num_groups, head_dim
        self.fused = fused
        if fused:
            self.n_out = 1

    @classmethod
    def from_dims(cls, dims) -> QKV:
        return cls(dims.num_attention_heads, dims.num_query_groups, dims.head_dim)

    @property
    def _hpg(self) -> int:
        return self.num_heads // self.num_groups

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        g, d, hpg = self.num_groups, self.head_dim, self._hpg
        check_dim(full_shape[0] == g * (hpg + 2) * d,
               f"linear_qkv rows = groups*(heads_per_group+2)*head_dim ({g}*({hpg}+2)*{d})",
               g * (hpg + 2) * d, full_shape[0])
        rest = tuple(full_shape[1:])
        if self.fused:
            return [tuple(full_shape)]
        return [(self.num_heads * d, *rest), (g * d, *rest), (g * d, *rest)]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        hpg = self._hpg
        d = self.head_dim * numel_of(shard_shape[1:])  # one head's elements
        gl = shard_shape[0] // ((hpg + 2) * self.head_dim)  # query groups per shard
        block = (hpg + 2) * d  # one group: [q heads; k; v]
        spans = [(0, hpg * d), (hpg * d, d), ((hpg + 1) * d, d)]
        # fused: q, k and v are row blocks of output 0, at q's and q + k's elements
        starts = [0, self.num_groups * hpg * d, self.num_groups * (hpg + 1) * d] if self.fused else [0, 0, 0]
        return [StridedCopy(0 if self.fused else j, (count, gl, n), (gl * n, n, 1), (S, block, 1),
                            dst_offset=starts[j], src_offset=start)
                for j, (start, n) in enumerate(spans)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        d, hpg = self.head_dim, self._hpg
        gl = self.num_groups // count
        g0, g1 = index * gl, (index + 1) * gl
        # fused: k and v start after all of q's (and k's) rows of the one HF tensor
        (qh, q0), (kh, k0), (vh, v0) = ([(hf[0], 0), (hf[0], self.num_heads * d),
                                         (hf[0], (self.num_heads + self.num_groups) * d)] if self.fused
                                        else [(h, 0) for h in hf])
        q = take_range(qh, 0, q0 + g0 * hpg * d, q0 + g1 * hpg * d)
        k = take_range(kh, 0, k0 + g0 * d, k0 + g1 * d)
        v = take_range(vh, 0, v0 + g0 * d, v0 + g1 * d)
        rest = tuple(q.shape[1:])
        parts = [q.reshape(gl, hpg * d, *rest), k.reshape(gl, d, *rest), v.reshape(gl, d, *rest)]
        return torch.cat(parts, dim=1).reshape(gl * (hpg + 2) * d, *rest)



class WholeOrSplit(Concat):
    """A linear whose Megatron module is split over TP along `tp_dim` in one model and whole on every TP rank in
    another, under the same name; the shard itself says which (`size` rows or columns: whole, else split), as
    Megatron decides for MLA's down projections (it compares the output width with the latent rank).

    MLA down projections (`LatentDown`); the Qwen3-VL patch merger's `linear_fc1` / `linear_fc2`: column- and
    row-parallel in a native Megatron tower (Megatron-Bridge 0.6.2 modelling_qwen3_vl/utils.py:140-167), whole in
    transformers' tower embedded in the Megatron model (Bridge 0.3.1), both named `vision_model.merger.*`."""

    check_attributes = False

    def __init__(self, size: int, tp_dim: int = 0):
        self.size, self.tp_dim = size, tp_dim

    def split(self, shard_shape: Shape, group: int) -> tuple[int, int | None]:
        if group == 1 or shard_shape[self.tp_dim] == self.size:
            return 1, None
        check_dim(shard_shape[self.tp_dim] * group == self.size, f"dim {self.tp_dim} of {self.size} split over "
               f"{group} TP ranks", self.size // group, shard_shape[self.tp_dim])
        return group, self.tp_dim

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        check_dim(full_shape[self.tp_dim] == self.size, f"dim {self.tp_dim} size", self.size, full_shape[self.tp_dim])
        return [tuple(full_shape)]


class LatentDown(WholeOrSplit):
    """MLA down projections (`linear_q_down_proj`, `linear_kv_down_proj`) -> q_a_proj / kv_a_proj_with_mqa.

    The local spec builds them column-parallel (split over TP), TE's spec duplicated on every rank, and TE marks
    even its duplicated weights `tensor_model_parallel=True`. Like Megatron itself (which compares the output
    width with the latent rank), this op decides from the shard's rows: all `rows` -> replicated, else split."""

    def __init__(self, rows: int):
        super().__init__(rows, 0)

    @property
    def rows(self) -> int:
        return self.size

    @classmethod
    def q_down(cls, dims) -> LatentDown:
        return cls(dims.q_lora_rank)

    @classmethod
    def kv_down(cls, dims) -> LatentDown:
        return cls(dims.kv_lora_rank + dims.qk_rope_head_dim)


class IndexerRope(LayoutOp):
    """DeepSeek sparse attention's indexer (`linear_wq_b`, `linear_wk`, `k_norm` weight and bias) -> HF
    `indexer.{wq_b, wk, k_norm}`: replicated on every TP rank (megatron-core builds the indexer's linears with
    parallel_mode="duplicated"), rows in blocks of `head_dim` (one per indexer head; wk and k_norm: one block).

    HF (transformers 5.24 modeling_deepseek_v32.py / modeling_glm_moe_dsa.py `Indexer.forward`) puts each head's
    `rope_dim` rotary rows first; megatron-core 0.16-0.18 (transformer/experimental_attention_variant/dsa.py
    `DSAIndexer._apply_rope`: `x_nope, x_pe = torch.split(...)`) puts them last and always applies MLA's
    interleaved rope to them (rope_utils.py `_apply_rotary_pos_emb_bshd(multi_latent_attention=True)` reads the
    pairs (0, 1), (2, 3), ...). So per block Megatron rows are [pass; rope'], HF rows [rope; pass], where rope' =
    rope for an interleaved-rope model (GLM-5) and, with `interleave`, rope' = the HF rope rows' two halves
    interleaved (DeepSeek-V3.2, whose HF indexer applies non-interleaved half-split rope): Megatron's
    de-interleave then gives exactly HF's half-split input. megatron-core 0.19 splits [pe, nope] as HF does, with
    `dsa_indexer_rope_interleaved` choosing the rope: no op there (Replicated)."""

    def __init__(self, head_dim: int, rope_dim: int, interleave: bool):
        if rope_dim > head_dim or (interleave and rope_dim % 2):
            raise ShapeMismatchError(f"indexer rope dims {rope_dim} within head_dim {head_dim} (even to interleave)")
        self.head_dim, self.rope_dim, self.interleave = head_dim, rope_dim, interleave

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        check_dim(full_shape[0] % self.head_dim == 0, "indexer rows: whole heads of index_head_dim", self.head_dim,
               full_shape[0])
        return [tuple(full_shape)]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        d, r = self.head_dim, self.rope_dim
        c = numel_of(shard_shape[1:])  # elements per row
        nb = shard_shape[0] // d
        out = [StridedCopy(0, (nb, (d - r) * c), (d * c, 1), (d * c, 1), dst_offset=r * c)]  # pass rows
        if not self.interleave:
            out.append(StridedCopy(0, (nb, r * c), (d * c, 1), (d * c, 1), src_offset=(d - r) * c))
        else:  # HF rope row i <- Megatron rope row 2i, HF row r/2 + i <- Megatron rope row 2i + 1
            out.append(StridedCopy(0, (nb, 2, r // 2, c), (d * c, r // 2 * c, c, 1), (d * c, c, 2 * c, 1),
                                   src_offset=(d - r) * c))
        return out

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        x = materialized(hf[0])
        d, r, rest = self.head_dim, self.rope_dim, tuple(x.shape[1:])
        x = x.reshape(-1, d, *rest)
        rope, rest_rows = x[:, :r], x[:, r:]
        if self.interleave:  # Megatron rope row 2i = HF row i, 2i + 1 = HF row r/2 + i
            rope = torch.stack([rope[:, :r // 2], rope[:, r // 2:]], dim=2).reshape(rope.shape)
        return torch.cat([rest_rows, rope], dim=1).reshape(tuple(full_shape)).contiguous()


class GatedInterleaved(LayoutOp):
    """GLU `linear_fc1` of an expert -> gpt-oss's `gate_up_proj` slice: gate and up interleaved by column
    (gate = x[..., ::2], up = x[..., 1::2]; transformers 5.23 models/gpt_oss/modeling_gpt_oss.py, _apply_gate),
    and for the weight transposed to [hidden, 2 * ffn] (HF multiplies `x @ gate_up_proj[e]`).

    Megatron's fc1 is [gate; up] ([2 * ffn, hidden], or [2 * ffn] for the bias); expert-TP shard i holds
    [gate_i; up_i], which become columns 2 * (i * f + r) + {0, 1} of the HF tensor."""

    tp_dim = 0
    strides = (1, 2)

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        check_dim(full_shape[0] % 2 == 0, "GLU linear_fc1 rows (gate + up) even", "an even count", full_shape[0])
        return [tuple(reversed(full_shape))]

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        return tuple(reversed(hf_shapes[0]))

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        f = shard_shape[0] // 2  # gate (and up) rows per shard
        if len(shard_shape) == 1:  # bias: out[2 * (i * f + r) + j] = shard_i[j * f + r]
            return [StridedCopy(0, (count, f), (2 * f, 2), (S, 1), dst_offset=j, src_offset=j * f) for j in (0, 1)]
        h = shard_shape[1]  # weight: out[c, 2 * (i * f + r) + j] = shard_i[j * f + r, c]
        cols = 2 * f * count
        return [StridedCopy(0, (count, f, h), (2 * f, 2, cols), (S, h, 1), dst_offset=j, src_offset=j * f * h)
                for j in (0, 1)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        f = full_shape[0] // 2 // count
        dim = len(full_shape) - 1  # the interleaved dim of the HF tensor
        part = take_range(hf[0], dim, 2 * index * f, 2 * (index + 1) * f)  # [.., 2f]: gate_i / up_i interleaved
        gate, up = (part[..., j::2] for j in (0, 1))
        return torch.cat([gate.t(), up.t()] if dim else [gate, up], dim=0).contiguous()


class GatedTransposed(LayoutOp):
    """GLU `linear_fc1` of an expert -> Qwen3-VL-MoE's `gate_up_proj` slice [hidden, 2 * ffn]: [gate | up] by
    column, i.e. Megatron's [gate; up] transposed (the published checkpoints' layout, transformers 4.57
    Qwen3VLMoeTextExperts `gate_up_proj` [E, hidden, 2 * expert_dim], `gate, up = (x @ gate_up_proj).chunk(2)`;
    transformers 5.24 transposes it on load, conversion_mapping.py "qwen3_vl_moe").

    Expert-TP shard i holds [gate_i; up_i] ([2f, hidden]): out[c, j * F + i * f + r] = shard_i[j * f + r, c],
    F = f * count, j = 0 (gate) or 1 (up)."""

    tp_dim = 0
    strides = (1, 2)

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        check_dim(len(full_shape) == 2 and full_shape[0] % 2 == 0, "GLU linear_fc1 weight [gate + up, hidden]",
               "2-D with even rows", list(full_shape))
        return [tuple(reversed(full_shape))]

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        return tuple(reversed(hf_shapes[0]))

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        f, h = shard_shape[0] // 2, shard_shape[1]
        cols = 2 * f * count
        return [StridedCopy(0, (count, f, h), (f, 1, cols), (S, h, 1), dst_offset=j * f * count, src_offset=j * f * h)
                for j in (0, 1)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        big = full_shape[0] // 2  # gate (and up) columns of the HF tensor
        f = big // count
        gate = take_range(hf[0], 1, index * f, (index + 1) * f)
        up = take_range(hf[0], 1, big + index * f, big + (index + 1) * f)
        return torch.cat([gate.t(), up.t()], dim=0).contiguous()


class RowTransposed(LayoutOp):
    """Row-parallel `linear_fc2` of an expert ([hidden, ffn], shards [hidden, ffn / n]) -> gpt-oss's
    `down_proj` slice [ffn, hidden] (HF multiplies `x @ down_proj[e]`)."""

    tp_dim = 1

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        return [tuple(reversed(full_shape))]

    def full_shape(self, hf_shapes: list[Shape]) -> Shape:
        return tuple(reversed(hf_shapes[0]))

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        h, c = shard_shape  # out[i * c + r, k] = shard_i[k, r]
        return [StridedCopy(0, (count, c, h), (c * h, h, 1), (S, 1, c))]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        c = full_shape[1] // count
        return take_range(hf[0], 0, index * c, (index + 1) * c).t().contiguous()


def full_shape_of_shard(shard_shape: Shape, tp_dim: int | None, count: int) -> Shape:
    shape = list(shard_shape)
    if tp_dim is not None and count > 1:
        shape[tp_dim] *= count
    return tuple(shape)


class ZeroCentered(Replicated):
    """A norm Megatron stores zero-centred (gamma = 1 + w, `layernorm_zero_centered_gamma`) whose HF module stores
    gamma itself: w_hf = w + 1 (Qwen3-Next's `linear_attn.norm`, transformers 5.23 Qwen3NextRMSNormGated).

    The only op that changes values. w + 1 is rounded in the tensor's dtype; loading computes w_hf - 1, exact
    (Sterbenz) for 0.5 <= w_hf <= 2, so HF -> Megatron -> HF is bit-exact there; Megatron -> HF -> Megatron loses
    the bits of w below the precision of w + 1 (fp32: |w| < 2^-24 vanishes, bf16: below 2^-8)."""

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        return [replace(c, add=1.0) for c in super().copies(shard_shape, count)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        return materialized(hf[0]) - 1
