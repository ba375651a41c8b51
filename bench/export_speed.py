"""Export speed of a Qwen3-30B-A3B-sized model on GPUs, side by side with mbridge and a per-tensor baseline.

    python bench/export_speed.py --layout ep4 --mbridge  # 4 GPUs (one process per GPU, NCCL)
    python bench/export_speed.py --layout ep2 --bucket-mb 256           # 2 GPUs
    python bench/export_speed.py --arch deepseek_v3 --layout ep2        # DeepSeek-V3 shapes, 4 layers + MTP
    python bench/export_speed.py --cpu --layout ep2 --layers 2 --experts 8 --hidden 256 --heads 4 --moe-ffn 64 \
        --vocab 1024 --mbridge                                          # the same code path on CPU (gloo)
    python bench/export_speed.py --layout ep4 --quantize fp8            # also block-FP8 exports (bf16 vs fp8)
    python bench/export_speed.py --layout ep2 --engine-placements sglang:tp2,sglang:tp2ep2  # engine-shard export

Builds a Megatron GPTModel with Qwen3-30B-A3B's shapes (48 layers, hidden 2048, 32 heads, 4 KV groups, head_dim 128,
128 experts, top-8, moe_ffn 768, vocab 151936, bf16, ~61 GB) with random weights made on the GPU, then measures on
the same model in one run:

* mcore2hf, every rank receiving every HF tensor (colocated RL sync): first call (plan + compile) and later calls;
  and the one-destination mode (rank 0 receives, the save / distributed-sender case);
* the per-tensor baseline in the style of slime's all_gather_params_async: per bucket, one async collective per
  tensor (TP all-gather, EP all-gather), fire all, wait all, then concatenate and convert with the same layout ops;
* mbridge 0.15.1 `export_weights` (per-tensor, blocking), on the model renamed to Transformer Engine's parameter
  names (mcore2hf.runtime.te_naming), as mbridge requires;
* the NCCL floor: the bytes each rank must receive (everything it does not hold in full) over the receive rate of
  an all-gather of a large buffer, measured in the same run.
* with --engine-placements (or --engine/--engine-tp/--engine-ep): the engine-shard export (issue 15), colocated
  (`mcore2hf.plan.engine_shards.colocated_ranks`: engine instance k on trainer ranks [k*tp, (k+1)*tp)), timed through
  `HFExporter.engine_buckets` iterated to the end; its wire bytes per GPU from the plan (`bytes_by_receiver`), and
  its own floor: wire bytes / the point-to-point receive rate of a batched isend/irecv exchange (--p2p-mb per rank
  pair) measured in the same run; each rank's slices checked bit for bit against the all-ranks export;
* with --quantize fp8 (or fp8-ue8m0): the same exports delivering block-FP8 tensors (float8_e4m3fn + float32
  weight_scale_inv), their output bytes, the bytes sent over the collectives, the ratio to the floor of the FP8
  bytes, and whether the quantization on the GPU equals the CPU reference bit for bit (sampled tensors).

Prints one table: method, seconds, GB/s (HF bytes materialized per rank / s), ratio to mcore2hf, ratio to the
floor, peak extra GPU memory (max_memory_allocated over what was allocated before the call); then the host issue
time of a later mcore2hf export (the time the CPU takes to issue all its work; the GPU finishes after) and the
memory after each of 20 consecutive exports (a leak check).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

LAYOUTS = {
    "ep4": dict(tp=1, pp=1, ep=4, etp=1),
    "tp2ep2": dict(tp=2, pp=1, ep=2, etp=1, world_size=4),
    "pp2ep2": dict(tp=1, pp=2, ep=2, etp=1),
    "etp2": dict(tp=1, pp=1, ep=2, etp=2),
    # 2 GPUs
    "ep2": dict(tp=1, pp=1, ep=2, etp=1),
    "tp2ep2-w2": dict(tp=2, pp=1, ep=2, etp=1),  # experts over the TP ranks
    "pp2": dict(tp=1, pp=2, ep=1, etp=1),
    "etp2-w2": dict(tp=1, pp=1, ep=1, etp=2),  # dense TP1 (DP2), experts ETP2
    "tp1": dict(tp=1, pp=1, ep=1, etp=1),
}


# published configs' shapes (layers reduced by --layers where a model would not fit the GPUs)
PRESETS = {
    "qwen3_moe": dict(  # Qwen3-30B-A3B
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
    "glm4_moe": dict(  # GLM-4.5-Air (46 layers, 106B): 16 layers by default
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=16, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
        num_experts_per_tok=8, first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
        partial_rotary_factor=0.5, num_nextn_predict_layers=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False),
    "deepseek_v3": dict(  # DeepSeek-V3 (61 layers, 671B): 4 layers by default, 1 dense, plus the MTP layer
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=1, n_shared_experts=1, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_nextn_predict_layers=1,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_scaling=None, tie_word_embeddings=False),
}
EXPERTS_KEY = {"qwen3_moe": "num_experts", "glm4_moe": "n_routed_experts", "deepseek_v3": "n_routed_experts"}


def hf_config(a) -> dict:
    cfg = dict(PRESETS[a.arch])
    for flag, key in (("layers", "num_hidden_layers"), ("experts", EXPERTS_KEY[a.arch]), ("hidden", "hidden_size"),
                      ("moe_ffn", "moe_intermediate_size"), ("vocab", "vocab_size")):
        if getattr(a, flag) is not None:
            cfg[key] = getattr(a, flag)
    if a.heads is not None:  # small CPU runs
        cfg["num_attention_heads"] = a.heads
        cfg["num_key_value_heads"] = min(cfg["num_key_value_heads"], a.heads)
    return cfg


def random_model(arch: str, config: dict, tp: int, device, seed: int = 1234):
    """(HF config, model chunks) of a Megatron model of `arch` with `config`'s shapes, bf16, built on `device` as in
    training (every param carries Megatron's parallel attributes, which mbridge reads), then filled with random
    normal(0, 0.02) values drawn on the device (seed + rank)."""
    import torch
    import torch.distributed as dist

    from mcore2hf.arch.hf_config import load_hf_config
    from mcore2hf.arch.registry import get_model_spec
    from mcore2hf.model_specs.common import build_model, padded_vocab_size

    spec = get_model_spec(arch)
    cfg = load_hf_config(config)
    cpu = device.type == "cpu"
    if not cpu:  # Megatron's initialization draws from the tensor-parallel RNG tracker on the GPU
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    with torch.device(device):
        chunks = build_model(spec, cfg, vocab_size=padded_vocab_size(cfg.vocab_size, tp), params_dtype=torch.bfloat16,
                             bf16=True, perform_initialization=True, use_cpu_initialization=cpu)
    chunks = [c.to(torch.bfloat16) for c in chunks]
    g = torch.Generator(device=device).manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.normal_(0, 0.02, generator=g)
    return cfg, chunks


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mem(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def timed(fn, device) -> tuple[float, int]:
    """Seconds and peak extra memory of fn()."""
    import torch

    sync(device)
    base = mem(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    fn()
    sync(device)
    dt = time.perf_counter() - t
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
    return dt, peak


def gpu_busy(fn, device) -> tuple[float, float]:
    """(GPU busy seconds, span seconds) of fn(): the union of all kernel and memcpy intervals on all streams, from
    the CUDA profiler. span - busy is the time the GPU waited (on the host, or on a dependency)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy / 1e6, (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0


def consume(buckets) -> int:
    """Materialize every bucket (the output buffer exists), dropping each before the next is built."""
    n = 0
    for bucket in buckets:
        n += bucket.nbytes
        del bucket
    return n


def per_tensor_baseline(ex, bucket_bytes: int) -> int:
    """slime-style: per bucket of local tensors, one async all-gather per tensor and group, wait all, concat,
    convert. Every rank gets every HF tensor. PP > 1 is not covered (slime broadcasts per tensor there)."""
    import torch
    import torch.distributed as dist

    ctx = ex.ctx
    sources = ex.plan().sources
    local = ex._local
    names = [n for n in sources if n in local]
    groups, size = [[]], 0
    for n in names:
        b = sources[n].shard_nbytes * max(1, ctx.ep.size if sources[n].is_expert else 1) * sources[n].count
        if groups[-1] and size + b > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += b
    total = 0
    for group in groups:
        pending = []
        for n in group:
            s, t = sources[n], local[n].get()
            tp = ctx.etp if s.is_expert else ctx.tp
            shards, works = [t], []
            if s.count > 1:
                shards = [torch.empty_like(t) for _ in range(tp.size)]
                works.append(dist.all_gather(shards, t, group=tp.group, async_op=True))
            experts = None
            if s.is_expert and ctx.ep.size > 1:  # every EP rank's tensor of the same local index
                experts = [[torch.empty_like(x) for _ in range(ctx.ep.size)] for x in shards]
                for x, outs in zip(shards, experts):
                    works.append(dist.all_gather(outs, x, group=ctx.ep.group, async_op=True))
            pending.append((s, shards, experts, works))
        for _, _, _, works in pending:
            for w in works:
                w.wait()
        for s, shards, experts, _ in pending:
            sets = [shards] if experts is None else [[e[m] for e in experts] for m in range(ctx.ep.size)]
            for shard_list in sets:
                for out in s.resolved.op.hf_tensors(shard_list):
                    total += out.numel() * out.element_size()
    return total


def checksums(named) -> dict:
    """name -> (shape, float64 sum) of every tensor, the sums left on the device until the end (no per-tensor sync)."""
    import torch

    out = {n: (tuple(t.shape), torch.sum(t, dtype=torch.float64)) for n, t in named}
    return {n: (shape, s.item()) for n, (shape, s) in out.items()}


def ours(ex, bb) -> dict:
    return checksums((n, t) for bucket in ex.buckets(bb) for n, t in bucket)


def mbridge_export(chunks, cfg, sums: dict) -> int:
    from mbridge import AutoBridge

    bridge = AutoBridge.from_config(cfg)
    sums.update(checksums(bridge.export_weights(chunks)))
    return len(sums)


def compare(ref: dict, got: dict) -> str:
    """Whether another method's tensors are ours: same names, shapes and float64 sums."""
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    bad = [n for n in ref if n in got and got[n] != ref[n]]
    if not (missing or extra or bad):
        return f"same {len(ref)} names, shapes and sums as mcore2hf"
    return f"DIFFERS: {len(missing)} missing {missing[:3]}, {len(extra)} extra {extra[:3]}, {len(bad)} differ " + \
        ", ".join(f"{n}: {got[n]} vs ours {ref[n]}" for n in bad[:3])


def nccl_floor(ex, device, dtype) -> tuple[float, float]:
    """(bytes this rank must receive, receive rate in bytes/s of an all-gather of a large buffer)."""
    import torch
    import torch.distributed as dist

    ctx = ex.ctx
    plan = ex.plan()
    need = 0
    for s in plan.sources.values():
        held_fully = s.count == 1 and ctx.pp.rank in s.stages and (not s.is_expert or s.ep == ctx.ep.rank)
        if not held_fully:
            need += s.hf_nbytes
    world = dist.get_world_size()
    per_rank = 1 << 30
    buf = torch.empty(world * per_rank, dtype=torch.uint8, device=device)
    for _ in range(3):
        dist.all_gather_into_tensor(buf, buf[ctx.rank * per_rank:(ctx.rank + 1) * per_rank])
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        dist.all_gather_into_tensor(buf, buf[ctx.rank * per_rank:(ctx.rank + 1) * per_rank])
    sync(device)
    dt = (time.perf_counter() - t) / 5
    del buf
    return need, (world - 1) * per_rank / dt


def bytes_moved(executor, exports: int) -> dict:
    """Per export on this rank: bytes received by the collectives, packed before them, copied after them."""
    return {k: v / exports for k, v in executor.stats.items() if k.endswith("_bytes")}


def staged_executor(ex, bb, device):
    """An executor of the same plan with no bucket's collective landing in its output (BucketPlan.direct off)."""
    from dataclasses import replace

    from mcore2hf.transfer.export import Executor

    plan = ex.plan(bb)
    return Executor(replace(plan, buckets=[replace(b, direct=None) for b in plan.buckets]), ex.ctx, ex._local,
                    None, device)


def wire_bytes(ex, bb, quantize=None) -> int:
    """Bytes this rank receives through the collectives of one all-ranks export (staging of every stage)."""
    prog = ex.executor(bb, quantize=quantize).programs
    return sum((st.axis.size - 1) * st.slot for p in prog for st in p.stages)


def fp8_floor_need(ex, bb, quantize) -> int:
    """The FP8 bytes this rank must receive: the quantized output of every source it does not hold in full."""
    ctx = ex.ctx
    plan = ex.plan(bb, quantize=quantize)
    need = 0
    for b in plan.buckets:
        for e in b.output:
            s = plan.sources[e.source]
            if not (s.count == 1 and ctx.pp.rank in s.stages and (not s.is_expert or s.ep == ctx.ep.rank)):
                need += e.nbytes
    return need


def fp8_cuda_equals_cpu(ex, bb, quantize, limit: int = 48) -> str:
    """Quantize on the device (the export) and on the CPU (reference quantizer on the exported bf16 tensor):
    bit-identical? Sampled over the first `limit` quantized tensors, clones kept on the host."""
    import torch

    from mcore2hf.quantize.fp8 import per_block_cast_to_fp8, scale_name

    plan = ex.plan(bb, quantize=quantize)
    names = set(plan.quantized_names()[:limit])
    bf16 = {n: t.cpu().clone() for b in ex.buckets(bb) for n, t in b if n in names}
    got = {n: t.cpu().clone() for b in ex.buckets(bb, quantize=quantize) for n, t in b
           if n in names or n.removesuffix("_scale_inv") in names}
    ue8m0 = quantize == "fp8-ue8m0"
    bad = []
    for n, t in bf16.items():
        q, sf = per_block_cast_to_fp8(t, ue8m0)
        if not (torch.equal(q.view(torch.uint8), got[n].view(torch.uint8))
                and torch.equal(sf.view(torch.int32), got[scale_name(n)].view(torch.int32))):
            bad.append(n)
    return f"{len(bf16) - len(bad)}/{len(bf16)} sampled tensors bit-identical" + (f", DIFFER: {bad[:3]}" if bad else "")


def parse_placements(a) -> list[tuple[str, int, int, str]]:
    """(engine, tp, ep, output) per placement: --engine-placements "sglang:tp2,vllm:tp2ep2:masked" plus the one
    --engine/--engine-tp/--engine-ep describe; output defaults to --engine-output."""
    import re

    out = []
    for spec in [x for x in (a.engine_placements or "").split(",") if x]:
        m = re.fullmatch(r"(sglang|vllm):tp(\d+)(?:ep(\d+))?(?::(slices|masked))?", spec.strip())
        if not m:
            raise SystemExit(f"--engine-placements: expected ENGINE:tpN[epM][:slices|masked] (ENGINE sglang or "
                             f"vllm), found {spec!r}")
        out.append((m[1], int(m[2]), int(m[3] or 1), m[4] or a.engine_output))
    if a.engine:
        if not a.engine_tp:
            raise SystemExit("--engine: expected --engine-tp N with it")
        out.append((a.engine, a.engine_tp, a.engine_ep, a.engine_output))
    return out


def size(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def placement_name(engine: str, tp: int, ep: int, output: str) -> str:
    return f"engine {engine}:tp{tp}" + (f"ep{ep}" if ep > 1 else "") + f" {output}"


def engine_iter(ex, ranks, bb, output: str):
    """exporter.engine_buckets(...): a bucket's materialized bytes, the flat slices buffer or the masked Bucket
    (`as_bucket()`, free: the masked executor wrote in place)."""
    for bucket in ex.engine_buckets(ranks, bb, output=output):
        yield bucket.flat.numel() if output == "slices" else bucket.as_bucket().nbytes


def consume_engine(ex, ranks, bb, output: str) -> int:
    return sum(engine_iter(ex, ranks, bb, output))


def drop_engine_executors(ex) -> None:
    """Free the engine executors' buffers before the next placement runs."""
    ex._engine_executors.clear()


def engine_check(ex, ranks, bb) -> tuple[int, int]:
    """(slices bit-identical, slices) of this rank: every raw slice against the same region of the all-ranks
    export of the same bucket (the engine plan keeps the export plan's buckets and order; both are collectives
    every rank runs in the same order)."""
    import torch

    same, n = [], 0
    for full, eb in zip(ex.buckets(bb), ex.engine_buckets(ranks, bb), strict=True):
        tensors = dict(full)
        for name, sl in eb.slices():
            ref = tensors[name]
            for d, off, length in sl.region:
                ref = ref.narrow(d, off, length)
            same.append(torch.equal(ref, sl.tensor))
            n += 1
    return sum(same), n


def p2p_rate(device, per_pair: int) -> float:
    """Receive rate (bytes/s per rank) of a batched isend/irecv exchange: every rank sends `per_pair` bytes to
    every other rank and receives as much from each, all at once (the engine mode's transfer pattern, at most)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return 0.0
    send = torch.empty(per_pair, dtype=torch.uint8, device=device)
    recv = {p: torch.empty(per_pair, dtype=torch.uint8, device=device) for p in range(world) if p != rank}

    ops = [dist.P2POp(dist.isend, send, p) for p in recv] + [dist.P2POp(dist.irecv, b, p) for p, b in recv.items()]
    for i in range(8):  # 3 warm-up rounds, 5 timed
        if i == 3:
            sync(device)
            dist.barrier()
            t = time.perf_counter()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    sync(device)
    return (world - 1) * per_pair * 5 / (time.perf_counter() - t)


def engine_rows(ex, bb, a, device, rows: dict) -> dict:
    """Time every engine placement on the same model: first call (plan + compile + export), later calls, the
    plan's bytes per receiver, the bit-for-bit check. Collective: every rank runs it."""
    import torch.distributed as dist

    from mcore2hf.plan.engine_shards import colocated_ranks

    info = {}
    world = dist.get_world_size()
    for engine, tp, ep, output in parse_placements(a):
        name = placement_name(engine, tp, ep, output)
        ranks = colocated_ranks(world, engine, tp, ep)
        run = functools.partial(consume_engine, ex, ranks, bb, output)
        first, peak_first = timed(run, device)
        runs = [timed(run, device) for _ in range(a.repeat)]
        rows[name] = (min(t for t, _ in runs), max(p for _, p in runs))
        by = ex.engine_plan(ranks, bb).bytes_by_receiver().get(dist.get_rank(), dict(needed=0, wire=0, local=0))
        check = engine_check(ex, ranks, bb)
        drop_engine_executors(ex)
        info[name] = dict(first=first, peak_first=peak_first, check=check, **by)
    return info


def schemes(a) -> list[str]:
    return [q for q in (a.quantize or "").split(",") if q]


def issue_time(fn, device) -> float:
    """Seconds the host takes to issue fn() (the device finishes later)."""
    sync(device)
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    sync(device)
    return dt


def kept_bytes(executor) -> int:
    """Bytes an executor keeps between exports: staging arena(s) and pooled output buffers."""
    pool = executor.core.pool
    return sum(x.flat.numel() for x in executor.core.arenas) + (sum(b.numel() for b in pool.buffers) if pool else 0)


def copy_floor(ex, device) -> tuple[float, float]:
    """(seconds to copy the export's HF bytes once on the device, copy rate in bytes/s), timed in this run: a
    device-to-device copy of 1 GiB chunks (each byte read once and written once)."""
    import torch

    total = ex.plan().total_bytes
    chunk = min(total, 1 << 30)
    src = torch.empty(chunk, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    rate = 10 * chunk / (time.perf_counter() - t)
    del src, dst
    return total / rate, rate


def fp8_every_tensor(ex, bb, quantize) -> str:
    """Every tensor of the FP8 export against the bf16 export of the same model: each quantized weight and scale
    equal to the torch reference quantizer (quantize.py's, the CPU path's arithmetic, run on the device with
    MCORE2HF_FP8_KERNEL=torch), every other tensor equal byte for byte."""
    import torch

    from mcore2hf.quantize.fp8 import per_block_cast_to_fp8, scale_name

    ue8m0 = quantize == "fp8-ue8m0"
    n = bad = 0
    prev = os.environ.get("MCORE2HF_FP8_KERNEL")
    os.environ["MCORE2HF_FP8_KERNEL"] = "torch"
    try:
        for b16, b8 in zip(ex.buckets(bb), ex.buckets(bb, quantize=quantize), strict=True):
            got = dict(b8)
            for name, t in b16:
                n += 1
                if scale_name(name) in got:
                    q, sf = per_block_cast_to_fp8(t, ue8m0)
                    ok = torch.equal(q.view(torch.uint8), got[name].view(torch.uint8)) and \
                        torch.equal(sf.view(torch.int32), got[scale_name(name)].view(torch.int32))
                else:
                    ok = torch.equal(t, got[name])
                bad += not ok
            del b16, b8, got
    finally:
        if prev is None:
            os.environ.pop("MCORE2HF_FP8_KERNEL")
        else:
            os.environ["MCORE2HF_FP8_KERNEL"] = prev
    return f"{n - bad}/{n} tensors equal to the torch reference" + (" DIFFER" if bad else "")


def staged_rows(ex, staged, bb, device, a, rows) -> tuple[str, dict]:
    consume(staged.run())
    runs = [timed(lambda: consume(staged.run()), device) for _ in range(a.repeat)]
    rows["mcore2hf (all ranks, staged)"] = (min(t for t, _ in runs), max(p for _, p in runs))
    moved_staged = bytes_moved(staged, 1 + a.repeat)
    return compare(ours(ex, bb), checksums((n, t) for b in staged.run() for n, t in b)), moved_staged


def job(a):

    import torch
    import torch.distributed as dist

    from mcore2hf import HFExporter

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if not a.cpu else torch.device("cpu")
    lay = LAYOUTS[a.layout]
    t = time.perf_counter()
    cfg, chunks = random_model(a.arch, hf_config(a), lay["tp"], device)
    sync(device)
    build_s = time.perf_counter() - t
    params_gb = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()) / 1e9
    bb = int(a.bucket_mb * 2**20)
    ex = HFExporter(chunks, cfg)
    rows = {}

    first, peak_first = timed(lambda: consume(ex.buckets(bb)), device)  # plan + compile + export
    plan = ex.plan(bb)
    hf_bytes = plan.total_bytes
    later = []
    for _ in range(a.repeat):
        later.append(timed(lambda: consume(ex.buckets(bb)), device))
    rows["mcore2hf (all ranks)"] = (min(t for t, _ in later), max(p for _, p in later))
    moved = bytes_moved(ex.executor(bb), 1 + a.repeat)
    kept = kept_bytes(ex.executor(bb))
    copy = copy_floor(ex, device) if not a.cpu else None
    # the same plan through staging (no collective landing in the output): what the direct layout saves
    staged = staged_executor(ex, bb, device) if not a.skip_receivers else None
    if staged is None:
        staged_same, moved_staged = "-", moved
    else:
        staged_same, moved_staged = staged_rows(ex, staged, bb, device, a, rows)
    staged = None
    if not a.skip_receivers:
        consume(ex.buckets(bb, receivers=0))
        one = [timed(lambda: consume(ex.buckets(bb, receivers=0)), device) for _ in range(a.repeat)]
        rows["mcore2hf (rank 0 only)"] = (min(t for t, _ in one), max(p for _, p in one))
        consume(ex.buckets(bb, overlap=True))
        two = [timed(lambda: consume(ex.buckets(bb, overlap=True)), device) for _ in range(a.repeat)]
        rows["mcore2hf (all ranks, overlap)"] = (min(t for t, _ in two), max(p for _, p in two))
        ex._executors.pop(ex.export_options(bucket_bytes=bb, overlap=True))  # free its two arenas before the rest
    all_wire = wire_bytes(ex, bb)
    engines = engine_rows(ex, bb, a, device, rows) if parse_placements(a) else {}

    fp8 = {}
    for q in schemes(a):
        consume(ex.buckets(bb, quantize=q))  # quantized plan + compile
        runs = [timed(lambda q=q: consume(ex.buckets(bb, quantize=q)), device) for _ in range(a.repeat)]
        rows[f"mcore2hf {q} (all ranks)"] = (min(t for t, _ in runs), max(p for _, p in runs))
        q_issue = issue_time(lambda q=q: consume(ex.buckets(bb, quantize=q)), device)
        if not a.skip_receivers:
            consume(ex.buckets(bb, receivers=0, quantize=q))
            runs = [timed(lambda q=q: consume(ex.buckets(bb, receivers=0, quantize=q)), device) for _ in range(a.repeat)]
            rows[f"mcore2hf {q} (rank 0 only)"] = (min(t for t, _ in runs), max(p for _, p in runs))
        qplan = ex.plan(bb, quantize=q)
        fp8[q] = dict(out_bytes=qplan.total_bytes, quantized=len(qplan.quantized_names()),
                      on_shards=len(qplan.prequantized_names()), wire_bf16=wire_bytes(ex, bb),
                      wire=wire_bytes(ex, bb, q), need=fp8_floor_need(ex, bb, q), issue=q_issue,
                      cuda_cpu=fp8_cuda_equals_cpu(ex, bb, q),  # collective: every rank runs it
                      every=fp8_every_tensor(ex, bb, q))
        for key in [k for k in ex._executors if k.quantize is not None]:
            ex._executors.pop(key)

    # host issue time of a later export: the CPU is done issuing before the GPU is done
    sync(device)
    t0 = time.perf_counter()
    c0 = time.process_time()
    consume(ex.buckets(bb))
    issue = time.perf_counter() - t0
    cpu = time.process_time() - c0
    sync(device)
    total = time.perf_counter() - t0

    try:
        busy = gpu_busy(lambda: consume(ex.buckets(bb)), device) if not a.cpu else (0.0, 0.0)
    except Exception as e:  # noqa: BLE001 - the profiler is optional here
        print(f"rank {rank}: no GPU profile: {e}")
        busy = (0.0, 0.0)

    leak = []
    for _ in range(a.leak_rounds):
        consume(ex.buckets(bb))
        sync(device)
        leak.append(mem(device))

    if lay["pp"] == 1 and not a.skip_baseline:
        per_tensor_baseline(ex, bb)
        base = [timed(lambda: per_tensor_baseline(ex, bb), device) for _ in range(max(1, a.repeat // 2))]
        rows["per-tensor async (slime-style)"] = (min(t for t, _ in base), max(p for _, p in base))
    floor_need, rate = nccl_floor(ex, device, torch.bfloat16) if not a.cpu else (0, 0)
    p2p = p2p_rate(device, int(a.p2p_mb * 2**20)) if engines else 0.0

    mb = None
    if a.mbridge:
        try:
            from mcore2hf.runtime.te_naming import to_te_names

            ref = ours(ex, bb)
            to_te_names(chunks)
            got = {}
            rows["mbridge 0.15.1 export_weights"] = timed(lambda: mbridge_export(chunks, cfg, got), device)
            mb = compare(ref, got)
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows["mbridge 0.15.1 export_weights"] = (float("nan"), 0)
            mb = f"{type(e).__name__}: {str(e)[:300]}"
    return dict(rank=rank, rows=rows, first=first, peak_first=peak_first, hf_bytes=hf_bytes, params_gb=params_gb,
                build_s=build_s, issue=issue, busy=busy, cpu=cpu, total=total, leak=leak, floor_need=floor_need, rate=rate,
                buckets=len(plan.buckets), tensors=plan.num_tensors, mbridge_note=mb, fp8=fp8, moved=moved,
                moved_staged=moved_staged, staged_same=staged_same,
                direct=sum(b.direct is not None for b in plan.buckets), all_wire=all_wire, engines=engines, p2p=p2p,
                kept=kept, copy=copy)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="ep4", choices=sorted(LAYOUTS))
    ap.add_argument("--arch", default="qwen3_moe", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="overrides of the preset's shapes")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--moe-ffn", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--leak-rounds", type=int, default=20)
    ap.add_argument("--mbridge", action="store_true", help="also time mbridge (slow: per-tensor blocking)")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU (small models): exercises the code path")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--quantize", default=None,
                    help="also time block-FP8 exports, fp8 and/or fp8-ue8m0 (comma-separated): bytes, floor of the FP8 "
                         "bytes, every tensor against the torch reference, sampled ones against the CPU")
    ap.add_argument("--skip-receivers", action="store_true",
                    help="leave out the rank-0-only, overlap and staged rows (shorter runs)")
    ap.add_argument("--engine-placements", default=None,
                    help="engine-shard export rows, e.g. sglang:tp2,sglang:tp2ep2,vllm:tp2:masked (colocated)")
    ap.add_argument("--engine", choices=["sglang", "vllm"], default=None, help="one engine placement (with --engine-tp)")
    ap.add_argument("--engine-tp", type=int, default=None)
    ap.add_argument("--engine-ep", type=int, default=1)
    ap.add_argument("--engine-output", choices=["slices", "masked"], default="slices",
                    help="raw slices, or full-shaped masked tensors (the default of --engine-placements entries)")
    ap.add_argument("--p2p-mb", type=float, default=None,
                    help="bytes per rank pair of the point-to-point rate measurement (default 1024, 8 on --cpu)")
    a = ap.parse_args()
    bad = [q for q in schemes(a) if q not in ("fp8", "fp8-ue8m0")]
    if bad:
        raise SystemExit(f"--quantize: expected fp8 and/or fp8-ue8m0, found {bad}")
    if a.p2p_mb is None:
        a.p2p_mb = 8 if a.cpu else 1024
    parse_placements(a)  # a malformed placement fails before any process starts
    from mcore2hf.runtime.world import Layout, run_world

    lay = LAYOUTS[a.layout]
    layout = Layout(**lay)
    res = run_world(job, layout, a, backend="gloo" if a.cpu else "nccl", timeout=3000)
    r0 = res[0]
    ref = max(x["rows"]["mcore2hf (all ranks)"][0] for x in res)  # the slowest rank finishes the export
    floor = max(x["floor_need"] / x["rate"] if x["rate"] else 0 for x in res)
    gb = r0["hf_bytes"] / 1e9
    c = hf_config(a)
    print(f"\n{a.arch} {c['num_hidden_layers']} layers x {c[EXPERTS_KEY[a.arch]]} experts, hidden {c['hidden_size']}: "
          f"{r0['tensors']} HF tensors, "
          f"{gb:.1f} GB bf16, {r0['buckets']} buckets of {a.bucket_mb:g} MiB; layout {a.layout} ({layout.size} ranks, "
          f"{'CPU/gloo' if a.cpu else 'GPU/NCCL'}); params per rank {r0['params_gb']:.1f} GB")
    if floor:
        print(f"NCCL floor: rank needs up to {max(x['floor_need'] for x in res) / 1e9:.1f} GB at "
              f"{min(x['rate'] for x in res) / 1e9:.0f} GB/s (all-gather receive rate, 1 GiB/rank) = {floor:.3f} s")
    engines = r0.get("engines") or {}
    p2p = min(x["p2p"] for x in res) if engines else 0.0
    if engines:
        print(f"point-to-point receive rate (batched isend/irecv, {a.p2p_mb:g} MiB per rank pair, all pairs at once): "
              f"{p2p / 1e9:.0f} GB/s per rank; an engine row's floor = max over ranks of its wire bytes / "
              f"that rank's rate")
    print(f"{'method':<34} {'seconds':>9} {'GB/s':>8} {'vs mcore2hf':>12} {'vs floor':>9} {'peak extra GiB':>15} "
          f"{'wire GB/GPU':>12}")
    for name in r0["rows"]:
        sec_max = max(x["rows"][name][0] for x in res)  # the slowest rank finishes the export
        peak_max = max(x["rows"][name][1] for x in res)
        out_gb, own_floor, wire = gb, floor, ""
        if name in engines:  # bytes this mode delivers per rank; its own point-to-point floor
            out_gb = max(x["engines"][name]["needed"] for x in res) / 1e9
            own_floor = max(x["engines"][name]["wire"] / x["p2p"] if x["p2p"] else 0 for x in res)
            wire = f"{max(x['engines'][name]['wire'] for x in res) / 1e9:.3f}"
        elif name == "mcore2hf (all ranks)":
            wire = f"{max(x['all_wire'] for x in res) / 1e9:.3f}"
        rate = out_gb / sec_max if sec_max == sec_max and sec_max > 0 else float("nan")
        vs_floor = f"{sec_max / own_floor:.2f}x" if own_floor else "-"
        print(f"{name:<34} {sec_max:>9.3f} {rate:>8.1f} {sec_max / ref:>11.2f}x "
              f"{vs_floor:>9} {peak_max / 2**30:>15.2f} {wire:>12}")
    for x in res[:1]:
        m, ms = x["moved"], x["moved_staged"]
        print(f"all ranks, bytes per export on rank {x['rank']}: received {m['received_bytes'] / 1e9:.2f} GB, packed "
              f"{m['packed_bytes'] / 1e9:.2f} GB, copied after the collectives {m['copied_bytes'] / 1e9:.2f} GB "
              f"(staged: {ms['packed_bytes'] / 1e9:.2f} GB packed, {ms['copied_bytes'] / 1e9:.2f} GB copied); "
              f"{x['direct']}/{x['buckets']} buckets gathered into their output; staged export: {x['staged_same']}")
    print(f"first mcore2hf call (plan + compile + export): {max(x['first'] for x in res):.2f} s, "
          f"peak extra {max(x['peak_first'] for x in res) / 2**30:.2f} GiB")
    for name in engines:
        e = [x["engines"][name] for x in res]
        sec = max(x["rows"][name][0] for x in res)
        own = max(y["wire"] / x["p2p"] if x["p2p"] else 0 for x, y in zip(res, e))
        target = 0.2 if name.split()[1].endswith(f"ep{lay['ep']}") and lay["ep"] > 1 else 0.6  # EP-matched engine
        same, n = sum(y["check"][0] for y in e), sum(y["check"][1] for y in e)
        print(f"{name}: first call (plan + compile + export) {max(y['first'] for y in e):.2f} s, peak extra "
              f"{max(y['peak_first'] for y in e) / 2**30:.2f} GiB; per GPU (max over ranks) loads "
              f"{size(max(y['needed'] for y in e))}, {size(max(y['wire'] for y in e))} over the wire, "
              f"{size(max(y['local'] for y in e))} copied locally; {sec / ref:.2f}x the all-ranks time "
              f"(target <= {target}x)" + (f", {sec / own:.2f}x its floor {own:.4f} s (target <= 1.5x)" if own
                                          else ", floor 0 (nothing crosses the wire)")
              + f"; slices vs the all-ranks export: {same}/{n} bit-identical" + (" DIFFER" if same != n else ""))
    print(f"host: issuing a later export took {r0['issue'] * 1e3:.1f} ms of its {r0['total'] * 1e3:.1f} ms "
          f"({r0['issue'] / r0['total']:.0%}; process CPU time {r0['cpu'] * 1e3:.1f} ms)")
    if r0.get("copy"):
        copy_s, rate = r0["copy"]
        print(f"copy floor: a device copy of the same {gb:.1f} GB (read + write) at {rate / 1e9:.0f} GB/s = {copy_s:.4f} s; "
              + "; ".join(f"{name} {max(x['rows'][name][0] for x in res) / copy_s:.2f}x" for name in r0["rows"]))
    print(f"kept between exports on rank 0 (staging arena + pooled output buffers): {r0['kept'] / 2**30:.2f} GiB")
    if r0["busy"][1]:
        b, span = r0["busy"]
        print(f"GPU (CUDA profiler, one later export): kernels and copies busy {b * 1e3:.1f} ms of a {span * 1e3:.1f} ms "
              f"span: idle {1 - b / span:.0%} (waiting on the host or on a dependency)")
    leak = r0["leak"]
    if leak:
        print(f"memory allocated after each of {len(leak)} exports: first {leak[0] / 2**30:.3f} GiB, last "
              f"{leak[-1] / 2**30:.3f} GiB, growth {(leak[-1] - leak[0]) / 2**20:.1f} MiB")
    for q, info in (r0.get("fp8") or {}).items():
        fp8_s = max(x["rows"][f"mcore2hf {q} (all ranks)"][0] for x in res)
        fp8_floor = max(x["fp8"][q]["need"] / x["rate"] if x["rate"] else 0 for x in res)
        wire = max(x["fp8"][q]["wire"] for x in res)
        wire_bf16 = max(x["fp8"][q]["wire_bf16"] for x in res)
        print(f"{q}: {info['quantized']} weights quantized ({info['on_shards']} on the shards before the "
              f"collectives); output {info['out_bytes'] / 1e9:.3f} GB vs bf16 {gb:.3f} GB "
              f"({info['out_bytes'] / r0['hf_bytes']:.2f}x); bytes received per rank over the collectives "
              f"{wire / 1e9:.3f} GB vs bf16 {wire_bf16 / 1e9:.3f} GB ({wire / max(wire_bf16, 1):.2f}x); export "
              f"{fp8_s:.3f} s vs bf16 {ref:.3f} s ({fp8_s / ref:.2f}x); host issue {info['issue'] * 1e3:.1f} ms"
              + (f"; floor of the FP8 bytes {fp8_floor:.3f} s, ratio {fp8_s / fp8_floor:.2f}x" if fp8_floor else ""))
        if r0.get("copy"):
            copy_s, rate = r0["copy"]
            # read the bf16 bytes once, write the FP8 output once, at the copy rate (a copy reads and writes each byte)
            floor8 = (r0["hf_bytes"] + info["out_bytes"]) / (2 * rate)
            print(f"{q} vs its copy floor (read {gb:.1f} GB bf16 + write {info['out_bytes'] / 1e9:.1f} GB at the copy "
                  f"rate) {floor8:.4f} s: {fp8_s / floor8:.2f}x; vs the bf16 export {fp8_s / ref:.2f}x")
        print(f"{q} on {'CPU' if a.cpu else 'CUDA'} vs the CPU reference quantizer: {info['cuda_cpu']}")
        if info.get("every"):
            print(f"{q}, every tensor of the model: {info['every']}")
    for x in res:
        if x.get("mbridge_note"):
            print(f"mbridge on rank {x['rank']}: {x['mbridge_note']}")
    print(f"command: {' '.join(sys.argv)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, default=str)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
