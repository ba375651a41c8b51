"""Senders held to the engines' wire formats: the flattened bucket, SGLang's serializer and HTTP payloads, the
distributed group + broadcast; against faithful fake engines in separate
processes (gloo on CPU), including failures and retries."""

import pytest
import torch
import worlds

from mcore2hf.buckets import Bucket
from mcore2hf.plan import pack_tight
from mcore2hf.senders.receiver import tight_views
from mcore2hf.senders.serialize import deserialize, flattened_payload, reconstruct, serialize
from mcore2hf.testing.fake_engine import EngineProcess, digest
from mcore2hf.testing.tiny import read_hf_checkpoint
from mcore2hf.testing.world import Layout, run_world


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


@pytest.fixture()
def engines():
    started = []

    def start(n=1, **kw):
        procs = [EngineProcess(**kw) for _ in range(n)]
        started.extend(procs)
        return procs

    yield start
    for p in started:
        p.stop()


SESSION_SYNC = ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor", "/flush_cache",
                "/end_weight_update", "/continue_generation"]


def protocol(calls: list[str]) -> list[str]:
    """The engine calls in order, runs of the same call collapsed (one per bucket)."""
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]


def check_engine(proc: EngineProcess, ckpt: str, ranks=(0,), versions=("1", "2")):
    ref = {n: digest(t) for n, t in read_hf_checkpoint(ckpt).items()}
    state = proc.state()
    for r in ranks:
        got = {n: v[0] for n, v in state["weights"][str(r)].items()}
        assert got == ref, f"rank {r}: {len(set(got) ^ set(ref))} names differ, bytes differ for " \
                           f"{[n for n in ref if got.get(n) != ref[n]][:5]}"
    vs = state["versions"]  # one per engine call: never decreasing, every sync's version present
    assert vs == sorted(vs, key=int) and vs[-1] == versions[-1] and set(versions) <= set(vs), vs
    return state


def test_sglang_colocated_two_engines_tp1(ckpts, engines):
    e = engines(2)
    layout = Layout(tp=2, ep=2, etp=1)
    run_world(worlds.sender_suite, layout, ckpts["qwen3_moe"], layout, "sglang-colocated", [p.url for p in e], 1, 0)
    for p in e:
        state = check_engine(p, ckpts["qwen3_moe"])
        # sglang 0.5.23's protocol, once per sync: no session left open, the engine resumed, the cache flushed
        assert protocol(state["calls"]) == ["/server_info"] + SESSION_SYNC * 2
        assert state["flushes"] == 2 and not state["paused"] and not state["session"]
        body = state["bodies"]["/update_weights_from_tensor"]
        assert body == ["flush_cache", "load_format", "serialized_named_tensors", "weight_version"]


def test_sglang_colocated_engine_tp2_gathers_both_ranks(ckpts, engines):
    (e,) = engines(1, tp_size=2)
    layout = Layout(tp=2, ep=2, etp=1)
    run_world(worlds.sender_suite, layout, ckpts["glm4_moe"], layout, "sglang-colocated", [e.url], 2, 0)
    check_engine(e, ckpts["glm4_moe"], ranks=(0, 1))


def test_sglang_distributed_two_engines(ckpts, engines):
    e = engines(2)
    layout = Layout(tp=2, ep=2, etp=1)
    run_world(worlds.sender_suite, layout, ckpts["deepseek_v3"], layout, "sglang-distributed", [p.url for p in e],
              1, 0)
    for p in e:
        state = check_engine(p, ckpts["deepseek_v3"])
        assert state["bodies"]["/init_weights_update_group"] == ["backend", "group_name", "master_address",
                                                                 "master_port", "rank_offset", "world_size"]
        assert state["bodies"]["/update_weights_from_distributed"] == ["dtypes", "flush_cache", "group_name",
                                                                       "load_format", "names", "shapes",
                                                                       "weight_version"]


def test_engine_error_then_retry(ckpts, engines):
    e = engines(2, faults={"/update_weights_from_tensor": ("fail", 2)})
    layout = Layout(tp=2, ep=2, etp=1)
    run_world(worlds.sender_suite, layout, ckpts["qwen3_moe"], layout, "sglang-colocated", [p.url for p in e], 1, 0,
              "injected failure on call 2")
    for p in e:
        check_engine(p, ckpts["qwen3_moe"])


def test_engine_timeout_then_retry(ckpts, engines):
    (slow,) = engines(1, faults={"/update_weights_from_tensor": ("sleep", 2, 8)})
    (fine,) = engines(1)
    layout = Layout(tp=2, ep=2, etp=1)
    run_world(worlds.sender_suite, layout, ckpts["qwen3_moe"], layout, "sglang-colocated", [slow.url, fine.url], 1, 0,
              "timed out", 64 * 1024, 3.0)
    check_engine(fine, ckpts["qwen3_moe"])


def test_receiver_disappears_mid_update_then_retry(ckpts, engines):
    """An engine process dies during a distributed update: every trainer rank raises (no hang), the version
    stays; the trainer's next sync, with the engine restarted, forms a new group and succeeds."""
    dying, alive = engines(1, faults={"/update_weights_from_distributed": ("exit", 2)})[0], engines(1)[0]
    layout = Layout(tp=2, ep=2, etp=1)
    run_world(worlds.sender_suite, layout, ckpts["qwen3_moe"], layout, "sglang-distributed", [dying.url, alive.url],
              1, 0, "bucket 1: ", 64 * 1024, 8.0, 0)
    dying.proc.join(10)
    assert not dying.proc.is_alive()
    (revived,) = engines(1, port=dying.port)
    run_world(worlds.sender_suite, layout, ckpts["qwen3_moe"], layout, "sglang-distributed", [revived.url, alive.url],
              1, 0, None, 64 * 1024, 8.0)
    check_engine(revived, ckpts["qwen3_moe"])
    check_engine(alive, ckpts["qwen3_moe"])


def test_pause_modes_refusal_api_key_and_cleanup_after_failure(ckpts, engines):
    """retract: 0.5.20 refuses the flush while requests wait (sync succeeds, warning, cache_flushed False), 0.5.23
    flushes; 0.5.4 is refused before anything is paused; an API key is needed and sent; after a failed update the
    engine is resumed, with no session and no group left open."""
    (e520,) = engines(1, version="0.5.20", running=3)
    (e523,) = engines(1, version="0.5.23", running=3)
    (old,) = engines(1, version="0.5.4.post3")
    (key,) = engines(1, api_key="s3cret")
    (failing,) = engines(1, faults={"/update_weights_from_tensor": ("fail", 2)})
    urls = {"0.5.20": e520.url, "0.5.23": e523.url, "0.5.4": old.url, "key": key.url, "failing": failing.url}
    r = run_world(worlds.sglang_modes_suite, Layout(), ckpts["qwen3_moe"], Layout(), urls)[0]
    assert r["0.5.20"] == dict(version=1, cache_flushed=False, warned=True), r
    assert r["0.5.23"] == dict(version=1, cache_flushed=True, warned=False), r
    assert e520.state()["flushes"] == 0 and e523.state()["flushes"] == 1
    assert r["refused_s"] < 10 and old.state()["calls"] and "/pause_generation" not in old.state()["calls"]
    assert r["keyed_version"] == 1
    check_engine(key, ckpts["qwen3_moe"], versions=("1",))
    st = failing.state()
    assert r["failed_version"] == 0 and not st["paused"] and not st["session"] and not st["groups"], st
    assert st["calls"][-1] == "/continue_generation", st["calls"]
