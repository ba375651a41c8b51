"""The dry run behind `mcore2hf plan`: the export plan of a model built on the meta device (no weights) in gloo
worker processes at the training layout, with each rank's extra memory, as text or JSON."""

from __future__ import annotations

from .sizes import format_size


def _plan_rank(hf_config, layout, bucket_bytes: int, dtype_name: str, te_names: bool, name_filter,
               quantize=None) -> dict:
    import torch
    import torch.distributed as dist

    from . import HFExporter, build_model

    dtype = getattr(torch, dtype_name)
    with torch.device("meta"):  # shapes and names only: no memory, no initialization
        # local spec: TE names, when asked for, are applied below (Transformer Engine needs no GPU then)
        chunks = build_model(hf_config, use_te=False, perform_initialization=False, params_dtype=dtype,
                             **layout.config_overrides())
        chunks = [c.to(dtype) for c in chunks]  # as Megatron's Float16Module does in training
    if te_names:
        from .runtime.te_naming import to_te_names

        to_te_names(chunks)
    ex = HFExporter(chunks, hf_config)
    plan = ex.plan(bucket_bytes, name_filter=name_filter, quantize=quantize)
    memory = ex.executor(bucket_bytes, name_filter=name_filter, quantize=quantize).memory_estimate()
    report = plan.to_dict() if dist.get_rank() == 0 else {}
    report["memory"] = memory
    return report


def run_plan(hf_config, layout, *, bucket_bytes: int, dtype: str = "bfloat16", te_names: bool = False,
             name_filter=None, quantize: str | None = None) -> dict:
    """The plan as a dict (tensors, buckets, layout, each rank's memory). The layout is checked first.
    `quantize="fp8"` / `"fp8-ue8m0"`: the FP8 export's plan (which weights are quantized, scale shapes)."""
    from .runtime.world import run_world

    layout.check(hf_config)
    ranks = run_world(_plan_rank, layout, hf_config, layout, bucket_bytes, dtype, te_names, name_filter, quantize)
    report = ranks[0]
    report["layout"] = {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep,
                        "etp": layout.expert_tp, "world_size": layout.size}
    report["memory"] = [dict(rank=r, **x["memory"]) for r, x in enumerate(ranks)]
    return report


def plan_report(report: dict, limit: int | None = None) -> str:
    lay = report["layout"]
    vpp = f" VPP{lay['vpp']}" if lay["vpp"] else ""
    lines = [f"plan for {report['model_type']} at TP{lay['tp']} PP{lay['pp']}{vpp} EP{lay['ep']} ETP{lay['etp']} "
             f"(world size {lay['world_size']}): {report['num_tensors']} HF tensors, "
             f"{format_size(report['total_bytes'])}, {len(report['buckets'])} bucket(s) of <= "
             f"{format_size(report['bucket_bytes'])}"]
    mem = report["memory"]
    worst = max(mem, key=lambda m: m["total_bytes"])
    lines.append(f"extra memory per rank during an export (every rank receives): up to "
                 f"{format_size(worst['total_bytes'])} (rank {worst['rank']}: staging arena "
                 f"{format_size(worst['arena_bytes'])} + largest output bucket "
                 f"{format_size(worst['largest_bucket_bytes'])}"
                 + (f" + the next one, gathered into while you hold it {format_size(worst['next_bucket_bytes'])}"
                    if worst.get("next_bucket_bytes") else "") + "), plus any bucket your loop keeps")
    if report.get("quantize"):
        q, pre = report["quantized"], report["quantized_on_shards"]
        lines.append(f"quantized ({report['quantize']}, 128x128 blocks): {len(q)} weights -> float8_e4m3fn + float32 "
                     f"weight_scale_inv (listed below), {len(pre)} of them on the shards before the collectives, "
                     f"{len(q) - len(pre)} after the gather")
    lines.append(f"{'bucket':>6}  {'HF tensor':<60} {'shape':<18} {'dtype':<9} source [op, shards x where]")
    tensors = report["tensors"]
    for t in tensors[:limit]:
        where = f"pp{','.join(map(str, t['stages']))}" + (f" ep{t['ep']}" if t["ep"] >= 0 else "")
        lines.append(f"{t['bucket']:>6}  {t['name']:<60} {str(t['shape']):<18} {t['dtype']:<9} "
                     f"{t['megatron']} [{t['op']}, {t['shards']} shard(s) x {where}]")
    if limit is not None and len(tensors) > limit:
        lines.append(f"... {len(tensors) - limit} more")
    return "\n".join(lines)
