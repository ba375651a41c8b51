"""Peak memory of the offline import (HF directory -> torch_dist checkpoint) against model size (CPU).

Writes random bf16 HF checkpoints of a Qwen3-MoE-shaped model at two sizes with transformers (in this process),
then imports each with `mcore2hf import` in a fresh process and reports its peak RSS, and checks the import
by exporting it back offline (`mcore2hf verify` against the source: identical).

    python bench/import_memory.py [--layers 4 16] [--file-size 1GB]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from offline_memory import BASE  # the same model shapes as the export benchmark


def write_hf(layers: int, out: str) -> None:
    import torch
    from transformers import AutoConfig

    from mcore2hf.runtime.tiny import make_hf_checkpoint

    cfg = AutoConfig.for_model("qwen3_moe", **BASE, num_hidden_layers=layers)
    make_hf_checkpoint(cfg, out, dtype=torch.bfloat16)


def _child_peak_rss(args: list[str]) -> int:
    """Peak RSS of a fresh `mcore2hf ...` process: its VmHWM (ru_maxrss is not usable here: Linux carries the
    parent's high-water mark, this process's transformers model included, into a forked child)."""
    code = ("import re, sys; from mcore2hf.cli import main; rc = main(sys.argv[1:]); "
            "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1); "
            "print('RSS', int(hwm) * 1024); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    return int(out.stdout.strip().split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--file-size", default="1GB")
    a = ap.parse_args()
    rows = []
    for layers in a.layers:
        work = tempfile.mkdtemp(prefix="mcore2hf-import-bench-")
        hf = os.path.join(work, "hf")
        write_hf(layers, hf)
        size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
        t0 = time.perf_counter()
        rss = _child_peak_rss(["import", hf, os.path.join(work, "ckpt"), "--file-size", a.file_size, "--quiet"])
        seconds = time.perf_counter() - t0
        verify = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "verify", hf, os.path.join(work, "ckpt")],
                                capture_output=True, text=True)
        if verify.returncode or "IDENTICAL" not in verify.stdout:
            sys.exit(f"the import of {layers} layers does not export back to its source:\n{verify.stdout}")
        rows.append((layers, size, rss, seconds))
        shutil.rmtree(work)
    print("\noffline import peak RSS (RSS includes ~0.3-0.5 GiB of torch/transformers; verified identical by "
          "`mcore2hf verify`)")
    print(f"{'layers':>6} {'HF GiB':>8} {'peak RSS GiB':>13} {'RSS / HF':>9} {'seconds':>8}")
    for layers, size, rss, seconds in rows:
        print(f"{layers:>6} {size / 2**30:>8.2f} {rss / 2**30:>13.2f} {rss / size:>9.2f} {seconds:>8.1f}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
