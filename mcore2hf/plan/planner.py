"""The planner: the export plan as a pure function of every rank's record, the HF config and the settings."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from ..arch.lora import check_mode, is_adapter, lora_converter
from ..arch.mapping import Converter
from ..sizes import format_size
from .checks import check
from .export import (
    ExportPlan,
    RankRecord,
    Source,
    assign_buckets,
    build_sources,
    filter_sources,
    quantized_plan,
)
from .options import ExportOptions

log = logging.getLogger("mcore2hf")

class Planner:
    """The export plan as a pure function of every rank's record (`plan.RankRecord`: names, shapes, dtypes and
    holder coordinates of its local tensors), the HF config and the settings; no tensor, no communication.

    The live exporter builds it from the all-gathered records (`HFExporter.planner`), the dry run
    (`mcore2hf.dry_run`) from records it derives in one process: both get the same plan from the same records.
    Sources are built (and checked against the HF config) once; plans are cached per settings."""

    def __init__(self, records: Sequence[RankRecord], hf_config, converter: Converter, dims, tp_size: int,
                 etp_size: int, *, verbose: bool = False, structure: bool = True):
        self.records = list(records)
        self.hf_config, self.converter, self.dims = hf_config, converter, dims
        self.spec = converter.spec
        self.tp_size, self.etp_size, self.world_size = tp_size, etp_size, len(self.records)
        self.verbose = verbose  # log each new plan (rank 0 of a live world)
        self.structure = structure  # check the sources against the HF config (not for a LoRA adapter table)
        self._sources: dict[str, Source] | None = None
        self._plans: dict[ExportOptions, ExportPlan] = {}

    @classmethod
    def of(cls, records: Sequence[RankRecord], hf_config, converter: Converter, dims, tp_size: int, etp_size: int, *,
           lora: str | None = None, lora_experts: str = "per_expert", verbose: bool = False) -> Planner:
        """The planner of a model that may hold Megatron-Bridge LoRA adapters (docs/lora.md): its base weights'
        sources are checked against the HF config in every mode; `lora="adapter"` plans the adapters alone,
        through the table derived from the architecture's, any other mode the base weights."""
        adapters = [t[0] for rec in records for t in rec.tensors if is_adapter(t[0])]
        check_mode(lora, bool(adapters), adapters[0] if adapters else None)
        base = [dataclasses.replace(rec, tensors=tuple(t for t in rec.tensors if not is_adapter(t[0])))
                for rec in records]
        planner = cls(base, hf_config, converter, dims, tp_size, etp_size, verbose=verbose)
        planner.sources  # noqa: B018 - the base model checked against the HF config in every mode
        if lora != "adapter":
            return planner
        only = [dataclasses.replace(rec, tensors=tuple(t for t in rec.tensors if is_adapter(t[0]))) for rec in records]
        return cls(only, hf_config, lora_converter(converter, lora_experts), dims, tp_size, etp_size, verbose=verbose,
                   structure=False)

    @property
    def sources(self) -> dict[str, Source]:
        """The global source table, checked against the HF config (layers, dense/MoE pattern, experts, ties)."""
        if self._sources is None:
            sources = build_sources(self.records, self.converter, self.dims, self.tp_size, self.etp_size)
            if self.structure:
                check(self.spec, self.hf_config, self.dims, what="the Megatron model", names=sources)
            self._sources = sources
        return self._sources

    def plan(self, options: ExportOptions) -> ExportPlan:
        """The export plan for these settings (see `HFExporter.plan`), cached by what it depends on."""
        key = options.planned
        if key not in self._plans:
            if key.quantize is not None:
                self._plans[key] = quantized_plan(self.plan(key.unquantized), fp8_policy(self.converter), key.quantize)
            else:
                sources = filter_sources(self.sources, key.name_filter)
                plan = self._plans[key] = ExportPlan(
                    model_type=self.converter.model_type, sources=sources,
                    buckets=assign_buckets(sources, key.bucket_bytes), bucket_bytes=key.bucket_bytes,
                    records=self.records, world_size=self.world_size)
                if self.verbose:
                    log.info("plan for %s: %d HF tensors, %s in %d bucket(s) of <= %s, world size %d%s",
                             plan.model_type, plan.num_tensors, format_size(plan.total_bytes), len(plan.buckets),
                             format_size(key.bucket_bytes), plan.world_size, ", filtered" if key.name_filter else "")
        return self._plans[key]


def fp8_policy(converter: Converter):
    """The architecture's FP8 table (which HF tensors stay unquantized), from its converter."""
    if converter.fp8 is None:
        raise ValueError(f"FP8 export is not supported for model_type {converter.model_type!r}: its "
                         "converter has no fp8 policy (which tensors stay unquantized)")
    return converter.fp8


