"""Layout ops of gated attention and the gated DeltaNet (Qwen3-Next, Qwen3.5): `GatedQKV` (per query group
[q; gate; k; v] -> `q_proj` [q_h; gate_h] per head, `k_proj`, `v_proj`), `GDNInProj` (the DeltaNet `in_proj` ->
`in_proj_qkvz` / `in_proj_ba` grouped by key head) and `ColumnParts` (a column-parallel tensor whose parts are split
over TP one by one). The op machinery and the common ops are in `layouts`."""

from __future__ import annotations

import torch

from ..errors import ShapeMismatchError
from .ops import QKV, LayoutOp, S, Shape, StridedCopy, check_dim, numel_of, take_range

#: megatron-core 0.16.1 gated_delta_net.py sharded_state_dict: in_proj saved as these parts (conv1d: the first
#: three), each a whole component, in Megatron's TP-1 order
GDN_PARTS = ("query", "key", "value", "z", "beta", "alpha")


class GatedQKV(QKV):
    """`linear_qkv` of gated attention (`attention_output_gate`) -> q_proj (query and gate), k_proj, v_proj.

    Megatron packs each query group as [q (hpg heads); gate (hpg heads); k; v] (megatron-core 0.16.1
    transformer/attention.py get_query_key_value_tensors, output_gate); HF's q_proj holds [q_h; gate_h] per head
    (transformers 5.23 modeling_qwen3_next.py Qwen3NextAttention: view(..., heads, 2 * head_dim).chunk(2)).
    TP splits whole groups."""

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        g, d, hpg = self.num_groups, self.head_dim, self._hpg
        check_dim(full_shape[0] == g * (2 * hpg + 2) * d,
               f"gated linear_qkv rows = groups*(2*heads_per_group+2)*head_dim ({g}*(2*{hpg}+2)*{d})",
               g * (2 * hpg + 2) * d, full_shape[0])
        rest = tuple(full_shape[1:])
        return [(2 * self.num_heads * d, *rest), (g * d, *rest), (g * d, *rest)]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        hpg = self._hpg
        d = self.head_dim * numel_of(shard_shape[1:])  # one head's elements
        gl = shard_shape[0] // ((2 * hpg + 2) * self.head_dim)  # query groups per shard
        block = (2 * hpg + 2) * d
        q = [StridedCopy(0, (count, gl, hpg, d), (gl * hpg * 2 * d, hpg * 2 * d, 2 * d, 1), (S, block, d, 1),
                         dst_offset=j * d, src_offset=j * hpg * d) for j in (0, 1)]  # query, then gate
        return q + [StridedCopy(j, (count, gl, d), (gl * d, d, 1), (S, block, 1), src_offset=(2 * hpg + j - 1) * d)
                    for j in (1, 2)]

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        d, hpg = self.head_dim, self._hpg
        gl = self.num_groups // count
        g0, g1 = index * gl, (index + 1) * gl
        qg = take_range(hf[0], 0, g0 * hpg * 2 * d, g1 * hpg * 2 * d)
        rest = tuple(qg.shape[1:])
        qg = qg.reshape(gl, hpg, 2, d, *rest)
        parts = [qg[:, :, 0].reshape(gl, hpg * d, *rest), qg[:, :, 1].reshape(gl, hpg * d, *rest),
                 take_range(hf[1], 0, g0 * d, g1 * d).reshape(gl, d, *rest),
                 take_range(hf[2], 0, g0 * d, g1 * d).reshape(gl, d, *rest)]
        return torch.cat(parts, dim=1).reshape(gl * (2 * hpg + 2) * d, *rest)


class GDNInProj(LayoutOp):
    """Gated DeltaNet `in_proj` -> HF `in_proj_qkvz` and `in_proj_ba`.

    Megatron (megatron-core 0.16.1 ssm/gated_delta_net.py): TP shard i is [q_i; k_i; v_i; z_i; b_i; a_i], each
    component's rows of the shard's key heads (q, k: nk/tp heads of dk) and value heads (v, z: nv/tp heads of dv;
    b, a: one row per value head). HF (transformers 5.23 modeling_qwen3_next.py fix_query_key_value_ordering)
    groups by key head: in_proj_qkvz is [q_h (dk); k_h (dk); v_h (r*dv); z_h (r*dv)] per key head h, in_proj_ba
    [b_h (r); a_h (r)], r = nv / nk value heads per key head (Megatron's repeat_interleave pairs the same)."""

    tp_dim = 0
    n_out = 2

    def __init__(self, num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int):
        if num_value_heads % num_key_heads:
            raise ShapeMismatchError(f"linear_num_value_heads {num_value_heads} is not a multiple of "
                                     f"linear_num_key_heads {num_key_heads}")
        self.nk, self.nv, self.dk, self.dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim

    @classmethod
    def from_dims(cls, dims) -> GDNInProj:
        return cls(dims.linear_num_key_heads, dims.linear_num_value_heads, dims.linear_key_head_dim,
                   dims.linear_value_head_dim)

    @property
    def _r(self) -> int:
        return self.nv // self.nk

    def checkpoint_parts(self) -> list[tuple[str, int]]:
        """(key suffix, rows) of the parts megatron-core saves it as (gated_delta_net.py sharded_state_dict,
        `_split_tensor_factory`): each a whole component, rows in Megatron's TP-1 order."""
        qk, vz = self.nk * self.dk, self.nv * self.dv
        return list(zip(GDN_PARTS, (qk, qk, vz, vz, self.nv, self.nv)))

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        qkvz = 2 * self.nk * self.dk + 2 * self.nv * self.dv
        check_dim(full_shape[0] == qkvz + 2 * self.nv,
               f"GDN in_proj rows = 2*nk*dk + 2*nv*dv + 2*nv (2*{self.nk}*{self.dk} + 2*{self.nv}*{self.dv} + "
               f"2*{self.nv})", qkvz + 2 * self.nv, full_shape[0])
        rest = tuple(full_shape[1:])
        return [(qkvz, *rest), (2 * self.nv, *rest)]

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        c, r, dk, dv = numel_of(shard_shape[1:]), self._r, self.dk, self.dv
        nk, nv = self.nk // count, self.nv // count  # key / value heads per shard
        w, wb = (2 * dk + 2 * r * dv) * c, 2 * r * c  # one key head's elements in qkvz / ba
        qk, vz = (nk, dk * c), (nk, r * dv * c)
        out = []
        # (output, per-key-head size, destination offset in the head, source offset in the shard)
        for o, (heads, n), dst, src in (
                (0, qk, 0, 0), (0, qk, dk * c, nk * dk * c),
                (0, vz, 2 * dk * c, 2 * nk * dk * c), (0, vz, (2 * dk + r * dv) * c, (2 * nk * dk + nv * dv) * c),
                (1, (nk, r * c), 0, 2 * (nk * dk + nv * dv) * c), (1, (nk, r * c), r * c, (2 * nk * dk + 2 * nv * dv + nv) * c)):
            step = w if o == 0 else wb
            out.append(StridedCopy(o, (count, heads, n), (heads * step, step, 1), (S, n, 1), dst_offset=dst,
                                   src_offset=src))
        return out

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        r, dk, dv = self._r, self.dk, self.dv
        nk = self.nk // count
        hw = 2 * dk + 2 * r * dv
        qkvz = take_range(hf[0], 0, index * nk * hw, (index + 1) * nk * hw)
        rest = tuple(qkvz.shape[1:])
        qkvz = qkvz.reshape(nk, hw, *rest)
        ba = take_range(hf[1], 0, index * nk * 2 * r, (index + 1) * nk * 2 * r).reshape(nk, 2 * r, *rest)
        cuts = [(qkvz, 0, dk), (qkvz, dk, 2 * dk), (qkvz, 2 * dk, 2 * dk + r * dv), (qkvz, 2 * dk + r * dv, hw),
                (ba, 0, r), (ba, r, 2 * r)]
        return torch.cat([t[:, a:b].reshape(-1, *rest) for t, a, b in cuts], dim=0)


class ColumnParts(LayoutOp):
    """A column-parallel tensor made of parts (full row counts `parts`), each split over TP on its own: shard i is
    [part_0 rows of shard i; part_1 rows of shard i; ...]. HF output j holds the next `groups[j]` parts, whole
    (default: one output [part_0; part_1; ...]). Gated DeltaNet (megatron-core 0.16.1 gated_delta_net.py): the
    depthwise conv1d over [q; k; v] (its sharded_state_dict splits it the same way; HF `linear_attn.conv1d`),
    and Qwen3.5's in_proj: the local output split as [q, k, v, z, b, a] is HF's in_proj_qkv = [q; k; v],
    in_proj_z, in_proj_b, in_proj_a (transformers 5.23 modeling_qwen3_5.py Qwen3_5GatedDeltaNet)."""

    tp_dim = 0

    def __init__(self, parts: tuple[int, ...], names: tuple[str, ...] = (), groups: tuple[int, ...] | None = None):
        self.parts, self.names = tuple(parts), tuple(names)
        self.groups = (len(self.parts),) if groups is None else tuple(groups)
        if sum(self.groups) != len(self.parts) or min(self.groups, default=0) < 1:
            raise ShapeMismatchError(f"part groups {list(self.groups)}: expected positive counts summing to "
                                     f"{len(self.parts)} (the parts {list(self.parts)})")
        self.n_out = len(self.groups)
        self._place = []  # per part: (output, first row in that output)
        first = 0
        for out, n in enumerate(self.groups):
            row = 0
            for rows in self.parts[first:first + n]:
                self._place.append((out, row))
                row += rows
            first += n

    @classmethod
    def gdn_conv(cls, dims) -> ColumnParts:
        qk = dims.linear_num_key_heads * dims.linear_key_head_dim
        return cls((qk, qk, dims.linear_num_value_heads * dims.linear_value_head_dim), names=GDN_PARTS[:3])

    def checkpoint_parts(self) -> list[tuple[str, int]]:
        """(key suffix, rows) of the parts megatron-core saves (conv1d: query, key, value); none without names."""
        return list(zip(self.names, self.parts))

    @classmethod
    def gdn_in_proj(cls, dims) -> ColumnParts:
        """Qwen3.5's separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a."""
        qk = dims.linear_num_key_heads * dims.linear_key_head_dim
        v, nv = dims.linear_num_value_heads * dims.linear_value_head_dim, dims.linear_num_value_heads
        # megatron-core saves in_proj under these part keys, as GDNInProj.checkpoint_parts
        return cls((qk, qk, v, v, nv, nv), GDN_PARTS, groups=(3, 1, 1, 1))

    def hf_shapes(self, full_shape: Shape) -> list[Shape]:
        check_dim(full_shape[0] == sum(self.parts), f"rows of parts {self.parts}", sum(self.parts), full_shape[0])
        rest, out, first = tuple(full_shape[1:]), [], 0
        for n in self.groups:
            out.append((sum(self.parts[first:first + n]), *rest))
            first += n
        return out

    def copies(self, shard_shape, count) -> list[StridedCopy]:
        c = numel_of(shard_shape[1:])
        out, src = [], 0
        for rows, (o, row) in zip(self.parts, self._place, strict=True):
            n = rows // count * c
            out.append(StridedCopy(o, (count, n), (n, 1), (S, 1), dst_offset=row * c, src_offset=src))
            src += n
        return out

    def shard_from_hf(self, hf, index, count, full_shape) -> torch.Tensor:
        pieces = []
        for rows, (o, row) in zip(self.parts, self._place, strict=True):
            n = rows // count
            pieces.append(take_range(hf[o], 0, row + index * n, row + (index + 1) * n))
        return torch.cat(pieces, dim=0)
