"""The dry run as text: one renderer for every plan, the live exporter's (`ExportPlan.describe()`) and the dry run
of `mcore2hf plan` (which adds the layout and each rank's memory), both from the plan as plain data
(`ExportPlan.to_dict()`, the JSON of `mcore2hf plan --json`)."""

from __future__ import annotations

from ..sizes import format_size


def render(report: dict, limit: int | None = None) -> str:
    """Every HF tensor of the plan (or the first `limit`) with its shape, dtype, bucket and Megatron source (the
    model's own parameter name, Transformer Engine's where it names it; its op, shards and where they are held);
    with the report's `layout` and `memory` when it has them."""
    lay = report.get("layout")
    at = ""
    if lay is not None:
        vpp = f" VPP{lay['vpp']}" if lay["vpp"] else ""
        at = f" at TP{lay['tp']} PP{lay['pp']}{vpp} EP{lay['ep']} ETP{lay['etp']}"
    lines = [f"plan for {report['model_type']}{at} (world size {report['world_size']}): {report['num_tensors']} HF "
             f"tensors, {format_size(report['total_bytes'])}, {len(report['buckets'])} bucket(s) of <= "
             f"{format_size(report['bucket_bytes'])}"]
    mem = report.get("memory")
    if mem:
        worst = max(mem, key=lambda m: m["total_bytes"])
        lines.append(f"extra memory per rank during an export (every rank receives): up to "
                     f"{format_size(worst['total_bytes'])} (rank {worst['rank']}: staging arena "
                     f"{format_size(worst['arena_bytes'])} + largest output bucket "
                     f"{format_size(worst['largest_bucket_bytes'])}"
                     + (f" + the next one, gathered into while you hold it {format_size(worst['next_bucket_bytes'])}"
                        if worst.get("next_bucket_bytes") else "") + "), plus any bucket your loop keeps")
        lines += memory_lines(mem)
    if report.get("quantize"):
        q, pre = report["quantized"], report["quantized_on_shards"]
        rows, cols = report.get("quantize_block", (128, 128))
        lines.append(f"quantized ({report['quantize']}, {rows}x{cols} blocks): {len(q)} weights become quantized "
                     f"weights + their scales (listed with their shapes), {len(pre)} of them on the shards before "
                     f"the collectives (op FP8RowSlices), {len(q) - len(pre)} after the gather; the other tensors "
                     "keep their dtype")
    lines.append(f"{'bucket':>6}  {'HF tensor':<60} {'shape':<18} {'dtype':<9} source [op, shards x where]")
    tensors = report["tensors"]
    for t in tensors[:limit]:
        where = f"pp{','.join(map(str, t['stages']))}" + (f" ep{t['ep']}" if t["ep"] >= 0 else "")
        lines.append(f"{t['bucket']:>6}  {t['name']:<60} {str(t['shape']):<18} {t['dtype']:<9} "
                     f"{t['megatron']} [{t['op']}, {t['shards']} shard(s) x {where}]")
    if limit is not None and len(tensors) > limit:
        lines.append(f"... {len(tensors) - limit} more")
    if "seconds" in report:
        lines.append(f"planned in {report['seconds']:.1f} s (one process, no weights)")
    return "\n".join(lines)


def memory_lines(memory: list[dict]) -> list[str]:
    """One line per distinct memory estimate, with the ranks that have it (most ranks share one)."""
    groups: dict[tuple, list[int]] = {}
    for m in memory:
        key = (m["total_bytes"], m["arena_bytes"], m["largest_bucket_bytes"], m.get("next_bucket_bytes", 0))
        groups.setdefault(key, []).append(m["rank"])
    lines = []
    for (total, arena, out, nxt), ranks in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[1][0])):
        lines.append(f"  ranks {_ranges(ranks)}: {format_size(total)} = staging arena {format_size(arena)} + "
                     f"output bucket {format_size(out)}" + (f" + next bucket {format_size(nxt)}" if nxt else ""))
    return lines


def _ranges(ranks: list[int]) -> str:
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
