"""Peak memory of the offline export against checkpoint size (CPU).

Writes torch_dist checkpoints of a Qwen3-MoE-shaped model at two sizes from a 2-rank gloo world (TP1 EP2,
random weights, bf16), then exports each with `mcore2hf export` in a fresh process and reports its peak RSS.

    python bench/offline_memory.py [--layers 4 16] [--bucket-size 256MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from mcore2hf.runtime.world import Layout, run_world

BASE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
            norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)


def write_checkpoint(hf_cfg: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from mcore2hf.arch.hf_config import load_hf_config
    from mcore2hf.model_specs import qwen3_moe
    from mcore2hf.model_specs.common import padded_vocab_size

    cfg = load_hf_config(hf_cfg)
    chunks = qwen3_moe.SPEC.build_model(cfg, vocab_size=padded_vocab_size(cfg.vocab_size, 1), params_dtype=torch.bfloat16,
                                   bf16=True, perform_initialization=False)
    chunks = [c.to(torch.bfloat16) for c in chunks]
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.normal_(0, 0.02)
    md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    it = os.path.join(out, "iter_0000001")
    if dist.get_rank() == 0:
        os.makedirs(it, exist_ok=True)
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.barrier()
    dist_checkpointing.save({"model": chunks[0].sharded_state_dict(metadata=md)}, it)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--bucket-size", default="256MiB")
    a = ap.parse_args()
    rows = []
    for layers in a.layers:
        work = tempfile.mkdtemp(prefix="mcore2hf-offline-bench-")
        hf_cfg = {"model_type": "qwen3_moe", **BASE, "num_hidden_layers": layers}
        cfg_path = os.path.join(work, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(hf_cfg, f)
        ckpt = os.path.join(work, "ckpt")
        run_world(write_checkpoint, Layout(ep=2), hf_cfg, ckpt)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "export", ckpt, os.path.join(work, "hf"),
                              "--hf-config", cfg_path, "--bucket-size", a.bucket_size, "--quiet"],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr)
        rss = _child_peak_rss(ckpt, os.path.join(work, "hf2"), cfg_path, a.bucket_size)
        rows.append((layers, size, rss, time.perf_counter() - t0))
    print(f"\noffline export peak RSS (bucket {a.bucket_size}; RSS includes ~0.3-0.5 GiB of torch/megatron/transformers)")
    print(f"{'layers':>6} {'checkpoint GiB':>15} {'peak RSS GiB':>13} {'RSS / ckpt':>10}")
    for layers, size, rss, _ in rows:
        print(f"{layers:>6} {size / 2**30:>15.2f} {rss / 2**30:>13.2f} {rss / size:>10.2f}")


def _child_peak_rss(ckpt: str, out: str, cfg: str, bucket: str) -> int:
    """Peak RSS of a fresh `mcore2hf export` process (ru_maxrss of the child)."""
    code = ("import resource, sys; from mcore2hf.cli import main; main(sys.argv[1:]); "
            "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code, "export", ckpt, out, "--hf-config", cfg, "--bucket-size", bucket,
                          "--quiet"], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().split()[-1])


if __name__ == "__main__":
    main()
