"""Our SGLang senders against SGLang's own code from the published wheels (CPU, GPU-only imports stubbed):
each release runs in its own server (mcore2hf.testing.sglang_real: one scheduler process per engine TP rank) whose
request types, session checks (>= 0.5.21), SafeUnpickler, patch_torch rebuild, FlattenedTensorBucket rebuild and
weight-update group + broadcast receive (init_weights_update_group at rank_offset + tp_rank, gloo) are the
release's. Pinned releases: 0.5.23 (the newest, with sessions), 0.5.20 (the last without sessions; already the
newer internal layout), and 0.5.4.post3 (refused). Run by hand (MCORE2HF_SGLANG_EXTRA): 0.5.22 and 0.5.10 (the
0.5.6-0.5.19 layout) passed on 2026-11-23. A wheel that cannot be fetched or imported fails these tests."""

import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch

from mcore2hf.senders.sglang import parse_version
from mcore2hf.testing import sglang_real
from mcore2hf.testing.wheels import unpacked_wheel
from mcore2hf.testing.world import Layout, run_world

SESSION_RELEASE, PRE_SESSION_RELEASE, REFUSED_RELEASE = "0.5.23", "0.5.20", "0.5.4.post3"
# more releases for a run by hand (not CI), e.g. MCORE2HF_SGLANG_EXTRA=0.5.22,0.5.10
EXTRA_RELEASES = [v for v in os.environ.get("MCORE2HF_SGLANG_EXTRA", "").split(",") if v]


def site(version: str) -> str:
    return str(unpacked_wheel("sglang", version, include=("sglang/*",)))


class RealServer:
    def __init__(self, version: str, tp: int = 1, api_key: str | None = None):
        cmd = [sys.executable, sglang_real.__file__, site(version), "--tp", str(tp)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"})
        line = self.proc.stdout.readline()  # "PORT <n> VERSION <v>" once the release's code is loaded
        if not line.startswith("PORT"):
            self.proc.kill()
            raise RuntimeError(f"sglang {version} server did not start: {self.proc.stderr.read()[-3000:]}")
        self.url = f"http://127.0.0.1:{line.split()[1]}"
        self.version = line.split()[3]

    def stop(self):
        self.proc.kill()
        self.proc.wait(10)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(17, 9, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(6)} | {"embed.ids": torch.arange(11)}


def digests(ts: dict) -> dict:
    return {n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in ts.items()}


class _Exporter:
    """Two buckets of fixed tensors (the exporter is not under test here: the senders and the engine are)."""

    def __init__(self, ts):
        self.ts = ts

    def executor(self, bucket_bytes, receivers):
        from types import SimpleNamespace

        from mcore2hf.buckets import Bucket
        from mcore2hf.plan import pack_tight

        names = list(self.ts)
        buckets = []
        for i, part in enumerate((names[:4], names[4:])):
            entries = pack_tight([(n, tuple(self.ts[n].shape), self.ts[n].dtype, n) for n in part])
            flat = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
            for e in entries:
                flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape).copy_(self.ts[e.name])
            buckets.append(Bucket(i, flat, entries))
        return SimpleNamespace(programs=buckets, stats={}, run=lambda timing=False: iter(buckets))


def _http(url: str, path: str, method: str = "GET") -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url + path, method=method), timeout=60) as r:
        return json.loads(r.read())


def trainer(url: str, engine_tp: int, api_key):
    """One rank of a trainer world of `engine_tp` ranks: colocated then distributed, two syncs each, through our
    senders into the real-code server; after each kind rank 0 takes the server's record and clears it."""
    import torch.distributed as dist

    from mcore2hf.senders import SGLangColocatedSender, SGLangDistributedSender, sync

    rank, out = dist.get_rank(), {}
    for kind in ("colocated", "distributed"):
        if kind == "colocated":
            sender = SGLangColocatedSender(url if rank == 0 else None, engine_tp, timeout=60, api_key=api_key)
        else:  # port 0: the sender hosts the rendezvous on a port the OS picks
            sender = SGLangDistributedSender([url] if rank == 0 else None, [engine_tp], "127.0.0.1", 0,
                                             backend="gloo", timeout=60, api_key=api_key)
        for seed in (0, 1):  # different bytes each sync: the second must replace the first
            sync(_Exporter(tensors(seed)), sender, progress=False)
        if kind == "distributed":
            sender.close()
        dist.barrier()
        out[kind] = {"version": sender.version}
        if rank == 0:
            out[kind]["state"] = _http(url, "/mcore2hf_state")
            _http(url, "/mcore2hf_reset", "POST")
        dist.barrier()
    return out


def refused_trainer(url: str, expect_error: str) -> float:
    from mcore2hf.senders import SGLangColocatedSender, UnsupportedEngine, sync

    sender = SGLangColocatedSender(url, 1, timeout=60)
    t = time.monotonic()
    with pytest.raises(UnsupportedEngine, match=expect_error):
        sync(_Exporter(tensors(0)), sender, progress=False)
    return time.monotonic() - t


SHARDED_LAYOUT = Layout(tp=1, ep=2)  # the trainer world of the engine-sharded case (qwen3_moe at EP 2)


def trainer_tp2(url: str, ckpt: str) -> dict:
    """The 0.5.23 engine-TP-2 world: the all-ranks syncs (`trainer`), then the engine-sharded ones
    (`sharded_trainer`) into the same server: one server and one world for both cases."""
    out = trainer(url, 2, "k3y")
    out["sharded"] = sharded_trainer(url, ckpt, SHARDED_LAYOUT, 256 * 1024)
    return out


@pytest.fixture(scope="module")
def session_tp2(tmp_path_factory) -> list:
    """Per-rank results of trainer_tp2 against one 0.5.23 server of engine TP 2 (shared by two tests)."""
    from mcore2hf.testing.tiny import make_hf_checkpoint, tiny_config

    ckpt = str(make_hf_checkpoint(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe")))
    server = RealServer(SESSION_RELEASE, tp=2, api_key="k3y")
    try:
        assert server.version == SESSION_RELEASE
        return run_world(trainer_tp2, SHARDED_LAYOUT, server.url, ckpt, timeout=300)
    finally:
        server.stop()


def protocol(calls):
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("version", [SESSION_RELEASE, PRE_SESSION_RELEASE, *EXTRA_RELEASES])
def test_sync_into_real_sglang(version, tp, request):
    """One server of engine TP `tp` (one scheduler process per TP rank, each running the release's code) and a
    trainer world of `tp` ranks: colocated (one payload per engine rank) then distributed (each engine rank joins
    the weight-update group at its rank offset and receives the broadcast), two syncs each: every byte equal on
    every engine rank, the version recorded, sessions exactly where the release has them."""
    sessions = parse_version(version) >= (0, 5, 21)  # update sessions came with 0.5.21
    shared = (version, tp) == (SESSION_RELEASE, 2)  # its world also runs the engine-sharded case
    server = None if shared else RealServer(version, tp=tp, api_key="k3y")
    try:
        if shared:
            results = request.getfixturevalue("session_tp2")
        else:
            assert server.version == version
            results = run_world(trainer, Layout(world_size=tp), server.url, tp, "k3y", timeout=300)
        want = digests(tensors(1))  # the second sync's
        for kind in ("colocated", "distributed"):
            assert [r[kind]["version"] for r in results] == [2] * tp, kind
            state = results[0][kind]["state"]
            assert sorted(state["weights"]) == [str(r) for r in range(tp)]
            for r in range(tp):
                got = {n: d[0] for n, d in state["weights"][str(r)].items()}
                assert got == want, f"{kind} rank {r}: {[n for n in want if got.get(n) != want[n]]}"
            # every update request of a sync carries its version
            assert set(state["versions"]) == {"1", "2"} and state["versions"] == sorted(state["versions"]), \
                (kind, state["versions"])
            update = "/update_weights_from_tensor" if kind == "colocated" else "/update_weights_from_distributed"
            one = ["/pause_generation"] + (["/begin_weight_update"] if sessions else []) + [update, "/flush_cache"] \
                + (["/end_weight_update"] if sessions else []) + ["/continue_generation"]
            if kind == "distributed":  # the group is formed in begin(), before the first pause
                expected = ["/server_info", "/init_weights_update_group"] + one + one \
                    + ["/destroy_weights_update_group"]
            else:
                expected = ["/server_info"] + one + one
            assert protocol(state["calls"]) == expected, (kind, state["calls"])
            assert not state["paused"]
    finally:
        if server is not None:
            server.stop()


def test_refuses_sglang_0_5_4_before_anything_moves():
    server = RealServer(REFUSED_RELEASE)
    try:
        (elapsed,) = run_world(refused_trainer, Layout(), server.url, "sglang 0.5.4.post3 is not supported",
                               timeout=120)
        assert elapsed < 30
    finally:
        server.stop()


def test_our_allowlist_is_within_sglangs_and_our_payload_passes_its_unpickler():
    """Every (module, name) our receivers admit, SGLang 0.5.23's SafeUnpickler admits too; our serialized payload
    (CPU tensors, SimpleNamespace metadata) unpickles with it and rebuilds with its FlattenedTensorBucket."""
    code = f"""
import hashlib, sys, torch
sys.path.insert(0, {os.path.dirname(sglang_real.__file__)!r})
import sglang_real
sglang_real.install({site(SESSION_RELEASE)!r})
from sglang.srt.utils.common import SafeUnpickler, MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
from mcore2hf.senders.serialize import ALLOWED_GLOBALS
extra = sorted(ALLOWED_GLOBALS - SafeUnpickler.ALLOWED_GLOBALS)
assert not extra, extra
monkey_patch_torch_reductions()
payload = MultiprocessingSerializer.deserialize(sys.stdin.read())
meta = [FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in payload["metadata"]]
for n, t in FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=meta).reconstruct_tensors():
    print(n, hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
"""
    from mcore2hf.senders.serialize import flattened_payload, serialize

    ts = tensors(1)
    b = _Exporter(ts).executor(0, None).programs[0]
    r = subprocess.run([sys.executable, "-c", code], input=serialize(flattened_payload(b), output_str=True),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = dict(line.rsplit(" ", 1) for line in r.stdout.strip().splitlines())
    assert len(got) == 4 and got == {n: d for n, d in digests(ts).items() if n in got}  # every byte, every tensor


# ------------------------------------------------------------------------------------ engine-sharded (issue 15)

def sharded_trainer(url: str, ckpt: str, layout, bucket_bytes: int) -> dict:
    """A trainer world of 2 (real megatron-core qwen3_moe at `layout`) feeding one SGLang server of engine TP 2,
    engine-sharded, without then with engine EP 2 (debug NaN fill): every engine rank must have received, per HF
    tensor, the full export's values in exactly its engine_regions and NaN everywhere else (digests of
    mask_to_engine of the full all-ranks export, an independent path); bytes received over the wire here vs what
    this rank receives in an all-ranks export."""
    import torch.distributed as dist
    import worlds

    from mcore2hf import HFExporter
    from mcore2hf.engine_shards import engine_regions, mask_to_engine
    from mcore2hf.senders import SGLangColocatedSender, sync

    rank = dist.get_rank()
    cfg, chunks = worlds.build(ckpt, layout)
    ex = HFExporter(chunks, cfg)
    ref = ex.state_dict()
    # what this rank receives through the collectives of the all-ranks export (as worlds.fp8_matrix counts it)
    all_ranks = sum((st.axis.size - 1) * st.slot for p in ex.executor(bucket_bytes).programs for st in p.stages)
    out = {"all_ranks_wire": all_ranks}
    for ep in (1, 2):
        sender = SGLangColocatedSender(url if rank == 0 else None, 2, timeout=60, api_key="k3y",
                                       engine_sharding=True, engine_ep_size=ep)
        placement = next(er.placement for er in sender.engine_ranks() if er.rank == rank)
        report = sync(ex, sender, progress=False, bucket_bytes=bucket_bytes, debug_nan=True)
        want = {n: digests({n: mask_to_engine(t, engine_regions(n, t.shape, ex.dims, placement, cfg.model_type),
                                              debug=True)})[n] for n, t in ref.items()}
        dist.barrier()
        box = [None]
        if rank == 0:
            box = [_http(url, "/mcore2hf_state")]
            _http(url, "/mcore2hf_reset", "POST")
        dist.broadcast_object_list(box, src=0)
        got = {n: d[0] for n, d in box[0]["weights"][str(placement.tp_rank)].items()}
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
        bad = [n for n in want if got[n] != want[n]]
        assert not bad, (ep, bad[:5])
        out[f"ep{ep}"] = {"version": sender.version, "wire": report.received_bytes, "sent": report.bytes,
                          "versions": box[0]["versions"], "seconds": report.seconds}
    return out


def test_engine_sharded_sync_into_real_sglang_tp2_from_qwen3_moe_ep2(capsys, session_tp2):
    """Engine-sharded colocated sync (issue 15) through SGLang 0.5.23's own receive path (flattened bucket over
    IPC, one scheduler process per engine TP rank): trainer qwen3_moe at EP2 (2 gloo ranks) -> engine TP 2, then
    TP 2 x EP 2. Each engine rank's tensors are bit-identical to the full export inside its engine regions and
    NaN outside (nothing else written; checked in sharded_trainer), and each trainer rank received fewer bytes
    than an all-ranks export. Runs in the world of test_sync_into_real_sglang[0.5.23-2] (fixture session_tp2)."""
    res = [r["sharded"] for r in session_tp2]
    for r in res:
        for ep in (1, 2):
            assert r[f"ep{ep}"]["version"] == 1 and r[f"ep{ep}"]["versions"], r
        # engine TP 2 needs the other rank's experts' halves; with engine EP 2 (= trainer EP, trainer TP 1) every
        # byte an engine rank loads is already on its GPU: nothing crosses the wire
        assert r["ep2"]["wire"] == 0 < r["ep1"]["wire"] < r["all_ranks_wire"], r
    with capsys.disabled():
        print("\nsglang engine TP2 from qwen3_moe EP2, bytes received per trainer rank: all-ranks "
              + " ".join(str(r["all_ranks_wire"]) for r in res) + " | engine-sharded "
              + " | ".join(f"ep{ep}: " + " ".join(str(r[f'ep{ep}']['wire']) for r in res) for ep in (1, 2))
              + " (sync s: " + " ".join(f"{r[f'ep{ep}']['seconds']:.2f}" for ep in (1, 2) for r in res) + ")")
