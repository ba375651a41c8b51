"""Offline import: an HF directory -> a Megatron torch_dist checkpoint, on a CPU, in bounded memory.

No torch.distributed, no model, no GPU. The HF names are mapped back through the converter's table (its rules
read right to left), each Megatron tensor is rebuilt with its layout op's inverse (`shard_from_hf` of the
single, TP-1 shard), and written as one chunk (a `torch.save` at a byte range of a `.distcp` file, as
torch.distributed.checkpoint's FileSystemWriter writes them) under the key Megatron's `sharded_state_dict`
gives it. Only one Megatron tensor is in memory at a time; the HF side is read slice by slice (safetensors).

Keys, global shapes and chunk offsets are the ones megatron-core 0.16.1's sharded state dict uses; the key scheme
(stacked or per-layer decoder layers, key renames, experts, MTP, hybrid stacks, parts, `_extra_state` objects) is
`mcore2hf.formats.checkpoint_keys`, which the offline export reads back. Written here (mlp.py `apply_swiglu_sharded_factory`,
dist_checkpointing/mapping.py `ShardedObject.unique_key`, strategies/torch.py `_mcore_to_torch_sharded_object`,
strategies/common.py `common.pt`, core.py `metadata.json`; tests/test_import.py compares them with a checkpoint
Megatron itself saved):

* every linear's `_extra_state` (a ShardedObject: `torch.save([None])`, what the local spec's linears hold; a hybrid
  model's output layer too, which GPTModel drops);
* the vocab-parallel tensors (embedding, output layer; MTP shares their keys) with exactly vocab_size rows: they
  are `allow_shape_mismatch` ShardedTensors (tensor_parallel/layers.py VocabParallelEmbedding
  `sharded_state_dict`, language_module.py, multi_token_prediction.py), which the torch_dist load strategy
  (strategies/torch.py `_mcore_to_dcp_compatible_tensor`: zero-initialized; `MCoreLoadPlanner
  ._temporarily_bypass_shape_validation`: only the overlap read) loads at any padded vocab, so at any TP. With
  `tp`, they are padded to a multiple of make_vocab_size_divisible_by x TP and chunked by that TP instead, as
  training at that TP saves them;
* hybrid models (`model_class="hybrid"`): the keys of the hybrid stack `build_model(..., model_class="hybrid")`
  builds, its layer pattern derived from the HF config as build_model derives it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .arch.hf_config import HFConfigLike, config_source
from .arch.mapping import NAME, Converter, ModelDims
from .arch.naming import HybridLayout, parse_name
from .arch.registry import get_converter
from .dtypes import parse_dtype
from .errors import (
    ImportTargetError,
    Problem,
    ShapeMismatchError,
    UnknownParametersError,
    UsageError,
    option,
)
from .formats import TRACKER
from .formats.checkpoint_keys import (
    GLU_PARTS,
    HF_TOWER,
    HYBRID_OUTPUT_EXTRA_STATE,
    MEGATRON_LM_TRANSFORMER_IMPL,
    TOWER_PREFIXES,
    VISION_TOWERS,
    KeyLayout,
    check_transformer_impl,
    embedded_tower_rules,
    layer_keys,
    part_key,
)
from .formats.hf_as_megatron import full_shape, megatron_names
from .formats.hf_dir import HFDirectory, as_published
from .formats.paths import (
    Staging,
    check_output_dir,
    overlaps,
    remove_stale,
    replace_file,
    user_entries,
)
from .formats.torch_dist import TORCH_DIST_OUTPUT, DistcpWriter, iteration_dir
from .layouts.ops import GatedColumn, GatedInterleaved, GatedTransposed, VocabRows, shape_of
from .plan.checks import check
from .sizes import parse_size, peak_rss


@dataclass
class Part:
    """One chunk to write: rows [row0, row0 + rows) of the Megatron tensor `name` (the GLU halves of singleton
    checkpoints are parts too), placed at `offsets` of checkpoint key `key`."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    row0: int = 0
    rows: int | None = None  # None: the whole tensor


@dataclass
class ImportSource:
    """One canonical Megatron tensor: its HF sources, layout op, full shape and where its chunks go."""

    name: str
    hf: tuple[str, ...]
    op: object
    shape: tuple[int, ...]
    dtype: torch.dtype
    keep_dtype: bool = False  # HF keeps it in its dtype when the import casts (e_score_correction_bias)
    parts: list[Part] = field(default_factory=list)


@dataclass
class ImportReport:
    ckpt_dir: str
    iteration: int
    tensors: int
    keys: int
    bytes_written: int
    seconds: float
    peak_rss_bytes: int
    layer_keys: str = ""  # which decoder-layer key form was written, and why (layer_keys)
    transformer_impl: str = MEGATRON_LM_TRANSFORMER_IMPL  # the layer spec whose norm keys were written


def plan_import(reader: HFDirectory, cfg, converter: Converter, dims: ModelDims, *, tp: int | None, divisible_by: int,
                singleton: bool, stacked: bool, hybrid: HybridLayout | None = None,
                transformer_impl: str = MEGATRON_LM_TRANSFORMER_IMPL, vision_tower: str | None = None,
                non_homogeneous: bool = False) -> tuple[list[ImportSource], dict[str, tuple], list[str]]:
    """Every Megatron tensor to write with its chunks, the checkpoint's keys {key: (global shape, dtype)}, and
    its `_extra_state` object keys; every problem is reported at once, before anything is written.
    `vision_tower`: the keys of a vision-language wrapper holding its tower (checkpoint_keys.VISION_TOWERS)."""
    from .model_specs.common import padded_vocab_size

    spec = converter.spec
    # what the Megatron model does not hold by design (a text model's vision tower) is not imported; a wrapper
    # holding its tower imports the not-held tensors its tower rules produce (the tower, not Qwen3.5's MTP)
    held = {n for n in reader.names() if not converter.not_held_by_model(n)}
    if vision_tower is not None:
        tower, _ = megatron_names(converter, dims, set(reader.names()) - held, vision_tower)
        held |= {h for name, r in tower.items() if name.startswith(TOWER_PREFIXES) for h in r.hf_names}
    resolved, unexplained = megatron_names(converter, dims, held, vision_tower)
    if unexplained:
        raise UnknownParametersError(converter.model_type, [f"{n} (an HF tensor no rule of the "
                                                            f"{converter.model_type} table produces)"
                                                            for n in unexplained])
    padded = dims.vocab_size if tp is None else padded_vocab_size(dims.vocab_size, tp, divisible_by)
    # gated DeltaNet layers (those with in_proj) save their input norm under in_proj
    names = [parse_name(n) for n in resolved]
    gdn = frozenset(p.layer for p in names if p.stack == "decoder" and p.rest == "self_attention.in_proj.weight")
    # MoE layers (those with a router; MTP's inner layers too) keep TE's separate pre-MLP norm
    moe = frozenset(p.layer for p in names if p.stack == "decoder" and p.rest == "mlp.router.weight")
    layout = KeyLayout(dims.num_layers, dims.num_experts, stacked=stacked, singleton=singleton,
                       mla=dims.kv_lora_rank is not None, dsa=dims.index_head_dim is not None, gdn_layers=gdn, hybrid=hybrid, moe_layers=moe,
                       transformer_impl=transformer_impl,
                       non_te=frozenset(spec.non_te_modules),
                       vision_tower=vision_tower, vision_depth=_count(resolved, "layers"),
                       vision_deepstack=_count(resolved, "deepstack_merger_list"), vision_stacked=not non_homogeneous)
    sources, keys, objects, problems = [], {}, set(), []
    for name, r in sorted(resolved.items()):
        missing = [n for n in r.hf_names if n not in reader]
        if missing:
            problems.append(Problem(name, f"HF tensor(s) {missing} missing (the table makes {list(r.hf_names)})"))
            continue
        hf = [reader.slice(n) for n in r.hf_names]  # the directory was validated when it was opened
        have = [shape_of(x) for x in hf]
        full = full_shape(r.op, have, padded)
        try:
            want = [tuple(s) for s in r.op.hf_shapes(full)]
        except ShapeMismatchError as e:
            problems.append(Problem(f"{name} <- {list(r.hf_names)}", str(e)))
            continue
        if want != have:
            problems.append(Problem(f"{name} <- {list(r.hf_names)}", f"shapes {[list(h) for h in have]} do not "
                                    f"make one Megatron tensor (expected {[list(w) for w in want]})"))
            continue
        dtype = hf[0].dtype
        src = ImportSource(name, r.hf_names, r.op, full, dtype, r.rule.keep_dtype)
        key, lead, glob = layout.key(name)
        zeros = (0,) * len(full)
        split = r.op.checkpoint_parts()
        if split:  # gated DeltaNet in_proj / conv1d: one key per component (gated_delta_net.py sharded_state_dict)
            src.parts, shapes, row = [], {}, 0
            for suffix, rows in split:
                shape = (*glob, rows, *full[1:])
                src.parts.append(Part(part_key(key, suffix), (*lead, *zeros), (*(1,) * len(lead), rows, *full[1:]),
                                      row, rows))
                shapes[part_key(key, suffix)] = shape
                row += rows
        elif singleton and isinstance(getattr(r.op, "inner", r.op), GLU_FC1):  # apply_swiglu_sharded_factory: _w, _v
            half = (full[0] // 2, *full[1:])
            src.parts = [Part(part_key(key, p), zeros, half, i * half[0], half[0]) for i, p in enumerate(GLU_PARTS)]
            shapes = {part_key(key, p): half for p in GLU_PARTS}
        elif isinstance(r.op, VocabRows) and tp is not None and tp > 1:  # chunked as training at this TP writes it
            rows = full[0] // tp
            src.parts = [Part(key, (i * rows, *zeros[1:]), (rows, *full[1:]), i * rows, rows) for i in range(tp)]
            shapes = {key: full}
        else:
            src.parts = [Part(key, (*lead, *zeros), (*(1,) * len(lead), *full))]
            shapes = {key: (*glob, *full)}
        for k, shape in shapes.items():
            if keys.setdefault(k, (shape, dtype))[0] != shape:
                problems.append(Problem(k, f"Megatron tensors of shapes {list(keys[k][0])} and {list(shape)}"))
        extra = layout.extra_state(name)
        if extra is not None:
            objects.add(extra)
        sources.append(src)
    if hybrid is not None:
        objects.add(HYBRID_OUTPUT_EXTRA_STATE)
    # every tensor against the model transformers builds from the config, as the export checks
    check(spec, cfg, dims, what=f"the HF checkpoint {reader.path}", problems=problems,
          shapes=None if problems else {n: shape_of(reader.slice(n)) for n in sorted(held)},
          not_held=converter.not_held_except(held))
    return sources, keys, sorted(objects)


def _check_vision_tower(converter: Converter, spec, vision_tower: str, model_class: str) -> None:
    """A wrapper's keys need a table whose tower the wrapper holds: a native tower the model spec builds (under
    `vision_model`), or pass-through rules of an embedded transformers tower (`embedded_tower_rules`)."""
    passes = sorted({r.megatron.removesuffix(f"{{{NAME}}}") for r in embedded_tower_rules(converter.rules)})
    native = spec.native_vision_tower is not None
    if model_class != "gpt" or (vision_tower == HF_TOWER and not passes) or (vision_tower != HF_TOWER and not native):
        embedded = f"an embedded tower under {', '.join(passes)}" if passes else "no embedded tower"
        raise UsageError(f"{option('vision_tower', vision_tower)}: {converter.model_type!r} has "
                         f"{'a native Megatron tower' if native else 'no native Megatron tower'} and {embedded} "
                         "(native: Megatron-Bridge 0.6.2's Qwen3VLModel, qwen3_vl, qwen3_vl_moe, qwen3_5, "
                         "qwen3_5_moe; hf: Bridge 0.3.1's Qwen3VLModel for those, its GLM45VModel (glm4v_moe), "
                         "0.6.2's KimiK25VLModel (kimi_k25)), model_class 'gpt' only")


def _count(resolved: dict, part: str) -> int:
    """How many native tower blocks (`layers`) or deepstack mergers the import writes."""
    return len({p.layer for p in map(parse_name, resolved) if p.stack == part})


#: Megatron's GLU linear_fc1 (weight and bias: [gate; up]) under every layout op that converts one
GLU_FC1 = (GatedColumn, GatedInterleaved, GatedTransposed)


def check_import_target(ckpt_dir: str, iteration: int, overwrite: bool, inputs: list[str]) -> None:
    """Refuse, before anything is written, an output that overlaps an input, a file, a directory that is not a
    Megatron checkpoint directory, or an existing iteration (with `overwrite`, only a torch_dist iteration
    directory is written over). What killed imports left (`mcore2hf.formats.paths`) is removed first."""
    target = iteration_dir(ckpt_dir, iteration)
    tracker = os.path.join(ckpt_dir, TRACKER)
    for inp in inputs:
        if overlaps(ckpt_dir, inp):
            raise ImportTargetError(f"output directory {ckpt_dir} overlaps the input {inp}: choose another output")
    if os.path.lexists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        raise ImportTargetError(f"output path {ckpt_dir} exists and is not a directory")
    remove_stale(tracker, TORCH_DIST_OUTPUT)
    if os.path.islink(target) or (os.path.lexists(target) and not os.path.isdir(target)):
        raise ImportTargetError(f"{target} is not a torch_dist checkpoint directory: refusing to replace it, "
                                "even with overwrite")
    remove_stale(target, TORCH_DIST_OUTPUT)
    if os.path.lexists(tracker) and not os.path.isfile(tracker):
        raise ImportTargetError(f"{tracker} exists and is not a file")
    if os.path.isdir(ckpt_dir) and not os.path.isfile(tracker) and user_entries(ckpt_dir):
        raise ImportTargetError(f"output directory {ckpt_dir} is not empty and not a Megatron checkpoint "
                                f"directory (no {TRACKER}): refusing to write into it")
    if os.path.lexists(target) and not overwrite:
        raise ImportTargetError(f"{target} exists (pass {option('overwrite')} to replace it)")
    check_output_dir(target, overwrite, TORCH_DIST_OUTPUT)


def import_checkpoint(hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, *,
                      hf_config: HFConfigLike | None = None, iteration: int = 0,
                      dtype: torch.dtype | str | None = None, tp: int | None = None,
                      make_vocab_size_divisible_by: int = 128,
                      singleton_local_shards: bool = False, moe_layer_freq: int | list[int] | str | None = None,
                      non_homogeneous_layers: bool = False, file_size: int | str = "5GB", overwrite: bool = False, progress: bool = True,
                      model_class: str = "gpt",
                      transformer_impl: str = MEGATRON_LM_TRANSFORMER_IMPL,
                      vision_tower: str | None = None) -> ImportReport:
    """Write a Megatron torch_dist checkpoint (`ckpt_dir/iter_NNNNNNN` + latest_checkpointed_iteration.txt)
    from an HF directory, which Megatron's `dist_checkpointing.load` reads at any TP/PP/VPP/EP/ETP layout and any
    vocab padding: the vocab-parallel tensors hold exactly vocab_size rows and Megatron loads them with
    `allow_shape_mismatch` (its padding rows zero). `tp` (with `make_vocab_size_divisible_by`) instead pads and
    chunks them exactly as training at that TP saves them; not needed for loading.

    `dtype` casts floating tensors (ones HF keeps in fp32, like e_score_correction_bias, stay fp32).
    `singleton_local_shards` writes per-expert keys with GLU fc1 as `_w`/`_v` (the metadata flag of the same name).
    The decoder layers' keys are stacked or per layer as megatron-core decides for the model that will load them
    (`layer_keys`): `moe_layer_freq` is that model's (Megatron-LM's `--moe-layer-freq`: an int, or a list / list
    expression such as '[0]+[1]*47'; default Megatron-LM's 1 where every layer is MoE, else the HF config's
    pattern), `non_homogeneous_layers` the sharded-state-dict metadata flag of that name. `model_class="hybrid"` writes the
    keys of the hybrid model `build_model(..., model_class="hybrid")` builds (megatron-core 0.19 HybridModel, 0.16
    MambaModel), its layer pattern derived from the HF config as build_model derives it. `transformer_impl` is the
    layer spec of the model that will load it (Megatron-LM's `--transformer-impl`): "transformer_engine" (Megatron-LM's
    default) keys the norms TE fuses into linears under the linears' `layer_norm_weight`, "local" as the local spec's
    keys map does (`checkpoint_keys.RENAMES`; what `build_model(use_te=False)` loads). `vision_tower` (a
    vision-language model, docs/vlm.md): the keys of Megatron-Bridge's wrapper holding its tower, the language
    model under `language_model.`: "native" a native Megatron tower (Bridge 0.6.2's Qwen3VLModel, `build_model(...,
    vision_tower="native")`), "hf" transformers' tower embedded (Bridge 0.3.1's Qwen3VLModel and GLM45VModel, 0.6.2's
    KimiK25VLModel: checkpoint_keys.TOWER_PREFIXES); None (default) the language model
    alone, as a GPT model's keys, the tower skipped. The iteration directory is
    written under a temporary name and renamed when complete; the tracker file is replaced last."""
    t0 = time.perf_counter()
    hf_dir = os.path.abspath(os.fspath(hf_dir))
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    cast = parse_dtype(dtype)
    limit = parse_size(file_size, "file_size")
    if model_class not in ("gpt", "hybrid"):
        raise UsageError(f"model_class must be 'gpt' or 'hybrid', got {model_class!r}")
    check_transformer_impl(transformer_impl)
    if vision_tower not in (None, *VISION_TOWERS):
        raise UsageError(f"vision_tower must be one of {', '.join(VISION_TOWERS)} or None, got {vision_tower!r}")
    if (tp is not None and tp < 1) or make_vocab_size_divisible_by < 1 or iteration < 0:
        raise ValueError(f"tp ({tp}) and make_vocab_size_divisible_by ({make_vocab_size_divisible_by}) must be "
                         f">= 1 and iteration ({iteration}) >= 0")
    source = config_source(hf_config if hf_config is not None else hf_dir)
    cfg = source.config
    inputs = [hf_dir] + ([source.directory] if source.directory else [])
    check_import_target(ckpt_dir, iteration, overwrite, inputs)
    converter = get_converter(cfg.model_type)
    spec = converter.spec
    dims = spec.dims(cfg)
    hybrid = None
    if model_class == "hybrid":
        from .model_specs.hybrid import hybrid_pattern

        # the pattern build_model gives the model, MTP depths as megatron-core 0.19's HybridModel holds them
        hybrid = HybridLayout.parse(hybrid_pattern(spec, cfg, mtp_depths=dims.num_mtp_layers))
    if vision_tower is not None:
        _check_vision_tower(converter, spec, vision_tower, model_class)
    stacked, why = layer_keys(spec, cfg, dims, moe_layer_freq, singleton=singleton_local_shards,
                              non_homogeneous=non_homogeneous_layers, hybrid=hybrid is not None)
    reader = HFDirectory(hf_dir)
    try:
        reader = as_published(reader, cfg)  # transformers' own save reads as the published layout
        sources, keys, objects = plan_import(reader, cfg, converter, dims, tp=tp, singleton=singleton_local_shards,
                                             divisible_by=make_vocab_size_divisible_by, stacked=stacked,
                                             hybrid=hybrid, transformer_impl=transformer_impl,
                                             vision_tower=vision_tower, non_homogeneous=non_homogeneous_layers)
    except BaseException:
        reader.close()
        raise

    def out_dtype(s: ImportSource) -> torch.dtype:
        return cast if cast is not None and s.dtype.is_floating_point and not s.keep_dtype else s.dtype

    key_dtypes = {p.key: out_dtype(s) for s in sources for p in s.parts}
    keys = {k: (shape, key_dtypes[k]) for k, (shape, _) in keys.items()}
    created = not os.path.isdir(ckpt_dir)
    target = iteration_dir(ckpt_dir, iteration)
    try:
        stage = Staging(target, TORCH_DIST_OUTPUT, overwrite)  # creates ckpt_dir
    except BaseException:
        reader.close()
        raise
    tmp = stage.path
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sources), unit="tensor", desc="import", disable=None)  # a bar only on a terminal
    try:
        writer = DistcpWriter(tmp, limit)
        for s, full in _tensors(reader, sources):
            full = full.to(out_dtype(s))
            for p in s.parts:
                writer.tensor(p.key, p.offsets, (full if p.rows is None else full[p.row0:p.row0 + p.rows])
                              .reshape(p.sizes))
            if bar is not None:
                bar.update(1)
        writer.finish(keys, objects, iteration)
        stage.commit()
        replace_file(os.path.join(ckpt_dir, TRACKER), str(iteration).encode(), TORCH_DIST_OUTPUT)  # the tracker last
    except BaseException as e:
        stage.abort()
        if created and os.path.isdir(ckpt_dir) and not os.listdir(ckpt_dir):
            os.rmdir(ckpt_dir)  # nothing of a failed import is left behind
        if isinstance(e, OSError):  # a full disk: named in one line
            raise stage.failure(e) from e
        raise
    finally:
        reader.close()
        if bar is not None:
            bar.close()
    return ImportReport(ckpt_dir, iteration, len(sources), len(keys) + len(objects), writer.bytes,
                        time.perf_counter() - t0, peak_rss(), why, transformer_impl)


def _tensors(reader: HFDirectory, sources: list[ImportSource]) -> Iterator[tuple[ImportSource, torch.Tensor]]:
    """Each Megatron tensor, rebuilt from its HF slices by the layout op's inverse (one at a time; the reader
    reads with positioned reads, so nothing read stays resident)."""
    for s in sources:
        hf = [reader.slice(n) for n in s.hf]
        yield s, s.op.shard_from_hf(hf, 0, 1, s.shape)
