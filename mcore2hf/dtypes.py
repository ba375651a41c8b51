"""Floating dtypes as users spell them (`bf16`, `bfloat16`, ...): one table for the command line and the API.

torch is imported only when a name is turned into a dtype, so the command line can offer the names without it."""

from __future__ import annotations

#: user spelling -> torch dtype attribute
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}


def parse_dtype(dtype):
    """A torch dtype from a torch dtype, a name in DTYPE_NAMES, or None (keep)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return getattr(torch, DTYPE_NAMES[dtype])
