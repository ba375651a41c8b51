"""Per-bucket host time of a later EngineExecutor run on CPU (issue 15, executor): the TP2 x PP2 x EP2 gloo world
of tests/test_engine_plan.py, real tiny megatron-core models, sglang engine TP 2 (and TP 2 EP 2 for MoE).

    python bench/engine_exec_cpu.py [--models qwen3_moe,deepseek_v3] [--runs 5] [--bucket-kib 64]

Prints, per model and engine placement, rank 0's wall and CPU (process) time per bucket of the first run
(compiles) and the median of the later runs, alternating with a floor (the same point-to-point rounds, nothing
packed or copied), with the messages (sends + receives) rank 0 posts per bucket. Runs against whichever mcore2hf is
importable (PYTHONPATH=<other checkout> measures another version, e.g. the earlier schemes bench/RESULTS.md compares
with; the `output` argument is used only where it exists)."""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def world(ckpts: dict, layout, runs: int, bucket_bytes: int, profile: bool = False) -> list:
    import cProfile
    import io
    import pstats

    import torch.distributed as dist
    import worlds

    from mcore2hf import HFExporter
    from mcore2hf.engine_shards import colocated_ranks

    prof = cProfile.Profile() if profile and dist.get_rank() == 0 else None
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
                if not hasattr(ex, "engine_executor") or not hasattr(ex.engine_executor(ranks, bucket_bytes, **kw).core,
                                                                     "counts"):
                    # an earlier version (PYTHONPATH=<its checkout>): its default path only
                    times = []
                    for _ in range(runs):
                        dist.barrier()
                        w0, c0, n = time.perf_counter(), time.process_time(), 0
                        for _bucket in ex.engine_buckets(ranks, bucket_bytes, **kw):
                            n += 1
                        times.append(((time.perf_counter() - w0) / n, (time.process_time() - c0) / n))
                    rows.append((model_type, f"sglang tp2 ep{ep}", output, n, times[0], _median(times[1:]), None))
                    continue
                rows.append((model_type, f"sglang tp2 ep{ep}", output, *compare(ex, ranks, bucket_bytes, output, runs,
                                                                                 prof)))
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())
    return rows


def _median(times: list) -> tuple[float, float]:
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def compare(ex, ranks, bucket_bytes: int, output: str, runs: int, prof) -> tuple:
    """This version's executor and a floor (the same point-to-point rounds on the compiled buffers, nothing packed
    or copied), later runs alternating between the two (so load from other jobs hits both alike)."""
    import torch
    import torch.distributed as dist

    from mcore2hf.transfer.engine import EngineExecutor

    plan = ex.engine_plan(ranks, bucket_bytes)
    new = EngineExecutor(plan, ex.ctx, ex._local, ex.device, output=output)

    def once(executor, profile_it=False) -> tuple[float, float, int]:
        dist.barrier()
        w0, c0, n = time.perf_counter(), time.process_time(), 0
        if profile_it:
            prof.enable()
        with torch.no_grad():
            for _bucket in executor.run():
                n += 1
        if profile_it:
            prof.disable()
        return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n, n

    first = once(new)
    msgs = new.core.counts["messages"] / first[2]
    times: dict[str, list] = {"new": [], "floor": []}
    for _ in range(runs - 1):
        times["new"].append(once(new, prof is not None)[:2])
        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        for cb in new._compiled:
            for w in new.core.exchange(cb.p2p, cb.index):
                w.wait()
        times["floor"].append(((time.perf_counter() - w0) / first[2], (time.process_time() - c0) / first[2]))
    return first[2], first[:2], _median(times["new"]), (_median(times["floor"]), msgs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3_moe,deepseek_v3")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bucket-kib", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="cProfile of rank 0's later runs (this version)")
    args = ap.parse_args()
    import mcore2hf
    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config
    from mcore2hf.runtime.world import Layout, run_world
    print("mcore2hf from", os.path.dirname(mcore2hf.__file__))
    layout = Layout(tp=2, pp=2, ep=2, etp=1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {m: str(make_hf_checkpoint(tiny_config(m), os.path.join(tmp, m))) for m in args.models.split(",")}
        rows = run_world(world, layout, ckpts, layout, args.runs, args.bucket_kib * 1024, args.profile)[0]
    print(f"{'model':12} {'engine':16} {'output':7} {'buckets':>7}  first run   later runs (median), wall / CPU ms per bucket")
    print(f"{'':12} {'':16} {'':7} {'':7}  {'':13}  {'this version':>13}  {'floor':>13}  msgs/bucket")
    for m, e, o, n, first, later, rest in rows:
        line = f"{m:12} {e:16} {o:7} {n:7}  {first[0] * 1e3:5.2f} / {first[1] * 1e3:5.2f}  " \
               f"{later[0] * 1e3:5.2f} / {later[1] * 1e3:5.2f}"
        if rest is not None:
            (fw, fc), msgs = rest
            line += f"  {fw * 1e3:5.2f} / {fc * 1e3:5.2f}  {msgs:11.1f}"
        print(line)


if __name__ == "__main__":
    main()
