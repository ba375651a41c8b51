"""Quantized export formats behind one protocol: what the plan, the executor, the offline export and the writers
ask of a format. A format (block FP8 today, `fp8.py`; MXFP8 or NVFP4 next) is one module implementing
`QuantScheme` and registering its options; the export option `quantize=` names one (`get_scheme`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


class QuantInto(Protocol):
    def run(self) -> None: ...


@runtime_checkable
class QuantScheme(Protocol):
    """One quantized format. A quantized weight `X.weight` becomes `weight_dtype` values plus its scale tensor
    `scale_name("X.weight")` of `scale_shape(shape)` and `scale_dtype`, one scale per `block` of the weight."""

    #: the `quantize=` value naming it
    name: str
    #: the weight block (rows, columns) one scale covers
    block: tuple[int, int]
    weight_dtype: torch.dtype
    scale_dtype: torch.dtype
    #: whether quantizing a shard's whole-block row or column ranges before the collectives is bit-identical to
    #: quantizing the full HF tensor after them (plan.export.prequantized_source)
    on_shards: bool

    def scale_name(self, weight_name: str) -> str: ...

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]: ...

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(quantized weight, scale) of one 2-D weight: the reference quantizer (its kernel where there is one)."""
        ...

    def quantize_batched(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize` of each matrix of a stack [N, m, n] in one pass, bit-identical to it."""
        ...

    def quantize_into(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> QuantInto:
        """Prepared once: each (weight, quantized view, scale view) quantized straight into the views by `run()`
        (its kernel's launch tables made here, for replays)."""
        ...

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def config(self, keep, tensors: Sequence[tuple[str, Sequence[int]]]) -> dict:
        """config.json's `quantization_config` for an export of `tensors` ((HF name, shape), before quantization);
        `keep`: the architecture's policy of what stays unquantized (`FP8Policy`)."""
        ...


SCHEMES: dict[str, QuantScheme] = {}


def register(scheme: QuantScheme) -> QuantScheme:
    SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(quantize: str | QuantScheme | None) -> QuantScheme | None:
    """The scheme for an export's `quantize=` argument (None: no quantization); a clear error otherwise (the
    package registers its schemes when imported)."""
    if quantize is None or isinstance(quantize, QuantScheme):
        return quantize
    if isinstance(quantize, str) and quantize in SCHEMES:
        return SCHEMES[quantize]
    raise ValueError(f"quantize must be one of {sorted(SCHEMES)} or None, got {quantize!r}")


BATCH_ELEMENTS = 1 << 25  # a batched quantization's input (its fp32 temporaries are ~8 bytes per element)


def chunks(items: list, numel: int, limit: int = BATCH_ELEMENTS) -> list[list]:
    """`items` (each of `numel` elements) in runs of at most `limit` elements (at least one item per run), so the
    temporaries of a batched quantization stay bounded whatever the bucket size."""
    per = max(1, limit // max(numel, 1))
    return [items[i:i + per] for i in range(0, len(items), per)]


def quantized_tensors(tensors: Sequence[tuple], keep, scheme: QuantScheme) -> list[tuple]:
    """The output tensors of an export: (name, shape, dtype, *rest) with each weight the policy `keep` quantizes
    turned into the scheme's weight dtype and followed by its scale (same *rest)."""
    out = []
    for name, shape, dtype, *rest in tensors:
        if dtype != scheme.weight_dtype and keep.quantized(name, shape):  # (already quantized: on the shard)
            out.append((name, tuple(shape), scheme.weight_dtype, *rest))
            out.append((scheme.scale_name(name), scheme.scale_shape(shape), scheme.scale_dtype, *rest))
        else:
            out.append((name, tuple(shape), dtype, *rest))
    return out


def quantize_flat(flat: torch.Tensor, entries: Sequence, out_entries: Sequence, scheme: QuantScheme) -> torch.Tensor:
    """A flat bucket (uint8, `entries`: objects with name, shape, dtype, start, nbytes) rewritten as the flat
    buffer of `out_entries`: quantized entries made from the same-named source tensor (their scale written to its
    scale entry), every other entry copied byte for byte."""
    src = {e.name: e for e in entries}
    dst = {e.name: e for e in out_entries}
    total = max((e.start + e.nbytes for e in out_entries), default=0)
    out = torch.empty(total, dtype=torch.uint8, device=flat.device)

    def view(buf, e):
        return buf[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape)

    groups: dict[tuple, list] = {}  # same shape and dtype: quantized together (bit-identical, fewer kernels)
    for e in out_entries:
        s = src.get(e.name)
        if s is None:  # a scale: written with its weight
            continue
        if e.dtype == s.dtype:
            out[e.start:e.start + e.nbytes].copy_(flat[s.start:s.start + s.nbytes])
        else:
            groups.setdefault((tuple(s.shape), s.dtype), []).append((s, e))
    for (shape, _), group in groups.items():
        for items in chunks(group, shape[0] * shape[1]):
            q, sf = scheme.quantize_batched(torch.stack([view(flat, s) for s, _ in items]))
            for k, (_, e) in enumerate(items):
                view(out, e).copy_(q[k])
                view(out, dst[scheme.scale_name(e.name)]).copy_(sf[k])
    return out
