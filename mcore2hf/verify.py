"""`mcore2hf verify A B`: two HF directories, or an HF directory and a Megatron torch_dist checkpoint, compared
tensor by tensor in bounded memory (one tensor of A at a time; B's tensors as the checkpoint reader converts
them). Differences are missing and unexpected names, shapes, dtypes and values (max absolute difference)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .errors import Mcore2HFError


@dataclass
class Comparison:
    a: str
    b: str
    compared: int = 0
    missing: list[str] = field(default_factory=list)  # in A, not in B
    unexpected: list[str] = field(default_factory=list)  # in B, not in A
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (name, what, detail)
    max_abs_diff: float = 0.0

    @property
    def identical(self) -> bool:
        return not (self.missing or self.unexpected or self.rows)


def is_megatron_checkpoint(path: str) -> bool:
    from .legacy import is_legacy_dir

    return (any(os.path.exists(os.path.join(path, f)) for f in ("latest_checkpointed_iteration.txt", ".metadata"))
            or is_legacy_dir(path))


def _hf_directory(path: str):
    """The tensors of an HF directory (index or single file), read one at a time (`loader.HFReader`)."""
    from .loader import HFReader

    try:
        return HFReader(path)
    except FileNotFoundError:
        raise Mcore2HFError(f"{path} is not an HF directory: no model.safetensors.index.json or "
                            "model.safetensors") from None


def _check(result: Comparison, name: str, ta: torch.Tensor, tb: torch.Tensor, atol: float) -> None:
    result.compared += 1
    if tuple(ta.shape) != tuple(tb.shape):
        result.rows.append((name, "shape", f"{list(ta.shape)} vs {list(tb.shape)}"))
        return
    if ta.dtype != tb.dtype:
        result.rows.append((name, "dtype", f"{str(ta.dtype)[6:]} vs {str(tb.dtype)[6:]}"))
    if ta.dtype == tb.dtype and torch.equal(ta, tb):
        return
    diff = (ta.double() - tb.double()).abs()
    nan = bool((ta.isnan() != tb.isnan()).any()) if ta.is_floating_point() else False
    worst = float(diff.nan_to_num(0.0).max()) if diff.numel() else 0.0
    result.max_abs_diff = max(result.max_abs_diff, worst)
    if nan or worst > atol:
        result.rows.append((name, "values", f"max |diff| {worst:.3e}" + (", NaN in one only" if nan else "")))


def compare(a: str | os.PathLike, b: str | os.PathLike, *, hf_config=None, iteration: int | None = None,
            atol: float = 0.0) -> Comparison:
    """Compare HF directory `a` with `b` (an HF directory or a Megatron checkpoint, converted with `hf_config`,
    default `a`'s config). Exact unless `atol` is given."""
    a, b = os.fspath(a), os.fspath(b)
    left = _hf_directory(a)
    left_names = left.names()
    result = Comparison(a, b)
    if is_megatron_checkpoint(b):
        from .offline import checkpoint_tensors

        seen = set()
        for name, tb in checkpoint_tensors(b, hf_config or a, iteration=iteration):
            seen.add(name)
            if name not in left_names:
                result.unexpected.append(name)
                continue
            _check(result, name, left.tensor(name), tb, atol)
        result.missing = sorted(left_names - seen)
    else:
        right = _hf_directory(b)
        result.missing = sorted(left_names - right.names())
        result.unexpected = sorted(right.names() - left_names)
        for name in sorted(left_names & right.names()):
            _check(result, name, left.tensor(name), right.tensor(name), atol)
    result.unexpected.sort()
    return result


def format_table(r: Comparison, limit: int = 50) -> str:
    rows = [(n, "missing", "in A, not in B") for n in r.missing]
    rows += [(n, "unexpected", "in B, not in A") for n in r.unexpected]
    rows += r.rows
    lines = [f"A: {r.a}", f"B: {r.b}",
             f"{r.compared} tensors compared: {len(r.missing)} missing, {len(r.unexpected)} unexpected, "
             f"{sum(1 for x in r.rows if x[1] == 'shape')} shape, {sum(1 for x in r.rows if x[1] == 'dtype')} dtype, "
             f"{sum(1 for x in r.rows if x[1] == 'values')} value difference(s); max |diff| {r.max_abs_diff:.3e}"]
    if rows:
        width = max(len(n) for n, _, _ in rows[:limit])
        lines.append(f"{'tensor':<{width}}  {'difference':<10}  detail")
        lines += [f"{n:<{width}}  {what:<10}  {detail}" for n, what, detail in rows[:limit]]
        if len(rows) > limit:
            lines.append(f"... {len(rows) - limit} more")
    lines.append("IDENTICAL" if r.identical else "DIFFERENT")
    return "\n".join(lines)
