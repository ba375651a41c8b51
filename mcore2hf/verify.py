"""`mcore2hf verify A B`: two HF directories, or an HF directory and a Megatron checkpoint (torch_dist or legacy),
compared tensor by tensor.

Memory: HF tensors are read in runs of rows (`CHUNK_ELEMENTS` per side, through hf_dir's positioned reads), so
comparing two HF directories holds about two chunks and their fp32 temporaries, whatever the tensor sizes; a
Megatron checkpoint is converted in buckets of `CKPT_BUCKET` (offline.checkpoint_tensors), each of its tensors
compared in the same runs.

What counts as equal:

* exact (default): same dtype and the same values (-0.0 == 0.0, NaN == NaN where both hold one);
* `atol`: values within `atol` in fp32 (fp64 where a side is fp64), whatever the dtypes (bf16 against fp32);
  integer tensors stay exact; the dtype pairs compared are reported;
* FP8 (a float8_e4m3fn `X.weight` with its `X.weight_scale_inv`, quantize/fp8.py's block format) against an
  unquantized `X.weight`, with `fp8="reference"` (default): the unquantized side, cast to the FP8 side's dtype
  for unquantized tensors (config.json's dtype: what the export quantized), quantized by our reference quantizer
  (DeepGEMM's, quantize.per_block_cast_to_fp8; UE8M0 scales where quantization_config says scale_fmt ue8m0) must
  give the same fp8 bytes and the same scales, bit for bit. Our exports are bit-identical to that quantizer
  (tests/test_offline.py, bench/RESULTS.md on an H100), so any difference is a real one, also a one-ulp flip
  that a tolerance would let through. `fp8="bound"` (checkpoints quantized by other tools): the dequantized
  value (fp8 x scale_inv) within half an FP8 step of its block (e4m3: 2^(max(floor(log2|q|), -6) - 4) x scale,
  the worst round-to-nearest error) plus 2^-20 of the value (fp32 rounding of the scaling) plus `atol`;
* FP8 against FP8: the fp8 bytes and the scales exactly.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .errors import UsageError
from .formats import is_megatron_checkpoint
from .formats.hf_dir import HFDirectory
from .offline import checkpoint_tensors

CHUNK_ELEMENTS = 1 << 21  # elements per side compared at a time (fp32 temporaries: 8 MiB each)
#: a Megatron checkpoint's tensors are converted in buckets of this size (a larger tensor is a bucket alone), so
#: its side holds about max(bucket, largest tensor)
CKPT_BUCKET = "64MiB"
FP8_MODES = ("reference", "bound")
KINDS = ("missing", "unexpected", "shape", "dtype", "values", "fp8")


@dataclass
class Comparison:
    a: str
    b: str
    atol: float = 0.0
    fp8_mode: str = "reference"
    compared: int = 0
    missing: list[str] = field(default_factory=list)  # in A, not in B
    unexpected: list[str] = field(default_factory=list)  # in B, not in A
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (name, kind, detail)
    max_abs_diff: float = 0.0  # of the values compared as values
    valued: int = 0  # tensors compared value by value (the others differed in shape, or are FP8)
    #: the model_type each side's HF config says (None: none found), to name two different models as such
    model_types: tuple[str | None, str | None] = (None, None)
    #: dequantized FP8 weights against their unquantized counterparts (fp8="bound"; "reference" computes it only
    #: where the bytes differ, for the report)
    fp8_max_abs_diff: float = 0.0
    #: how each compared pair was compared: ("bfloat16", "float32", "in float32") -> tensors
    pairs: Counter = field(default_factory=Counter)

    @property
    def identical(self) -> bool:
        return not (self.missing or self.unexpected or self.rows)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- one side of a pair: rows [r0, r1) of a tensor, read when asked ------------------------------------------------

@dataclass
class Side:
    """A tensor of one side: shape, dtype and `rows(r0, r1)`; `scale` its FP8 scale_inv (a Side) if it has one."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Callable[[int, int], torch.Tensor]
    scale: Side | None = None


def _hf_side(d: HFDirectory, name: str, scale: str | None = None) -> Side:
    lazy = d.slice(name)
    if not lazy.shape:
        return Side((), lazy.dtype, lambda r0, r1: lazy[:])
    return Side(lazy.shape, lazy.dtype, lambda r0, r1: lazy[r0:r1],
                _hf_side(d, scale) if scale is not None else None)


def _tensor_side(t: torch.Tensor) -> Side:
    return Side(tuple(t.shape), t.dtype, (lambda r0, r1: t) if t.dim() == 0 else (lambda r0, r1: t[r0:r1]))


def _row_runs(shape: tuple[int, ...], multiple: int = 1) -> Iterator[tuple[int, int]]:
    """Row ranges of about CHUNK_ELEMENTS elements, each a multiple of `multiple` rows (FP8 blocks stay whole)."""
    if not shape:
        yield 0, 1
        return
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    step = max(multiple, CHUNK_ELEMENTS // max(per_row, 1) // multiple * multiple)
    for r0 in range(0, shape[0], step):
        yield r0, min(shape[0], r0 + step)
    if shape[0] == 0:
        yield 0, 0


# -- comparing one pair --------------------------------------------------------------------------------------------

def _compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """fp32, or what holds both exactly where fp32 cannot: fp64, complex, integers (as fp64: |x| < 2^53)."""
    if a.is_complex or b.is_complex:
        return torch.complex128
    if torch.float64 in (a, b) or not (a.is_floating_point and b.is_floating_point):
        return torch.float64
    return torch.float32


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, as int64 words where they divide into them (8x fewer elements to compare)."""
    raw = t.reshape(-1).view(torch.uint8)
    try:
        return raw.view(torch.int64)
    except RuntimeError:  # a size or offset not a multiple of 8
        return raw


def _over(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, atol: float) -> tuple[float, torch.Tensor]:
    """(max |x - y|, mask of the elements whose difference exceeds atol) computed in `dtype`; equal values (equal
    infinities, -0.0 and 0.0) and NaN in both are no difference, NaN in one only an infinite one."""
    x, y = x.to(dtype), y.to(dtype)
    diff = x - y
    diff = diff.abs() if diff.is_complex() else diff.abs_()  # in place from here: one temporary of the run's size
    diff[(x == y) | (x.isnan() & y.isnan())] = 0
    diff.nan_to_num_(nan=float("inf"))
    worst = float(diff.max()) if diff.numel() else 0.0
    return worst, diff > atol


def _at(shape: tuple[int, ...], r0: int, mask: torch.Tensor) -> list[int]:
    """The index (in the whole tensor) of the first element set in `mask`, a run of rows starting at row r0."""
    flat = int(mask.reshape(-1).nonzero()[0])
    idx = []
    for d in reversed(shape[1:]):
        idx.append(flat % d)
        flat //= d
    return [r0 + flat, *reversed(idx)] if shape else []


def _compare_values(r: Comparison, name: str, a: Side, b: Side) -> None:
    ints = not (a.dtype.is_floating_point or a.dtype.is_complex or b.dtype.is_floating_point or b.dtype.is_complex)
    exact = r.atol == 0.0 or ints
    dtype = _compute_dtype(a.dtype, b.dtype)
    if exact and a.dtype != b.dtype:
        r.rows.append((name, "dtype", f"{_short(a.dtype)} vs {_short(b.dtype)}"))
    r.pairs[(_short(a.dtype), _short(b.dtype), "exactly" if exact else f"in {_short(dtype)}")] += 1
    r.valued += 1
    worst, count, first = 0.0, 0, None
    for r0, r1 in _row_runs(a.shape):
        x, y = a.rows(r0, r1), b.rows(r0, r1)
        if x.dtype == y.dtype and torch.equal(_bytes(x), _bytes(y)):
            continue  # the same bytes: the common case, without the conversion's temporaries
        w, over = _over(x, y, dtype, 0.0 if exact else r.atol)
        worst = max(worst, w)
        n = int(over.sum())
        if n and first is None:
            first = _at(a.shape, r0, over)
        count += n
    r.max_abs_diff = max(r.max_abs_diff, worst)
    if count:
        limit = "" if exact else f" by more than atol {r.atol:g}"
        r.rows.append((name, "values", f"max |diff| {worst:.3e}; {count} element(s) differ{limit}, first at {first}"))


def _fp8_scheme(d: HFDirectory | None) -> tuple[bool | None, torch.dtype | None, int]:
    """(UE8M0 scales?, dtype the unquantized tensors have, block) from an FP8 directory's config.json
    (quantization_config as output_config writes it and the published block-FP8 checkpoints have it)."""
    from .quantize.fp8 import BLOCK

    if d is None:
        return None, None, BLOCK
    try:
        with open(os.path.join(d.path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None, None, BLOCK
    qc = cfg.get("quantization_config") or {}
    text = cfg.get("text_config") or {}
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    block = qc.get("weight_block_size") or [BLOCK, BLOCK]
    ue8m0 = None if not qc else qc.get("scale_fmt") == "ue8m0"
    return ue8m0, getattr(torch, dtype, None) if isinstance(dtype, str) else None, int(block[0])


def _is_pow2(t: torch.Tensor) -> bool:
    t = t.float()
    return bool(((t.view(torch.int32) & 0x7FFFFF) == 0).all())


def _fp8_step(q: torch.Tensor) -> torch.Tensor:
    """The spacing of float8_e4m3fn values at |q| (3 mantissa bits; subnormal below 2^-6)."""
    return q.abs().clamp_min_(2.0 ** -6).log2_().floor_().sub_(3).exp2_()


def _compare_fp8(r: Comparison, name: str, q: Side, src: Side, scheme: tuple, q_is_a: bool) -> None:
    """An FP8 weight (with its scale) against the unquantized one (`src`): see the module's docstring."""
    from .quantize.fp8 import ceil_div, dequantize_fp8, per_block_cast_to_fp8

    ue8m0, src_dtype, block = scheme
    label = ("float8_e4m3fn+scale", _short(src.dtype)) if q_is_a else (_short(src.dtype), "float8_e4m3fn+scale")
    if q.shape != src.shape:
        r.rows.append((name, "shape", f"{list(q.shape)} vs {list(src.shape)}" if q_is_a
                       else f"{list(src.shape)} vs {list(q.shape)}"))
        return
    m, n = q.shape
    want_scale = (ceil_div(m, block), ceil_div(n, block))
    if q.scale.shape != want_scale:
        r.rows.append((name, "fp8", f"scale_inv has shape {list(q.scale.shape)}, a {[m, n]} weight in "
                                    f"{block}x{block} blocks needs {list(want_scale)}"))
        return
    if ue8m0 is None:  # no quantization_config: UE8M0 when every stored scale is a power of two
        ue8m0 = _is_pow2(q.scale.rows(0, want_scale[0]))
    reference = r.fp8_mode == "reference"
    r.pairs[(*label, f"by the reference quantizer{' (UE8M0)' if ue8m0 else ''}" if reference
             else "dequantized, within half an FP8 step" + (f" + atol {r.atol:g}" if r.atol else ""))] += 1
    bad_bytes = bad_scales = bad_values = 0
    first, worst = None, 0.0
    for r0, r1 in _row_runs(q.shape, block):
        w, s, x = q.rows(r0, r1), q.scale.rows(r0 // block, ceil_div(r1, block)), src.rows(r0, r1)
        if reference:
            rq, rs = per_block_cast_to_fp8(x.to(src_dtype or x.dtype), ue8m0, block)
            flips = w.view(torch.uint8) != rq.view(torch.uint8)
            nb, ns = int(flips.sum()), int((s.float().view(torch.int32) != rs.view(torch.int32)).sum())
            bad_bytes, bad_scales = bad_bytes + nb, bad_scales + ns
            if not (nb or ns):
                continue  # equal: the dequantized difference (for the report only) is not computed
            if first is None and nb:
                first = _at(q.shape, r0, flips)
        xf = x.float()
        diff = dequantize_fp8(w, s, torch.float32, block).sub_(xf).abs_().nan_to_num_(nan=float("inf"))
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        if not reference:
            bound = _fp8_step(w.float()).mul_(0.5)
            bound.mul_(s.float().repeat_interleave(block, 0)[:r1 - r0].repeat_interleave(block, 1)[:, :n])
            bound.add_(xf.abs().mul_(2.0 ** -20)).add_(r.atol)  # (xf may be the caller's tensor: not in place)
            over = diff > bound
            count = int(over.sum())
            bad_values += count
            if first is None and count:
                first = _at(q.shape, r0, over)
    r.fp8_max_abs_diff = max(r.fp8_max_abs_diff, worst)
    if reference and (bad_bytes or bad_scales):
        r.rows.append((name, "fp8", f"{bad_bytes} of {m * n} fp8 byte(s) and {bad_scales} of "
                                    f"{want_scale[0] * want_scale[1]} scale(s) differ from the reference quantizer's"
                                    + (f", first byte at {first}" if first else "")
                                    + f"; dequantized max |diff| {worst:.3e}"))
    elif bad_values:
        r.rows.append((name, "fp8", f"{bad_values} of {m * n} dequantized element(s) beyond half an FP8 step of "
                                    f"their block's scale, first at {first}; max |diff| {worst:.3e}"))


def _compare_fp8_pair(r: Comparison, name: str, a: Side, b: Side) -> None:
    """FP8 against FP8: the fp8 bytes and the scales exactly."""
    r.pairs[("float8_e4m3fn+scale", "float8_e4m3fn+scale", "exactly")] += 1
    if a.shape != b.shape or a.scale.shape != b.scale.shape:
        r.rows.append((name, "shape", f"{list(a.shape)} (scale {list(a.scale.shape)}) vs {list(b.shape)} "
                                      f"(scale {list(b.scale.shape)})"))
        return
    flips = scales = 0
    for r0, r1 in _row_runs(a.shape):
        flips += int((a.rows(r0, r1).view(torch.uint8) != b.rows(r0, r1).view(torch.uint8)).sum())
    for r0, r1 in _row_runs(a.scale.shape):
        scales += int((a.scale.rows(r0, r1).float().view(torch.int32)
                       != b.scale.rows(r0, r1).float().view(torch.int32)).sum())
    if flips or scales:
        r.rows.append((name, "fp8", f"{flips} fp8 byte(s) and {scales} scale(s) differ"))


def _compare(r: Comparison, name: str, a: Side, b: Side, scheme: tuple) -> None:
    r.compared += 1
    if a.scale is not None and b.scale is not None:
        return _compare_fp8_pair(r, name, a, b)
    if a.scale is not None or b.scale is not None:
        q, src = (a, b) if a.scale is not None else (b, a)
        if src.dtype.is_floating_point and src.dtype != torch.float8_e4m3fn and len(src.shape) == 2:
            return _compare_fp8(r, name, q, src, scheme, a.scale is not None)
    if a.shape != b.shape:
        r.rows.append((name, "shape", f"{list(a.shape)} vs {list(b.shape)}"))
        return None
    return _compare_values(r, name, a, b)


def _fp8_weights(d: HFDirectory) -> dict[str, str]:
    """{fp8 weight: its scale_inv} of an HF directory (quantize/fp8.py's format)."""
    from .quantize.fp8 import scale_name

    return {n: scale_name(n) for n in d.names()
            if d.info(n).dtype == torch.float8_e4m3fn and scale_name(n) in d}


def compare(a: str | os.PathLike, b: str | os.PathLike, *, hf_config=None, iteration: int | None = None,
            atol: float = 0.0, fp8: str = "reference") -> Comparison:
    """Compare HF directory `a` with `b` (an HF directory or a Megatron checkpoint, converted with `hf_config`,
    default `a`'s config). Exact unless `atol` is given; FP8 weights as the module's docstring says."""
    if fp8 not in FP8_MODES:
        raise UsageError(f"fp8 must be one of {', '.join(FP8_MODES)}, got {fp8!r}")
    if not atol >= 0.0:
        raise UsageError(f"atol must be >= 0, got {atol}")
    a, b = os.fspath(a), os.fspath(b)
    result = Comparison(a, b, atol=atol, fp8_mode=fp8)
    result.model_types = (_model_type(a), _model_type(hf_config or a) if is_megatron_checkpoint(b) else _model_type(b))
    with HFDirectory(a) as left:
        fp8_a = _fp8_weights(left)
        if is_megatron_checkpoint(b):
            scheme = _fp8_scheme(left)
            seen = set()
            for name, tb in checkpoint_tensors(b, hf_config or a, iteration=iteration, bucket_bytes=CKPT_BUCKET):
                seen.add(name)
                if name not in left:
                    result.unexpected.append(name)
                    continue
                _compare(result, name, _hf_side(left, name, fp8_a.get(name)), _tensor_side(tb), scheme)
            consumed = {fp8_a[n] for n in seen if n in fp8_a}  # the scales of FP8 weights compared with Megatron's
            result.missing = sorted(set(left.names()) - seen - consumed)
        else:
            with HFDirectory(b) as right:
                _compare_directories(result, left, right, fp8_a)
    result.unexpected.sort()
    return result


def _model_type(config) -> str | None:
    """The model_type of an HF config (a directory, config.json, dict or PretrainedConfig), read without
    transformers; None where there is none."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    value = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return value if isinstance(value, str) else None


def _compare_directories(r: Comparison, left: HFDirectory, right: HFDirectory, fp8_a: dict[str, str]) -> None:
    fp8_b = _fp8_weights(right)
    scheme = _fp8_scheme(left if fp8_a else right if fp8_b else None)
    # an FP8 weight's scale is compared with the weight (against the other side's FP8 weight or unquantized one),
    # not as a name of its own
    paired = {n for n in set(fp8_a) | set(fp8_b) if n in left and n in right}
    skip_a = {fp8_a[n] for n in paired if n in fp8_a}
    skip_b = {fp8_b[n] for n in paired if n in fp8_b}
    names_a, names_b = set(left.names()) - skip_a, set(right.names()) - skip_b
    r.missing = sorted(names_a - names_b)
    r.unexpected = sorted(names_b - names_a)
    for name in sorted(names_a & names_b):
        _compare(r, name, _hf_side(left, name, fp8_a.get(name)), _hf_side(right, name, fp8_b.get(name)), scheme)


def format_table(r: Comparison, limit: int = 10) -> str:
    """The report: a summary line, how the pairs were compared, and per kind of difference the first `limit`
    tensors and how many more."""
    groups: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    groups["missing"] = [(n, "in A, not in B") for n in r.missing]
    groups["unexpected"] = [(n, "in B, not in A") for n in r.unexpected]
    for name, kind, detail in r.rows:
        groups.setdefault(kind, []).append((name, detail))
    counts = ", ".join(f"{len(v)} {k}" for k, v in groups.items())
    how = "exact" if r.atol == 0 else f"atol {r.atol:g}"
    kinds = [f" ({t})" if t else "" for t in r.model_types]
    lines = [f"A: {r.a}{kinds[0]}", f"B: {r.b}{kinds[1]}"]
    if None not in r.model_types and r.model_types[0] != r.model_types[1]:
        lines.append(f"different models: A is {r.model_types[0]}, B is {r.model_types[1]}")
    shapes = sum(kind == "shape" for _, kind, _ in r.rows)
    values = (f"max |diff| {r.max_abs_diff:.3e} over the {r.valued} compared by value" if r.valued else
              "no values compared: the tensors of the same name differ in shape" if r.compared and shapes == r.compared
              else "")
    lines += [f"{r.compared} tensors compared ({how}): {counts} difference(s)" + (f"; {values}" if values else "")
             + (f"; FP8 dequantized vs unquantized max |diff| {r.fp8_max_abs_diff:.3e}"
                if any("FP8 step" in w for *_, w in r.pairs) else "")]
    for (da, db, way), n in sorted(r.pairs.items(), key=lambda x: -x[1]):
        lines.append(f"  {n} x {da} vs {db}, {way}")
    for kind, rows in groups.items():
        if not rows:
            continue
        lines.append(f"{kind} ({len(rows)}):")
        shown = rows[:limit]
        width = max(len(n) for n, _ in shown)
        lines += [f"  {n:<{width}}  {detail}" for n, detail in shown]
        if len(rows) > limit:
            lines.append(f"  ... and {len(rows) - limit} more")
    lines.append("IDENTICAL" if r.identical else "DIFFERENT")
    return "\n".join(lines)
