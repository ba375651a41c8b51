"""Verified sync: what the engines' own weight checkers answer, read the same way for both engines.

The engine calls live with each protocol (sglang.py `/weights_checker`, vllm.py `/weight_checker` and the workers'
`compute_weight_checksums` / `reset_weights`); here is what they share: per engine rank, the engine's per-parameter
checksums; the names whose checksums changed between a baseline and the synced weights; an engine parameter
name traced back to the HF tensors we sent for it; and the check that every replica of one step holds the same
weights.
"""

from __future__ import annotations

import hashlib
import re

from ..errors import UsageError

MODES = ("proof", "checksum")

# Engine parameters that fuse several HF tensors (the engines' stacked_params_mapping / expert mapping, e.g.
# sglang 0.5.23 models/qwen2.py, llama.py, deepseek_v2.py; vllm 0.33.0 the same models): engine module -> HF modules
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
    "w13_weight": ("gate_proj", "up_proj", "w1", "w3"),
    "w2_weight": ("down_proj", "w2"),
    "w13_weight_scale_inv": ("gate_proj", "up_proj", "w1", "w3"),
    "w2_weight_scale_inv": ("down_proj", "w2"),
}


def check_mode(verify: str | None) -> str | None:
    """None or one of MODES; UsageError otherwise."""
    if verify not in (None, *MODES):
        raise UsageError(f"verify: expected None, 'proof' or 'checksum', found {verify!r}")
    return verify


def rank_digest(checksums: dict[str, str]) -> str:
    """One digest of a rank's per-parameter checksums (as sglang 0.5.23 utils/weight_checker.py:83
    overall_checksum makes its per_gpu_checksum: sha256 over the sorted names and their checksums)."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def changed(baseline: dict[str, dict[str, str]], now: dict[str, dict[str, str]]) -> list[str]:
    """'rank: name' of every parameter whose checksum differs (or that one side lacks), per engine rank."""
    out = []
    for rank in sorted(baseline.keys() | now.keys()):
        a, b = baseline.get(rank, {}), now.get(rank, {})
        out += [f"{rank}: {n}" for n in sorted(a.keys() | b.keys()) if a.get(n) != b.get(n)]
    return out


#: the role prefixes SGLang's checker gives a draft runner's parameters (0.5.23 weight_updater.py:53-68
#: `_merge_checksum_payloads`: "<role>.<name>" for every role but "target", roles "draft" / "draft_step_<i>";
#: 0.5.20 weight_updater.py:63-66: "draft.<name>")
_ROLE = r"draft(?:_step_\d+)?"
_DRAFT_ROLE = re.compile(rf"^({_ROLE})\.(.+)$")
#: an MTP draft's own module prefixes in the engines' draft classes (SGLang 0.5.23 deepseek_nextn.py:115-138 and
#: glm4_moe_nextn.py: `model.decoder.*` the MTP layer's decoder layer, `model.{enorm,hnorm,eh_proj,shared_head}`)
_DRAFT_MODULE = re.compile(r"^model\.(?:decoder\.)?")
_HF_LAYER = re.compile(r"^(.*layers\.\d+\.)")


def split_roles(checksums: dict[str, str]) -> dict[str, dict[str, str]]:
    """One engine rank's checksums per role: {"": the target's, "draft": the draft runner's, ...}, the role prefix
    SGLang's checker gives the draft's parameters removed."""
    out: dict[str, dict[str, str]] = {}
    for name, digest in checksums.items():
        m = _DRAFT_ROLE.match(name)
        role, own = (m[1], m[2]) if m else ("", name)
        out.setdefault(role, {})[own] = digest
    return out


def trace(engine_name: str, sent: set[str], draft: set[str] | None = None) -> list[str]:
    """The HF tensors we sent that an engine parameter is loaded from: the same name, else the HF modules its
    fused module stacks (FUSED), else every tensor sent under its parent module. A draft runner's parameter
    ("<rank>:draft: <name>") is traced among the draft's tensors (`draft`), its module prefix taken for their MTP
    layer's."""
    rank, _, name = engine_name.rpartition(": ")
    name = re.sub(r"^(dp\d+:pp\d+:pcp\d+:tp\d+:)", "", name)  # vLLM's per-worker prefix (gpu_worker.py:380)
    if draft and re.fullmatch(_ROLE, rank.rsplit(":", 1)[-1]):
        layer = next((m[1] for s in sorted(draft) if (m := _HF_LAYER.match(s))), "")
        if name not in draft and layer:  # the draft class's own module names (model.decoder.*, model.enorm)
            name = _DRAFT_MODULE.sub(layer, name)
        sent = draft
    if name in sent:
        return [name]
    module, _, leaf = name.rpartition(".")
    parent, _, own = module.rpartition(".")
    for fused, parts in FUSED.items():
        if own == fused or leaf == fused:
            base = parent if own == fused else module
            hits = sorted(s for s in sent if s.startswith(base + ".") and any(f".{p}." in s[len(base):] for p in parts))
            if hits:
                return hits
    base = module if module else name
    return sorted(s for s in sent if s.startswith(base + ".") or s == base)


def explain(mismatches: list[str], sent: set[str], limit: int = 20, draft: set[str] | None = None) -> str:
    """Each mismatched engine parameter with the HF tensors we sent for it (the first `limit`; a draft runner's
    among the draft's, `draft`)."""
    parts = []
    for m in mismatches[:limit]:
        hf = trace(m, sent, draft)
        shown = ", ".join(hf[:6]) + (f" (+{len(hf) - 6})" if len(hf) > 6 else "")
        parts.append(f"{m} <- {shown or 'no HF tensor we sent'}")
    more = f"; and {len(mismatches) - limit} more" if len(mismatches) > limit else ""
    return "; ".join(parts) + more


def replica_disagreement(records: list[tuple[str, dict[str, str]]]) -> str | None:
    """Engines of one step (`(engine, {rank: digest})`, from every trainer rank) whose weights differ: engines
    with the same ranks are replicas and must hold the same digest on every rank. None when they agree."""
    groups: dict[tuple, list] = {}
    for where, ranks in records:
        groups.setdefault(tuple(sorted(ranks)), []).append((where, ranks))
    for members in groups.values():
        first_where, first = members[0]
        for where, ranks in members[1:]:
            bad = [r for r in sorted(ranks) if ranks[r] != first[r]]
            if bad:
                return (f"engine replicas disagree after the sync: {where} and {first_where} hold different weights "
                        f"on engine ranks {bad}")
    return None
