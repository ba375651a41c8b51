"""Speculative-decoding drafts: what each engine serves as its draft, and what one sync does with it.

An engine treats its draft as a model of its own with its own update path (docs/engines.md "Speculative-decoding
drafts"): SGLang >= 0.5.21 loads each update into the runners a `selector` names ("target" / "draft" / "all",
default "all": sglang 0.5.23 managers/io_struct.py:2017,2045,2200,2223, scheduler_components/weight_updater.py:178
`_select_runners`); vLLM 0.33 loads a session's chunks into the draft model only after
`/start_draft_weight_update` (entrypoints/rl/online/api_router.py:188, v1/worker/gpu_worker.py:1552-1590). What
the model holds decides what a draft may get:

* its MTP layers (DeepSeek-V3, GLM-4.5, ...) are the weights of the engine's MTP draft (SGLang: NEXTN / EAGLE with
  the target's own checkpoint as draft; vLLM: method "mtp"): updated with the target (`draft="auto"`);
* a model without MTP layers, or an engine whose draft is a model of its own (EAGLE, EAGLE3, a draft model), or
  `draft="keep"`: the target only, the draft left as it is (a frozen draft touched by a target update lost its
  acceptance silently: miles#1926);
* a draft that should be updated but cannot be (a release without selectors, a vLLM backend without draft
  sessions): refused on every rank before anything is paused or sent, unless `draft="keep"` says to leave it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedEngine, UsageError
from .protocol import DRAFT_CHOICES, Passes, SyncSpec

#: what an engine serves as its speculative-decoding draft
KINDS = (None, "mtp", "separate", "unknown")


@dataclass(frozen=True)
class EngineDraft:
    """One engine's draft as its server reports it."""

    where: str
    kind: str | None  # KINDS: None (no draft weights), "mtp" (the model's own MTP layers), "separate", "unknown"
    detail: str = ""  # what the engine reported, for messages ("speculative_algorithm EAGLE3, draft /ckpt/eagle")
    refusal: str | None = None  # why its MTP draft cannot be updated by this sync (release, backend, TP)


def check_choice(spec: SyncSpec) -> None:
    """UsageError for a draft choice sync cannot honour whatever the engines (before any engine call)."""
    if spec.draft not in DRAFT_CHOICES:
        raise UsageError(f"draft: expected one of {DRAFT_CHOICES}, found {spec.draft!r}")
    if spec.draft == "update" and not spec.model_draft:
        raise UsageError("draft='update': expected a model holding MTP layers (the weights of the engines' MTP "
                         "draft), found none (built with mtp_num_layers=None, filtered out by name_filter, or an "
                         "adapter export)")


def without_draft(spec: SyncSpec) -> Passes | None:
    """The passes of a sync that sends no draft pass whatever the engines serve (no engine call needed); None when
    the engines' drafts decide (`decide`)."""
    if spec.draft == "keep":
        return Passes(("target",), "left alone (draft='keep')")
    if not spec.model_draft:
        return Passes(("target",), "target only: the model holds no MTP layers")
    return None


def decide(spec: SyncSpec, engines: list[EngineDraft], copies: bool, every_engine: bool = False) -> Passes:
    """The passes of a sync whose model holds MTP layers, from every engine's draft (the same list on every rank,
    so every rank decides the same, or raises the same UnsupportedEngine). `every_engine`: the draft pass reaches
    every engine or none (a broadcast whose receivers all need a draft session)."""
    fixed = without_draft(spec)
    if fixed is not None:
        return fixed
    drafts = [e for e in engines if e.kind is not None]
    mtp = [e for e in engines if e.kind in ("mtp", "unknown")]
    unknown = [e for e in mtp if e.kind == "unknown"]
    if unknown and spec.draft == "auto":
        raise UnsupportedEngine(f"{unknown[0].where}: cannot tell whether it serves an MTP draft ({unknown[0].detail}); "
                                "the model holds MTP layers: pass draft='update' to update the engines' MTP draft, "
                                "or draft='keep' to leave any draft as it is")
    if not mtp:
        if spec.draft == "update":
            raise UnsupportedEngine("draft='update': no engine serves an MTP draft ("
                                    + "; ".join(f"{e.where}: {e.detail or 'no draft'}" for e in engines) + ")")
        what = f"{drafts[0].where} serves a draft of its own ({drafts[0].detail})" if drafts else \
            "no engine serves a draft"
        return Passes(("target",), f"target only: {what}; the model's MTP layers were not sent")
    separate = [e for e in engines if e.kind == "separate"]
    if separate:
        raise UnsupportedEngine(f"engines of one sync serve different drafts: {mtp[0].where} the model's MTP layers, "
                                f"{separate[0].where} a draft of its own ({separate[0].detail}); sync them with "
                                "separate senders, or pass draft='keep'")
    without = [e for e in engines if e.kind is None]
    if every_engine and without:
        raise UnsupportedEngine(f"{without[0].where} serves no draft, and the draft's weights reach every engine of "
                                "this sender together; sync it with a separate sender, or pass draft='keep'")
    refused = [e for e in mtp if e.refusal]
    if refused:
        raise UnsupportedEngine(f"{refused[0].where}: its MTP draft cannot be updated: {refused[0].refusal}; pass "
                                "draft='keep' to leave it as it is (its acceptance falls as the target moves away)")
    return Passes(("target", "draft"), f"updated on {len(mtp)} of {len(engines)} engine(s)", copies)
