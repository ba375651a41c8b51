"""The GPU speed benchmark's code path, at small size on CPU (gloo): it must run and report every method."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_export_speed_bench_runs_on_cpu():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "export_speed.py"), "--cpu", "--layout", "tp2ep2-w2",
           "--arch", "glm4_moe", "--layers", "2", "--experts", "8", "--hidden", "128", "--heads", "4",
           "--moe-ffn", "128", "--vocab", "1000", "--repeat", "1", "--leak-rounds", "2", "--quantize", "fp8,fp8-ue8m0",
           "--engine-placements", "sglang:tp2,vllm:tp2ep2:masked"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DIFFER" not in out.stdout, out.stdout
    for row in ("mcore2hf (all ranks)", "mcore2hf (rank 0 only)", "mcore2hf (all ranks, overlap)",
                "per-tensor async (slime-style)", "growth 0.0 MiB", "mcore2hf fp8 (all ranks)",
                "mcore2hf fp8 (rank 0 only)", "weights quantized", "sampled tensors bit-identical",
                "mcore2hf (all ranks, staged)", "buckets gathered into their output",
                "engine sglang:tp2 slices", "engine vllm:tp2ep2 masked", "point-to-point receive rate",
                "mcore2hf fp8-ue8m0 (all ranks)", "tensors equal to the torch reference",
                "kept between exports"):
        assert row in out.stdout, out.stdout
    # every rank's engine slices equal the same regions of the all-ranks export, bit for bit (no DIFFER above)
    checks = [line for line in out.stdout.splitlines() if line.startswith("engine ") and "bit-identical" in line]
    assert len(checks) == 2 and all("/0 bit" not in line for line in checks), out.stdout
