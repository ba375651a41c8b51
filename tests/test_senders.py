"""The senders' wire formats on their own: the flattened bucket (SGLang's layout, the distributed receiver's
rebuild) and our serializer (round trip, restricted unpickling). The senders against the engines themselves,
failures and retries included, run against each release's own code: tests/test_sglang_contract.py and
tests/test_vllm_contract.py."""

import pytest
import torch

from mcore2hf.plan.export import pack_tight
from mcore2hf.senders.receiver import tight_views
from mcore2hf.senders.serialize import deserialize, flattened_payload, reconstruct, serialize
from mcore2hf.transfer.buckets import Bucket


def make_bucket(tensors: dict[str, torch.Tensor]) -> Bucket:
    entries = pack_tight([(n, tuple(t.shape), t.dtype, n) for n, t in tensors.items()])
    flat = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
    for e in entries:
        flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    return Bucket(0, flat, entries)


MIXED = {"a.bf16": torch.randn(3, 5).bfloat16(), "b.fp32": torch.randn(7), "c.bf16": torch.randn(4, 4).bfloat16(),
         "d.fp32": torch.randn(2, 3), "e.i64": torch.arange(5)}


def test_flattened_bucket_is_sglangs_layout_mixed_dtypes():
    b = make_bucket(MIXED)
    meta = b.metadata()
    assert [m.name for m in meta] == ["e.i64", "b.fp32", "d.fp32", "a.bf16", "c.bf16"]  # widest first, stable
    # what SGLang's FlattenedTensorBucket(named_tensors=...) builds: flatten().view(uint8), concatenated in order
    theirs = torch.cat([MIXED[m.name].flatten().view(torch.uint8) for m in meta])
    assert torch.equal(b.flat, theirs)
    start = 0
    for m in meta:
        assert (m.start_idx, m.end_idx, m.numel) == (start, start + m.numel, MIXED[m.name].numel() * MIXED[m.name].element_size())
        start = m.end_idx
    for name, t in b:  # views, no copies
        assert torch.equal(t, MIXED[name]) and t.data_ptr() >= b.flat.data_ptr()
    # the distributed receiver's rebuild from names / dtypes / shapes in request order
    views = tight_views(b.flat, [m.name for m in meta], [str(m.dtype)[6:] for m in meta], [list(m.shape) for m in meta])
    assert all(torch.equal(t, MIXED[n]) for n, t in views)


def test_serializer_round_trip_and_restricted_unpickling():
    b = make_bucket(MIXED)
    for as_text in (True, False):
        data = serialize(flattened_payload(b), output_str=as_text)
        assert isinstance(data, str if as_text else bytes)
        payload = deserialize(data)
        assert {n: t.clone() for n, t in reconstruct(payload)}.keys() == MIXED.keys()
        assert all(torch.equal(t, MIXED[n]) for n, t in reconstruct(payload))
    import pickle

    class Evil:
        def __reduce__(self):
            return (eval, ("1 + 1",))

    class Loader:  # a callable of torch's that a prefix allowlist of "torch." would admit
        def __init__(self, fn):
            self.fn = fn

        def __reduce__(self):
            return (self.fn, ("/tmp/payload.pt",))

    for bad in (Evil(), __import__("collections").Counter(), Loader(torch.load), Loader(torch.hub.load),
                Loader(torch.save)):
        with pytest.raises(pickle.UnpicklingError, match="refusing"):
            deserialize(pickle.dumps({"x": bad}))


def test_verify_traces_engine_parameters_to_the_hf_tensors_sent():
    """A mismatched engine parameter is traced to what we sent: the same name, the HF modules a fused engine
    module stacks (sglang / vllm stacked_params_mapping), or what was sent under its module; vLLM's per-worker
    prefix and our 'rank: ' prefix are dropped first."""
    from mcore2hf.senders.checker import explain, trace

    sent = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight",
            "model.layers.0.mlp.experts.0.down_proj.weight", "model.norm.weight"}
    assert trace("dp0:pp0:tp1: model.norm.weight", sent) == ["model.norm.weight"]
    assert trace("dp0:pp0:pcp0:tp0:model.layers.0.self_attn.qkv_proj.weight", sent) == [
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight"]
    assert trace("model.layers.0.mlp.experts.w13_weight", sent) == [
        "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight"]
    assert trace("model.layers.0.mlp.experts.w2_weight", sent) == ["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert trace("lm_head.weight", sent) == []
    assert explain(["tp0: lm_head.weight"], sent) == "tp0: lm_head.weight <- no HF tensor we sent"


def test_verify_checksum_diff_and_replicas():
    """changed(): per engine rank, every parameter whose checksum differs or that one side lacks; replicas (engines
    with the same ranks) must hold the same digest on every rank, engines of another layout are not compared."""
    from mcore2hf.senders.checker import changed, rank_digest, replica_disagreement

    base = {"tp0": {"a": "1", "b": "2"}, "tp1": {"a": "3"}}
    assert changed(base, base) == []
    assert changed(base, {"tp0": {"a": "1", "b": "9"}, "tp1": {"a": "3", "c": "4"}}) == ["tp0: b", "tp1: c"]
    assert rank_digest({"b": "2", "a": "1"}) == rank_digest({"a": "1", "b": "2"}) != rank_digest({"a": "1"})
    one = {"tp0": "x", "tp1": "y"}
    assert replica_disagreement([("e1", one), ("e2", dict(one)), ("e3", {"tp0": "z"})]) is None
    msg = replica_disagreement([("e1", one), ("e2", {"tp0": "x", "tp1": "q"})])
    assert "e2 and e1" in msg and "['tp1']" in msg, msg


def test_verify_refused_without_an_engine_checker():
    """verify needs an engine sender (a writer has no checker) and a known mode; proof needs the pause."""
    from mcore2hf.errors import UsageError
    from mcore2hf.senders import SafetensorsWriter, Sender, sync

    writer = SafetensorsWriter.__new__(SafetensorsWriter)
    with pytest.raises(UsageError, match="expected an SGLang or vLLM engine sender"):
        sync(None, writer, verify="checksum")
    with pytest.raises(UsageError, match="expected None, 'proof' or 'checksum', found 'all'"):
        sync(None, writer, verify="all")
    class Engine(Sender):  # a sender that takes verify: proof still needs the pause, refused before prepare
        def prepare(self, spec):
            raise AssertionError("refused before the sender is asked")

    with pytest.raises(UsageError, match="expected pause=True"):
        sync(None, Engine(), verify="proof", pause=False)
    with pytest.raises(UsageError, match=r"expected a sender \(send\(bucket\) and finish\(\)\), found object"):
        sync(None, object())


def test_verify_refused_on_sglang_releases_without_the_checksum_checker():
    """SGLang 0.5.6-0.5.10 serve /weights_checker without the 'checksum' action (read in their wheels): verify is
    refused by version, naming it; 0.5.20 (run in the contract tests) passes; without verify nothing is asked."""
    from types import SimpleNamespace

    from mcore2hf.senders.sglang import ServerFacts, SGLangColocatedSender

    sender = SGLangColocatedSender.__new__(SGLangColocatedSender)
    state = SimpleNamespace(facts=ServerFacts("0.5.10", 1, 1), where="http://e:1")
    sender._engines, sender.verify = [state], "proof"
    assert "sglang 0.5.10 cannot verify a sync: verify needs sglang >= 0.5.20" in sender._checker_refusal()
    state.facts = ServerFacts("0.5.20", 1, 1)
    assert sender._checker_refusal() is None
    state.facts, sender.verify = ServerFacts("0.5.10", 1, 1), None
    assert sender._checker_refusal() is None


def test_adapter_sync_refused_by_sglang_release_and_flags():
    """An adapter-only sync needs /load_lora_adapter_from_tensors (sglang >= 0.5.20: read in the 0.5.20 and 0.5.23
    wheels; 0.5.4.post3 has none) and LoRA on (/server_info's resolved enable_lora, or lora_paths when it is
    unset: 0.5.23 server_args.py:287); unknown when the server does not report it."""
    import types

    from mcore2hf.senders.sglang import SGLangColocatedSender, check_server

    def refusal(**info):
        st = types.SimpleNamespace(facts=check_server(info, "http://x"))
        return SGLangColocatedSender._adapter_refusal(None, st)

    assert "needs sglang >= 0.5.20" in refusal(version="0.5.10", enable_lora=True)
    assert "started without LoRA" in refusal(version="0.5.23", enable_lora=False)
    assert refusal(version="0.5.23", enable_lora=None, lora_paths=["a=/x"]) is None
    assert refusal(version="0.5.20", enable_lora=True) is None and refusal(version="0.5.23") is None


def test_draft_decision_from_every_engines_draft():
    """senders/drafts.py: what one sync does with the engines' speculative-decoding drafts, decided from every
    engine's report (the same on every rank): the MTP layers go to MTP drafts only; a draft of its own is left
    alone unless draft='update' insists (refused); a draft that cannot be updated is refused unless draft='keep';
    an engine that cannot tell is refused with 'auto'; a model without MTP layers or draft='keep' never asks."""
    from mcore2hf.errors import UnsupportedEngine, UsageError
    from mcore2hf.senders.drafts import EngineDraft, check_choice, decide, without_draft
    from mcore2hf.senders.protocol import SyncSpec

    mtp, none = EngineDraft("a", "mtp", "EAGLE"), EngineDraft("b", None)
    eagle, unknown = EngineDraft("c", "separate", "EAGLE3"), EngineDraft("d", "unknown", "404")
    stale = EngineDraft("e", "mtp", refusal="no draft sessions")
    auto, update, keep = (SyncSpec(draft=d, model_draft=True) for d in ("auto", "update", "keep"))
    assert decide(auto, [mtp, none], copies=True) == decide(auto, [mtp, none], True)
    p = decide(auto, [mtp, none], copies=True)
    assert p.roles == ("target", "draft") and p.copies and p.draft == "updated on 1 of 2 engine(s)"
    assert decide(keep, [mtp], False).roles == ("target",) == without_draft(SyncSpec()).roles
    assert without_draft(auto) is None and without_draft(SyncSpec()).draft == "target only: the model holds no MTP layers"
    p = decide(auto, [eagle, none], False)
    assert p.roles == ("target",) and "c serves a draft of its own (EAGLE3)" in p.draft
    assert decide(auto, [none], False).draft.startswith("target only: no engine serves a draft")
    for spec, engines, match in ((update, [eagle], "no engine serves an MTP draft"),
                                 (auto, [mtp, eagle], "engines of one sync serve different drafts"),
                                 (auto, [unknown], "cannot tell whether it serves an MTP draft"),
                                 (auto, [stale], "e: its MTP draft cannot be updated: no draft sessions"),
                                 (update, [stale], "pass draft='keep'")):
        with pytest.raises(UnsupportedEngine, match=match):
            decide(spec, engines, False)
    with pytest.raises(UnsupportedEngine, match="b serves no draft, and the draft's weights reach every engine"):
        decide(auto, [mtp, none], False, every_engine=True)
    assert decide(update, [unknown], False).roles == ("target", "draft")  # "update" tries; the engine refuses
    with pytest.raises(UsageError, match="expected a model holding MTP layers"):
        check_choice(SyncSpec(draft="update"))
    with pytest.raises(UsageError, match=r"expected one of \('auto', 'update', 'keep'\), found 'all'"):
        check_choice(SyncSpec(draft="all"))


def test_draft_checksums_per_role_traced_to_the_draft_tensors():
    """SGLang's checker prefixes a draft runner's parameters with its role (0.5.23 weight_updater.py:53-68,
    "draft" / "draft_step_<i>"; 0.5.20 "draft."): split per role, and a draft parameter (the NextN class's own
    module names) traced to the MTP tensors sent to the draft, not to the target's layer of the same suffix."""
    from mcore2hf.senders.checker import explain, split_roles, trace

    got = split_roles({"model.layers.0.w": "1", "draft.model.decoder.w": "2", "draft_step_1.model.enorm.weight": "3"})
    assert got == {"": {"model.layers.0.w": "1"}, "draft": {"model.decoder.w": "2"},
                   "draft_step_1": {"model.enorm.weight": "3"}}
    target = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    draft = {"model.layers.4.self_attn.q_proj.weight", "model.layers.4.self_attn.k_proj.weight",
             "model.layers.4.self_attn.v_proj.weight", "model.layers.4.enorm.weight"}
    assert trace("dp0:pp0:tp0:draft: model.decoder.self_attn.qkv_proj.weight", target, draft) == \
        sorted(n for n in draft if "proj" in n)
    assert trace("dp0:pp0:tp0:draft: model.enorm.weight", target, draft) == ["model.layers.4.enorm.weight"]
    assert trace("dp0:pp0:tp0:draft: model.layers.4.enorm.weight", target, draft) == ["model.layers.4.enorm.weight"]
    assert trace("dp0:pp0:tp0: model.layers.0.self_attn.qkv_proj.weight", target, draft) == sorted(target)
    assert "draft: model.enorm.weight <- model.layers.4.enorm.weight" in \
        explain(["dp0:pp0:tp0:draft: model.enorm.weight"], target, draft=draft)
