"""The block-FP8 quantizer as one fused CUDA kernel (Triton): per 128x128 block, amax, scale, cast, written straight
into the caller's output views; bit-identical to `quantize.per_block_cast_to_fp8` (DeepGEMM's reference).

Each program quantizes one block of one matrix of a stack [K, M, N] read through any strides (a view of a bucket,
an arena or a parameter) and writes the fp8 block and its scale where the caller says (views of the output bucket),
so an FP8 export writes its bytes once. The arithmetic is the reference's step for step, in fp32: block amax of
|x| (partial edge blocks: the zero padding never raises a max) clamped at 1e-4; sf = amax / 448 as an IEEE
division (`div_rn`: the reference divides by a 0-dim tensor, `quantize._true_div`); UE8M0: the exponent bits + 1
when the mantissa is non-zero, clamped to [1, 254]; q = x * (1 / sf) (IEEE reciprocal, then an fp32 product) cast
to float8_e4m3fn with round-to-nearest-even and saturation at 448, as PyTorch's conversion does.

Only imported where CUDA and Triton exist (torch's CUDA builds ship Triton); the torch reference stays the CPU path
and the oracle (bench/export_speed.py checks every quantized tensor of a model against it)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _quantize_block(x_ptr, q_ptr, s_ptr, bm, bn, M, N, sx_m, sx_n, sq_m, sq_n, ss_m, ss_n,
                    UE8M0: tl.constexpr, BLOCK: tl.constexpr):
    """Block (bm, bn) of one matrix: x read at x_ptr + row * sx_m + col * sx_n, fp8 and scale written likewise."""
    rows = bm * BLOCK + tl.arange(0, BLOCK)
    cols = bn * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x_off = rows[:, None].to(tl.int64) * sx_m + cols[None, :].to(tl.int64) * sx_n
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-4)
    sf = tl.math.div_rn(amax, 448.0)
    if UE8M0:
        bits = sf.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        exp = tl.minimum(tl.maximum(exp, 1), 254)
        sf = (exp << 23).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(1.0, sf)
    q = (x * inv).to(tl.float8e4nv)
    q_off = rows[:, None].to(tl.int64) * sq_m + cols[None, :].to(tl.int64) * sq_n
    tl.store(q_ptr + q_off, q, mask=mask)
    tl.store(s_ptr + bm * ss_m + bn * ss_n, sf)


@triton.jit
def _block_fp8_kernel(x_ptr, q_ptr, s_ptr, M, N, nb_m, nb_n,
                      sx_k, sx_m, sx_n, sq_k, sq_m, sq_n, ss_k, ss_m, ss_n,
                      UE8M0: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    k = pid // (nb_m * nb_n)
    rest = pid % (nb_m * nb_n)
    k64 = k.to(tl.int64)
    _quantize_block(x_ptr + k64 * sx_k, q_ptr + k64 * sq_k, s_ptr + k64 * ss_k, rest // nb_n, rest % nb_n, M, N,
                    sx_m, sx_n, sq_m, sq_n, ss_m, ss_n, UE8M0, BLOCK)


@triton.jit
def _block_fp8_table_kernel(x_ptr, q_ptr, s_ptr, x_offs, q_offs, s_offs, M, N, nb_m, nb_n,
                            sx_m, sx_n, sq_m, sq_n, ss_m, ss_n, UE8M0: tl.constexpr, BLOCK: tl.constexpr,
                            X_AL: tl.constexpr, Q_AL: tl.constexpr):
    """Matrix k at element offsets x_offs[k], q_offs[k], s_offs[k] from the first one's pointers (any addresses:
    parameters allocated apart, outputs anywhere in a bucket). X_AL / Q_AL: elements every offset is a multiple
    of (up to 16 bytes), so the loads and stores stay vectorized."""
    pid = tl.program_id(0)
    k = pid // (nb_m * nb_n)
    rest = pid % (nb_m * nb_n)
    xo = tl.multiple_of(tl.load(x_offs + k), X_AL)
    qo = tl.multiple_of(tl.load(q_offs + k), Q_AL)
    _quantize_block(x_ptr + xo, q_ptr + qo, s_ptr + tl.load(s_offs + k),
                    rest // nb_n, rest % nb_n, M, N, sx_m, sx_n, sq_m, sq_n, ss_m, ss_n, UE8M0, BLOCK)


def block_cast_to_fp8_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, ue8m0: bool) -> None:
    """Quantize `x` ([M, N] or a stack [K, M, N], bf16/fp16/fp32, any strides) into `q` (float8_e4m3fn, the same
    shape, any strides) and `scale` (float32 [ceil(M/128), ceil(N/128)] or [K, ...]): one kernel launch."""
    if x.dim() == 2:
        x, q, scale = x.unsqueeze(0), q.unsqueeze(0), scale.unsqueeze(0)
    k, m, n = x.shape
    nb_m, nb_n = triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK)
    if tuple(q.shape) != (k, m, n) or tuple(scale.shape) != (k, nb_m, nb_n) or q.dtype != torch.float8_e4m3fn \
            or scale.dtype != torch.float32:
        raise ValueError(f"block FP8 into: expected q float8_e4m3fn {[k, m, n]} and scale float32 {[k, nb_m, nb_n]}, "
                         f"got {q.dtype} {list(q.shape)} and {scale.dtype} {list(scale.shape)}")
    if k * nb_m * nb_n == 0:
        return
    _block_fp8_kernel[(k * nb_m * nb_n,)](x, q, scale, m, n, nb_m, nb_n, *x.stride(), *q.stride(), *scale.stride(),
                                          UE8M0=ue8m0, BLOCK=BLOCK, num_warps=8)


class Table:
    """Many same-shaped 2-D weights quantized into their outputs by one launch (`_block_fp8_table_kernel`): the
    element offsets of every weight, fp8 output and scale from the first one's, on the device, made once. `run`
    is one launch (and is captured in a CUDA graph as one)."""

    def __init__(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        x0, q0, s0 = items[0]
        m, n = x0.shape
        for x, q, s in items:
            if tuple(x.shape) != (m, n) or tuple(q.shape) != (m, n) or x.stride() != x0.stride() \
                    or q.stride() != q0.stride() or s.stride() != s0.stride() or x.dtype != x0.dtype \
                    or q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
                raise ValueError("block FP8 table: expected weights of one shape, dtype and strides with float8_e4m3fn "
                                 "outputs and float32 scales")

        def offs(ts: list[torch.Tensor]) -> torch.Tensor:
            isz, base = ts[0].element_size(), ts[0].data_ptr()
            return torch.tensor([(t.data_ptr() - base) // isz for t in ts], dtype=torch.int64).to(x0.device)

        def align(ts: list[torch.Tensor]) -> int:
            """Elements every offset from the first is a multiple of, at most 16 bytes' worth."""
            isz, base = ts[0].element_size(), ts[0].data_ptr()
            g = 16
            for t in ts:
                g = math.gcd(g, t.data_ptr() - base)
            return max(1, g // isz)

        self.first = (x0, q0, s0)
        self.offs = [offs([it[j] for it in items]) for j in range(3)]
        self.align = (align([it[0] for it in items]), align([it[1] for it in items]))
        self.m, self.n, self.k = m, n, len(items)
        self.nb_m, self.nb_n = triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK)

    def run(self, ue8m0: bool) -> None:
        x0, q0, s0 = self.first
        _block_fp8_table_kernel[(self.k * self.nb_m * self.nb_n,)](
            x0, q0, s0, *self.offs, self.m, self.n, self.nb_m, self.nb_n, *x0.stride(), *q0.stride(), *s0.stride(),
            UE8M0=ue8m0, BLOCK=BLOCK, X_AL=self.align[0], Q_AL=self.align[1], num_warps=8)


def block_cast_to_fp8(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv) of a 2-D weight or a stack [K, M, N], new tensors on x's device."""
    shape = tuple(x.shape)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((*shape[:-2], triton.cdiv(shape[-2], BLOCK), triton.cdiv(shape[-1], BLOCK)), dtype=torch.float32,
                    device=x.device)
    block_cast_to_fp8_into(x, q, s, ue8m0)
    return q, s
