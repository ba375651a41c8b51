"""Peak memory of `mcore2hf verify` on HF directories of a few hundred MB (CPU).

Writes with safetensors a bf16 directory A (8 tensors of 4096 x 6144 and a norm, 384 MiB, 4 shards and an index),
an identical copy B, an fp32 copy C (769 MiB) and a block-FP8 copy Q (the reference quantizer, 193 MiB, with the
config.json an FP8 export has), then runs each comparison in a fresh process and reports its peak RSS (VmHWM)
next to that of a process that only imports torch and safetensors.

    python bench/verify_memory.py [--dir /tmp/verify-bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

CASES = [("bf16 vs bf16, identical", "a", "b", []),
         ("bf16 vs fp32, --atol 1e-2", "a", "c", ["--atol", "1e-2"]),
         ("FP8 vs bf16, reference quantizer", "q", "a", []),
         ("FP8 vs bf16, --fp8 bound", "q", "a", ["--fp8", "bound"])]


def write(root: str) -> None:
    import torch
    from safetensors.torch import save_file

    from mcore2hf.quantize.fp8 import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(4096, 6144, generator=g).bfloat16()
               for i in range(8)}
    tensors["model.norm.weight"] = torch.ones(4096, dtype=torch.bfloat16)
    names = sorted(tensors)
    for d in "abcq":
        os.makedirs(os.path.join(root, d), exist_ok=True)
    maps: dict[str, dict[str, str]] = {d: {} for d in "abcq"}
    for k in range(4):
        f = f"model-{k + 1:05d}-of-00004.safetensors"
        part = {n: tensors[n] for n in names[k::4]}
        quantized = {}
        for n, t in part.items():
            if t.dim() == 2:
                quantized[n], quantized[n + "_scale_inv"] = per_block_cast_to_fp8(t)
            else:
                quantized[n] = t
        for d, content in (("a", part), ("b", part), ("c", {n: t.float() for n, t in part.items()}),
                           ("q", quantized)):
            save_file(content, os.path.join(root, d, f), metadata={"format": "pt"})
            maps[d].update(dict.fromkeys(content, f))
    for d, wm in maps.items():
        with open(os.path.join(root, d, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": wm}, fh)
    with open(os.path.join(root, "q", "config.json"), "w") as fh:  # as output_config writes an FP8 export's
        json.dump({"torch_dtype": "bfloat16", "quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}}, fh)


def peak_rss(code: str, *args: str) -> tuple[int, str]:
    """VmHWM of a fresh process running `code` (ru_maxrss would carry this process's high-water mark)."""
    code += ("\nimport re\nprint('RSS', re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    m = re.search(r"^RSS (\d+)$", out.stdout, re.M)
    if m is None:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    verdict = "IDENTICAL" if "\nIDENTICAL" in out.stdout else "DIFFERENT"
    return int(m.group(1)) * 1024, verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where the directories go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep them")
    a = p.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="verify-bench-")
    if not os.path.isdir(os.path.join(root, "q")):
        write(root)
    try:
        base, _ = peak_rss("import torch, safetensors")
        print(f"baseline (import torch, safetensors): {base / 2**20:.0f} MiB")
        print(f"{'comparison':<36}  {'verdict':<9}  peak RSS")
        run = ("import sys\nfrom mcore2hf.cli import main\ntry:\n    main(['verify', *sys.argv[1:]])\n"
               "except SystemExit:\n    pass")
        for label, x, y, extra in CASES:
            rss, verdict = peak_rss(run, os.path.join(root, x), os.path.join(root, y), *extra)
            print(f"{label:<36}  {verdict:<9}  {rss / 2**20:.0f} MiB")
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
