"""Our SGLang senders against SGLang's own code from the published wheels (CPU, GPU-only imports stubbed):
each release runs in its own server (harness.sglang_real: one scheduler process per engine TP rank) whose
request types, session checks (>= 0.5.21), SafeUnpickler, patch_torch rebuild, FlattenedTensorBucket rebuild and
weight-update group + broadcast receive (init_weights_update_group at rank_offset + tp_rank, gloo), and the
scheduler's pause / continue / abort / flush decisions, are the release's. Failures (class Case) are injected
around that code (the model's load_weights raises, hangs until its client gave up, or kills its scheduler process);
what follows is the release's doing. Pinned releases: 0.5.23 (the newest, with sessions), 0.5.20 (the last without sessions; already
the newer internal layout), and 0.5.4.post3 (refused). Run by hand (MCORE2HF_SGLANG_EXTRA): 0.5.22 and 0.5.10
(the 0.5.6-0.5.19 layout) passed on 2026-11-23, 0.5.10 again with the scheduler-side pause / flush on
2026-11-25. A wheel that cannot be fetched or imported fails these tests. Most cases share the servers of
`Engines` (a new server costs CI seconds), each case in a trainer-world job of its own on servers replaced where
an earlier case left one down or failed: no case depends on another."""

import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch
from harness import sglang_real
from harness.wheels import unpacked_wheel

from mcore2hf.runtime.world import Layout, run_world
from mcore2hf.senders.sglang import parse_version

SESSION_RELEASE, PRE_SESSION_RELEASE, REFUSED_RELEASE = "0.5.23", "0.5.20", "0.5.4.post3"
# more releases for a run by hand (not CI), e.g. MCORE2HF_SGLANG_EXTRA=0.5.22,0.5.10
EXTRA_RELEASES = [v for v in os.environ.get("MCORE2HF_SGLANG_EXTRA", "").split(",") if v]


def site(version: str) -> str:
    return str(unpacked_wheel("sglang", version, include=("sglang/*",)))


class RealServer(sglang_real.RealServer):
    """harness.sglang_real.RealServer of a pinned release (its wheel fetched and cached)."""

    def __init__(self, version: str, tp: int = 1, api_key: str | None = None, port: int = 0, wait: bool = True,
                 extra: tuple[str, ...] = ()):
        super().__init__(site(version), version, tp, api_key, port, wait, extra=extra)


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

        from mcore2hf.plan.export import pack_tight
        from mcore2hf.transfer.buckets import Bucket

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


def trainer(urls: list[str], engine_tp: int, api_key):
    """One rank of a trainer world of len(urls) * engine_tp ranks, servers of engine TP `engine_tp`: colocated
    (engine i fed by ranks i * engine_tp ...) then distributed (every engine in one group), two syncs each, through
    our senders into the real-code servers; after each kind rank 0 takes each server's record and clears it."""
    import torch.distributed as dist

    from mcore2hf.senders import SGLangColocatedSender, SGLangDistributedSender, sync

    rank, out = dist.get_rank(), {}
    for kind in ("colocated", "distributed"):
        if kind == "colocated":
            sender = SGLangColocatedSender(urls[rank // engine_tp] if rank % engine_tp == 0 else None, engine_tp,
                                           timeout=60, api_key=api_key)
        else:  # port 0: the sender hosts the rendezvous on a port the OS picks
            sender = SGLangDistributedSender(urls if rank == 0 else None, [engine_tp] * len(urls), "127.0.0.1", 0,
                                             backend="gloo", timeout=60, api_key=api_key)
        for seed in (0, 1):  # different bytes each sync: the second must replace the first
            sync(_Exporter(tensors(seed)), sender, progress=False)
        if kind == "distributed":
            sender.close()
        dist.barrier()
        out[kind] = {"version": sender.version}
        if rank == 0:
            out[kind]["states"] = [_http(url, "/mcore2hf_state") for url in urls]
            for url in urls:
                _http(url, "/mcore2hf_reset", "POST")
        dist.barrier()
    return out


SHARDED_LAYOUT = Layout(tp=1, ep=2)  # the trainer world of every shared-server case (qwen3_moe at EP 2: 2 ranks)
KEY = "k3y"  # every shared server is started with this API key


class Engines:
    """The servers the cases share, started together (all keyed): "tp2" 0.5.23 engine TP 2, "a" 0.5.23 TP 1, "c"
    0.5.20 TP 1, "old" 0.5.4.post3 (refused). Each case runs in a trainer world job of its own and gets the servers
    through `use`: a server that is down (a case killed it) or that a failed case used is replaced first, on its
    port, and every one is reset, so no case depends on another's order or outcome, and one case cannot fail
    another."""

    SPECS = {"tp2": (SESSION_RELEASE, 2), "a": (SESSION_RELEASE, 1), "c": (PRE_SESSION_RELEASE, 1),
             "old": (REFUSED_RELEASE, 1)}

    def __init__(self, ckpt: str):
        self.ckpt, self.dirty = ckpt, set()
        self.servers = {n: RealServer(v, tp=tp, api_key=KEY, wait=False) for n, (v, tp) in self.SPECS.items()}
        for s in self.servers.values():
            s.wait()
        assert [s.version for s in self.servers.values()] == [s.wanted for s in self.servers.values()]
        self.urls = {n: s.url for n, s in self.servers.items()}

    def run(self, fn, names: tuple[str, ...], *args, timeout: float = 300) -> list:
        """fn(urls, ckpt, *args) on every rank of the 2-rank trainer world, with servers `names` up and reset."""
        for n in names:
            server = self.servers[n]
            if n in self.dirty or server.proc.poll() is not None:
                server.stop()
                version, tp = self.SPECS[n]
                self.servers[n] = RealServer(version, tp=tp, api_key=KEY, port=server.port)
                self.dirty.discard(n)
            if n != "old":
                _post(self.urls[n], "/mcore2hf_reset", {"parameters": True})
        try:
            return run_world(fn, SHARDED_LAYOUT, {n: self.urls[n] for n in names}, self.ckpt, *args, timeout=timeout)
        except BaseException:
            self.dirty.update(names)
            raise

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

    ckpt = str(make_hf_checkpoint(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe")))
    e = Engines(ckpt)
    yield e
    e.stop()


def real_model(ckpt: str):
    """The real megatron-core qwen3_moe at SHARDED_LAYOUT (EP 2) loaded from `ckpt`, and its exporter."""
    import worlds

    from mcore2hf import HFExporter

    cfg, chunks = worlds.build(ckpt, SHARDED_LAYOUT)
    return cfg, HFExporter(chunks, cfg)


def all_ranks_case(urls: dict, ckpt: str, names: tuple[str, ...], engine_tp: int) -> dict:
    """`trainer` into the servers `names` (engine TP `engine_tp`)."""
    return trainer([urls[n] for n in names], engine_tp, KEY)


@pytest.fixture(scope="module")
def all_ranks_tp1(engines) -> list:
    """The all-ranks syncs into two engines of TP 1 side by side, one per trainer rank and then in one group:
    a (0.5.23) and c (0.5.20). test_sync_into_real_sglang reads each release's side of it."""
    return engines.run(all_ranks_case, ("a", "c"), ("a", "c"), 1)


# ------------------------------------------------------------------------------- failures (trainer rank 0 drives)

def _post(url: str, path: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _view(url: str, want: dict | None = None) -> dict:
    """An engine as its objects report it (the harness' state route): per TP rank the release's update session,
    weight-update groups, scheduler paused flag, queued requests and flushes; the tokenizer side's paused flag;
    with `want` (name: digest), per TP rank the names whose bytes differ (or are missing, or extra)."""
    st = _http(url, "/mcore2hf_state")
    out = {"paused": st["paused"], "ranks": st["ranks"]}
    if want is not None:
        out["wrong"] = [sorted(n for n in set(want) | set(w) if w.get(n, [None])[0] != want.get(n))
                        for w in (st["weights"][str(r)] for r in range(len(st["ranks"])))]
    return out


def _wait_down(url: str, timeout: float = 120.0) -> float:
    """Seconds until nothing answers at `url` any more (a dying server may first hold a request unanswered)."""
    import urllib.error
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            urllib.request.urlopen(url + "/mcore2hf_state", timeout=2).close()
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionRefusedError):
                return time.monotonic() - t0
        except (TimeoutError, ConnectionError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} still answers after {timeout} s")


class Case:
    """What a failure case does on each trainer rank (rank 0 drives the harness' routes and owns the servers it
    starts again): faults are injected around the releases' own code (sglang_real: the model's load_weights raises,
    hangs or kills its scheduler process), and what follows is the release's doing."""

    def __init__(self, urls: dict):
        import torch.distributed as dist

        self.urls, self.lead, self.restarted = urls, dist.get_rank() == 0, []

    def synced(self, sender, seed: int) -> int:
        from mcore2hf.senders import sync

        sync(_Exporter(tensors(seed)), sender, progress=False)
        return sender.version

    def failed(self, sender, seed: int, match: str) -> dict:
        """The sync raises EngineError matching `match`; the sender's version before and after, and the error."""
        from mcore2hf.senders import EngineError

        before = sender.version
        with pytest.raises(EngineError, match=match) as e:
            self.synced(sender, seed)
        return {"version": (before, sender.version), "error": str(e.value)}

    def arm(self, server: str, **fault) -> None:
        import torch.distributed as dist

        if self.lead:
            _post(self.urls[server], "/mcore2hf_fault", fault)
        dist.barrier()

    def views(self, want: int | dict | None, *names: str) -> dict | None:
        """Rank 0's view of engines `names`; `want`: the bytes they must hold (a seed of tensors(), or digests)."""
        import torch.distributed as dist

        dist.barrier()  # every rank's engine calls are done
        want = digests(tensors(want)) if isinstance(want, int) else want
        return {n: _view(self.urls[n], want) for n in names} if self.lead else None

    def relaunch(self, name: str, version: str) -> dict | None:
        """The dead server is started again on its port (as an orchestrator would), then waited for."""
        import torch.distributed as dist

        out = None
        if self.lead:
            down = _wait_down(self.urls[name])
            self.restarted.append(RealServer(version, 1, KEY, port=int(self.urls[name].rsplit(":", 1)[1])))
            out = {"down_after_s": down}
        dist.barrier()
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for server in self.restarted:  # the engine set replaces it for the next case that needs it
            server.stop()


def real_model_case(urls: dict, ckpt: str) -> dict:
    """The real model (its buckets, `receivers` as each sender asks) through a colocated sender into a and c (one
    per trainer rank) and through a distributed sender into one group of tp2 and c."""
    from mcore2hf.senders import SGLangColocatedSender, SGLangDistributedSender, sync

    with Case(urls) as case:
        _, ex = real_model(ckpt)
        col = SGLangColocatedSender(urls["a"] if case.lead else urls["c"], 1, timeout=300, api_key=KEY)
        dis = SGLangDistributedSender([urls["tp2"], urls["c"]] if case.lead else None, [2, 1], "127.0.0.1", 0,
                                      backend="gloo", timeout=300, api_key=KEY)
        ref, out = digests(ex.state_dict()), {}
        for kind, sender, names in (("colocated", col, ("a", "c")), ("distributed", dis, ("tp2", "c"))):
            sync(ex, sender, progress=False, bucket_bytes=256 * 1024)
            out[kind] = {"version": sender.version, "engines": case.views(ref, *names)}
            if case.lead:  # each kind's record on its own: c is fed by both
                for name in names:
                    _post(urls[name], "/mcore2hf_reset", {})
        dis.close()
        out["closed"] = case.views(None, "tp2", "c")
    return out


def load_error_case(urls: dict, ckpt: str) -> dict:
    """Colocated into a (rank 0) and c (rank 1): a's model raises on bucket 1 of the second sync. 0.5.23 does not
    catch it on the tensor path (model_runner_components/weight_updater.py _update_weights_from_flattened_bucket),
    its scheduler process dies (scheduler.py run_scheduler_process: SIGQUIT to the server), the server with it;
    then a is started again on its port and the sender retries."""
    from mcore2hf.senders import SGLangColocatedSender

    with Case(urls) as case:
        col = SGLangColocatedSender(urls["a"] if case.lead else urls["c"], 1, timeout=300, api_key=KEY)
        case.synced(col, 10)
        case.arm("a", kind="raise", call=2)
        out = {"failed": case.failed(col, 11, r"weight update failed: rank 0: bucket 1: "), "c": case.views(None, "c")}
        out["restart"] = case.relaunch("a", SESSION_RELEASE)
        out["retry_version"] = case.synced(col, 12)
        out["retry"] = case.views(12, "a", "c")
    return out


def engine_error_case(urls: dict, ckpt: str) -> dict:
    """Distributed, tp2 (group ranks 1-2) and c (rank 3) in one group: tp2's TP rank 0 model raises on bucket 1;
    the distributed path catches it and answers 400 (weight_updater.py load_weights_from_distributed, 0.5.23;
    update_weights_from_distributed, 0.5.20)."""
    from mcore2hf.senders import SGLangDistributedSender

    with Case(urls) as case:
        dis = SGLangDistributedSender([urls["tp2"], urls["c"]] if case.lead else None, [2, 1], "127.0.0.1", 0,
                                      backend="gloo", timeout=300, api_key=KEY)
        case.synced(dis, 19)
        case.arm("tp2", kind="raise", call=2, rank=0)
        out = {"failed": case.failed(dis, 20, "Failed to update parameter online"),
               "after": case.views(None, "tp2", "c")}
        out["retry_version"] = case.synced(dis, 21)
        out["retry"] = case.views(21, "tp2", "c")
        dis.close()
    return out


def engine_died_case(urls: dict, ckpt: str) -> dict:
    """Distributed as above: c's scheduler process dies in its model on bucket 0 (after the broadcast) and the
    release's SubprocessWatchdog ends the server; the retry forms a new group with c started again."""
    from mcore2hf.senders import SGLangDistributedSender

    with Case(urls) as case:
        dis = SGLangDistributedSender([urls["tp2"], urls["c"]] if case.lead else None, [2, 1], "127.0.0.1", 0,
                                      backend="gloo", timeout=300, api_key=KEY)
        case.synced(dis, 21)
        case.arm("c", kind="exit", call=1)
        out = {"failed": case.failed(dis, 22, "bucket 0: .*update_weights_from_distributed"),
               "tp2": case.views(None, "tp2")}
        out["restart"] = case.relaunch("c", PRE_SESSION_RELEASE)
        out["retry_version"] = case.synced(dis, 23)
        out["retry"] = case.views(23, "tp2", "c")
        dis.close()
        out["closed"] = case.views(None, "tp2", "c")
    return out


def timeout_case(urls: dict, ckpt: str) -> dict:
    """A model that does not answer before the sender gives up (sglang_real's "hang": held until the sender's
    next request arrives), whatever the machine's pace: colocated into a (rank 0, hangs on bucket 0) and c (rank
    1); then one engine of TP 2 fed by both ranks (rank 1 waits in the engine group for rank 0's call), its TP
    rank 0 hanging. The sender timeout is measured, not guessed: 5x a healthy sync of the same tensors through the
    same engines just before (at least 3 s), so no healthy call reaches it however loaded the machine."""
    import torch.distributed as dist

    from mcore2hf.senders import SGLangColocatedSender

    with Case(urls) as case:
        mine = urls["a"] if case.lead else urls["c"]
        pace = {}
        for name, url, tp in (("tp1", mine, 1), ("tp2", urls["tp2"] if case.lead else None, 2)):
            t = time.monotonic()
            case.synced(SGLangColocatedSender(url, tp, timeout=300, api_key=KEY), 12)
            took = torch.tensor([time.monotonic() - t], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            pace[name] = max(3.0, 5 * took.item())
        slow = SGLangColocatedSender(mine, 1, timeout=pace["tp1"], api_key=KEY)
        case.synced(slow, 12)
        case.arm("a", kind="hang", call=1)
        out = {"timeouts": pace, "failed": case.failed(slow, 13, "timed out")}
        out["retry_version"] = case.synced(slow, 14)
        out["retry"] = case.views(14, "a", "c")
        tp2 = SGLangColocatedSender(urls["tp2"] if case.lead else None, 2, timeout=pace["tp2"], api_key=KEY)
        case.synced(tp2, 15)
        case.arm("tp2", kind="hang", call=1, rank=0)
        out["tp2"] = {"failed": case.failed(tp2, 16, "timed out")}
        out["tp2"]["retry_version"] = case.synced(tp2, 17)
        out["tp2"]["retry"] = case.views(17, "tp2")
    return out


def pause_modes_case(urls: dict, ckpt: str) -> dict:
    """Requests queued in both schedulers (rank 0 feeds c: 0.5.20, rank 1 feeds a: 0.5.23): a retract-mode pause
    leaves them queued, then each release's flush_cache decides (managers/scheduler.py: 0.5.20 is_fully_idle()
    counts the queue, 0.5.23 is_fully_idle(ignore_waiting=self._engine_paused) does not); an abort-mode pause has
    the scheduler drop them (tokenizer_manager.py pause_generation: abort_request with abort_all, not the
    scheduler's pause; scheduler.py abort_request pops the waiting queue)."""
    import warnings

    from mcore2hf.senders import SGLangColocatedSender

    with Case(urls) as case:
        if case.lead:
            for name in ("c", "a"):
                _post(urls[name], "/mcore2hf_requests", {"queued": 3})
        mine = urls["c"] if case.lead else urls["a"]
        out = {"before": case.views(None, "c", "a")}
        retract = SGLangColocatedSender(mine, 1, timeout=300, api_key=KEY, pause_mode="retract")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            version = case.synced(retract, 30)
        out["retract"] = {"version": version, "cache_flushed": retract.cache_flushed,
                          "warned": any("refused /flush_cache" in str(w.message) for w in seen)}
        out["retract_engines"] = case.views(30, "c", "a")
        abort = SGLangColocatedSender(mine, 1, timeout=300, api_key=KEY)
        out["abort"] = {"version": case.synced(abort, 31), "cache_flushed": abort.cache_flushed}
        out["abort_engines"] = case.views(31, "c", "a")
    return out


def refusals_case(urls: dict, ckpt: str) -> dict:
    """0.5.4.post3 is refused before anything is paused (both ranks feed it); a key is needed and sent."""
    from mcore2hf.senders import SGLangColocatedSender, UnsupportedEngine

    with Case(urls) as case:
        with pytest.raises(UnsupportedEngine, match=r"sglang 0\.5\.4\.post3 is not supported"):
            case.synced(SGLangColocatedSender(urls["old"], 1, timeout=300, api_key=KEY), 40)
        with pytest.raises(UnsupportedEngine, match="HTTP 401"):  # rank 0 feeds a, rank 1 c: no key sent
            case.synced(SGLangColocatedSender(urls["a"] if case.lead else urls["c"], 1, timeout=300), 41)
        out = {"engines": case.views(None, "a", "c")}
        if case.lead:
            out["old_calls"] = _http(urls["old"], "/mcore2hf_state")["calls"]
    return out


def verified_case(urls: dict, ckpt: str) -> dict:
    """sync(verify=...) through SGLang's own /weights_checker (utils/weight_checker.py of 0.5.23 and 0.5.20, their
    hashing and comparison). Two colocated engines of TP 1 (a: 0.5.23, c: 0.5.20; one per trainer rank, so
    replicas): a plain sync, a proof sync, a checksum sync, each timed; then the TP-2 engine (0.5.23, fed by both
    ranks): a proof sync, then one whose engine TP rank 1 loads one tensor wrong, which every trainer rank reports
    by engine rank and parameter name (in SGLang only TP rank 0's compare result reaches the HTTP reply,
    weight_updater.py:424; the per-rank checksums cover every rank)."""
    import torch.distributed as dist

    from mcore2hf.senders import EngineError, SGLangColocatedSender, sync

    out: dict = {}
    with Case(urls) as case:
        _, ex = real_model(ckpt)
        ver = SGLangColocatedSender(urls["a"] if case.lead else urls["c"], 1, timeout=300, api_key=KEY)
        for mode in (None, "proof", "checksum"):
            dist.barrier()
            t = time.perf_counter()
            rep = sync(ex, ver, progress=False, bucket_bytes=256 * 1024, verify=mode)
            dist.barrier()
            out[str(mode)] = {"seconds": time.perf_counter() - t, "version": ver.version, "verify": rep.verify,
                              "checksums": rep.checksums, "summary": rep.summary()}
        tp2 = SGLangColocatedSender(urls["tp2"] if case.lead else None, 2, timeout=300, api_key=KEY)
        sync(ex, tp2, progress=False, bucket_bytes=256 * 1024)  # the engine loads the trainer's weights
        rep = sync(ex, tp2, progress=False, bucket_bytes=256 * 1024, verify="proof")
        out["tp2_proof"] = {"version": tp2.version, "checksums": rep.checksums}
        wrong = sorted(ex.state_dict())[3]  # one HF tensor of the export
        case.arm("tp2", kind="corrupt", name=wrong, rank=1)
        try:
            sync(ex, tp2, progress=False, bucket_bytes=256 * 1024, verify="proof")
            out["tp2_wrong"] = {"error": None}
        except EngineError as e:
            out["tp2_wrong"] = {"error": str(e), "version": tp2.version}
        out["wrong"] = wrong
        sync(ex, tp2, progress=False, bucket_bytes=256 * 1024, verify="checksum")
        out["tp2_after"] = {"version": tp2.version}
    return out


def sharded_case(urls: dict, ckpt: str) -> dict:
    cfg, ex = real_model(ckpt)
    return sharded_trainer(urls["tp2"], ex, cfg, 256 * 1024)


def protocol(calls):
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]


# (release, engine TP) served by the shared servers: the test runs `trainer` through them
SHARED = {(SESSION_RELEASE, 2): "tp2", (SESSION_RELEASE, 1): "a", (PRE_SESSION_RELEASE, 1): "c"}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("version", [SESSION_RELEASE, PRE_SESSION_RELEASE, *EXTRA_RELEASES])
def test_sync_into_real_sglang(version, tp, request):
    """One server of engine TP `tp` (one scheduler process per TP rank, each running the release's code) fed by
    `tp` trainer ranks: colocated (one payload per engine rank) then distributed (each engine rank joins the
    weight-update group at its rank offset and receives the broadcast), two syncs each: every byte equal on every
    engine rank, the version recorded, sessions exactly where the release has them. The pairs in SHARED run on the
    shared servers (engine TP 1: 0.5.23 and 0.5.20 side by side, one per trainer rank, and in one group:
    fixture all_ranks_tp1); the others on a server of their own."""
    sessions = parse_version(version) >= (0, 5, 21)  # update sessions came with 0.5.21
    server = None if (version, tp) in SHARED else RealServer(version, tp=tp, api_key=KEY)
    try:
        if server is not None:
            assert server.version == version
            results, index = run_world(trainer, Layout(world_size=tp), [server.url], tp, KEY, timeout=300), 0
        elif tp == 2:
            results, index = request.getfixturevalue("engines").run(all_ranks_case, ("tp2",), ("tp2",), 2), 0
        else:
            results, index = request.getfixturevalue("all_ranks_tp1"), ("a", "c").index(SHARED[version, tp])
        want = digests(tensors(1))  # the second sync's
        for kind in ("colocated", "distributed"):
            assert [r[kind]["version"] for r in results] == [2] * len(results), kind
            state = results[0][kind]["states"][index]
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


def assert_failed_then_retried(res: list, version: int) -> None:
    """Every trainer rank raised EngineError with the same message, the version stayed at `version`, and the
    retry committed version + 1."""
    assert [r["failed"]["version"] for r in res] == [(version, version)] * len(res), res
    assert len({r["failed"]["error"] for r in res}) == 1, [r["failed"]["error"] for r in res]
    assert [r["retry_version"] for r in res] == [version + 1] * len(res)


def assert_clean(view: dict, group_open: bool = False) -> None:
    """Resumed (tokenizer side and every scheduler), no update session open, and a weight-update group only
    where a distributed sender still holds one (it keeps it between syncs until close())."""
    assert not view["paused"], view
    for st in view["ranks"]:
        assert not st["engine_paused"] and not st["session"] and len(st["groups"]) == group_open, view


def assert_every_byte(views: dict, tp: dict, group_open: bool = False) -> None:
    """Every engine rank holds exactly the retry's tensors, byte for byte, and is left clean."""
    for name, view in views.items():
        assert len(view["wrong"]) == tp[name] and view["wrong"] == [[]] * tp[name], (name, view["wrong"])
        assert_clean(view, group_open)


def test_real_model_into_two_colocated_engines_and_a_two_engine_group(engines):
    """The qwen3_moe of a real megatron-core model (EP 2; 256 KiB buckets) through a colocated sender into two
    engines of TP 1 (0.5.23 and 0.5.20, one per trainer rank), then through a distributed sender into one group of
    two engines (0.5.23 at engine TP 2, 0.5.20): every engine rank holds every HF tensor of the export, byte for
    byte, and each engine is left resumed with no session open; close() leaves no group."""
    res = engines.run(real_model_case, ("tp2", "a", "c"))
    lead = res[0]
    assert [r[kind]["version"] for r in res for kind in ("colocated", "distributed")] == [1] * 4
    assert_every_byte(lead["colocated"]["engines"], {"a": 1, "c": 1})
    assert_every_byte(lead["distributed"]["engines"], {"tp2": 2, "c": 1}, group_open=True)
    for view in lead["closed"].values():
        assert_clean(view)


def test_verified_sync_with_sglangs_own_weights_checker(engines):
    """sync(verify=...) through SGLang's /weights_checker (0.5.23 and 0.5.20's own checker code): a proof sync
    (checksums, snapshot, reset, sync, compare) of the real model passes on both releases and on every rank of an
    engine of TP 2; replicas of one step (a and c) report the same per-rank digest; a sync in which engine TP rank
    1 loads one tensor wrong fails on every trainer rank, naming that engine rank and parameter and the HF tensor
    sent for it, and the version stays; a checksum sync afterwards repairs and records it."""
    res = engines.run(verified_case, ("tp2", "a", "c"))
    for r in res:
        assert [r[m]["version"] for m in ("None", "proof", "checksum")] == [1, 2, 3], r
        assert r["None"]["verify"] is None and r["proof"]["verify"] == "proof", r
        ranks = r["proof"]["checksums"]
        assert len(ranks) == 2 and all(list(d) == ["dp0:pp0:tp0"] for d in ranks.values()), ranks
        assert len({tuple(d.items()) for d in ranks.values()}) == 1, ranks  # a (0.5.23) == c (0.5.20)
        assert r["checksum"]["checksums"] == ranks  # the same weights, the same digests
        assert list(r["tp2_proof"]["checksums"].values())[0].keys() == {"dp0:pp0:tp0", "dp0:pp0:tp1"}
        err = r["tp2_wrong"]["error"]
        assert err and "1 engine parameters differ" in err and f"dp0:pp0:tp1: {r['wrong']} <- {r['wrong']}" in err, err
        assert r["tp2_wrong"]["version"] == 2 and r["tp2_after"]["version"] == 3, r
    assert len({r["tp2_wrong"]["error"] for r in res}) == 1
    t = {m: res[0][m]["seconds"] for m in ("None", "proof", "checksum")}
    print(f"\nverified sync, CPU harness, qwen3_moe tiny into two engines: plain {t['None']:.3f} s, "
          f"proof {t['proof']:.3f} s, checksum {t['checksum']:.3f} s")


def test_timeout_then_retry(engines):
    """Colocated into a (0.5.23, rank 0) and c (0.5.20, rank 1): a's model does not answer bucket 0 before the
    sender gives up. Every rank raises EngineError ("timed out"), the version stays; the engine then takes the
    sender's cleanup and the retry, in order (its scheduler runs one request at a time), and the retry puts every
    byte on both engines. The same into one engine of TP 2 fed by both ranks (the second rank waits for the
    first's engine call in their group)."""
    res = engines.run(timeout_case, ("tp2", "a", "c"))
    lead = res[0]
    for r, view, tp in ((res, lead["retry"], {"a": 1, "c": 1}), ([r["tp2"] for r in res], lead["tp2"]["retry"],
                                                                {"tp2": 2})):
        assert_failed_then_retried(r, 1)
        assert all("timed out" in x["failed"]["error"] for x in r)
        assert_every_byte(view, tp)
    print(f"\nsender timeouts (5x a healthy sync here, at least 3 s): {lead['timeouts']}")


def test_engine_error_in_a_two_engine_group_then_retry(engines):
    """Distributed, two engines in one group (0.5.23 engine TP 2 and 0.5.20 TP 1): TP rank 0 of the first fails to
    load bucket 1 and its release answers 400. Every rank raises EngineError, the version stays; afterwards both
    engines are resumed with no session and no group open (as their objects report); the retry puts every byte
    on all three engine ranks."""
    res = engines.run(engine_error_case, ("tp2", "c"))
    assert_failed_then_retried(res, 1)
    for view in res[0]["after"].values():
        assert_clean(view)
    assert_every_byte(res[0]["retry"], {"tp2": 2, "c": 1}, group_open=True)


def test_pause_modes_with_queued_requests(engines):
    """Three requests queued in each engine's scheduler. Retract: 0.5.20's flush_cache refuses (its idle check
    counts the queue): the sync succeeds with a warning and cache_flushed False, nothing flushed, the requests
    still queued; 0.5.23 ignores the queue of a paused engine and flushes. Abort (the default): the release's
    abort_request drops the queued requests and both flush."""
    res = engines.run(pause_modes_case, ("a", "c"))
    lead = res[0]
    c_rank, a_rank = res  # trainer rank 0 feeds c (0.5.20), rank 1 feeds a (0.5.23)
    assert c_rank["retract"] == {"version": 1, "cache_flushed": False, "warned": True}, c_rank
    assert a_rank["retract"] == {"version": 1, "cache_flushed": True, "warned": False}, a_rank
    assert [r["abort"] for r in res] == [{"version": 1, "cache_flushed": True}] * 2, res
    flushes = {n: v["ranks"][0]["flushes"] for n, v in lead["before"].items()}
    assert {n: v["ranks"][0]["queued"] for n, v in lead["before"].items()} == {"c": 3, "a": 3}
    retract, abort = lead["retract_engines"], lead["abort_engines"]
    assert {n: v["ranks"][0]["flushes"] - flushes[n] for n, v in retract.items()} == {"c": 0, "a": 1}
    assert {n: v["ranks"][0]["queued"] for n, v in retract.items()} == {"c": 3, "a": 3}
    assert {n: v["ranks"][0]["flushes"] - flushes[n] for n, v in abort.items()} == {"c": 1, "a": 2}
    assert {n: v["ranks"][0]["queued"] for n, v in abort.items()} == {"c": 0, "a": 0}
    assert_every_byte(retract, {"c": 1, "a": 1})
    assert_every_byte(abort, {"c": 1, "a": 1})


def test_refuses_sglang_0_5_4_and_needs_the_api_key(engines):
    """0.5.4.post3 is refused (UnsupportedEngine on every rank, raised inside the world) from its server info
    alone, before any pause; without the API key a keyed server answers 401 and the sync is refused the same way,
    leaving it untouched."""
    lead = engines.run(refusals_case, ("a", "c", "old"))[0]
    assert lead["old_calls"] and "/pause_generation" not in lead["old_calls"], lead["old_calls"]
    for view in lead["engines"].values():
        assert_clean(view)


def test_engine_dies_mid_update_then_retry_after_restart(engines):
    """Distributed as above: the 0.5.20 engine's scheduler process dies in bucket 0 and the release's watchdog
    ends its server. Every rank raises EngineError, the version stays; the surviving engine is resumed with no
    session and no group; the retry, with the engine restarted on its port, forms a new group and puts every
    byte on all engine ranks; close() leaves no group on either engine."""
    res = engines.run(engine_died_case, ("tp2", "c"))
    lead = res[0]
    assert_failed_then_retried(res, 1)
    assert_clean(lead["tp2"]["tp2"])
    assert_every_byte(lead["retry"], {"tp2": 2, "c": 1}, group_open=True)
    for view in lead["closed"].values():
        assert_clean(view)


def test_load_error_kills_the_0_5_23_engine_then_retry_after_restart(engines):
    """Colocated, two engines of TP 1 (0.5.23 and 0.5.20, one per trainer rank): 0.5.23's model raises on bucket
    1; the release does not catch it on the tensor path and its server dies. Every trainer rank raises EngineError
    and keeps its version; the other engine is left resumed; the retry, with the engine restarted on its port,
    puts every byte on both."""
    res = engines.run(load_error_case, ("a", "c"))
    assert_failed_then_retried(res, 1)
    assert_clean(res[0]["c"]["c"])
    assert_every_byte(res[0]["retry"], {"a": 1, "c": 1})


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

def sharded_trainer(url: str, ex, cfg, bucket_bytes: int) -> dict:
    """A trainer world of 2 (`ex`: real megatron-core qwen3_moe at SHARDED_LAYOUT) feeding one SGLang server of engine TP 2,
    engine-sharded, without then with engine EP 2 (debug NaN fill): every engine rank must have received, per HF
    tensor, the full export's values in exactly its engine_regions and NaN everywhere else (digests of
    mask_to_engine of the full all-ranks export, an independent path); bytes received over the wire here vs what
    this rank receives in an all-ranks export."""
    import torch.distributed as dist

    from mcore2hf.plan.engine_shards import engine_regions, mask_to_engine
    from mcore2hf.senders import SGLangColocatedSender, sync

    rank = dist.get_rank()
    ref = ex.state_dict()
    # what this rank receives through the collectives of the all-ranks export (as worlds.fp8_matrix counts it)
    all_ranks = sum((st.axis.size - 1) * st.slot for p in ex.executor(bucket_bytes).programs for st in p.stages)
    out = {"all_ranks_wire": all_ranks}
    for ep in (1, 2):
        sender = SGLangColocatedSender(url if rank == 0 else None, 2, timeout=60, api_key=KEY,
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


def test_engine_sharded_sync_into_real_sglang_tp2_from_qwen3_moe_ep2(capsys, engines):
    """Engine-sharded colocated sync (issue 15) through SGLang 0.5.23's own receive path (flattened bucket over
    IPC, one scheduler process per engine TP rank): trainer qwen3_moe at EP2 (2 gloo ranks) -> engine TP 2, then
    TP 2 x EP 2. Each engine rank's tensors are bit-identical to the full export inside its engine regions and
    NaN outside (nothing else written; checked in sharded_trainer), and each trainer rank received fewer bytes
    than an all-ranks export. On the shared 0.5.23 server of engine TP 2."""
    res = engines.run(sharded_case, ("tp2",))
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


# ------------------------------------------------------------------------ speculative-decoding drafts (issue 37)

DRAFT_LAYOUT = Layout(tp=1, ep=2)  # deepseek_v3 tiny with its MTP layer, experts (the MTP layer's too) over EP 2
DRAFT_BUCKET = 64 * 1024  # bytes: several buckets per pass


def _split(state: dict, rank: str = "0") -> tuple[dict, dict | None]:
    """One engine rank's target and draft records: {name: sha256}."""
    target = {n: d[0] for n, d in state["weights"][rank].items()}
    draft = state["draft_weights"][rank]
    return target, None if draft is None else {n: d[0] for n, d in draft.items()}


def draft_trainer(urls: dict, ckpt: str) -> dict:
    """The draft cases, in one world of 2 ranks (DRAFT_LAYOUT) whose real deepseek_v3 holds an MTP layer, against
    four servers: "mtp" (0.5.23 with an MTP draft runner), "plain" (0.5.23, no draft), "eagle" (0.5.23, a draft
    model of its own), "old" (0.5.20 with an MTP draft runner). Colocated senders feed rank 0's engine and rank
    1's; after each case rank 0 takes the engines' records and clears them."""
    import torch.distributed as dist
    import worlds

    from mcore2hf import HFExporter, load_hf_weights
    from mcore2hf.senders import (
        EngineError,
        SGLangColocatedSender,
        SGLangDistributedSender,
        UnsupportedEngine,
        sync,
    )

    lead = dist.get_rank() == 0
    cfg, chunks = worlds.build(ckpt, DRAFT_LAYOUT)
    load_hf_weights(chunks, ckpt)  # the checkpoint's weights: every expert and layer distinct
    ex = HFExporter(chunks, cfg)
    mtp = ex.draft_tensors(DRAFT_BUCKET)
    out = {"layer": sorted(mtp.layer), "copies": sorted(mtp.copies), "full": digests(ex.state_dict()),
           "fp8_full": digests(ex.state_dict(quantize="fp8"))}

    def states(*names: str) -> dict | None:
        dist.barrier()
        got = {n: _http(urls[n], "/mcore2hf_state") for n in names} if lead else None
        if lead:
            for n in names:
                _post(urls[n], "/mcore2hf_reset", {})
        dist.barrier()
        return got

    def colocated(first: str, second: str):
        return SGLangColocatedSender(urls[first] if lead else urls[second], 1, timeout=60, api_key=KEY)

    def refused(fn) -> str | None:
        try:
            fn()
        except (UnsupportedEngine, EngineError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    col = colocated("mtp", "plain")
    for case, kw in (("auto", {}), ("fp8", {"quantize": "fp8"}), ("keep", {"draft": "keep"})):
        rep = sync(ex, col, progress=False, bucket_bytes=DRAFT_BUCKET, **kw)
        out[case] = {"draft": rep.draft, "draft_buckets": rep.draft_buckets, "buckets": rep.buckets,
                     "version": col.version, "states": states("mtp", "plain")}
    # a proof sync covers the draft runner (SGLang's checker per role); one draft tensor loaded wrong is named
    if lead:  # the recorders' parameters of the FP8 sync (scales) go: from here on the model's bf16 export only
        for n in ("mtp", "plain"):
            _post(urls[n], "/mcore2hf_reset", {"parameters": True})
    dist.barrier()
    sync(ex, col, progress=False, bucket_bytes=DRAFT_BUCKET)  # the engines hold the trainer's weights
    rep = sync(ex, col, progress=False, bucket_bytes=DRAFT_BUCKET, verify="proof")
    out["proof"] = {"checksums": rep.checksums, "version": col.version}
    wrong = sorted(mtp.layer)[0]
    if lead:
        _post(urls["mtp"], "/mcore2hf_fault", {"kind": "corrupt", "name": wrong, "model": "draft"})
    dist.barrier()
    out["proof_wrong"] = {"error": refused(lambda: sync(ex, col, progress=False, bucket_bytes=DRAFT_BUCKET,
                                                          verify="proof")), "version": col.version, "wrong": wrong}
    sync(ex, col, progress=False, bucket_bytes=DRAFT_BUCKET, verify="checksum")  # repairs
    states("mtp", "plain")
    # distributed: both engines in one group; the draft's broadcasts reach the draftless one too (no runner loads)
    dis = SGLangDistributedSender([urls["mtp"], urls["plain"]] if lead else None, [1, 1], "127.0.0.1", 0,
                                  backend="gloo", timeout=60, api_key=KEY)
    rep = sync(ex, dis, progress=False, bucket_bytes=DRAFT_BUCKET)
    dis.close()
    out["distributed"] = {"draft": rep.draft, "version": dis.version, "states": states("mtp", "plain")}
    # refused before anything moves: 0.5.20 with a draft (no runner selectors: whatever the choice), and
    # draft="update" into an engine whose draft is a model of its own (EAGLE3), which "auto" leaves alone
    for case, name, kw in (("old", "old", {}), ("old_keep", "old", {"draft": "keep"}),
                           ("eagle", "eagle", {"draft": "update"})):
        sender = colocated(name, "plain")
        out[f"{case}_refused"] = {"error": refused(lambda s=sender, k=kw: sync(ex, s, progress=False,
                                                                                 bucket_bytes=DRAFT_BUCKET, **k)),
                                  "version": sender.version, "states": states(name)}
    rep = sync(ex, colocated("eagle", "plain"), progress=False, bucket_bytes=DRAFT_BUCKET)
    out["eagle_synced"] = {"draft": rep.draft, "states": states("eagle", "plain")}
    # a model trained without its MTP layer: the target only, the engine's draft left as it is
    _, plain_chunks = worlds.build(ckpt, DRAFT_LAYOUT, mtp=False)
    load_hf_weights(plain_chunks, ckpt)
    plain = HFExporter(plain_chunks, cfg)
    rep = sync(plain, col, progress=False, bucket_bytes=DRAFT_BUCKET)
    out["no_mtp"] = {"draft": rep.draft, "draft_buckets": rep.draft_buckets, "states": states("mtp"),
                     "full": digests(plain.state_dict())}
    return out


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> list:
    """Per-rank results of draft_trainer (its four servers started together, stopped after)."""
    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

    servers = {"mtp": RealServer(SESSION_RELEASE, api_key=KEY, wait=False, extra=("--draft", "mtp")),
               "plain": RealServer(SESSION_RELEASE, api_key=KEY, wait=False),
               "eagle": RealServer(SESSION_RELEASE, api_key=KEY, wait=False, extra=("--draft", "separate")),
               "old": RealServer(PRE_SESSION_RELEASE, api_key=KEY, wait=False, extra=("--draft", "mtp"))}
    try:
        ckpt = str(make_hf_checkpoint(tiny_config("deepseek_v3"), tmp_path_factory.mktemp("deepseek_v3")))
        for s in servers.values():
            s.wait()
        try:
            return run_world(draft_trainer, DRAFT_LAYOUT, {n: s.url for n, s in servers.items()}, ckpt, timeout=900)
        except Exception:  # what the servers said (a scheduler's traceback)
            for name, s in servers.items():
                s.log.seek(0)
                print(f"--- server {name}:\n{s.log.read()[-4000:]}", file=sys.stderr)
            raise
    finally:
        for s in servers.values():
            s.stop()


def _expected(res: dict, key: str = "full") -> tuple[dict, dict, dict]:
    """(the target's tensors, the MTP layers' own, every MTP tensor with the copies) of the export: {name: sha256}."""
    every, layer = res[key], set(res["layer"])
    mtp = layer | set(res["copies"])
    if key == "fp8_full":  # FP8 weights' scales belong with them
        layer |= {n for n in every if n.removesuffix("_scale_inv") in layer}
        mtp |= layer
    return {n: d for n, d in every.items() if n not in mtp}, {n: d for n, d in every.items() if n in layer}, mtp


def test_mtp_draft_into_real_sglang(drafts):
    """A model holding an MTP layer, colocated into two 0.5.23 engines (one with an MTP draft runner, one without):
    the target runners got every tensor but the MTP layer's, the draft runner exactly the MTP layer's own tensors
    (not the embedding / head copies: SGLang's NextN drafts take the target's, deepseek_weight_loader.py:333), each
    byte for byte, through the release's own selector fan-out (weight_updater.py:178); the draftless engine's
    draft pass sent nothing; the report says so. The same in block FP8 (`sync(quantize="fp8")`: the engines get
    what `state_dict(quantize="fp8")` holds); with draft="keep" the draft runner got nothing."""
    res = drafts[0]
    assert res["layer"] and res["copies"] == ["model.layers.4.embed_tokens.weight",
                                              "model.layers.4.shared_head.head.weight"], res["copies"]
    assert all(n.startswith("model.layers.4.") for n in res["layer"]) and "model.layers.4.enorm.weight" in res["layer"]
    for case, key in (("auto", "full"), ("fp8", "fp8_full")):
        target, layer, _ = _expected(res, key)
        got = res[case]
        assert [r[case]["version"] for r in drafts] == [got["version"]] * 2 and got["draft_buckets"] > 0, got
        assert got["draft"] == "updated on 1 of 2 engine(s)", got["draft"]
        mtp_target, mtp_draft = _split(got["states"]["mtp"])
        plain_target, plain_draft = _split(got["states"]["plain"])
        assert mtp_target == target and plain_target == target, case
        assert mtp_draft == layer, (case, sorted(set(mtp_draft) ^ set(layer))[:5])
        assert plain_draft is None
        calls = protocol(got["states"]["mtp"]["calls"])
        assert calls.count("/update_weights_from_tensor") == 1 and "/begin_weight_update" in calls, calls
    keep = res["keep"]
    assert keep["draft"] == "left alone (draft='keep')" and keep["draft_buckets"] == 0
    assert _split(keep["states"]["mtp"]) == (_expected(res)[0], {})


def test_mtp_draft_verified_per_role_in_real_sglang(drafts):
    """verify="proof" with the draft updated: SGLang 0.5.23's checker (selector "all") resets, reloads and checks
    the draft runner too, its checksums reported per role ("dp0:pp0:tp0:draft"); a draft tensor loaded wrong fails
    the sync on every rank, naming the draft runner's parameter and the HF tensor sent for it."""
    for r in drafts:
        ranks = r["proof"]["checksums"]
        assert sorted(map(sorted, ranks.values())) == [["dp0:pp0:tp0"], ["dp0:pp0:tp0", "dp0:pp0:tp0:draft"]], ranks
        err, wrong = r["proof_wrong"]["error"], r["proof_wrong"]["wrong"]
        assert err and "1 engine parameters differ" in err and f"dp0:pp0:tp0:draft: {wrong} <- {wrong}" in err, err
        assert r["proof_wrong"]["version"] == r["proof"]["version"]
    assert len({r["proof_wrong"]["error"] for r in drafts}) == 1


def test_mtp_draft_over_the_distributed_path_of_real_sglang(drafts):
    """Both engines in one weight-update group: each draft broadcast reaches both, the MTP-draft engine's draft
    runner loads it (0.5.23 weight_updater.py:199-221: received once, loaded into every selected runner), the
    draftless one receives it into no runner."""
    res = drafts[0]
    target, layer, _ = _expected(res)
    got = res["distributed"]
    assert got["draft"] == "updated on 1 of 2 engine(s)"
    assert _split(got["states"]["mtp"]) == (target, layer)
    assert _split(got["states"]["plain"]) == (target, None)


def test_mtp_draft_refusals_and_what_is_left_alone(drafts):
    """Refused on every rank before anything is paused: SGLang 0.5.20 serving a draft, whatever the choice (no
    runner selectors: its tensor path loads every update into draft and target, weight_updater.py:160-167), and
    draft="update" into an engine whose draft is a model of its own (EAGLE3), which "auto" leaves alone (the
    MTP layer sent nowhere). A model without MTP layers syncs the target only, the draft runner untouched."""
    res = drafts[0]
    target = _expected(res)[0]
    for case, name, match in (("old", "old", "sglang 0.5.20 serves a speculative draft (EAGLE) and has no runner "
                               "selectors"), ("old_keep", "old", "so a sync can neither update the draft nor leave "
                                              "it alone"), ("eagle", "eagle", "draft='update': no engine serves an "
                                                            "MTP draft")):
        got = res[f"{case}_refused"]
        assert got["error"] and got["error"].startswith("UnsupportedEngine") and match in got["error"], got["error"]
        assert len({r[f"{case}_refused"]["error"] for r in drafts}) == 1 and got["version"] == 0
        assert "/pause_generation" not in got["states"][name]["calls"], got["states"][name]["calls"]
        assert _split(got["states"][name]) == ({}, {}), case  # nothing loaded
    eagle = res["eagle_synced"]
    assert eagle["draft"].startswith("target only:") and "serves a draft of its own" in eagle["draft"], eagle["draft"]
    assert _split(eagle["states"]["eagle"]) == (target, {})
    no_mtp = res["no_mtp"]
    assert no_mtp["draft"] == "target only: the model holds no MTP layers" and no_mtp["draft_buckets"] == 0
    assert no_mtp["full"] == target  # the same weights (the checkpoint's), without the MTP layer
    assert _split(no_mtp["states"]["mtp"]) == (target, {})
