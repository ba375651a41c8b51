"""Export options: what a caller chooses for one export."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..quantize.fp8 import FP8Scheme

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's measured sweet spot between memory and per-bucket overhead
Receivers = str | int | Sequence[int] | None
NameFilterLike = Callable[[str], bool] | None  # e.g. naming.NameFilter(exclude=(r"^model\.layers\.48\.",))
Quantize = str | FP8Scheme | None  # "fp8" / "fp8-ue8m0": block-FP8 output (see mcore2hf.quantize)
