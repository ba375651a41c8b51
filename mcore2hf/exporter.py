"""HFExporter: a live, sharded Megatron model -> byte-bounded buckets of full HF tensors."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence

import torch

from .arch.hf_config import HFConfigLike, config_source
from .arch.lora import (
    EXPERT_FORMS,
    LORA_MODES,
    LoraInfo,
    Merger,
    gather_adapters,
    peft_config,
)
from .arch.mapping import Converter
from .arch.naming import LocalTensor, local_tensors, model_config, unwrap_model
from .arch.registry import get_converter
from .collective import agree
from .errors import Mcore2HFError, UsageError
from .formats.hf_dir import group_tensors, stored_buckets
from .formats.safetensors import (
    SafetensorsWriter,
    TensorInfo,
    base_completion,
    check_base,
    check_target,
    read_base,
)
from .parallel import ParallelContext
from .plan.checks import check, checked_dims
from .plan.engine import EngineShardPlan, plan_engine_shards
from .plan.engine_shards import EngineRank, EngineShardError
from .plan.export import ExportPlan, MTPTensors, gather_records, mtp_outputs
from .plan.options import (
    DEFAULT_BUCKET_BYTES,
    ExportOptions,
    NameFilterLike,
    Quantize,
    Receivers,
    export_options,
)
from .plan.planner import Planner, fp8_policy
from .transfer.buckets import Bucket
from .transfer.engine import EngineBucket, EngineExecutor
from .transfer.export import Executor

BASE_SYNC = ("first", "every")  # HFExporter(base=...): the base's tensors with the first export, or with every one

log = logging.getLogger("mcore2hf")
MODEL = "the Megatron model"  # what the checks name


class HFExporter:
    """Streams a Megatron model's weights out as HF-named full tensors.

    Every rank of the model's world constructs it and calls `buckets()` / `save_pretrained()` in step: the
    collectives happen inside. The first call builds the plan (one metadata all-gather); later calls reuse it.

    Which ranks receive full tensors is the `receivers` argument of `buckets()`:
      * "all" (default): every rank gets every tensor (colocated RL sync: each trainer rank feeds the
        inference engine on its GPU);
      * a rank or list of ranks: only those get tensors (saving, a distributed sender), and each shard is
        sent once to each of them; the others yield empty buckets so every rank's loop runs in step.

    Extra memory per rank: a staging arena for the collectives (the largest bucket's gathered shards; two with
    `overlap=True`), kept between calls so later exports allocate nothing for it (`release()` frees it), plus the
    output buffer of the bucket being built, plus any bucket the caller still holds. A tensor larger than
    `bucket_bytes` is a bucket alone, so a bucket here is at most max(bucket_bytes, largest tensor).
    """

    def __init__(self, model, hf_config: HFConfigLike, *, converter: Converter | None = None,
                 lora: str | None = None, lora_experts: str = "per_expert", base: str | os.PathLike | None = None,
                 base_sync: str = "first"):
        """`lora`: for a model with Megatron-Bridge LoRA adapters (docs/lora.md), what is exported: "adapter" (the
        adapters alone, HF/PEFT names; `save_pretrained` writes a PEFT adapter directory), "merged" (W + alpha/r B A,
        computed on the shards; the model is not modified) or "base" (the frozen base weights). `lora_experts`
        (lora="adapter"): routed experts' adapters "per_expert" (`experts.E.gate_proj.lora_A`, what SGLang and vLLM's
        2-D MoE LoRA load) or "stacked" (PEFT's 3-D form on transformers 5's fused experts, `target_parameters`;
        vLLM 0.33 `is_3d_lora_weight`).

        `base` (an HF directory, e.g. the published checkpoint): the tensors the converter declares not held by the
        Megatron model that it does not produce (a frozen vision tower the trainer does not hold, docs/vlm.md
        layout 3) complete the export, read from it as stored (hf_dir: one bucket in memory at a time) and
        delivered after the model's own buckets, on the ranks that receive (each read by those ranks alone, never
        gathered): with the first export only (`base_sync="first"`: `buckets()` iterated to its end, or a
        `sync()` that committed), or with every export (`"every"`: engines that reload or free them).
        `save_pretrained` completes its directory from it unless given another `base`."""
        if lora is not None and lora not in LORA_MODES:
            raise UsageError(f"lora must be one of {LORA_MODES} or None, got {lora!r}")
        if lora_experts != "per_expert" and lora != "adapter":
            raise UsageError(f"lora_experts={lora_experts!r}: expected lora='adapter' (only an adapter export has an "
                             f"expert form), found lora={lora!r}")
        if lora_experts not in EXPERT_FORMS:
            raise UsageError(f"lora_experts must be one of {EXPERT_FORMS}, got {lora_experts!r}")
        if base_sync not in BASE_SYNC:
            raise UsageError(f"base_sync must be one of {BASE_SYNC}, got {base_sync!r}")
        self.base, self.base_sync = (None if base is None else os.fspath(base)), base_sync
        self._base_delivered = False
        self._base_groups: dict[ExportOptions, list] = {}
        self.lora, self.lora_experts = lora, lora_experts
        self.lora_info: LoraInfo | None = None
        self._merger: Merger | None = None
        self.chunks = unwrap_model(model)
        self.config_source = config_source(hf_config)  # written as given by save_pretrained
        self.hf_config = self.config_source.config
        self.converter = converter or get_converter(self.hf_config.model_type)
        self.spec = self.converter.spec
        self.ctx = ParallelContext.from_megatron()
        self.dims = checked_dims(self.spec, self.hf_config, mtp_layers(model_config(self.chunks)), MODEL)
        self._local: dict[str, LocalTensor] | None = None
        self._planner: Planner | None = None
        self._plans: dict[tuple, EngineShardPlan] = {}  # (engine ranks, options.planned)
        self._executors: dict[ExportOptions, Executor] = {}
        self._engine_executors: dict[tuple, EngineExecutor] = {}  # (engine ranks, options.planned, output, debug)
        p = next(self.chunks[0].parameters())
        self.device = p.device

    # -- planning --------------------------------------------------------------------------------------------
    @property
    def planner(self) -> Planner:
        """The plan's builder, from every rank's record (collective on first use: one metadata all-gather)."""
        if self._planner is None:
            check(self.spec, self.hf_config, self.dims, what=MODEL, model_config=model_config(self.chunks))
            local = local_tensors(self.chunks, self.ctx)
            self._local = {t.name: t for t in local}
            planner = Planner.of(gather_records(local, self.ctx), self.hf_config, self.converter, self.dims,
                                 self.ctx.tp.size, self.ctx.etp.size, lora=self.lora, lora_experts=self.lora_experts,
                                 verbose=self.ctx.rank == 0)
            if self.lora in ("adapter", "merged"):
                self.lora_info, mine = gather_adapters(self.chunks, local, self.converter, self.dims,
                                                       self.ctx.world_size)
                if self.ctx.etp.size > 1 and self.ctx.rank == 0 and any(a.is_expert for a in mine):
                    log.warning("LoRA on experts at expert-TP %d: Megatron-Bridge's forward of expert adapters at "
                                "expert-TP > 1 is not LoRA (Megatron-Bridge issue 5634); the export is W + alpha/r "
                                "B A of the trained factors, which is not what that forward computed (docs/lora.md)",
                                self.ctx.etp.size)
            if self.lora == "merged":
                self._merger = Merger(mine, self._local, self.lora_info, self.ctx.tp, self.ctx.etp)
                self._local = self._merger.merged_local()
            self._planner = planner
        return self._planner

    def export_options(self, options: ExportOptions | None = None, **given) -> ExportOptions:
        """The settings of one call as the one normalised value every cache is keyed by: `options`, or the
        separate arguments (bucket_bytes, receivers, overlap, name_filter, quantize); receivers checked against
        this world. Every method taking these settings also takes `options=` (what `sync()` passes through)."""
        return export_options(options, **given).check_receivers(self.ctx.world_size)

    def plan(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, name_filter: NameFilterLike = None,
             quantize: Quantize = None, *, options: ExportOptions | None = None) -> ExportPlan:
        """The export plan (collective on first call). `print(plan.describe())` is the dry run.

        `name_filter(hf_name) -> bool` keeps only the HF tensors it accepts (e.g. no MTP layers for an engine
        without them): filtered tensors are not gathered, converted or sent. `quantize="fp8"` / `"fp8-ue8m0"`:
        the weights the architecture's converter quantizes are delivered as float8_e4m3fn plus a float32
        `weight_scale_inv` [ceil(out/128), ceil(in/128)] (DeepSeek-V3 / Qwen3-FP8 format), bit-identical to
        quantizing each full HF tensor; tensors whose 128x128 blocks never straddle a shard are quantized where
        they are held, before the collectives (half the bytes on the wire), the others after the gather."""
        return self.planner.plan(self.export_options(options, bucket_bytes=bucket_bytes, name_filter=name_filter,
                                                     quantize=quantize))

    def draft_tensors(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      name_filter: NameFilterLike = None) -> MTPTensors:
        """The HF tensors of the model's MTP layers this export sends (collective on first use: the plan): what an
        engine's MTP draft loads (senders/drafts.py). Empty for a model without MTP layers, or an adapter export."""
        if self.lora == "adapter" or not self.dims.num_mtp_layers:
            return MTPTensors(frozenset(), frozenset())
        return mtp_outputs(self.plan(bucket_bytes, name_filter).sources, self.dims.num_layers)

    def fp8_policy(self):
        """The architecture's FP8 table (which HF tensors stay unquantized), from its converter."""
        return fp8_policy(self.converter)

    @property
    def local_tensors(self) -> dict[str, LocalTensor]:
        """This rank's tensors by canonical name, as the executors read them (known once a plan was built)."""
        if self._local is None:
            raise ValueError("local_tensors: expected a plan to have been built (plan(), engine_plan()), found none")
        return self._local

    def release(self) -> None:
        """Free the compiled executors and their staging arenas (the plan is kept; the next export recompiles)."""
        self._executors.clear()
        self._engine_executors.clear()

    def executor(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, receivers: Receivers = "all",
                 overlap: bool = False, name_filter: NameFilterLike = None, quantize: Quantize = None, *,
                 options: ExportOptions | None = None) -> Executor:
        """The compiled executor for these settings (built and cached on first use)."""
        return self._executor(self.export_options(options, bucket_bytes=bucket_bytes, receivers=receivers,
                                                  overlap=overlap, name_filter=name_filter, quantize=quantize))

    def _executor(self, opts: ExportOptions) -> Executor:
        if opts not in self._executors:
            plan = self.planner.plan(opts)
            self._executors[opts] = Executor(plan, self.ctx, self._local, opts.receivers, self.device,
                                             arenas=2 if opts.overlap else 1)
        return self._executors[opts]

    # -- export ----------------------------------------------------------------------------------------------
    def buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, receivers: Receivers = "all",
                overlap: bool = False, name_filter: NameFilterLike = None,
                quantize: Quantize = None, *, options: ExportOptions | None = None) -> Iterator[Bucket]:
        """Yield buckets of (HF name, full tensor). Every rank must iterate to the end.

        Drop each bucket before asking for the next to keep one output bucket alive at a time. `overlap=True`
        runs the next bucket's first collectives while this one is converted, with one more bucket of staging.
        `name_filter(hf_name) -> bool` selects tensors at plan level (see `plan`). `quantize="fp8"` /
        `"fp8-ue8m0"`: block-FP8 weights and their `weight_scale_inv` tensors, ordinary entries of the bucket."""
        opts = self.export_options(options, bucket_bytes=bucket_bytes, receivers=receivers, overlap=overlap,
                                   name_filter=name_filter, quantize=quantize)
        groups = self._base_groups_of(opts)  # checked before anything moves
        yield from self._model_buckets(opts)
        yield from self._base_buckets(opts, groups)
        self.base_delivered()

    def _model_buckets(self, opts: ExportOptions) -> Iterator[Bucket]:
        self._refresh_merge()
        yield from self._executor(opts).run()

    # -- base completion (the base's tensors the model does not hold) -----------------------------------------------
    def base_groups(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, name_filter: NameFilterLike = None,
                    quantize: Quantize = None, *, options: ExportOptions | None = None) -> list:
        """The base checkpoint's tensors this export delivers after the model's, in buckets of at most
        `bucket_bytes` (`hf_dir.group_tensors`); [] without a base, or once delivered with base_sync="first".
        Checked once per settings (no communication: every rank reads the same headers), before anything moves:
        the base is this model's checkpoint (model_type, unquantized, shapes of the tensors both have) and what it
        adds is only what the converter declares not held (`senders.safetensors.base_completion`)."""
        return self._base_groups_of(self.export_options(options, bucket_bytes=bucket_bytes, name_filter=name_filter,
                                                        quantize=quantize))

    def _base_groups_of(self, opts: ExportOptions) -> list:
        if self.base is None or self.lora == "adapter" or (self.base_sync == "first" and self._base_delivered):
            return []
        key = opts.planned
        if key not in self._base_groups:
            if key.quantize is not None:
                raise UsageError("a quantized export is not completed from a base checkpoint (its tensors would be "
                                 "missing from the quantization config): drop quantize, or base")
            check_base(self.base, self.config_source)
            produced = [TensorInfo(e.name, e.shape, e.dtype) for e in self.planner.plan(key).hf_entries()]
            tensors = base_completion(produced, read_base(self.base), self.converter.not_held_by_model)
            keep = key.name_filter or (lambda name: True)
            self._base_groups[key] = group_tensors([t for t in tensors if keep(t.name)], key.bucket_bytes)
        return self._base_groups[key]

    def base_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, receivers: Receivers = "all",
                     name_filter: NameFilterLike = None, quantize: Quantize = None,
                     groups: list | None = None, *, options: ExportOptions | None = None) -> Iterator[Bucket]:
        """The base's tensors (`base_groups`) as buckets, numbered after the model's: read from the base directory
        on each receiving rank (empty buckets elsewhere, so loops stay in step). `buckets()` and `sync()` send them
        after the model's; call `base_delivered()` once they reached their destination."""
        opts = self.export_options(options, bucket_bytes=bucket_bytes, receivers=receivers, name_filter=name_filter,
                                   quantize=quantize)
        return self._base_buckets(opts, self._base_groups_of(opts) if groups is None else groups)

    def _base_buckets(self, opts: ExportOptions, groups: list) -> Iterator[Bucket]:
        if not groups:
            return iter(())
        recv = opts.receivers
        device = self.device if recv is None or self.ctx.rank in recv else None
        first = len(self.planner.plan(opts).buckets)
        return stored_buckets(self.base, groups, first, device)

    def base_delivered(self) -> None:
        """The base's tensors reached the engines (with base_sync="first", later exports do without them)."""
        self._base_delivered = True

    def _refresh_merge(self) -> None:
        """lora="merged": gather the adapters' split factors (collective, before every export: training moves them)."""
        self.planner  # noqa: B018 - built (and the merger made) on first use
        if self._merger is not None:
            self._merger.refresh()

    def engine_plan(self, engine_ranks: Sequence[EngineRank], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    name_filter: NameFilterLike = None, *, options: ExportOptions | None = None) -> EngineShardPlan:
        """The engine-shard plan (routes from holders to engine ranks), built once per settings, no communication
        beyond the export plan's. `engine_ranks`: e.g. `colocated_ranks(world_size, "sglang", tp_size)`."""
        if self.lora == "adapter":
            raise EngineShardError("LoRA adapters are not engine-sharded: engines load an adapter whole and slice it "
                                   "for their own TP (SGLang 0.5.23 srt/managers/tp_worker.py:220); export it with "
                                   "buckets() or save_pretrained() (docs/lora.md)")
        opts = self.export_options(options, bucket_bytes=bucket_bytes, name_filter=name_filter)
        key = (tuple(engine_ranks), opts.planned)
        if key not in self._plans:
            self._plans[key] = plan_engine_shards(self.planner.plan(opts.planned), list(engine_ranks), self.dims)
        return self._plans[key]

    def engine_buckets(self, engine_ranks: Sequence[EngineRank], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       name_filter: NameFilterLike = None, quantize: Quantize = None, output: str = "slices",
                       debug: bool = False, *, options: ExportOptions | None = None) -> Iterator[EngineBucket]:
        """Engine-sharded export (collective: every rank iterates): each rank's bucket holds only the regions its
        engine rank loads (`bucket.slices()` raw; `bucket.as_bucket()` full-shaped, a Bucket any sender sends);
        a rank that feeds no engine rank gets empty buckets. No byte is received that the engine rank does not
        load. `output="masked"` writes every piece straight into its full-shaped HF tensor (`as_bucket()` is
        then free); `debug` fills the unsent regions with NaN (float dtypes)."""
        self._refresh_merge()
        return self.engine_executor(engine_ranks, bucket_bytes, name_filter, quantize, output, debug,
                                    options=options).run()

    def engine_executor(self, engine_ranks: Sequence[EngineRank], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        name_filter: NameFilterLike = None, quantize: Quantize = None, output: str = "slices",
                        debug: bool = False, *, options: ExportOptions | None = None) -> EngineExecutor:
        """The compiled engine-shard executor for these settings (built and cached on first use; its `stats`
        count the bytes sent, received and copied locally). Refusals (EngineShardError) come from here, before
        anything moves."""
        opts = self.export_options(options, bucket_bytes=bucket_bytes, name_filter=name_filter, quantize=quantize)
        if opts.quantize is not None:
            raise EngineShardError(f"quantize={opts.quantize.name!r} with engine sharding: not supported yet (FP8 "
                                   "blocks need 128-aligned regions); export unquantized or with buckets()")
        pending = [t.name for g in self._base_groups_of(opts) for t in g]
        if pending:
            raise EngineShardError(f"engine sharding with a base checkpoint: its {len(pending)} tensor(s) the model "
                                   f"does not hold (e.g. {pending[:3]}) are read whole from disk, not sharded for the "
                                   "engines' ranks; sync them without engine sharding first (base_sync='first'), or "
                                   "export them with buckets()")
        key = (tuple(engine_ranks), opts.planned, output, debug)
        if key not in self._engine_executors:
            self._engine_executors[key] = EngineExecutor(self.engine_plan(engine_ranks, options=opts.planned),
                                                         self.ctx, self._local, self.device, output=output, debug=debug)
        return self._engine_executors[key]

    def named_tensors(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, receivers: Receivers = "all",
                      name_filter: NameFilterLike = None, quantize: Quantize = None, *,
                      options: ExportOptions | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets(bucket_bytes, receivers, name_filter=name_filter, quantize=quantize,
                                   options=options):
            yield from bucket

    def state_dict(self, receivers: Receivers = "all", name_filter: NameFilterLike = None,
                   quantize: Quantize = None, *, options: ExportOptions | None = None) -> dict[str, torch.Tensor]:
        """All HF tensors as one dict (copies): for tests and small models."""
        return {name: t.clone() for name, t in self.named_tensors(receivers=receivers, name_filter=name_filter,
                                                                  quantize=quantize, options=options)}

    def adapter_config(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, name_filter: NameFilterLike = None,
                       base: str | os.PathLike | None = None, *, options: ExportOptions | None = None) -> dict:
        """lora="adapter": the PEFT adapter_config.json of this export as a dict (r, lora_alpha, target_modules,
        `base_model_name_or_path`: `base` or else the HF config's directory); collective on first use (the plan).
        What save_pretrained writes, and what the engine senders hand SGLang (`config_dict`)."""
        if self.lora != "adapter":
            raise UsageError(f"adapter_config: expected an HFExporter(lora='adapter'), found lora={self.lora!r}")
        opts = self.export_options(options, bucket_bytes=bucket_bytes, name_filter=name_filter)
        names = [e.name for e in self.planner.plan(opts.planned).hf_entries()]  # sets lora_info
        return peft_config(self.lora_info, names, self.dims.num_layers,
                           os.fspath(base) if base is not None else self.config_source.directory)

    def save_pretrained(self, out_dir: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES, writer_rank: int = 0,
                        overwrite: bool = False, extra_files: Sequence[str] | None = None,
                        name_filter: NameFilterLike = None, progress: bool = True, quantize: Quantize = None,
                        base: str | os.PathLike | None = None, options: ExportOptions | None = None) -> str:
        """Write config.json, sharded *.safetensors and model.safetensors.index.json (from writer_rank only).

        Collective. The directory appears only when complete; on failure every rank raises and nothing is left.
        config.json is the user's file as given (only the dtype value changes, a quantization_config of the
        source is dropped); tokenizer and generation files of an HF directory given as config are copied
        (`extra_files` replaces that list). `progress` shows a progress bar on the writer rank (on a terminal).
        `quantize="fp8"` / `"fp8-ue8m0"` writes a block-FP8 checkpoint with its `quantization_config`.
        `base` (an HF directory, e.g. the published checkpoint) completes the output with the base tensors the
        converter declares not held by the Megatron model (a text model's vision tower), copied in bounded chunks,
        and the base's tokenizer/preprocessor files; config.json stays the export's (see SafetensorsWriter).
        With lora="adapter" it writes a PEFT adapter directory instead: adapter_config.json (r, lora_alpha,
        target_modules, `base_model_name_or_path`: `base` or else the HF config's directory) and one
        adapter_model.safetensors, as peft's PeftModel.from_pretrained loads it."""
        opts = dataclasses.replace(self.export_options(options, bucket_bytes=bucket_bytes, name_filter=name_filter,
                                                       quantize=quantize).planned, receivers=writer_rank)
        scheme = opts.quantize
        if base is None and self.base is not None and scheme is None and self.lora != "adapter":
            base = self.base  # the exporter's base completes its directory too
        adapter_config = None
        if self.lora == "adapter":
            if scheme is not None:
                raise UsageError("a LoRA adapter export is not quantized: drop quantize")
            adapter_config = self.adapter_config(base=base, options=opts.planned)
        plan = self.planner.plan(opts)
        quantization = None
        if scheme is not None:
            unquantized = self.planner.plan(opts.unquantized)
            quantization = scheme.config(self.fp8_policy(), [(e.name, e.shape) for e in unquantized.hf_entries()])
        writer = None
        error = None
        src = self.config_source
        if self.ctx.rank == writer_rank:
            try:
                inputs = ([src.directory] if src.directory else []) + ([base] if base is not None else [])
                check_target(out_dir, overwrite, inputs)
                infos = [TensorInfo(e.name, e.shape, e.dtype) for e in plan.hf_entries()]
                if adapter_config is not None:  # the base is named in adapter_config.json, never copied
                    writer = SafetensorsWriter(out_dir, infos, None, overwrite=overwrite, inputs=inputs,
                                               adapter_config=adapter_config)
                else:
                    writer = SafetensorsWriter(out_dir, infos, src, max_shard_size=max_shard_size,
                                               overwrite=overwrite, inputs=inputs, quantization=quantization,
                                               extra_files=src.companion_files if extra_files is None else extra_files,
                                               base=base, not_held=self.converter.not_held_by_model)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = f"{type(e).__name__}: {e}"
        agree(error, Mcore2HFError, f"save_pretrained({out_dir}) failed on ")  # the writer's error, on every rank
        bar = None
        if writer is not None and progress:
            from tqdm import tqdm

            bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="save_pretrained", disable=None)
        # the model's buckets: the writer completes the directory from `base` itself (byte ranges, file to file)
        for bucket in self._model_buckets(opts.check_receivers(self.ctx.world_size)):
            if writer is not None and error is None:
                try:
                    writer.send(bucket)
                except Exception as e:  # noqa: BLE001 - keep draining so the other ranks do not hang
                    error = f"{type(e).__name__}: {e}"
                if bar is not None:
                    bar.update(bucket.nbytes)
        if bar is not None:
            bar.close()
        if writer is not None:
            if error is None:
                try:
                    writer.finish()
                except Exception as e:  # noqa: BLE001
                    error = f"{type(e).__name__}: {e}"
            else:
                writer.abort()
        agree(error, Mcore2HFError, f"save_pretrained({out_dir}) failed on ")
        return os.path.abspath(os.fspath(out_dir))


def mtp_layers(model_config) -> int:
    """The MTP layers a Megatron model has (its TransformerConfig's mtp_num_layers)."""
    return int(getattr(model_config, "mtp_num_layers", None) or 0)
