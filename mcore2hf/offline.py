"""Offline export: a Megatron checkpoint -> an HF directory, on a CPU, in bounded memory.

No torch.distributed, no model, no GPU: the checkpoint is opened in its format (`formats.open_checkpoint`:
megatron-core's torch_dist, read chunk by chunk with every byte CRC-checked, or Megatron-LM's legacy per-rank
`torch` files), its tensors come as canonical sources (`formats.checkpoint_keys`, the scheme the import writes),
are checked against the HF config (`plan.checks`, as every entry point checks), converted by the converter's
layout ops and written out bucket by bucket through the streaming safetensors writer. Peak memory is about one
bucket plus the tensor being converted, whatever the model size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .arch.hf_config import HFConfigLike, config_source, hf_tensor_shapes
from .arch.lora import (
    A_SUFFIX,
    ADAPTER,
    B_SUFFIX,
    LoraInfo,
    adapter_shapes,
    check_mode,
    is_adapter,
    lora_converter,
    merged_whole,
    peft_config,
)
from .arch.naming import HYBRID_FINAL_NORM, checkpoint_hybrid_layout, filter_outputs, parse_name
from .arch.registry import get_converter
from .dtypes import parse_dtype
from .errors import (
    CheckpointError,
    Problem,
    ShapeMismatchError,
    UsageError,
    option,
)
from .formats import (
    CheckpointReader,
    CombinedReader,
    is_megatron_checkpoint,
    open_checkpoint,
    resolve_iteration_dir,
)
from .formats.checkpoint_keys import CkptSource
from .formats.safetensors import SafetensorsWriter, TensorInfo, check_target
from .layouts.geometry import align, nbytes
from .layouts.ops import full_shape_of_shard
from .layouts.stacked import Stacked
from .plan.checks import check, check_mapped, checked_dims
from .plan.export import pack_tight, stack_units
from .plan.options import ExportOptions
from .plan.planner import fp8_policy
from .quantize.scheme import quantize_flat, quantized_tensors
from .sizes import parse_size, peak_rss
from .transfer.buckets import Bucket

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")



@dataclass
class ExportReport:
    out_dir: str
    tensors: int
    bytes_written: int
    checkpoint_bytes: int
    ignored_keys: int
    seconds: float
    peak_rss_bytes: int
    notes: list[str] = field(default_factory=list)


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, hf_config: HFConfigLike | None, *,
                      iteration: int | None = None, dtype: torch.dtype | str | None = None,
                      max_shard_size: int | str = "5GB", bucket_bytes: int | str = "1GiB",
                      overwrite: bool = False, progress: bool = True, name_filter=None,
                      make_vocab_size_divisible_by: int = 128, quantize: str | None = None,
                      base: str | os.PathLike | None = None, lora: str | None = None,
                      lora_alpha: float | None = None) -> ExportReport:
    """Write an HF directory from a Megatron torch_dist checkpoint (no GPU, no torch.distributed).

    `dtype` casts floating tensors (tensors HF keeps in fp32, like e_score_correction_bias, stay fp32).
    Every tensor's shape is checked against the model transformers builds from `hf_config`, and the vocab rows
    dropped as padding must be exactly Megatron's padding (`make_vocab_size_divisible_by` x the checkpoint's
    TP); all problems are reported at once, before anything is written. `name_filter(hf_name) -> bool` selects
    tensors. `quantize="fp8"` / `"fp8-ue8m0"` writes a block-FP8 checkpoint (see `mcore2hf.quantize`): each
    bucket is quantized after it is read, so memory stays about one bucket plus its quantized copy. `base` (an HF
    directory) completes the output with the base tensors the checkpoint does not produce (`SafetensorsWriter`).
    A checkpoint of a Megatron-Bridge LoRA model: `lora="adapter"` writes a PEFT adapter directory,
    `lora="merged"` the HF directory of W + lora_alpha/r B A, `lora="base"` the base weights (docs/lora.md). An
    adapter-only checkpoint (Megatron-Bridge's PEFT training saves its adapters alone) takes its base weights for
    "merged" / "base" from `base`: the base model's HF directory (which also completes the output) or Megatron
    checkpoint."""
    t0 = time.perf_counter()
    if hf_config is None:  # Megatron's args cannot say which HF architecture this is (mcore2hf.formats.legacy)
        from .formats.legacy import missing_hf_config

        raise UsageError(missing_hf_config(resolve_iteration_dir(ckpt_dir, iteration)))
    budget = parse_size(bucket_bytes, "bucket_bytes")  # every argument is checked before anything is created
    parse_size(max_shard_size, "max_shard_size")
    cast = parse_dtype(dtype)
    scheme = ExportOptions(budget, name_filter=name_filter, quantize=quantize).quantize
    out_dir = os.path.abspath(os.fspath(out_dir))
    source = config_source(hf_config)
    converter = get_converter(source.config.model_type)
    policy = None if scheme is None else fp8_policy(converter)
    inputs = [ckpt_dir] + ([source.directory] if source.directory else []) + ([base] if base is not None else [])
    check_target(out_dir, overwrite, inputs)
    it_dir = resolve_iteration_dir(ckpt_dir, iteration)
    check_target(out_dir, overwrite, [it_dir])  # e.g. a symlinked iter_* directory elsewhere
    if lora == "adapter" and (quantize is not None or base is not None):
        raise UsageError(f"a LoRA adapter export is neither quantized nor completed from a base: drop "
                         f"{option('quantize', None)} / {option('base', None)}")
    reader, sources, ignored = prepare_sources(it_dir, source.config, make_vocab_size_divisible_by, name_filter,
                                               lora, lora_alpha, base_weights=base)
    if base is not None and is_megatron_checkpoint(base):
        base = None  # it gave the base weights (an adapter-only checkpoint's); only an HF directory completes

    def out_dtype(s: CkptSource) -> torch.dtype:
        return cast if cast is not None and s.dtype.is_floating_point and not s.keep_dtype else s.dtype

    tensors = list({name: (name, shape, out_dtype(s)) for s in sources for name, shape in s.hf}.values())
    quantization = None
    if scheme is not None:
        quantization = scheme.config(policy, [(name, shape) for name, shape, _ in tensors])
        tensors = quantized_tensors(tensors, policy, scheme)
    infos = [TensorInfo(name, shape, dt) for name, shape, dt in tensors]
    if lora == "adapter":  # r from the factors' shapes (checked equal), alpha as given
        r = next(shape[0] for name, shape, _ in tensors if ".lora_A." in name)
        num_layers = converter.spec.dims(source.config).num_layers
        config = peft_config(LoraInfo(r, float(lora_alpha), ()), [t.name for t in infos], num_layers,
                             source.directory)
        writer = SafetensorsWriter(out_dir, infos, None, overwrite=overwrite, inputs=inputs + [it_dir],
                                   adapter_config=config)
    else:
        writer = SafetensorsWriter(out_dir, infos, source, max_shard_size=max_shard_size, overwrite=overwrite,
                                   extra_files=source.companion_files, inputs=inputs + [it_dir],
                                   quantization=quantization, base=base, not_held=converter.not_held_by_model)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(t.nbytes for t in infos), unit="B", unit_scale=True, desc="export",
                   disable=None)  # a bar only on a terminal
    written = 0
    try:
        for index, group in enumerate(_groups(sources, budget, out_dtype)):
            bucket = _convert(reader, group, out_dtype, index)
            if scheme is not None:
                entries = pack_tight(quantized_tensors([(e.name, e.shape, e.dtype, e.source) for e in bucket.entries],
                                                       policy, scheme))
                bucket = Bucket(index, quantize_flat(bucket.flat, bucket.entries, entries, scheme), entries)
            writer.send(bucket)
            n = sum(e.nbytes for e in bucket.entries)
            del bucket  # one output buffer at a time
            written += n
            if bar is not None:
                bar.update(n)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return ExportReport(out_dir, len(infos), written, reader.checkpoint_bytes(),
                        len(ignored), time.perf_counter() - t0, peak_rss(), writer.notes)


def prepare_sources(it_dir: str, cfg, make_vocab_size_divisible_by: int = 128, name_filter=None,
                    lora: str | None = None, lora_alpha: float | None = None,
                    base_weights: str | os.PathLike | None = None
                    ) -> tuple[CheckpointReader, list[CkptSource], list[str]]:
    """The checkpoint's model tensors, resolved to HF names and shapes and checked against the HF config (every
    problem at once); also the keys that are not model weights. A checkpoint of a Megatron-Bridge LoRA model:
    `lora` says what is exported, as for HFExporter (docs/lora.md); the checkpoint does not hold alpha, so
    "adapter" and "merged" need `lora_alpha`. An adapter-only checkpoint (what Megatron-Bridge's PEFT training
    saves: its adapters, no base weights) exports as "adapter" alone, or as "merged" / "base" with
    `base_weights`: the base model's HF directory or Megatron checkpoint, read with it (CombinedReader)."""
    converter = get_converter(cfg.model_type)
    spec = converter.spec
    dims = spec.dims(cfg)
    reader = open_checkpoint(it_dir)
    sources, ignored = _checkpoint_sources(reader, spec, cfg, dims)
    adapter_only = bool(sources) and all(is_adapter(s.name) for s in sources)
    if base_weights is not None and not adapter_only and is_megatron_checkpoint(base_weights):
        raise UsageError(f"{option('base', base_weights)}: a Megatron checkpoint gives the base weights of an "
                         f"adapter-only checkpoint, and {it_dir} holds its own base weights (pass an HF directory "
                         "to complete the output from)")
    if adapter_only and lora in ("merged", "base"):
        if base_weights is None:
            raise UsageError(f"{it_dir} holds LoRA adapters only (Megatron-Bridge's PEFT checkpoints save no base "
                             f"weights): {option('lora', lora)} needs {option('base', None)}, the base model's HF "
                             "directory or Megatron checkpoint")
        reader = CombinedReader([reader, open_checkpoint(base_weights, hf_config=cfg)])
        sources, ignored = _checkpoint_sources(reader, spec, cfg, dims)
    reader.check_files({key for s in sources for shard in s.reads for key, _ in shard})
    if not sources:
        raise CheckpointError(f"{it_dir} holds no model weights (keys: {sorted(reader.tensors)[:5]}...)")
    adapters = [s for s in sources if is_adapter(s.name)]
    sources = [s for s in sources if not is_adapter(s.name)]
    check_mode(lora, bool(adapters), adapters[0].key if adapters else None)
    if lora in ("adapter", "merged") and lora_alpha is None:
        raise UsageError(f"{option('lora', lora)}: a checkpoint does not hold LoRA's alpha; pass "
                         f"{option('lora_alpha', None)}, the alpha of Megatron-Bridge's LoRA(dim=..., alpha=...) the "
                         "model was trained with")
    if not sources:  # adapters only, exported alone: checked against the config's model (its MTP layers too)
        sources = _adapter_sources(adapters, converter, dims, cfg, dims.num_mtp_layers, it_dir)
        return reader, (_filtered(sources, name_filter) if name_filter is not None else sources), ignored

    what = f"the checkpoint {it_dir}"
    check_mapped(converter, {s.name: s.name if s.name == s.key else f"{s.name} (checkpoint key {s.key})"
                             for s in sources}, what)  # first: another architecture is that, not a layer count
    ckpt_mtp = len({p.layer for p in (parse_name(s.name) for s in sources) if p.stack == "mtp"})
    dims = checked_dims(spec, cfg, ckpt_mtp, what)

    for s in sources:
        r = converter.resolve(s.name, dims)
        s.op, s.n_out, s.keep_dtype = r.op, r.op.n_out, r.rule.keep_dtype
        count, dim = r.op.split(s.shape, len(s.reads))  # as the live plan splits a rank's shard (plan._shard_split)
        s.reads, s.shape = s.reads[:count], full_shape_of_shard(s.shape, dim, count)
    problems = vocab_padding_problems([(s.key, s.shape[0], reader.tp_of(s)) for s in sources if s.name in VOCAB_KEYS],
                                      dims.vocab_size, make_vocab_size_divisible_by)
    for s in sources:
        r = converter.resolve(s.name, dims)
        try:
            shapes = r.op.hf_shapes(s.shape)
        except ShapeMismatchError as e:
            problems.append(Problem(f"{s.key} -> {list(r.hf_names)}", str(e)))
            continue
        s.hf = list(zip(r.hf_names + r.copies, shapes + [shapes[0]] * len(r.copies)))
    # every tensor against the model transformers builds from this config (a tower held: all of it)
    produced = None if problems else {name: shape for s in sources for name, shape in s.hf}
    check(spec, cfg, dims, what=what, names=[s.name for s in sources], shapes=produced, problems=problems,
          not_held=converter.not_held_except(produced or {}))
    if lora in ("adapter", "merged"):
        resolved = _adapter_sources(adapters, converter, dims, cfg, ckpt_mtp, it_dir)
        if lora == "adapter":
            sources = resolved
        else:
            _attach_merges(sources, adapters, lora_alpha)
    if name_filter is not None:
        sources = _filtered(sources, name_filter)
    return reader, sources, ignored


def _checkpoint_sources(reader, spec, cfg, dims) -> tuple[list[CkptSource], list[str]]:
    hybrid = None
    if HYBRID_FINAL_NORM in reader.tensors:  # a hybrid model's: its pattern from the HF config
        from .model_specs.hybrid import hybrid_pattern

        hybrid = checkpoint_hybrid_layout(reader.tensors, hybrid_pattern(spec, cfg))
    return reader.sources(dims.num_layers, bool(getattr(cfg, "tie_word_embeddings", False)), hybrid)


def _adapter_sources(adapters: list[CkptSource], converter, dims, cfg, ckpt_mtp: int, it_dir: str) -> list[CkptSource]:
    """The adapter factors resolved through the derived LoRA table, their shapes checked against the base weights."""
    derived = lora_converter(converter)
    problems = []
    for s in adapters:
        r = derived.resolve(s.name, dims)
        if r is None:
            base = converter.resolve(s.name.split(ADAPTER)[0] + ".weight", dims)
            how = f"-> {list(base.hf_names)} with {type(base.op).__name__}" if base else "(no rule)"
            problems.append(f"{s.key}: a LoRA adapter on a module whose base weight {how} has no HF/PEFT adapter form")
            continue
        s.op, s.n_out = r.op, r.op.n_out
        count, dim = r.op.split(s.shape, len(s.reads))
        s.reads, s.shape = s.reads[:count], full_shape_of_shard(s.shape, dim, count)
        shapes = r.op.hf_shapes(s.shape)
        s.hf = list(zip(r.hf_names + r.copies, shapes + [shapes[0]] * len(r.copies)))
    if not problems:
        _, problems = adapter_shapes({n: shape for s in adapters for n, shape in s.hf},
                                     hf_tensor_shapes(cfg, ckpt_mtp, converter.not_held_by_model))
    if problems:
        raise ShapeMismatchError(f"the LoRA adapters of {it_dir}:\n  " + "\n  ".join(problems))
    return adapters


def _attach_merges(sources: list[CkptSource], adapters: list[CkptSource], alpha: float) -> None:
    """lora="merged": each adapted base weight gets its (A, B) sources and alpha / r."""
    split = sorted({s.name.split(ADAPTER)[0] for s in adapters if ".adapter.adapter_" in s.name})
    if split:
        raise UsageError(f"{option('lora', 'merged')} offline: canonical LoRA (adapter.adapter_q/k/v, "
                         f"adapter_gate/up) is not merged from checkpoints yet ({split[:3]}); export "
                         f"{option('lora', 'adapter')}, or merge live")
    by_name = {s.name: s for s in adapters}
    for s in sources:
        module = s.name.removesuffix(".weight")
        a, b = by_name.get(module + A_SUFFIX), by_name.get(module + B_SUFFIX)
        if a is None and b is None:
            continue
        if a is None or b is None or len(s.reads) != 1:
            raise CheckpointError(f"{s.key}: LoRA merge needs the whole base weight and both factors "
                                  f"(A {'found' if a else 'missing'}, B {'found' if b else 'missing'})")
        s.merge = (a, b, alpha / a.shape[0])


def _read_whole(reader, s: CkptSource) -> torch.Tensor:
    parts = [reader.read(key, lead) for key, lead in s.reads[0]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def checkpoint_tensors(ckpt_dir: str | os.PathLike, hf_config: HFConfigLike, *, iteration: int | None = None,
                       bucket_bytes: int | str = "1GiB", make_vocab_size_divisible_by: int = 128):
    """(HF name, tensor) pairs of a torch_dist checkpoint, converted bucket by bucket (bounded memory), as
    `export_checkpoint` would write them; the tensors of a bucket are views valid until the next one."""
    budget = parse_size(bucket_bytes, "bucket_bytes")
    it_dir = resolve_iteration_dir(ckpt_dir, iteration)
    reader, sources, _ = prepare_sources(it_dir, config_source(hf_config).config, make_vocab_size_divisible_by)

    def same(s: CkptSource) -> torch.dtype:
        return s.dtype

    for index, group in enumerate(_groups(sources, budget, same)):
        yield from _convert(reader, group, same, index)


def vocab_padding_problems(vocab: list[tuple[str, int, int]], vocab_size: int, divisible_by: int) -> list[str]:
    """Rows beyond `vocab_size` may only be Megatron's padding: up to the next multiple of divisible_by x TP, TP
    read from the checkpoint's own sharding of the vocab-parallel tensor (`vocab`: (key, rows, TP) each). A larger
    surplus means the HF config's vocab_size is too small, and dropping those rows would silently lose real
    vocabulary."""
    problems = []
    for key, rows, tp in vocab:
        m = divisible_by * tp
        padded = (vocab_size + m - 1) // m * m
        if rows not in (vocab_size, padded):
            problems.append(f"{key} has {rows} rows (TP {tp} in the checkpoint); HF vocab_size {vocab_size} padded "
                            f"to a multiple of make_vocab_size_divisible_by {divisible_by} x TP {tp} gives {padded}: "
                            "the HF config's vocab_size does not match the checkpoint (or pass the divisor used "
                            "in training)")
    return problems


def _filtered(sources: list[CkptSource], keep) -> list[CkptSource]:
    kept = filter_outputs(keep, ((s.name, [n for n, _ in s.hf[:s.n_out]], [n for n, _ in s.hf[s.n_out:]])
                                 for s in sources))
    return [replace(s, hf=s.hf[:s.n_out] + [h for h in s.hf[s.n_out:] if h[0] in kept[s.name]])
            for s in sources if s.name in kept]


def _groups(sources: Sequence[CkptSource], budget: int, out_dtype):
    """Byte-bounded groups of sources, in checkpoint order (a source over the budget is a group alone; the pieces
    of a stacked HF tensor, e.g. gpt-oss's experts.gate_up_proj, go into one group, which may exceed it)."""
    group, size = [], 0
    for unit in stack_units(list(sources), lambda s: (s.op, tuple(n for n, _ in s.hf[:s.n_out]), s.key)):
        n = sum(align(nbytes(shape[1:] if isinstance(s.op, Stacked) else shape, out_dtype(s)))
                for s in unit for _, shape in s.hf)
        if group and size + n > budget:
            yield group
            group, size = [], 0
        group += unit
        size += n
    if group:
        yield group


def _convert(reader: CheckpointReader, group: list[CkptSource], out_dtype, index: int) -> Bucket:
    # the pieces of a stacked tensor share its entry, each writing its item
    entries = pack_tight(list({name: (name, shape, out_dtype(s), s.name) for s in group for name, shape in s.hf}.values()))
    flat = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
    views = {e.name: flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape) for e in entries}
    for s in group:
        shards = []
        for shard in s.reads:
            parts = [reader.read(key, lead) for key, lead in shard]
            shards.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
        if s.merge is not None:  # W + alpha/r B A on the whole Megatron tensor (B's rows are laid out as W's)
            a, b, scale = s.merge
            w = shards[0]
            shards = [merged_whole(w, _read_whole(reader, b), _read_whole(reader, a), scale)]
        outs = [views[name] for name, _ in s.hf]
        s.op.to_hf(shards, outs[:s.n_out])  # copy_ casts when a dtype was asked for
        for out in outs[s.n_out:]:
            out.copy_(outs[0])
    return Bucket(index, flat, entries)
