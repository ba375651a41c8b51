"""FP8 block quantization in the format of the published block-FP8 checkpoints (DeepSeek-V3, Qwen3-*-FP8;
GLM-4.5-FP8 is per-channel compressed-tensors: only its choice of unquantized tensors is followed).

A quantized linear weight `X.weight` [out, in] becomes `X.weight` float8_e4m3fn [out, in] plus
`X.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)]; dequantized value = fp8 * scale_inv per 128x128
block, edge blocks partial (DeepSeek-V3 README_WEIGHTS.md, "FP8 Weight Documentation": blocks not aligned to 128
are zero-padded to 128 before the scale is computed, float32 scales, `quantization_config` = {activation_scheme:
dynamic, fmt: e4m3, quant_method: fp8, weight_block_size: [128, 128]}).

The arithmetic is DeepGEMM's reference quantizer, bit for bit: `per_block_cast_to_fp8` and `ceil_to_ue8m0` in
deep_gemm/utils/math.py of deepseek-ai/DeepGEMM at commit 54e22612409371d6364144b69086735beb54e98b (2026-06-23),
the same file as in the PyPI wheel sgl-deep-gemm 0.2.5 (the tests' oracle). SGLang 0.5.23 carries a UE8M0-only copy
(sglang/srt/layers/quantization/fp8_utils.py, same bit arithmetic); its sglang/benchmark/deepseek_utils.py copy
scales by 448 / amax, which is not equivalent (0.06% of the bytes of a random 2048x2048 bf16 weight differ).
Which tensors a given architecture keeps unquantized is not decided here: each converter carries an `FP8Policy`
table (converters/common.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import regex
import torch

from ..layouts.ops import LayoutOp, StridedCopy
from .scheme import register

BLOCK = 128  # weight_block_size of every published block-FP8 checkpoint
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """Shape of the weight_scale_inv of a weight of `shape` [out, in]."""
    out, inp = shape
    return ceil_div(out, BLOCK), ceil_div(inp, BLOCK)


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= |x| (fp32 bit arithmetic: exponent + 1 when the mantissa is non-zero,
    exponent clamped to [1, 254]). DeepGEMM 54e2261 deep_gemm/utils/math.py `ceil_to_ue8m0`; older DeepGEMM and
    SGLang's copies use pow(2, ceil(log2(x))), which rounds differently where log2 is inexact."""
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def _cuda_kernel(x: torch.Tensor):
    """The fused CUDA quantizer (quantize_cuda) for a CUDA tensor, or None: CPU tensors, no Triton, or
    MCORE2HF_FP8_KERNEL=torch (the reference path, e.g. to compare)."""
    import os

    if not x.is_cuda or os.environ.get("MCORE2HF_FP8_KERNEL") == "torch":
        return None
    try:
        from . import fp8_cuda as quantize_cuda
    except ImportError:
        return None
    return quantize_cuda


def _true_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor rounded as IEEE division on every device: PyTorch's CUDA kernel turns division by a Python
    scalar into multiplication by its reciprocal (one ulp off for amax / 448, measured on an H200), a 0-dim tensor
    divisor keeps the true division that DeepGEMM's `x_amax / 448.0` computes on CPU."""
    return t / t.new_full((), divisor)


def per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False,
                          block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight [m, n], float32 scale_inv [ceil(m/block), ceil(n/block)]) of a 2-D tensor.

    DeepGEMM 54e2261 deep_gemm/utils/math.py `per_block_cast_to_fp8`, step for step: zero-pad to whole blocks,
    block amax in fp32 clamped at 1e-4 (a zero block gets scale 1e-4/448 and fp8 zeros: no inf/nan),
    sf = amax / 448 (UE8M0: rounded up to a power of two), fp8 = (x * (1 / sf)) cast to float8_e4m3fn, the
    product computed in fp32 (a bf16 tensor times an fp32 tensor promotes)."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantization takes a 2-D weight, got shape {tuple(x.shape)}")
    kernel = _cuda_kernel(x) if block == BLOCK else None
    if kernel is not None:
        return kernel.block_cast_to_fp8(x, use_ue8m0)
    m, n = x.shape
    padded = torch.zeros((ceil_div(m, block) * block, ceil_div(n, block) * block), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    view = padded.view(-1, block, padded.size(1) // block, block)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = _true_div(amax, FP8_MAX)
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    scaled = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return scaled.view_as(padded)[:m, :n].contiguous(), sf.view(view.size(0), view.size(2))


def per_block_cast_to_fp8_batched(x: torch.Tensor, use_ue8m0: bool = False,
                                  block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_block_cast_to_fp8` of each matrix of a stack [N, m, n] in one pass (a dozen kernels for the whole
    stack instead of per matrix): the same elementwise steps and per-block max, so bit-identical to it."""
    if x.dim() != 3:
        raise ValueError(f"expected a stack of 2-D weights [N, m, n], got shape {tuple(x.shape)}")
    kernel = _cuda_kernel(x) if block == BLOCK else None
    if kernel is not None:
        return kernel.block_cast_to_fp8(x, use_ue8m0)
    k, m, n = x.shape
    padded = torch.zeros((k, ceil_div(m, block) * block, ceil_div(n, block) * block), dtype=x.dtype, device=x.device)
    padded[:, :m, :n] = x
    view = padded.view(k, -1, block, padded.size(2) // block, block)
    amax = view.abs().float().amax(dim=(2, 4), keepdim=True).clamp(1e-4)
    sf = _true_div(amax, FP8_MAX)
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    scaled = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return scaled.view_as(padded)[:, :m, :n].contiguous(), sf.view(k, view.size(1), view.size(3))


class FP8Into:
    """Weights quantized straight into their output views (an FP8 export writes its fp8 bytes once): `items` are
    (weight [m, n], fp8 output view, float32 scale_inv view). On CUDA the fused kernel, one launch per group of
    same-shaped weights (offset tables made here, once); elsewhere the reference quantizer, then copied."""

    def __init__(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], use_ue8m0: bool):
        self.items, self.ue8m0 = items, use_ue8m0
        kernel = _cuda_kernel(items[0][0]) if items else None
        self.tables = None
        if kernel is not None:
            groups: dict[tuple, list] = {}
            for x, q, s in items:
                groups.setdefault((tuple(x.shape), x.dtype, x.stride(), q.stride(), s.stride()), []).append((x, q, s))
            self.tables = [kernel.Table(g) for g in groups.values()]

    def run(self) -> None:
        if self.tables is not None:
            for t in self.tables:
                t.run(self.ue8m0)
            return
        for x, q, s in self.items:
            wq, sf = per_block_cast_to_fp8(x, self.ue8m0)
            q.copy_(wq)
            s.copy_(sf)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                   block: int = BLOCK) -> torch.Tensor:
    """fp8 weight x its block's scale_inv, as engines and transformers dequantize (edge blocks partial)."""
    m, n = weight.shape
    if tuple(scale_inv.shape) != (ceil_div(m, block), ceil_div(n, block)):
        raise ValueError(f"scale_inv of a [{m}, {n}] weight must be [{ceil_div(m, block)}, {ceil_div(n, block)}], "
                         f"got {list(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(block, 0)[:m].repeat_interleave(block, 1)[:, :n]
    return (weight.float() * s).to(dtype)


@dataclass(frozen=True)
class FP8Policy:
    """One architecture's quantization table: which HF tensors stay in the export dtype.

    Every 2-D `*.weight` is quantized except those matching `keep` (regexes over HF names); 1-D tensors (norms,
    biases, e_score_correction_bias) are never quantized. `list_not_converted`: the published config lists
    `modules_to_not_convert` (newer vLLM needs the router gates in it), so ours lists the module of every
    unquantized weight, norms included, in layer order, as Qwen3-30B-A3B-FP8's config.json does ("lm_head",
    "model.layers.0.input_layernorm", "model.layers.0.mlp.gate", "model.layers.0.post_attention_layernorm", ...;
    quoted in vllm-project/llm-compressor#1758 and xorbitsai/inference#4032).

    `tower`: a vision-language model's tower / projector prefixes (e.g. "model.visual."), all kept unquantized
    (`keep` holds them). `modules_to_not_convert` then lists each tower module (even without
    `list_not_converted`) and the prefixes themselves: vLLM 0.33 matches the list exactly, after its model's
    name mapper (layers/quantization/fp8.py Fp8Config, utils/quant_utils.py is_layer_skipped match_mode "exact"),
    and would otherwise quantize the tower of a Kimi-K2.5 export (models/kimi_k25.py passes the quant config to
    the tower and projector unless it is compressed-tensors); SGLang 0.5.23 matches on module-path boundaries
    and splits a fused `qkv_proj` into q/k/v shard names first (layers/quantization/utils.py is_layer_skipped,
    _FALLBACK_FUSED_SHARDS), so no per-module entry names GLM-4.5V's tower `visual.blocks.N.attn.qkv_proj`
    (models/glm4v_moe.py passes the quant config to the tower) and only the prefix keeps it unquantized (the
    published GLM-4.5V-FP8 lists engine module names for the tower's qkv: vllm-project/vllm#22949)."""

    keep: tuple[str, ...]
    list_not_converted: bool = True
    source: str = ""  # what the table follows (published checkpoints, engine loaders)
    tower: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "_keep", [regex.compile(p) for p in self.keep])

    def quantized(self, name: str, shape: Sequence[int]) -> bool:
        return len(shape) == 2 and name.endswith(".weight") and not any(p.fullmatch(name) for p in self._keep)

    def not_converted(self, tensors: Sequence[tuple[str, Sequence[int]]]) -> list[str] | None:
        """config.json's `modules_to_not_convert` for an export of `tensors` ((HF name, shape), before
        quantization); None where the published checkpoints list none."""
        if not (self.list_not_converted or self.tower):
            return None
        return sorted({name.removesuffix(".weight") for name, shape in tensors
                       if name.endswith(".weight") and not self.quantized(name, shape)
                       and (self.list_not_converted or name.startswith(self.tower))}
                      | {t.rstrip(".") for t in self.tower}, key=_natural)


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in regex.split(r"(\d+)", name))


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


# --------------------------------------------------------------------------------------------------------------
# quantizing on the shards, before the collectives


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


class FP8RowSlices(LayoutOp):
    """The layout op of a tensor quantized where it is held, before any collective: each shard travels as a byte
    blob [fp8 weight R x C | pad to 4 | float32 scales ceil(R/128) x ceil(C/128)], and each HF output is made of
    pieces, runs of whole rows [a, b) of shard i placed at row d (axis 0; or of whole columns, axis 1: a
    row-parallel tensor), with a and d on 128 block boundaries and b - a whole blocks (or ending at the last
    row / column of both the shard and the output): so no block straddles a shard, a piece's fp8 data and scales
    are (strided) byte ranges of the blob, and quantizing the shards quantizes the outputs exactly. Outputs in
    order: weight 0, its scale_inv, weight 1, ... Valid only where `row_pieces` found the original op to be such
    a permutation (the plan checks it per tensor)."""

    def __init__(self, rows: int, cols: int, outputs: tuple[tuple[tuple[int, int, int, int], ...], ...],
                 out_sizes: tuple[int, ...], axis: int = 0):
        self.rows, self.cols, self.outputs, self.out_sizes = rows, cols, tuple(outputs), tuple(out_sizes)
        self.axis = axis
        self.n_out = 2 * len(outputs)

    @staticmethod
    def blob_nbytes(rows: int, cols: int) -> int:
        rb, cb = scale_shape((rows, cols))
        return _align4(rows * cols) + rb * cb * 4

    @property
    def scale_offset(self) -> int:
        return _align4(self.rows * self.cols)

    def hf_shapes(self, full_shape):
        out = []
        for n in self.out_sizes:
            shape = (n, self.cols) if self.axis == 0 else (self.rows, n)
            out += [shape, scale_shape(shape)]
        return out

    def copies(self, shard_shape, count):
        c = self.cols
        rb, cb = scale_shape((self.rows, c))
        soff = self.scale_offset
        specs = []
        for k, pieces in enumerate(self.outputs):
            for i, a, b, d in pieces:
                nb = ceil_div(b - a, BLOCK)
                if self.axis == 0:  # whole rows: contiguous bytes
                    specs.append(StridedCopy(2 * k, ((b - a) * c,), (1,), (1,), d * c, a * c, i))
                    specs.append(StridedCopy(2 * k + 1, (nb * cb * 4,), (1,), (1,), d // BLOCK * cb * 4,
                                             soff + a // BLOCK * cb * 4, i))
                else:  # whole columns: every row's run of bytes, and every scale row's run of 4-byte scales
                    n = self.out_sizes[k]
                    cb_out = ceil_div(n, BLOCK)
                    specs.append(StridedCopy(2 * k, (self.rows, b - a), (n, 1), (c, 1), d, a, i))
                    specs.append(StridedCopy(2 * k + 1, (rb, nb * 4), (cb_out * 4, 1), (cb * 4, 1), d // BLOCK * 4,
                                             soff + a // BLOCK * 4, i))
        return specs


def _probe(op: LayoutOp, shape: tuple[int, int], count: int, axis: int):
    """The op run on shards labelled shard * size + index along `axis` (int32, the same across the other axis)."""
    rows, cols = shape
    size = shape[axis]
    shards = []
    for i in range(count):
        ids = torch.arange(i * size, (i + 1) * size, dtype=torch.int32)
        shards.append((ids.unsqueeze(1) if axis == 0 else ids.unsqueeze(0)).expand(rows, cols).contiguous())
    try:
        return op.hf_tensors(shards)
    except Exception:  # noqa: BLE001 - an op that cannot run on these shapes alone is not such a permutation
        return None


def row_pieces(op: LayoutOp, shape: tuple[int, ...], count: int):
    """(pieces per output, sizes per output, axis) when `op` makes each HF output of a tensor held as `count`
    shards of `shape` out of runs of whole shard rows (axis 0) or whole shard columns (axis 1) aligned as
    FP8RowSlices needs; None otherwise (rows and columns both permuted, a run not on 128 block boundaries, ...).
    Found by running the op on labels (shard * size + index), so it assumes nothing about how any op is written."""
    if len(shape) != 2:
        return None
    for axis in (0, 1):
        found = _pieces(op, tuple(shape), count, axis)
        if found is not None:
            return (*found, axis)
    return None


def _pieces(op: LayoutOp, shape: tuple[int, int], count: int, axis: int):
    rows = shape[0]
    size, other = shape[axis], shape[1 - axis]
    outs = _probe(op, shape, count, axis)
    if outs is None:
        return None
    if axis == 1:  # the other index must be kept as is: every output row r is shard row r
        same = _probe(op, shape, count, 0)
        if same is None or any(o.dim() != 2 or o.shape[0] != rows or not torch.equal(
                o, torch.arange(rows, dtype=torch.int32).unsqueeze(1).expand_as(o) + (o // rows) * rows)
                for o in same):
            return None
    outputs, out_sizes = [], []
    for out in outs:
        if out.dim() != 2 or out.shape[1 - axis] != other or out.shape[axis] == 0:
            return None
        label = out[:, 0] if axis == 0 else out[0, :]
        if not torch.equal(out, label.unsqueeze(1 - axis).expand_as(out)):
            return None  # not a permutation along `axis` alone
        n = out.shape[axis]
        label = label.long()
        # a new piece where the label does not continue the previous one's (another shard, or a jump)
        breaks = torch.nonzero((label[1:] != label[:-1] + 1) | (label[1:] // size != label[:-1] // size))
        starts = [0] + [int(x) + 1 for x in breaks.flatten()]
        pieces = []
        for j, d in enumerate(starts):
            e = starts[j + 1] if j + 1 < len(starts) else n
            i, a = divmod(int(label[d]), size)
            b = a + (e - d)
            tail = b == size and e == n  # the partial last block of both the shard and the output
            if a % BLOCK or d % BLOCK or ((b - a) % BLOCK and not tail):
                return None
            pieces.append((i, a, b, d))
        outputs.append(tuple(pieces))
        out_sizes.append(n)
    return tuple(outputs), tuple(out_sizes)


@dataclass(frozen=True)
class FP8Scheme:
    """Block FP8 as a `QuantScheme` (quantize/scheme.py): `fp8` (float32 scales as amax / 448) or `fp8-ue8m0`
    (scales rounded up to powers of two, for DeepGEMM's UE8M0 kernels on Blackwell; still stored as float32
    tensors). 128x128 blocks, float8_e4m3fn weights, float32 `weight_scale_inv`, DeepGEMM's reference quantizer
    (the fused CUDA kernel, quantize_cuda, where the weight is on a GPU)."""

    name: str
    ue8m0: bool
    block: tuple[int, int] = (BLOCK, BLOCK)
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    scale_dtype: torch.dtype = torch.float32
    on_shards: bool = True

    def scale_name(self, weight_name: str) -> str:
        return scale_name(weight_name)

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        return scale_shape(shape)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_block_cast_to_fp8(weight, self.ue8m0)

    def quantize_batched(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_block_cast_to_fp8_batched(stack, self.ue8m0)

    def quantize_into(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> FP8Into:
        return FP8Into(items, self.ue8m0)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        return dequantize_fp8(weight, scale, dtype)

    def config(self, keep: FP8Policy, tensors: Sequence[tuple[str, Sequence[int]]]) -> dict:
        """The published block-FP8 checkpoints' quantization_config (module docstring), with the modules `keep`
        leaves unquantized where the policy lists them (FP8Policy.not_converted)."""
        out: dict = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                     "weight_block_size": list(self.block)}
        if self.ue8m0:
            out["scale_fmt"] = "ue8m0"
        listed = keep.not_converted(tensors)
        if listed is not None:
            out["modules_to_not_convert"] = listed
        return out


register(FP8Scheme("fp8", False))
register(FP8Scheme("fp8-ue8m0", True))
