"""The main job on a built-in tiny model, end to end, on CPU: `mcore2hf demo`.

1. transformers writes a tiny random HF checkpoint (the source of truth);
2. a gloo world at a multi-rank layout builds the real Megatron model from the HF config and loads the weights;
3. HFExporter streams it out (every rank receives) and each rank checks every tensor is bit-identical to the
   source; a second export reuses the plan; save_pretrained writes an HF directory;
4. transformers loads that directory (no missing/unexpected keys) and its logits are compared with the
   Megatron forward on the same tokens.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from .runtime.world import Layout, run_world

DEMO_LAYOUT = Layout(tp=2, ep=4, etp=1)


def _say(since: float | None, text: str) -> None:
    """A progress line (`since`: the demo's start, wall clock, the same in every process; None: silent)."""
    if since is not None:
        print(f"  [{time.time() - since:5.1f} s] {text}", flush=True)


def _rank_job(ckpt: str, layout: Layout, out_dir: str, tokens: torch.Tensor, overwrite: bool = False,
              since: float | None = None) -> dict:
    import torch.distributed as dist

    from . import HFExporter, build_model, load_hf_weights
    from .arch.hf_config import load_hf_config, text_config
    from .arch.registry import get_converter
    from .runtime.forward import megatron_logits
    from .runtime.tiny import read_hf_checkpoint

    talk = since if dist.get_rank() == 0 else None  # rank 0 speaks for the world (its stdout is the demo's)
    _say(talk, "building the Megatron model from the HF config on every rank")
    cfg = load_hf_config(ckpt)
    chunks = build_model(cfg, use_te=False, **layout.config_overrides())  # CPU gloo workers: the local spec
    load_hf_weights(chunks, ckpt)  # collective: every rank has loaded when it returns
    _say(talk, "built on every rank and loaded from the checkpoint (load_hf_weights)")
    # what the Megatron model holds (a multimodal source's vision tower is not: the saved directory gets it from
    # the source, `base`)
    not_held = get_converter(cfg.model_type).not_held_by_model
    ref = {n: t for n, t in read_hf_checkpoint(ckpt).items() if not not_held(n)}

    ex = HFExporter(chunks, cfg)
    t0 = time.perf_counter()
    plan = ex.plan(bucket_bytes=256 * 1024)
    got, nbytes = {}, 0
    for bucket in ex.buckets(bucket_bytes=256 * 1024):
        nbytes += bucket.nbytes
        got.update((n, t.clone()) for n, t in bucket)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in ex.buckets(bucket_bytes=256 * 1024):
        pass
    second = time.perf_counter() - t0
    identical = set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    passed = torch.tensor([int(identical)])
    dist.all_reduce(passed)
    _say(talk, f"export: {len(got)} HF tensors in {len(plan.buckets)} buckets to every rank, first "
               f"{first * 1e3:.0f} ms (plans), second {second * 1e3:.0f} ms; bit-identical to the source: "
               f"{'PASS' if int(passed) == dist.get_world_size() else 'FAIL'} on {int(passed)}/"
               f"{dist.get_world_size()} ranks")
    ex.save_pretrained(out_dir, bucket_bytes=256 * 1024, overwrite=overwrite,
                       base=ckpt if len(ref) < len(read_hf_checkpoint(ckpt)) else None)
    _say(talk, "save_pretrained wrote the HF directory; next the Megatron forward of 2 x 16 tokens")

    logits = megatron_logits(chunks, tokens, text_config(cfg).vocab_size)  # every stage in order, at any layout
    return dict(rank=dist.get_rank(), identical=identical, tensors=len(got), bytes=nbytes,
                buckets=len(plan.buckets), first_s=first, second_s=second, logits=logits)


def run_demo(model_type: str = "qwen3_moe", layout: Layout = DEMO_LAYOUT, out_dir: str | None = None,
             overwrite: bool = False, progress: bool = False) -> dict:
    """Run the demo; returns the verification results (also printed by the CLI). `out_dir` keeps the exported
    directory (`overwrite`: replace an earlier export there). `progress`: a line on stdout as each stage ends
    (the world's from its rank 0)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .arch.hf_config import text_config
    from .runtime.tiny import make_hf_checkpoint, tiny_config

    since = time.time() if progress else None
    with tempfile.TemporaryDirectory(prefix="mcore2hf-demo-") as work:  # nothing is left behind but `out_dir`
        config = tiny_config(model_type)
        ckpt = make_hf_checkpoint(config, os.path.join(work, "source"))
        _say(since, f"transformers wrote a random tiny {model_type} checkpoint (the source of truth)")
        exported = out_dir or os.path.join(work, "exported")
        tokens = torch.randint(0, text_config(config).vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        _say(since, f"starting {layout.size} gloo worker processes at {layout} (each imports torch and "
                    "megatron-core first: the slow part)")
        t0 = time.perf_counter()
        ranks = run_world(_rank_job, layout, ckpt, layout, exported, tokens, overwrite, since,
                          on_progress=lambda stage, rank, n: _say(since, f"rank {rank}: {stage} ({n}/{layout.size})"))
        world_s = time.perf_counter() - t0
        _say(since, "world done; transformers loads the exported directory and runs the same tokens")

        # a multimodal model (Qwen3.5) loads whole, its vision tower completed from the source; its text forward
        auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
        hf, info = auto.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
        # transformers builds no MTP layers; it skips them only at the published layer index (e.g. DeepSeek-V3's
        # 61, modeling_deepseek_v3.py, transformers 5.23), so a tiny model's MTP tensors show up as unexpected
        cfg = text_config(config)
        mtp = tuple(f"model.layers.{cfg.num_hidden_layers + m}." for m in range(getattr(cfg, "num_nextn_predict_layers", 0) or 0))
        info["mtp_keys"] = [k for k in info["unexpected_keys"] if k.startswith(mtp)] if mtp else []
        info["unexpected_keys"] = [k for k in info["unexpected_keys"] if k not in info["mtp_keys"]]
        clean = not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
        diff = None
        if ranks[0]["logits"] is not None:
            with torch.no_grad():
                ref = hf.eval()(input_ids=tokens).logits
            diff = (ranks[0]["logits"] - ref).abs().max().item()
        _say(since, f"from_pretrained: {'PASS' if clean else 'FAIL'}"
                    + ("" if diff is None else f"; logits max |diff| to Megatron's {diff:.2e}"))
    return dict(model_type=model_type, layout=str(layout), ranks=ranks, world_s=world_s, out_dir=out_dir,
                loading_info=info, clean_load=clean, logit_diff=diff)


def format_report(r: dict) -> tuple[str, bool]:
    ranks = r["ranks"]
    r0 = ranks[0]
    ok_ident = all(x["identical"] for x in ranks)
    ok_load = r["clean_load"]
    from .runtime.forward import logit_tolerance

    tol = logit_tolerance(r["model_type"])
    ok_logits = r["logit_diff"] is None or r["logit_diff"] <= tol
    rows = [
        ("source", "random tiny HF checkpoint written by transformers"),
        ("layout", f"{r['layout']} ({len(ranks)} gloo ranks on CPU, real megatron-core GPTModel)"),
        ("export (every rank receives)", f"{r0['tensors']} HF tensors, {r0['bytes'] / 2**20:.2f} MiB, "
                                         f"{r0['buckets']} buckets"),
        ("bit-identical to the source", f"{'PASS' if ok_ident else 'FAIL'} on {sum(x['identical'] for x in ranks)}"
                                        f"/{len(ranks)} ranks"),
        ("plan reuse", f"first export {r0['first_s'] * 1e3:.0f} ms (plans), second {r0['second_s'] * 1e3:.0f} ms"),
        ("save_pretrained -> from_pretrained", f"{'PASS' if ok_load else 'FAIL'}: missing "
                                               f"{len(r['loading_info']['missing_keys'])}, unexpected "
                                               f"{len(r['loading_info']['unexpected_keys'])}"
                                               + (f" (and {len(r['loading_info']['mtp_keys'])} MTP tensors, which "
                                                  "transformers does not build)" if r["loading_info"]["mtp_keys"] else "")),
    ]
    if r["logit_diff"] is not None:
        rows.append(("logits: Megatron vs transformers", f"{'PASS' if ok_logits else 'FAIL'}: max |diff| "
                                                         f"{r['logit_diff']:.2e} (fp32, tolerance {tol:g})"))
    width = max(len(a) for a, _ in rows)
    lines = [f"mcore2hf demo: {r['model_type']}  ({r['world_s']:.1f} s)", ""]
    lines += [f"  {a:<{width}}  {b}" for a, b in rows]
    lines += ["", f"  exported directory: {r['out_dir']}" if r["out_dir"] else
              "  (nothing was kept: pass --out DIR to keep the exported HF directory)"]
    ok = ok_ident and ok_load and ok_logits
    lines.append("  RESULT: " + ("all checks passed" if ok else "FAILED"))
    return "\n".join(lines), ok
