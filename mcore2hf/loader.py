"""load_hf_weights: HF tensors -> a sharded Megatron model. Each rank reads only the slices its shards need."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .arch.hf_config import HFConfigLike, load_hf_config
from .arch.lora import expert_form, is_adapter, lora_converter
from .arch.mapping import Converter
from .arch.naming import local_tensors, model_config, unwrap_model
from .errors import (
    Mcore2HFError,
    MissingWeightsError,
    ShapeMismatchError,
    UnknownParametersError,
    problem_list,
)
from .formats.hf_dir import as_published, open_tensors
from .layouts.ops import shape_of
from .parallel import ParallelContext
from .plan.checks import check, checked_dims
from .plan.export import shard_split

log = logging.getLogger("mcore2hf")


@dataclass
class LoadReport:
    loaded: int  # local tensors filled on this rank
    hf_tensors_read: int  # distinct HF tensors this rank read from
    #: HF tensors of parts the Megatron model does not hold by design (converter's `not_held`), not loaded
    skipped: list[str] = field(default_factory=list)


def load_hf_weights(model, source: str | os.PathLike | Mapping[str, torch.Tensor],
                    hf_config: HFConfigLike | None = None, *, converter: Converter | None = None,
                    strict: bool = True, lora: bool = False) -> LoadReport:
    """Fill a Megatron model (any TP/PP/VPP/EP/ETP layout) from HF weights: a directory or a state dict.

    `hf_config` defaults to the directory's config.json. With `strict`, HF tensors that no rank used are an
    error (collective: every rank of the world must call it), except those the converter declares the model does
    not hold (`Converter.not_held`, e.g. a text-only model's vision tower): skipped and listed in `skipped`.

    A model with Megatron-Bridge LoRA adapters: the base weights load as usual (the adapters are left alone);
    `lora=True` loads the adapters instead, from a PEFT adapter directory or state dict (HF/PEFT names, see
    docs/lora.md); the q/k/v (gate/up) adapters of one fused Megatron linear must hold the same lora_A."""
    chunks = unwrap_model(model)
    if hf_config is None:
        if isinstance(source, Mapping):
            raise Mcore2HFError("hf_config is required when loading from a state dict")
        hf_config = source
    cfg = load_hf_config(hf_config)
    from .arch.registry import get_converter

    converter = converter or get_converter(cfg.model_type)
    spec = converter.spec
    reader = as_published(open_tensors(source), cfg)  # transformers' own save reads as the published layout
    if lora:  # per-expert or PEFT's stacked 3-D expert factors, as the source holds them
        converter = lora_converter(converter, expert_form(reader.names()))
    ctx = ParallelContext.from_megatron()
    megatron = model_config(chunks)
    dims = checked_dims(spec, cfg, int(getattr(megatron, "mtp_num_layers", None) or 0), "the Megatron model")
    hf_mtp = spec.dims(cfg).num_mtp_layers
    check(spec, cfg, dims, what="the Megatron model", model_config=megatron)
    local = [t for t in local_tensors(chunks, ctx) if is_adapter(t.name) == lora]
    if lora and not _exchange([t.name for t in local], [], [], set())[0]:
        raise Mcore2HFError("lora=True, but the model holds no LoRA adapter (Megatron-Bridge's "
                            "<module>.adapter.linear_in / linear_out)")

    unknown = [t.name for t in local if converter.resolve(t.name, dims) is None]
    missing = sorted({n for t in local if t.name not in unknown
                      for n in converter.resolve(t.name, dims).hf_names if n not in reader})
    used: set[str] = set()
    problems: list[str] = []
    if not unknown and not missing:
        problems = _load_local(local, converter, dims, ctx, reader, used)
    reader_names = set(reader.names())
    reader.close()

    # errors are collective: a rank whose shards are fine must raise too, or it would hang in the next collective
    unknown, missing, problems, all_used = _exchange(unknown, missing, problems, used)
    if unknown:
        raise UnknownParametersError(converter.model_type, unknown)
    if missing:
        raise MissingWeightsError(missing, reader.path)
    if problems:
        raise ShapeMismatchError("cannot load HF weights:\n  " + problem_list(problems))
    # declared by the converter (e.g. a text-only model's vision tower): skipped by design, never an error
    skipped = sorted(n for n in reader_names - all_used if converter.not_held_by_model(n))
    if skipped and ctx.rank == 0:
        log.info("load_hf_weights: skipped %d HF tensor(s) the %s model does not hold by design, e.g. %s",
                 len(skipped), converter.model_type, skipped[:3])
    if strict:
        ignored = {n for n in reader_names
                   if converter.ignored_on_load(n, dims) or _skipped_mtp_layer(n, dims, hf_mtp)}
        unused = sorted(reader_names - all_used - ignored - set(skipped))
        if unused:
            raise Mcore2HFError(f"{len(unused)} HF tensor(s) in {reader.path} match no Megatron parameter "
                                f"(pass strict=False to ignore):\n  " + problem_list(unused, groups=16))
    return LoadReport(loaded=len(local), hf_tensors_read=len(used), skipped=skipped)


def _load_local(local, converter, dims, ctx, reader, used: set[str]) -> list[str]:
    """Copy each local tensor's shard in; returns the problems found (nothing is raised mid-way)."""
    problems: list[str] = []
    with torch.no_grad():
        for t in local:
            r = converter.resolve(t.name, dims)
            op = r.op
            group = ctx.etp if t.is_expert else ctx.tp
            try:
                count, dim = shard_split(t.name, t.local_name, op, t.sharded, t.dim, t.stride, group.size,
                                          t.is_expert, t.shape)
            except ShapeMismatchError as e:
                problems.append(f"{t.local_name} ({t.name}): {e}")
                continue
            index = group.rank if count > 1 else 0
            full = list(t.shape)
            if dim is not None:
                full[dim] *= count
            hf = [reader.slice(n) for n in r.hf_names]
            try:
                want = op.hf_shapes(tuple(full))
            except ShapeMismatchError as e:
                problems.append(f"{t.local_name} ({t.name}): {e}")
                continue
            have = [shape_of(x) for x in hf]
            if [tuple(w) for w in want] != have:
                problems.append(f"{t.local_name} ({t.name}) <- {list(r.hf_names)}: expected HF shapes "
                                f"{[list(w) for w in want]}, found {[list(h) for h in have]}")
                continue
            shared = [n for n in r.copies if is_adapter(t.name) and n in reader and not torch.equal(_full(reader.slice(n)),
                                                                          _full(hf[0]))]
            if shared:  # PEFT's q/k/v adapters of one fused linear: loading keeps one lora_A, so they must be equal
                problems.append(f"{t.local_name} ({t.name}) <- {r.hf_names[0]}: {shared} differ from it, but "
                                "Megatron holds one tensor for them")
                continue
            shard = op.shard_from_hf(hf, index, count, tuple(full))
            if tuple(shard.shape) != t.shape:
                problems.append(f"{t.local_name}: shard shape {tuple(shard.shape)} != parameter shape {t.shape}")
                continue
            t.get().copy_(shard)
            used.update(r.hf_names)
    return problems


def _full(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x[:]


def _exchange(unknown, missing, problems, used):
    """Union of every rank's findings (one all_gather_object)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return unknown, missing, problems, used
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (unknown, missing, problems, sorted(used)))
    u, m, p, us = set(), set(), [], set()
    for gu, gm, gp, gus in gathered:
        u.update(gu)
        m.update(gm)
        p.extend(x for x in gp if x not in p)
        us.update(gus)
    return sorted(u), sorted(m), p, us


def _skipped_mtp_layer(hf_name: str, dims, hf_mtp: int) -> bool:
    """A tensor of an HF MTP layer the Megatron model does not have (trained without MTP)."""
    parts = hf_name.split(".")
    if len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    return dims.num_layers + dims.num_mtp_layers <= int(parts[2]) < dims.num_layers + hf_mtp
