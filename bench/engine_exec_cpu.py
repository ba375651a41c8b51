"""Per-bucket host time of a later EngineExecutor run on CPU (issue 15, executor): the TP2 x PP2 x EP2 gloo world
of tests/test_engine_plan.py, real tiny megatron-core models, sglang engine TP 2 (and TP 2 EP 2 for MoE).

    python bench/engine_exec_cpu.py [--models qwen3_moe,deepseek_v3] [--runs 5] [--bucket-kib 64]

Prints, per model and engine placement, rank 0's wall and CPU (process) time per bucket of the first run
(compiles) and the median of the later runs. Runs against whichever mcore2hf is importable (PYTHONPATH=<other
checkout> compares another version; the `output` argument is used only where it exists)."""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def world(ckpts: dict, layout, runs: int, bucket_bytes: int) -> list:
    import torch.distributed as dist
    import worlds

    from mcore2hf import HFExporter
    from mcore2hf.engine_shards import colocated_ranks

    rows = []
    for model_type, ckpt in ckpts.items():
        cfg, chunks = worlds.build(ckpt, layout)
        ex = HFExporter(chunks, cfg)
        eps = [1, 2] if ex.dims.num_experts else [1]
        outputs = ["slices", "masked"] if "output" in inspect.signature(ex.engine_buckets).parameters else ["slices"]
        for ep in eps:
            ranks = colocated_ranks(layout.size, "sglang", 2, ep)
            for output in outputs:
                kw = {"output": output} if len(outputs) > 1 else {}
                times = []
                for _ in range(runs):
                    dist.barrier()
                    w0, c0, n = time.perf_counter(), time.process_time(), 0
                    for _bucket in ex.engine_buckets(ranks, bucket_bytes, **kw):
                        n += 1
                    times.append(((time.perf_counter() - w0) / n, (time.process_time() - c0) / n))
                later = times[1:]
                rows.append((model_type, f"sglang tp2 ep{ep}", output, n, times[0],
                             (statistics.median(t[0] for t in later), statistics.median(t[1] for t in later))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3_moe,deepseek_v3")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bucket-kib", type=int, default=64)
    args = ap.parse_args()
    import mcore2hf
    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config
    from mcore2hf.runtime.world import Layout, run_world
    print("mcore2hf from", os.path.dirname(mcore2hf.__file__))
    layout = Layout(tp=2, pp=2, ep=2, etp=1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {m: str(make_hf_checkpoint(tiny_config(m), os.path.join(tmp, m))) for m in args.models.split(",")}
        rows = run_world(world, layout, ckpts, layout, args.runs, args.bucket_kib * 1024)[0]
    print(f"{'model':12} {'engine':16} {'output':7} {'buckets':>7}  first run wall/cpu ms/bucket   "
          "later runs (median) wall/cpu ms/bucket")
    for m, e, o, n, first, later in rows:
        print(f"{m:12} {e:16} {o:7} {n:7}  {first[0] * 1e3:8.2f} / {first[1] * 1e3:6.2f}"
              f"              {later[0] * 1e3:8.2f} / {later[1] * 1e3:6.2f}")


if __name__ == "__main__":
    main()
