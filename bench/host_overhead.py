"""Host (Python) cost of an export as the tensor count grows, on CPU with tiny tensors (gloo).

A Qwen3-30B-A3B-shaped *count* of tensors (48 layers x 128 experts) with tiny dimensions, so the time is the
per-tensor work of the exporter rather than data movement.

    python bench/host_overhead.py [--layers 48] [--experts 128] [--ep 4] [--profile]

Prints rank 0's wall and process CPU time of a later export (pooled output buffers, precomputed views,
all-gathers run as point-to-point rounds), and of the same plan through staging (no collective landing in the
output), in the same run, with the all-gathers, point-to-point messages and bytes received per export, and a
floor: the same rounds on buffers of their own, nothing packed or copied. (The earlier schemes this was measured
against, gloo's own all-gather and a new output buffer per bucket, are retired: bench/RESULTS.md has their rows.) With --ep 1 (one process) there is no collective: the time is the
host's issue work alone. The tensors are tiny but many: EP 4 at 24 layers still moves ~60 MiB into each rank.
"""

from __future__ import annotations

import argparse
import time

from mcore2hf.runtime.world import Layout, run_world


def job(cfg: dict, rounds: int, profile: bool):
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    from mcore2hf import HFExporter
    from mcore2hf.hf_config import load_hf_config
    from mcore2hf.model_specs import qwen3_moe

    hf = load_hf_config(cfg)
    chunks = qwen3_moe.build_model(hf, vocab_size=128, perform_initialization=False)
    ex = HFExporter(chunks, hf)
    t = time.perf_counter()
    plan = ex.plan(16 * 2**20)
    plan_s = time.perf_counter() - t
    n = sum(len(b) for b in ex.buckets(16 * 2**20))  # first call builds the programs
    from dataclasses import replace

    from mcore2hf.transfer.export import Executor

    def prepared(executor):
        """An executor after its first export (compiled)."""
        for _ in executor.run():
            pass
        executor.first = (dict(executor.core.counts), executor.stats["received_bytes"])
        return executor

    def export(executor, profile_it: bool = False) -> None:
        if profile_it:
            prof.enable()
        for _ in executor.run():
            pass
        if profile_it:
            prof.disable()

    def gathers(executor):
        """The export's all-gathers (groups, slots) on buffers of their own with nothing packed or copied: what
        moving its bytes costs on this transport (the floor)."""
        stages = [(st.group, st.direct[1:] if st.direct else (st.recv.numel() // st.slot, st.me, st.slot))
                  for cb in executor._compiled for st in cb.stages]
        bufs = [torch.empty(m * slot, dtype=torch.uint8, device=ex.device) for _, (m, _, slot) in stages]

        def run(_profile_it: bool = False) -> None:
            for k, (buf, (group, (_, me, slot))) in enumerate(zip(bufs, stages)):
                for w in executor.core.gather(buf, me, slot, group, k):
                    w.wait()
        return run

    prof = cProfile.Profile() if profile and dist.get_rank() == 0 else None
    main = prepared(Executor(plan, ex.ctx, ex._local, None, ex.device))
    runs = {"new": main,
            # the same plan with no collective landing in its output (the staged path), for comparison
            "staged": prepared(Executor(replace(plan, buckets=[replace(b, direct=None) for b in plan.buckets]),
                                        ex.ctx, ex._local, None, ex.device))}
    fns = {k: (lambda p=False, e=e: export(e, p)) for k, e in runs.items()}
    if dist.get_world_size() > 1:
        fns["floor"] = gathers(main)
    best = {k: (float("inf"), float("inf")) for k in fns}
    for _ in range(rounds):  # the variants alternate, so load from other jobs hits them alike
        for k, fn in fns.items():
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            fn(k == "new" and prof is not None)
            best[k] = (min(best[k][0], time.perf_counter() - t), min(best[k][1], time.process_time() - c))
    out = {"tensors": n, "buckets": len(plan.buckets), "plan_s": plan_s, "floor": best.get("floor"),
           "direct": sum(b.direct is not None for b in plan.buckets),
           **{k: (*best[k], *e.first) for k, e in runs.items()}}
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        out["profile"] = s.getvalue()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ep", type=int, default=4)
    # --hidden 16: 16x fewer bytes than 64, so that at EP > 1 the collectives' data no longer hides the host work
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    h = a.hidden
    cfg = dict(model_type="qwen3_moe", vocab_size=100, hidden_size=h, intermediate_size=3 * h // 2,
               moe_intermediate_size=h // 2, num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
               head_dim=h // 4,
               num_experts=a.experts, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256)
    r = run_world(job, Layout(ep=a.ep), cfg, a.rounds, a.profile)[0]
    print(f"{r['tensors']} HF tensors in {r['buckets']} buckets, EP {a.ep}: plan {r['plan_s']:.2f} s; "
          f"{r['direct']} buckets gathered into their output")
    print(f"{'later export (rank 0, least of ' + str(a.rounds) + ')':44} {'wall ms':>8} {'CPU ms':>8} {'CPU us/tensor':>14}"
          f" {'all-gathers':>11} {'p2p msgs':>8} {'recv MiB':>8}")
    for key, label in (("new", "this version"), ("staged", "staged (no direct landing)")):
        wall, cpu, counts, received = r[key]
        print(f"{label:44} {wall * 1e3:8.1f} {cpu * 1e3:8.1f} {cpu / r['tensors'] * 1e6:14.2f}"
              f" {counts['collectives']:11} {counts['messages']:8} {received / 2**20:8.1f}")
    if r["floor"] is not None:
        wall, cpu = r["floor"]
        print(f"{'floor: the same p2p rounds, nothing packed':44} {wall * 1e3:8.1f} {cpu * 1e3:8.1f}")
    if "profile" in r:
        print(r["profile"])


if __name__ == "__main__":
    main()
