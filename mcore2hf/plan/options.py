"""Export options: what a caller chooses for one export, as one frozen value normalised where it enters
(`ExportOptions(...)`), then the key of every cache that depends on it (plans, executors, engine plans, base groups)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..quantize.scheme import QuantScheme, get_scheme

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's measured sweet spot between memory and per-bucket overhead
Receivers = str | int | Sequence[int] | None
NameFilterLike = Callable[[str], bool] | None  # e.g. naming.NameFilter(exclude=(r"^model\.layers\.48\.",))
Quantize = str | QuantScheme | None  # a scheme's name ("fp8", "fp8-ue8m0": block FP8) or the scheme


@dataclass(frozen=True)
class ExportOptions:
    """One export's settings, normalised when made: `bucket_bytes` a positive int, `receivers` None (every rank)
    or a sorted tuple of ranks, `quantize` None or the scheme object. Hashable: the cache key of plans and
    executors (`planned` drops what a plan does not depend on). `name_filter(hf_name) -> bool` is kept as given
    (its own equality and hash: an `naming.NameFilter` is a value, a lambda is itself)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    receivers: Receivers = None
    overlap: bool = False
    name_filter: NameFilterLike = None
    quantize: Quantize = None

    def __post_init__(self):
        b = self.bucket_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {b!r}")
        object.__setattr__(self, "receivers", _receivers(self.receivers))
        object.__setattr__(self, "overlap", bool(self.overlap))
        object.__setattr__(self, "quantize", get_scheme(self.quantize))

    @property
    def planned(self) -> ExportOptions:
        """What the plan depends on (bucket budget, name filter, quantization): receivers and overlap dropped."""
        return dataclasses.replace(self, receivers=None, overlap=False)

    @property
    def unquantized(self) -> ExportOptions:
        return dataclasses.replace(self, quantize=None)

    def check_receivers(self, world_size: int) -> ExportOptions:
        """Itself, once its receivers are ranks of a world of `world_size`."""
        bad = [r for r in self.receivers or () if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"receivers must be 'all' or ranks in [0, {world_size}), got {list(self.receivers)}")
        return self


def _receivers(receivers: Receivers) -> tuple[int, ...] | None:
    if receivers is None or (isinstance(receivers, str) and receivers == "all"):
        return None
    if isinstance(receivers, str):
        raise ValueError(f"receivers must be 'all' or ranks, got {receivers!r}")
    if isinstance(receivers, int):
        receivers = (receivers,)
    out = tuple(sorted({int(r) for r in receivers}))
    if not out:
        raise ValueError(f"receivers must be 'all' or ranks, got {receivers!r}")
    return out


def export_options(options: ExportOptions | None = None, **given) -> ExportOptions:
    """`options`, or an ExportOptions of the separately given settings (one or the other: a setting given beside
    `options` differing from its default is refused, so nothing is silently ignored)."""
    if options is None:
        return ExportOptions(**given)
    if not isinstance(options, ExportOptions):
        raise UsageError(f"options: expected an ExportOptions, found {type(options).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(ExportOptions)}
    clash = sorted(k for k, v in given.items() if v is not defaults[k] and v != defaults[k]
                   and not (k == "receivers" and v == "all"))
    if clash:
        raise UsageError(f"options=ExportOptions(...) and {', '.join(clash)} given together: expected one or the other")
    return options
