"""LoRA exports against the plain export, in one run (issue 25's bench): a Qwen3-30B-A3B-shaped model with
Megatron-Bridge LoRA (rank 32) on every attention linear and every expert linear, its adapters random.

    python bench/lora_export.py --layers 12                       # on a lent GPU (one rank, NCCL)
    python bench/lora_export.py --cpu --layers 2 --experts 4 --hidden 256 --heads 4 --moe-ffn 64 --vocab 1024

Rows: the plain export of the base weights (`lora="base"`: what a full sync sends), the adapter-only export
(`lora="adapter"`: what an adapter sync sends), the merged export (`lora="merged"`: W + alpha/r B A on the
shards), and a device copy of the base export's bytes (the floor). Bytes and best-of-`--repeat` seconds, ratios
against the plain export; then the merged export's expert and o_proj tensors against the per-weight merge
(W.float() + s B.float() @ A.float()).to(dtype) computed on the device (elements that differ). "Before" numbers:
run this script with an older mcore2hf wheel on PYTHONPATH (it uses no API newer than the export itself). Bridge's LoRA needs megatron-core < 0.17 (Megatron-Bridge 0.3.1, the release the tests
pin: tests/harness/bridge_lora.py): on the GPU machine carry megatron-core 0.16.1's cp312 wheel and the unpacked
Bridge files (MCORE2HF_WHEEL_CACHE)."""

from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from export_speed import consume, copy_floor, hf_config, random_model, sync, timed  # noqa: E402

#: what the issue asks: every attention linear and every expert linear (Bridge's target names)
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def job(a) -> dict:
    import torch
    from harness.bridge_lora import apply_lora

    from mcore2hf import HFExporter

    device = torch.device("cpu") if a.cpu else torch.device("cuda", torch.cuda.current_device())
    cfg, chunks = random_model("qwen3_moe", hf_config(a), 1, device)
    apply_lora(a.bridge, chunks, TARGETS, a.rank, 2 * a.rank)
    g = torch.Generator(device=device).manual_seed(7)
    with torch.no_grad():  # Bridge initializes B to zero: random factors, so the merge does real work
        for c in chunks:
            for n, p in c.named_parameters():
                if ".adapter." in n:
                    p.normal_(0, 0.02, generator=g)
    sync(device)
    bb = int(a.bucket_mb * 2**20)
    rows = {}
    for mode in ("base", "adapter", "merged"):
        ex = HFExporter(chunks, cfg, lora=mode)
        consume(ex.buckets(bb))  # plan + compile
        best = min(timed(lambda ex=ex: consume(ex.buckets(bb)), device)[0] for _ in range(a.repeat))
        rows[mode] = (ex.plan(bb).total_bytes, best, len(ex.plan(bb).hf_entries()))
        if mode == "base":
            rows["floor"] = (rows["base"][0], copy_floor(ex, device)[0], 0)
        if mode == "merged":
            check = check_merged(chunks, ex, bb, 2.0)
        ex.release()
        del ex
    return {"rows": rows, "check": check}


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_O_PROJ = re.compile(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight")


def check_merged(chunks, ex, bb: int, scale: float) -> dict:
    """The merged export's expert and o_proj tensors (column- and row-parallel bases: their HF tensors are row
    ranges of the Megatron weight at TP 1) against the per-weight merge of the code before batching,
    (W.float() + scale * (B.float() @ A.float())).to(W.dtype), computed here on the device: elements compared,
    elements that differ, the largest difference."""

    params = {n: p.detach() for n, p in chunks[0].named_parameters()}
    seen = differ = 0
    worst = 0.0
    for bucket in ex.buckets(bb):
        for name, t in bucket:
            m, o = _EXPERT.fullmatch(name), _O_PROJ.fullmatch(name)
            if m:
                layer, e, part = m.groups()
                module = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{2 if part == 'down' else 1}"
            elif o:
                module, part = f"decoder.layers.{o.group(1)}.self_attention.linear_proj", "down"
            else:
                continue
            w, a, b = (params[f"{module}.{k}.weight"] for k in ("to_wrap", "adapter.linear_in", "adapter.linear_out"))
            ref = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
            if part != "down":  # fc1 [gate; up]
                half = ref.shape[0] // 2
                ref = ref[:half] if part == "gate" else ref[half:]
            seen += t.numel()
            differ += int((t != ref).sum())
            worst = max(worst, float((t.float() - ref.float()).abs().max()))
        del bucket
    return {"elements": seen, "differ": differ, "max_abs": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--moe-ffn", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    a.arch = "qwen3_moe"
    from harness.bridge_lora import bridge_root

    from mcore2hf.runtime.world import Layout, run_world

    a.bridge = bridge_root()
    run = run_world(job, Layout(), a, backend="gloo" if a.cpu else "nccl", timeout=3000)[0]
    r = run["rows"]
    c = hf_config(a)
    print(f"\nqwen3_moe (Qwen3-30B-A3B shapes) {c['num_hidden_layers']} layers x {c['num_experts']} experts, "
          f"hidden {c['hidden_size']}; Bridge LoRA r={a.rank} on {', '.join(TARGETS)} (attention and every expert); "
          f"TP 1, {'CPU/gloo' if a.cpu else 'GPU'}")
    base = r["base"][1]
    print(f"{'export':34s} {'HF tensors':>10s} {'GB':>9s} {'seconds':>9s} {'vs base':>8s}")
    names = {"base": 'plain (lora="base")', "adapter": 'adapter only (lora="adapter")',
             "merged": 'merged (lora="merged")', "floor": "device copy of the base bytes"}
    for k in ("base", "adapter", "merged", "floor"):
        nbytes, s, n = r[k]
        print(f"{names[k]:34s} {n or '':>10} {nbytes / 1e9:9.3f} {s:9.4f} {s / base:7.2f}x")
    print(f"adapter bytes / base bytes: {r['adapter'][0] / r['base'][0]:.4f}")
    ck = run["check"]
    print(f"merged vs the per-weight merge before batching ((W.float() + s B.float() @ A.float()).to(dtype), on this "
          f"device; experts and o_proj): {ck['differ']} of {ck['elements']} elements differ, max |diff| "
          f"{ck['max_abs']:.3g}")


if __name__ == "__main__":
    main()
