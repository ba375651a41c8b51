"""megatron-core >= 0.19's HybridModel (hybrid layer patterns, attention and MLP as separate Megatron layers) exports
and loads like the GPTModel of the same HF weights (issue 14). For qwen3 (pattern "*-*-*-*-") and qwen3_moe
("*E*E*E*E"), at each layout: the GPTModel and the HybridModel are built with `mcore2hf.build_model` (the latter
with model_class="hybrid": one '|' segment per pipeline stage), loaded with the same tiny random HF weights, and
both exports must equal the HF source bit for bit; the HybridModel also loads the GPTModel's export and, at PP1,
gives the GPTModel's logits exactly (tests/worlds.py `hybrid_suite`). The offline import for hybrid models
(`import_checkpoint(..., model_class="hybrid")`, written once per architecture) is loaded at every layout by
Megatron's own `dist_checkpointing.load` (strict) into the HybridModel and exported: bit for bit the HF source; and
the import is exported back offline (no Megatron) to the HF source. Prints a table; exit status 1 if anything
failed.

On the GPU machine (Python 3.12, megatron-core 0.19.2 carried in .whl/ with an mcore2hf wheel of this checkout):
    bash bench/on_device.sh "CUDA_VISIBLE_DEVICES= python3 bench/hybrid_check.py"
gloo CPU workers by default; `--backend nccl` runs the layouts that fit the visible GPUs (no logits there).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

LAYOUTS = {  # name -> (Layout kwargs, architectures)
    "tp2": (dict(tp=2), ["qwen3", "qwen3_moe"]),
    "pp2": (dict(pp=2), ["qwen3", "qwen3_moe"]),
    "pp2-vpp2": (dict(pp=2, vpp=2), ["qwen3", "qwen3_moe"]),
    "tp2-ep2": (dict(tp=2, ep=2), ["qwen3_moe"]),
    "tp2-pp2-ep2-etp1": (dict(tp=2, pp=2, ep=2, etp=1), ["qwen3", "qwen3_moe"]),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()

    import megatron.core
    import torch
    import transformers
    import worlds

    from mcore2hf.importer import import_checkpoint
    from mcore2hf.offline import export_checkpoint
    from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
    from mcore2hf.runtime.world import Layout, run_world

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
          f"transformers {transformers.__version__}, backend {args.backend}")
    root = tempfile.mkdtemp(prefix="hybrid_check_")
    ckpts = {mt: make_hf_checkpoint(tiny_config(mt), os.path.join(root, mt)) for mt in ("qwen3", "qwen3_moe")}
    rows, failures = [], 0
    imports = os.path.join(root, "import")  # the hybrid model's checkpoint keys, loaded at every layout below
    for mt, ckpt in ckpts.items():
        import_checkpoint(ckpt, os.path.join(imports, mt), model_class="hybrid", progress=False)
        back = os.path.join(root, "reexport", mt)
        export_checkpoint(os.path.join(imports, mt), back, ckpt, progress=False)
        got, ref = read_hf_checkpoint(back), read_hf_checkpoint(ckpt)
        ok = got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
        failures += not ok
        rows.append(("import -> offline export", mt, "-", "-", "-", f"{len(ref)}", "PASS" if ok else "FAIL", "-"))
    for name in args.layouts.split(","):
        kwargs, archs = LAYOUTS[name]
        layout = Layout(**kwargs)
        if layout.vpp and importlib.util.find_spec("megatron.core.models.hybrid") is None:
            rows.append((name, "-", "-", "-", "-", "-", "skipped: megatron-core < 0.19 has no hybrid VPP", "-"))
            continue
        if args.backend == "nccl" and layout.size > torch.cuda.device_count():
            rows.append((name, "-", "-", "-", "-", "-", f"skipped: {layout.size} ranks, "
                         f"{torch.cuda.device_count()} GPUs", "-"))
            continue
        tokens = None
        if layout.pp == 1 and args.backend == "gloo":
            tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        t = time.perf_counter()
        try:
            results = run_world(worlds.for_each_arch, layout, worlds.hybrid_suite, {mt: ckpts[mt] for mt in archs},
                                layout, tokens, None, imports, backend=args.backend)
        except Exception as e:  # noqa: BLE001 - a world that fails to start is one row, the others still run
            rows.append((name, ",".join(archs), "-", "-", "-", "-", f"FAIL: {type(e).__name__}: {e}"[:300], "-"))
            failures += 1
            continue
        seconds = time.perf_counter() - t
        for mt in archs:
            r = results[0][mt]
            if isinstance(r, Exception):
                failures += 1
                rows.append((name, mt, "-", "-", "-", "-", "FAIL", f"{seconds:.0f}"))
                print(f"--- {name} {mt}:\n{r}")
                continue
            layers = sum(x[mt]["megatron_layers_here"] for x in results) * layout.pp // layout.size
            logits = "-" if r["logits_max_diff"] is None else f"{r['logits_max_diff']:.1e}"
            # one replica holds every Megatron layer of the pattern once (pipeline stages and VPP chunks together)
            ok = (layers == len(r["pattern"]) and r["logits_max_diff"] in (None, 0.0)
                  and r["imported_tensors"] == r["tensors"])
            failures += not ok
            rows.append((name, mt, r["model_class"], r["pattern"], f"{layers}", f"{r['tensors']}",
                         ("PASS" if ok else "FAIL") + f" (logits max abs diff {logits}; import loaded: "
                         f"{r['imported_tensors']} tensors)", f"{seconds:.0f}"))
    head = ("layout", "arch", "model", "pattern", "Megatron layers", "HF tensors",
            "hybrid == GPTModel == HF source, bit for bit; pattern mismatch refused; import loaded", "world s")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("RESULT:", "all checks passed" if not failures else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
