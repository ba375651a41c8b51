"""Command line: `mcore2hf demo | list | plan | export`."""

from __future__ import annotations

import argparse
import sys

import torch

from .testing.world import Layout, run_world


def _layout_args(p: argparse.ArgumentParser, tp=1, pp=1, ep=1, etp=None) -> None:
    p.add_argument("--tp", type=int, default=tp)
    p.add_argument("--pp", type=int, default=pp)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--ep", type=int, default=ep)
    p.add_argument("--etp", type=int, default=etp)
    p.add_argument("--first-stage-layers", type=int, default=None, help="uneven pipeline: layers on stage 0")
    p.add_argument("--last-stage-layers", type=int, default=None)


def _layout(a) -> Layout:
    return Layout(tp=a.tp, pp=a.pp, vpp=a.vpp, ep=a.ep, etp=a.etp, first_stage_layers=a.first_stage_layers,
                  last_stage_layers=a.last_stage_layers)


def cmd_list(_a) -> int:
    from .registry import get_converter, list_architectures

    for name in list_architectures():
        conv = get_converter(name)
        alias = f" (format of {conv.model_type})" if conv.model_type != name else ""
        print(f"{name:<14} {len(conv.rules):>3} rules{alias}")
    return 0


def cmd_demo(a) -> int:
    from .demo import format_report, run_demo

    report, ok = format_report(run_demo(a.model_type, _layout(a), a.out))
    print(report)
    return 0 if ok else 1


def _plan_rank(hf_config, layout: Layout, bucket_bytes: int, limit, dtype_name: str) -> str | None:
    import torch.distributed as dist

    from . import HFExporter
    from .hf_config import load_hf_config
    from .model_specs.common import padded_vocab_size
    from .registry import get_model_spec

    cfg = load_hf_config(hf_config)
    dtype = getattr(torch, dtype_name)
    with torch.device("meta"):  # shapes and names only: no memory, no initialization
        chunks = get_model_spec(cfg.model_type).build_model(
            cfg, vocab_size=padded_vocab_size(cfg.vocab_size, layout.tp), perform_initialization=False,
            params_dtype=dtype, **layout.config_overrides())
        chunks = [c.to(dtype) for c in chunks]  # as Megatron's Float16Module does in training
    plan = HFExporter(chunks, cfg).plan(bucket_bytes)
    return plan.describe(limit) if dist.get_rank() == 0 else None


def cmd_plan(a) -> int:
    from .testing.tiny import tiny_config

    hf_config = tiny_config(a.hf_config[5:]) if a.hf_config.startswith("tiny:") else a.hf_config
    out = run_world(_plan_rank, _layout(a), hf_config, _layout(a), int(a.bucket_mb * 2**20), a.limit, a.dtype)
    print(out[0])
    return 0


def cmd_export(a) -> int:
    from .offline import export_checkpoint

    r = export_checkpoint(a.ckpt_dir, a.out_dir, a.hf_config, iteration=a.iteration, dtype=a.dtype,
                          max_shard_size=a.shard_size, bucket_bytes=a.bucket_size, overwrite=a.overwrite,
                          progress=not a.quiet)
    if not a.quiet:
        print(f"wrote {r.tensors} HF tensors ({r.bytes_written / 2**30:.2f} GiB) to {r.out_dir} in {r.seconds:.1f} s; "
              f"checkpoint {r.checkpoint_bytes / 2**30:.2f} GiB, {r.ignored_keys} non-model keys skipped; "
              f"peak RSS {r.peak_rss_bytes / 2**30:.2f} GiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mcore2hf", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="export a built-in tiny model at a multi-rank layout and verify it end to end")
    d.add_argument("--model-type", default="qwen3_moe")
    d.add_argument("--out", default=None, help="where to write the exported HF directory (default: a temp dir)")
    _layout_args(d, tp=2, ep=4, etp=1)
    d.set_defaults(fn=cmd_demo)

    ls = sub.add_parser("list", help="registered architectures (HF model_type)")
    ls.set_defaults(fn=cmd_list)

    pl = sub.add_parser("plan", help="dry run: every HF tensor with shape, dtype, Megatron source and bucket")
    pl.add_argument("--hf-config", required=True, help="config.json, an HF directory, or tiny:<model_type>")
    pl.add_argument("--bucket-mb", type=float, default=512)
    pl.add_argument("--limit", type=int, default=None, help="print at most this many tensors")
    pl.add_argument("--dtype", default="bfloat16")
    _layout_args(pl)
    pl.set_defaults(fn=cmd_plan)

    ex = sub.add_parser("export", help="Megatron torch_dist checkpoint -> HF directory, offline (CPU, bounded memory)")
    ex.add_argument("ckpt_dir", help="checkpoint directory (with latest_checkpointed_iteration.txt) or an iter_* dir")
    ex.add_argument("out_dir")
    ex.add_argument("--hf-config", required=True, help="config.json or an HF directory (its tokenizer files are copied)")
    ex.add_argument("--iteration", type=int, default=None)
    ex.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast floating tensors")
    ex.add_argument("--shard-size", default="5GB")
    ex.add_argument("--bucket-size", default="1GiB", help="bytes converted at a time (bounds memory)")
    ex.add_argument("--overwrite", action="store_true")
    ex.add_argument("--quiet", action="store_true")
    ex.set_defaults(fn=cmd_export)

    a = p.parse_args(argv)
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
