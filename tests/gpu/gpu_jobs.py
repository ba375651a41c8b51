"""What the GPU suite's NCCL workers run (one process per GPU, spawned by mcore2hf.runtime.world.run_world).

Every check compares on this rank, tensor by tensor, with an oracle that is not the code under test: the HF
checkpoint transformers wrote and the model was loaded from (exact: the export is a permutation of it), DeepGEMM's
quantizer run on the CPU for FP8 (tests/oracle.py; a GPU runs the same arithmetic to other bytes for some
elements), and the all-ranks export for engine-shard slices. Failures are collected, not raised, so every rank
keeps issuing the same collectives to the end; the test asserts on what each rank returns."""

from __future__ import annotations

import faulthandler
import itertools
import os
import re
from collections import defaultdict

import torch
import torch.distributed as dist

from mcore2hf import HFExporter, build_model, load_hf_weights
from mcore2hf.hf_config import load_hf_config
from mcore2hf.runtime.tiny import read_hf_checkpoint
from mcore2hf.runtime.world import Layout

#: seconds a worker may spend in one job before it dumps its stack and exits (the parent's timeout is longer)
JOB_TIMEOUT = 240


def build_cuda(ckpt: str, layout: Layout, vision_tower: str | None = None) -> tuple:
    """A bf16 model of the checkpoint at `layout`, built on this rank's GPU as a training job builds it (Megatron's
    initialization on the device), then loaded from the checkpoint."""
    from megatron.core import tensor_parallel

    cuda = torch.cuda.is_available()  # the same job runs on CPU (gloo) to check the job itself
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    with torch.device(this_device()):
        chunks = build_model(ckpt, use_te=False, params_dtype=torch.bfloat16, bf16=True, vision_tower=vision_tower,
                             use_cpu_initialization=not cuda, **layout.config_overrides())
    chunks = [c.to(torch.bfloat16) for c in chunks]  # what Megatron's Float16Module does (norms too)
    load_hf_weights(chunks, ckpt)
    return load_hf_config(ckpt), chunks


def this_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def differ(got: dict, want: dict, what: str) -> list[str]:
    """This rank's mismatches of an export with its oracle (names, dtypes, every byte)."""
    problems = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        problems.append(f"{what}: missing {missing[:3]} ({len(missing)}), extra {extra[:3]} ({len(extra)})")
    bad = [n for n in want if n in got and (got[n].dtype != want[n].dtype or got[n].shape != want[n].shape
                                            or not torch.equal(got[n], want[n]))]
    if bad:
        problems.append(f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[:4]}")
    return problems


def collect(buckets, hold: bool = False, between=None) -> dict:
    """name -> tensor of every bucket (cloned unless `hold`: then the buckets themselves are kept alive to the end,
    and the next ones are built while they are held); `between()` runs after each bucket (consumer collectives)."""
    out, held = {}, []
    for b in buckets:
        if hold:
            held.append(b)
            out.update(dict(b))
        else:
            out.update({n: t.clone() for n, t in b})
        if between is not None:
            between()
        del b
    return out


def bucket_kinds(plan, layout: Layout, bucket_bytes: int) -> list[str]:
    """Which kinds of bucket the plan holds (the GPU suite must reach each): gathered straight into the output
    (`direct`), through staging at PP or EP > 1 (`staged`), a layer's routed experts over several buckets
    (`experts-split`), a tensor alone over the budget (`oversize`), a stacked tensor gathered in rounds
    (`rounds`), and at PP > 1 a bucket whose stages' contributions need different earlier collectives
    (`pp-uneven-depends`: one stage packs local tensors only, another packs what a TP/EP all-gather delivered)."""
    kinds = set()
    layer_buckets = defaultdict(set)
    for b in plan.buckets:
        if b.direct is not None:
            kinds.add("direct")
        elif layout.pp > 1 or layout.ep > 1:
            kinds.add("staged")
        if b.nbytes > bucket_bytes and len(b.sources) == 1:
            kinds.add("oversize")
        if b.rounds:
            kinds.add("rounds")
        for s in b.sources:
            m = re.search(r"layers\.(\d+)\.mlp\.experts\.", s.name)
            if m and s.is_expert:
                layer_buckets[(s.stage, m.group(1))].add(b.index)
        if layout.pp > 1:
            needs = {st: any(s.count > 1 or (s.is_expert and layout.ep > 1) for s in b.sources if s.stage == st)
                     for st in range(layout.pp)}
            if len(set(needs.values())) > 1:
                kinds.add("pp-uneven-depends")
    if any(len(v) > 1 for v in layer_buckets.values()):
        kinds.add("experts-split")
    return sorted(kinds)


def export_matrix(ckpt: str, layout: Layout, bucket_bytes: int, fp8: bool, engines: bool,
                  vision_tower: str | None = None) -> dict:
    """One model at `layout`, exported every way a trainer does on GPUs, each export checked on this rank:

    * three bf16 exports in a row (plan + compile, then replays on pooled buffers with CUDA graphs);
    * an FP8 export (the Triton kernel) between bf16 ones, against the CPU reference quantizer;
    * every bucket held while the next ones are built;
    * a consumer that runs collectives on the trainer's own groups (PP, EP, TP, the world) between buckets, and
      two exports iterated in step (bf16 and FP8 zipped), whose collectives interleave on the same groups;
    * overlap=True (two arenas), chosen receivers (rank 0; rank 0 and the last), and the engine-sharded export's
      slices against the all-ranks export.
    Returns this rank's problems, the plan's bucket kinds and counts."""
    faulthandler.dump_traceback_later(JOB_TIMEOUT, exit=True)
    try:
        return _export_matrix(ckpt, layout, bucket_bytes, fp8, engines, vision_tower)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _export_matrix(ckpt, layout, bb, fp8, engines, vision_tower) -> dict:
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    device = this_device()
    cfg, chunks = build_cuda(ckpt, layout, vision_tower)
    ref_cpu = read_hf_checkpoint(ckpt)
    ref = {n: t.to(device) for n, t in ref_cpu.items()}
    ex = HFExporter(chunks, cfg)
    problems: list[str] = []
    plan = ex.plan(bb)

    for i in range(3):  # the first plans and compiles, the next replay (pooled buffers, CUDA graphs)
        problems += differ(collect(ex.buckets(bb)), ref, f"bf16 export {i + 1} of 3")

    want8 = None
    if fp8:
        import worlds

        want8 = {n: t.to(device) for n, t in worlds.reference_fp8(ref_cpu, ex.fp8_policy(), False).items()}
        problems += differ(collect(ex.buckets(bb, quantize="fp8")), want8, "fp8 export (between bf16 ones)")
        problems += differ(collect(ex.buckets(bb)), ref, "bf16 export after fp8")

    problems += differ(collect(ex.buckets(bb), hold=True), ref, "every bucket held")

    scratch = torch.ones(8, device=device)
    groups = [g for g in (ps.get_pipeline_model_parallel_group(), ps.get_expert_model_parallel_group(),
                          ps.get_tensor_model_parallel_group(), None)]

    def consumer_collectives():  # what an RL consumer may run between buckets (a barrier, a reduction)
        for g in groups:
            dist.all_reduce(scratch, group=g)

    problems += differ(collect(ex.buckets(bb), between=consumer_collectives), ref,
                       "consumer collectives on PP/EP/TP/world between buckets")
    # two exports iterated in step (their collectives interleave on the same groups): FP8 beside bf16, or bf16 at
    # another bucket size (the same settings share one arena: refused, tests/worlds.plan_suite)
    got = [{}, {}]
    for step in itertools.zip_longest(ex.buckets(bb), ex.buckets(bb, quantize="fp8") if fp8 else ex.buckets(bb // 2)):
        for into, b in zip(got, step):
            if b is not None:
                into.update({n: t.clone() for n, t in b})
        del step
    problems += differ(got[0], ref, "bf16 export zipped with another")
    problems += differ(got[1], want8 if fp8 else ref, "second export zipped with the first")

    problems += differ(collect(ex.buckets(bb, overlap=True)), ref, "overlap=True")
    last = dist.get_world_size() - 1
    for receivers in ([0], [0, last]):
        got = collect(ex.buckets(bb, receivers=receivers))
        if rank in receivers:
            problems += differ(got, ref, f"receivers={receivers}")
        elif got:
            problems.append(f"receivers={receivers}: a non-receiver got {len(got)} tensors")

    engine = {}
    if engines:
        import worlds

        engine = worlds.engine_matrix(ex, ref, layout, cfg.model_type)
        for key, e in engine.items():
            if "refused" not in e and (e["missing"] or e["extra"] or e["differ"]):
                problems.append(f"engine {key}: missing {e['missing']}, extra {e['extra']}, differ {e['differ']}")
    dist.barrier()
    return dict(problems=problems, kinds=bucket_kinds(plan, layout, bb), buckets=len(plan.buckets),
                tensors=len(ref), engine=sorted(k for k, e in engine.items() if "refused" not in e))


def suite_checkpoint(model_type: str, out_dir: str, **overrides) -> str:
    """A bf16 HF checkpoint written by transformers, of the tiny config of `model_type` grown to shapes where a
    1 MiB bucket holds a few experts: the planner then makes every kind of bucket (`bucket_kinds`)."""
    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

    if os.path.isdir(out_dir):
        return out_dir
    return make_hf_checkpoint(tiny_config(model_type, **overrides), out_dir, seed=3, dtype=torch.bfloat16)


def same_or_one_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal, or (bf16 / fp16) at most one unit in the last place apart per element: a merged weight rounded once
    from fp32 products that a GPU and a CPU sum in different orders (never more than one rounding step)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype not in (torch.bfloat16, torch.float16):
        return torch.equal(got, want)
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    return bool(((a - b).abs() <= 1).all())  # same sign: adjacent patterns; a sign change is 0 <-> -0 only here


def lora_export(ckpt: str, layout: Layout, adapter_dir: str, bridge: str, targets: tuple[str, ...],
                bucket_bytes: int) -> dict:
    """A bf16 model wrapped by Megatron-Bridge's own LoRA, base and adapters loaded from HF/PEFT sources written by
    transformers and the test: the adapter-only export equal to the adapter file (three in a row, then held, then
    with consumer collectives between buckets), and the merged export within one bf16 rounding of W + alpha/r B A
    computed on the CPU in fp32 (three in a row). Returns this rank's problems."""
    faulthandler.dump_traceback_later(JOB_TIMEOUT, exit=True)
    try:
        from harness.bridge_lora import apply_lora
        from safetensors.torch import load_file
        from worlds import LORA_ALPHA, LORA_R

        from mcore2hf.lora import peft_name

        device = this_device()
        cfg = load_hf_config(ckpt)
        with torch.device(device):
            chunks = build_model(ckpt, use_te=False, params_dtype=torch.bfloat16, bf16=True,
                                 use_cpu_initialization=not torch.cuda.is_available(), mtp_num_layers=None,
                                 **layout.config_overrides())
        chunks = [c.to(torch.bfloat16) for c in chunks]
        apply_lora(bridge, chunks, list(targets), LORA_R, LORA_ALPHA)
        load_hf_weights(chunks, ckpt, strict=False)  # the base into the wrapped model (adapters left alone)
        load_hf_weights(chunks, adapter_dir, ckpt, lora=True)
        adapters_cpu = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
        adapters = {n: t.to(device) for n, t in adapters_cpu.items()}
        problems: list[str] = []
        ex = HFExporter(chunks, cfg, lora="adapter")
        for i in range(3):
            problems += differ(collect(ex.buckets(bucket_bytes)), adapters, f"lora adapter export {i + 1} of 3")
        problems += differ(collect(ex.buckets(bucket_bytes), hold=True), adapters, "lora adapter, buckets held")
        scratch = torch.ones(8, device=device)

        def consumer_collectives():
            dist.all_reduce(scratch)

        problems += differ(collect(ex.buckets(bucket_bytes), between=consumer_collectives), adapters,
                           "lora adapter, consumer collectives between buckets")
        base = read_hf_checkpoint(ckpt)
        scale = LORA_ALPHA / LORA_R
        merging = HFExporter(chunks, cfg, lora="merged")
        for i in range(3):
            got = collect(merging.buckets(bucket_bytes))
            bad = []
            for n, w in base.items():
                a, b = peft_name(n, "A"), peft_name(n, "B")
                want = w if a not in adapters_cpu else \
                    (w.float() + scale * adapters_cpu[b].float() @ adapters_cpu[a].float()).to(w.dtype)
                if n not in got or not same_or_one_ulp(got[n].cpu(), want):
                    bad.append(n)
            if bad:
                problems.append(f"lora merged export {i + 1} of 3: {len(bad)} tensors not within one bf16 rounding "
                                f"of W + s B A, e.g. {bad[:4]}")
        dist.barrier()
        return dict(problems=problems, adapters=len(adapters))
    finally:
        faulthandler.cancel_dump_traceback_later()
