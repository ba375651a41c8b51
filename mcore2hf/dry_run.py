"""The dry run behind `mcore2hf plan`: the export plan and each rank's extra memory, for any world size, in one
process and in seconds, as text or JSON.

The plan is a pure function of every rank's record (`plan.RankRecord`: its place and the names, shapes, dtypes
and TP attributes of its local tensors; `plan.planner.Planner`). A live world all-gathers the records; here they are
derived in this process, with megatron-core's own machinery:

* the ranks' coordinates and groups: megatron-core's `RankGenerator`s, built as `initialize_model_parallel` builds
  them (order tp-cp-ep-dp-pp, the expert grid with expert-TP and expert-DP);
* each rank's local tensors: the model chunks of its PP stage built on the meta device (no memory) with the real
  `build_model`, under Megatron's parallel state initialized at that stage's first rank in a `fake`
  torch.distributed world of the full size (torch's no-op backend: no process, no communication). Ranks of one
  stage differ only in their TP / expert-TP shard (same shapes, Megatron splits evenly) and their EP rank (the
  local experts' global indices, which `naming.local_tensors` derives from the EP rank), so one build per stage
  gives every rank's record;
* the plan: the live export's `Planner` on those records; the memory: `transfer.builders.memory_estimates`, the executor's own
  estimate per rank, its programs shared by ranks that differ only in rank ids.

tests/test_layout_matrix.py checks, in every layout world, that this plan's `describe()` and every rank's memory
equal what the live ranks built.
"""

from __future__ import annotations

import contextlib
import sys
import time


def rank_contexts(layout) -> list:
    """Every rank's `ParallelContext` (no process group) at `layout`, from megatron-core's `RankGenerator`s,
    built as megatron-core 0.16.1 parallel_state.initialize_model_parallel builds them (default order
    "tp-cp-ep-dp-pp", no context parallelism)."""
    from megatron.core.parallel_state import RankGenerator

    from .parallel import Axis, ParallelContext

    world, tp, pp, ep, etp = layout.size, layout.tp, layout.pp, layout.ep, layout.expert_tp
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order, rank_offset=0)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order, rank_offset=0)

    def axes(gen, token: str) -> dict[int, Axis]:
        out = {}
        for ranks in gen.get_ranks(token):
            for i, r in enumerate(ranks):
                out[r] = Axis(len(ranks), i, tuple(ranks), None)
        return out

    tps, pps, eps, etps = axes(dense, "tp"), axes(dense, "pp"), axes(expert, "ep"), axes(expert, "tp")
    return [ParallelContext(rank=r, world_size=world, tp=tps[r], pp=pps[r], ep=eps[r], etp=etps[r],
                            vpp=layout.vpp, backend="fake") for r in range(world)]


@contextlib.contextmanager
def _no_rope_tables():
    """YaRN rotary embeddings (DeepSeek-V3's MLA) compute their cos/sin tables on the CPU in __init__, in every
    layer (megatron-core 0.16.1 models/common/embeddings/yarn_rotary_pos_embedding.py `_set_cos_sin_cache`,
    device "cpu" whatever the default device): a forward cache, no parameter; skipped while the dry run builds."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    cls = yarn.YarnRotaryEmbedding
    real = cls.__dict__.get("_set_cos_sin_cache")
    if real is None:  # another release: nothing to skip
        yield
        return
    cls._set_cos_sin_cache = lambda self, *a, **k: None
    try:
        yield
    finally:
        cls._set_cos_sin_cache = real


def _stage_model(hf_config, layout, rank: int, world: int, dtype_name: str, te_names: bool,
                 vision_tower: str | None = None, model_class: str = "gpt", mtp: bool = True):
    """The model chunks of `rank` on the meta device, built under Megatron's parallel state at `layout` in a
    fake torch.distributed world (as `rank` of `world`); also the ParallelContext megatron-core gives that rank.
    The world and the parallel state are torn down before returning."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from .arch.build import build_model
    from .parallel import ParallelContext
    from .runtime.world import init_megatron

    dtype = getattr(torch, dtype_name)
    hook = sys.excepthook  # init_process_group prefixes errors with "[rank{r}]:" (torch 2.13): not ours to keep
    dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())
    try:
        init_megatron(layout, gloo_groups=False)
        overrides = dict(layout.config_overrides(), params_dtype=dtype)
        if not mtp:  # a model built without the HF config's MTP layers
            overrides["mtp_num_layers"] = None
        if dtype != torch.float32:  # as Megatron-LM configures bf16 / fp16 training
            overrides.update(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        with torch.device("meta"), _no_rope_tables():  # shapes and names only: no memory, no initialization
            # local spec: TE names, when asked for, are applied below (Transformer Engine needs no GPU then)
            chunks = build_model(hf_config, use_te=False, vision_tower=None if vision_tower == "hf" else vision_tower,
                                 model_class=model_class, **overrides)  # initialized as in training
            if vision_tower == "hf":
                chunks = [_embedded_tower(c, hf_config) for c in chunks]
            chunks = [c.to(dtype) for c in chunks]  # as Megatron's Float16Module does in training
        if te_names:
            from .runtime.te_naming import to_te_names

            to_te_names(chunks)
        return chunks, ParallelContext.from_megatron()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        sys.excepthook = hook


def _embedded_tower(chunk, hf_config):
    """A vision-language wrapper around the GPT chunk as Megatron-Bridge holds transformers' tower: Bridge 0.3.1's
    Qwen3VLModel (models/qwen_vl/modelling_qwen3_vl/model.py:97-107, `vision_model`) and GLM45VModel
    (models/glm_vl/modeling_glm_45v.py:126-131, `visual`), 0.6.2's KimiK25VLModel (models/kimi_vl/
    modeling_kimi_k25_vl.py:148-220, `vision_tower` and `mm_projector`): the tower's module(s) where the chunk holds
    the first stage's embedding (`pre_process`), registered first as their __init__s do, the GPT model as
    `language_model` (the names and shapes a plan needs; its forward is not run). Each tower module is the one a
    pass-through rule of the table names (`checkpoint_keys.embedded_tower_rules`, e.g. `visual.{NAME}` ->
    `model.visual.{NAME}`) in transformers' multimodal class built from the config; where that class holds it under
    other names than the published checkpoint (Kimi-K2.5: its conversion_mapping renames on load, and Bridge builds
    the checkpoint's remote code), a module holding the published tensors' names and shapes."""
    import torch
    from transformers import AutoModelForImageTextToText

    from .arch.hf_config import hf_tensor_shapes
    from .arch.mapping import NAME
    from .arch.registry import get_converter
    from .errors import UsageError, option
    from .formats.checkpoint_keys import TOWER_PREFIXES, embedded_tower_rules

    rules = embedded_tower_rules(get_converter(hf_config.model_type).rules)
    if not rules:
        raise UsageError(f"{option('vision_tower', 'hf')}: {hf_config.model_type!r} has no embedded tower under "
                         f"{', '.join(TOWER_PREFIXES)} (Megatron-Bridge's Qwen3VLModel: qwen3_vl, qwen3_vl_moe, "
                         "qwen3_5, qwen3_5_moe; GLM45VModel: glm4v_moe; KimiK25VLModel: kimi_k25)")
    wrapper = torch.nn.Module()
    if chunk.pre_process:  # registered first, as Bridge's __init__ does (the order of its parameters)
        dtype = next(chunk.parameters()).dtype
        hf = AutoModelForImageTextToText.from_config(hf_config, dtype=dtype)
        shapes = hf_tensor_shapes(hf_config)
        for rule in rules:
            path = rule.hf[0].removesuffix(f".{{{NAME}}}")
            published = {n[len(path) + 1:]: s for n, s in shapes.items() if n.startswith(f"{path}.")}
            try:
                module = hf.get_submodule(path)
            except AttributeError:
                module = None
            if module is None or {n: tuple(p.shape) for n, p in module.named_parameters()} != published:
                module = _module_of(published, dtype)
            wrapper.add_module(rule.megatron.removesuffix(f".{{{NAME}}}"), module)
    wrapper.language_model = chunk
    return wrapper


def _module_of(shapes: dict[str, tuple[int, ...]], dtype):
    """A module holding parameters of these dotted names and shapes (uninitialized)."""
    import torch

    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(tuple(shape), dtype=dtype)))
    return root


def dry_run_records(hf_config, layout, *, dtype: str = "bfloat16", te_names: bool = False,
                    vision_tower: str | None = None, model_class: str = "gpt", mtp: bool = True):
    """(every rank's RankRecord, every rank's ParallelContext, the Megatron model's TransformerConfig) at `layout`,
    derived in this process (module docstring). torch.distributed must not be initialized here."""
    import dataclasses

    import torch.distributed as dist

    from .arch.naming import local_tensors, model_config, shift_experts
    from .errors import ParallelStateError
    from .plan.export import rank_record

    if dist.is_available() and dist.is_initialized():
        raise ParallelStateError("the dry run sets up its own (fake) torch.distributed world in this process, but "
                                 "torch.distributed is already initialized here: run it in a process without one "
                                 "(e.g. `mcore2hf plan`)")
    contexts = rank_contexts(layout)
    records: list = [None] * layout.size
    config = None
    for stage in range(layout.pp):
        ranks = [c for c in contexts if c.pp.rank == stage]
        first = ranks[0]
        chunks, megatron_ctx = _stage_model(hf_config, layout, first.rank, layout.size, dtype, te_names, vision_tower,
                                            model_class, mtp)
        mine = dataclasses.replace(megatron_ctx, backend=first.backend)
        mine = dataclasses.replace(mine, tp=dataclasses.replace(mine.tp, group=None),
                                   pp=dataclasses.replace(mine.pp, group=None),
                                   ep=dataclasses.replace(mine.ep, group=None),
                                   etp=dataclasses.replace(mine.etp, group=None))
        if mine != first:  # the RankGenerators above must give what initialize_model_parallel gave
            raise AssertionError(f"internal error: rank {first.rank}: megatron-core's parallel state {mine} differs "
                                 f"from the dry run's {first}")
        config = config or model_config(chunks)
        local = local_tensors(chunks, first)
        experts = getattr(config, "num_moe_experts", None) or 0
        by_ep: dict[int, list] = {first.ep.rank: local}
        for ctx in ranks:  # names depend on the EP rank only (the local experts' global indices)
            if ctx.ep.rank not in by_ep:
                offset = (ctx.ep.rank - first.ep.rank) * (experts // ctx.ep.size)
                by_ep[ctx.ep.rank] = shift_experts(local, offset)
            records[ctx.rank] = rank_record(by_ep[ctx.ep.rank], ctx)
    return records, contexts, config


def dry_run(hf_config, layout, *, bucket_bytes: int, dtype: str = "bfloat16", te_names: bool = False,
            name_filter=None, quantize: str | None = None, vision_tower: str | None = None, model_class: str = "gpt",
            mtp: bool = True):
    """(the ExportPlan every rank of a live world at `layout` would build, each rank's memory estimate as
    `Executor.memory_estimate()` gives it, all ranks receiving), computed in this process. `vision_tower="native"`:
    the model as `build_model(..., vision_tower="native")` builds it (its tower on the first stage); "hf":
    Megatron-Bridge 0.3.1's Qwen3VLModel (transformers' tower embedded on the first stage, `_embedded_tower`).
    `model_class="hybrid"`: the hybrid model `build_model(..., model_class="hybrid")` builds; `mtp=False`: the
    model built without the HF config's MTP layers (`mtp_num_layers=None`)."""

    from .arch.hf_config import load_hf_config
    from .arch.registry import get_converter
    from .plan.checks import check, checked_dims
    from .plan.options import ExportOptions
    from .plan.planner import Planner
    from .transfer.builders import memory_estimates

    cfg = load_hf_config(hf_config)
    records, contexts, config = dry_run_records(cfg, layout, dtype=dtype, te_names=te_names, vision_tower=vision_tower,
                                                model_class=model_class, mtp=mtp)
    converter = get_converter(cfg.model_type)
    spec = converter.spec
    dims = checked_dims(spec, cfg, int(getattr(config, "mtp_num_layers", None) or 0), "the Megatron model")
    check(spec, cfg, dims, what="the Megatron model", model_config=config)  # as HFExporter checks the live model
    planner = Planner(records, cfg, converter, dims, layout.tp, layout.expert_tp)
    plan = planner.plan(ExportOptions(bucket_bytes, name_filter=name_filter, quantize=quantize))
    return plan, memory_estimates(plan, contexts)


def run_plan(hf_config, layout, *, bucket_bytes: int, dtype: str = "bfloat16", te_names: bool = False,
             name_filter=None, quantize: str | None = None, vision_tower: str | None = None,
             model_class: str = "gpt", mtp: bool = True) -> dict:
    """The plan as a dict (tensors, buckets, layout, each rank's memory). The layout is checked first.
    `quantize="fp8"` / `"fp8-ue8m0"`: the FP8 export's plan (which weights are quantized, scale shapes)."""
    from .arch.hf_config import load_hf_config

    t0 = time.perf_counter()
    cfg = load_hf_config(hf_config)
    layout.check(cfg, processes=False)
    plan, memory = dry_run(cfg, layout, bucket_bytes=bucket_bytes, dtype=dtype, te_names=te_names,
                           name_filter=name_filter, quantize=quantize, vision_tower=vision_tower,
                           model_class=model_class, mtp=mtp)
    report = plan.to_dict()
    report["layout"] = {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep,
                        "etp": layout.expert_tp, "world_size": layout.size}
    report["memory"] = [dict(rank=r, **m) for r, m in enumerate(memory)]
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report
