"""Colocated syncs over real CUDA IPC on one GPU, into the engines' own receive code (issue 27, part 2).

    bash bench/on_device.sh "python3 bench/gpu_ipc.py"    # on a lent GPU: carry .whl/ and .whl-ipc/ (see below)
    python bench/gpu_ipc.py --cpu                         # the same code path on CPU (the smoke run of CI machines)
    python bench/gpu_ipc.py --pack .whl-ipc               # write the engines' .py files to carry (engines.tar.xz)

The trainer is a one-rank megatron-core world (mcore2hf.runtime.world.run_world: its own process, NCCL on the GPU);
each engine is another process on the same GPU, running the release's own receive code through the contract
tests' harness (tests/harness/sglang_real.py, tests/harness/vllm_real.py) with CUDA tensors instead of CPU shared
memory:

* SGLang 0.5.23 and 0.5.20 (`SGLangColocatedSender`): each bucket as one flattened bucket whose CUDA IPC handle
  names the GPU by UUID; the release's SafeUnpickler, its patch_torch rebuild (UUID -> device index),
  FlattenedTensorBucket and WeightUpdater load it into the engine's parameters on its GPU;
* vLLM 0.33.0 IPC (`VLLMColocatedSender`), packed and unpacked: vLLM's own IPC weight-transfer engine
  (ipc_engine.py: the packed importer, or rebuild_cuda_tensor per tensor, keyed by the GPU's UUID) loads them
  with default_weight_loader inside its layerwise-reload session.

Cases: a small qwen3_moe-shaped model (random weights), bf16 and block-FP8 (`quantize="fp8"`: float8_e4m3fn
weights and float32 scales), two syncs per case with different bytes (the weights change in between); after each
sync every HF tensor's bytes in the engine's parameters are compared (sha256, taken on the engine side) with the
trainer's export, with its dtype and shape. Timing: Qwen3-30B-A3B shapes with as many layers as fit beside the
engine's copy (--layers), bf16: the export alone (buckets materialized) against the whole colocated sync
(`sync()`: pause, export, IPC handoff, the engine's copy into its parameters, finish, flush / resume); after the
timed syncs the engine's parameters are compared with the export again (a cheap on-device digest,
harness.sglang_real.fingerprint: 24+ GB would take minutes through sha256).

What the device machine needs (no registry there): .whl/ with megatron-core, einops and this checkout's mcore2hf
wheel (bench/on_device.sh), plus .whl-ipc/: engines.tar.xz (the releases' .py files, `--pack`) and the wheels
of the engines' pure-Python and small compiled dependencies (docs/engines.md "Real CUDA IPC on a GPU").
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import types

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SGLANG = ("0.5.23", "0.5.20")
VLLM = "0.33.0"
SMALL = dict(num_hidden_layers=2, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=2,
             vocab_size=2048)


# ------------------------------------------------------------------------------------------------- engines' code

def engine_site(root: str | None, name: str, version: str) -> str:
    """The release's unpacked files: ROOT/<name>-<version> (carried to the GPU machine), else the contract tests'
    cached wheel (downloaded once)."""
    if root and os.path.isdir(os.path.join(root, f"{name}-{version}")):
        return os.path.join(root, f"{name}-{version}")
    from harness.wheels import unpacked_wheel

    include = ("sglang/*",) if name == "sglang" else ("vllm/*.py", "vllm-*.dist-info/*")
    return str(unpacked_wheel(name, version, include))


def pack(out_dir: str) -> str:
    """OUT_DIR/engines.tar.xz: the .py files (and dist-info) of the three releases, as <name>-<version>/...: the
    harness runs only Python code of the engines; their compiled kernels (most of the wheels' size) stay behind."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "engines.tar.xz")
    with tarfile.open(path + ".partial", "w:xz") as tar:
        for name, version in [("sglang", v) for v in SGLANG] + [("vllm", VLLM)]:
            site = engine_site(None, name, version)
            for top, _, files in os.walk(site):
                for f in files:
                    full = os.path.join(top, f)
                    if f.endswith(".py") or ".dist-info" in full:
                        tar.add(full, os.path.join(f"{name}-{version}", os.path.relpath(full, site)))
    os.replace(path + ".partial", path)
    return path


def engine_env(site: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.path.join(REPO, "tests"),
                                                         os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


class VLLMServer:
    """harness.vllm_real serve mode in its own process: one engine of TP 1 whose parameters are `spec` (zeros)."""

    def __init__(self, site: str, spec: list, device: str):
        fd, self.spec = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.vllm_real", "--serve", self.spec, device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=engine_env(site), cwd=REPO)

    def wait(self) -> VLLMServer:
        line = self.proc.stdout.readline()
        if not line.startswith("URL"):
            self.proc.kill()
            self.log.seek(0)
            raise RuntimeError(f"vllm server did not start: {self.log.read()[-3000:]}")
        self.url, self.version = line.split()[1], line.split()[3]
        return self

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()
        os.unlink(self.spec)


def sglang_server(site: str, version: str, device: str):
    from harness.sglang_real import RealServer

    env = {k: v for k, v in engine_env(site).items() if k == "PYTHONPATH"}
    return RealServer(site, version, device=device, wait=False, env=env)


def http(url: str, path: str, method: str = "GET"):
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url + path, method=method), timeout=600) as r:
        return json.loads(r.read())


# ------------------------------------------------------------------------------------------------ trainer side

def sha256(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def expected(ex, bucket_bytes: int, quantize: str | None, fast: bool) -> dict:
    """name -> [digest, dtype, shape] of every HF tensor of the export (one bucket alive at a time)."""
    from harness.sglang_real import fingerprint

    fn = fingerprint if fast else sha256
    out = {}
    for bucket in ex.buckets(bucket_bytes, quantize=quantize):
        for name, t in bucket:
            out[name] = [fn(t), str(t.dtype).removeprefix("torch."), list(t.shape)]
    return out


def engine_weights(kind: str, url: str, fast: bool) -> dict:
    """What the engine's parameters hold, as its harness reports it (hashed in the engine process)."""
    q = "?digest=fingerprint" if fast else ""
    st = http(url, "/mcore2hf_state" + q)
    return st["weights"]["0"] if kind == "sglang" else st["weights"]


def compare(want: dict, got: dict) -> str | None:
    """None when every tensor is there with the same bytes, dtype and shape; else what differs."""
    got = {n: list(v) for n, v in got.items()}
    missing = sorted(set(want) - set(got))
    bad = sorted(n for n in want if n in got and got[n] != want[n])
    if missing or bad:
        return f"{len(missing)} missing (e.g. {missing[:3]}), {len(bad)} differ (e.g. {bad[:3]}) of {len(want)}"
    return None


def perturb(chunks, seed: int) -> None:
    """New weights (every parameter changes): what a training step does between two syncs."""
    import torch

    g = torch.Generator(device=next(chunks[0].parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).to(p.dtype), alpha=0.01)


def make_sender(kind: str, url: str, packed: bool):
    from mcore2hf.senders import SGLangColocatedSender
    from mcore2hf.senders.vllm import VLLMColocatedSender

    if kind == "sglang":
        return SGLangColocatedSender(url, 1, timeout=600)
    return VLLMColocatedSender(url, 1, packed=packed, timeout=600)


def quantized(ex, quantize: str | None):
    """The exporter as sync() sees it, delivering block-FP8 when `quantize` is set."""
    if quantize is None:
        return ex
    return types.SimpleNamespace(executor=functools.partial(ex.executor, quantize=quantize))


def spec_of(want: dict) -> list:
    return [[n, shape, dtype] for n, (_, dtype, shape) in want.items()]


def cases(a, device, engines: dict) -> list:
    """The correctness cases on the small model: every engine x bf16 / fp8 x two syncs with different bytes."""
    import torch
    from export_speed import PRESETS, random_model

    from mcore2hf import HFExporter

    cfg, chunks = random_model("qwen3_moe", dict(PRESETS["qwen3_moe"], **SMALL), 1, device)
    ex = HFExporter(chunks, cfg)
    bb = 1 << 20  # several buckets per sync
    rows = []
    servers = {}
    try:
        for v in SGLANG:  # started together (each loads its release), waited for below
            servers[f"sglang-{v}"] = sglang_server(engines[f"sglang-{v}"], v, a.device)
        for q in (None, "fp8"):
            spec = spec_of(expected(ex, bb, q, fast=False))
            servers[f"vllm-{q}"] = VLLMServer(engines["vllm"], spec, a.device)
        for s in servers.values():
            s.wait()
        step = 0
        for name, kind, packed in ([(f"sglang {v}", "sglang", True) for v in SGLANG]
                                   + [("vllm 0.33.0 ipc packed", "vllm", True),
                                      ("vllm 0.33.0 ipc unpacked", "vllm", False)]):
            for q in (None, "fp8"):
                server = servers[f"sglang-{name.split()[1]}" if kind == "sglang" else f"vllm-{q}"]
                sender = make_sender(kind, server.url, packed)
                results, digests = [], []
                for _ in range(2):
                    step += 1
                    perturb(chunks, step)
                    want = expected(ex, bb, q, fast=False)
                    if kind == "sglang":
                        http(server.url, "/mcore2hf_reset", "POST")
                    t = time.perf_counter()
                    rep = sync(quantized(ex, q), sender, bucket_bytes=bb, progress=False)
                    dt = time.perf_counter() - t
                    err = compare(want, engine_weights(kind, server.url, fast=False))
                    results.append((err, dt, rep.buckets, sum(torch.Size(s).numel() for _, _, s in want.values())))
                    digests.append(want)
                # the second sync's bytes differ from the first's everywhere (a stale engine would fail)
                same = sum(digests[0][n][0] == digests[1][n][0] for n in digests[0])
                rows.append(dict(engine=name, dtype=q or "bf16", tensors=len(digests[1]),
                                 dtypes=sorted({d for _, d, _ in digests[1].values()}),
                                 syncs=[r[0] or "every byte equal" for r in results],
                                 seconds=[round(r[1], 3) for r in results], buckets=results[-1][2],
                                 unchanged_between_syncs=same, version=sender.version,
                                 ok=all(r[0] is None for r in results) and same == 0 and sender.version == 2))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    del ex, chunks
    return rows


def timing(a, device, engines: dict) -> dict:
    """Qwen3-30B-A3B shapes, a.layers layers, bf16: export alone vs the whole colocated sync, per engine."""
    import torch
    from export_speed import PRESETS, random_model

    from mcore2hf import HFExporter

    config = dict(PRESETS["qwen3_moe"], num_hidden_layers=a.layers)
    if a.cpu:  # the code path only
        config.update(SMALL, num_hidden_layers=a.layers)
    cfg, chunks = random_model("qwen3_moe", config, 1, device)
    ex = HFExporter(chunks, cfg)
    bb = int(a.bucket_mb * 2**20)
    sync_dev = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    def export_alone() -> float:
        sync_dev()
        t = time.perf_counter()
        for bucket in ex.buckets(bb):
            del bucket
        sync_dev()
        return time.perf_counter() - t

    export_alone()  # plan + compile
    export_s = min(export_alone() for _ in range(a.repeat))
    nbytes = ex.plan(bb).total_bytes
    out = {"layers": a.layers, "gb": nbytes / 1e9, "bucket_mb": a.bucket_mb, "export_s": export_s, "engines": {}}
    print(f"timing: qwen3_moe {a.layers} layers, {nbytes / 1e9:.2f} GB bf16, buckets of {a.bucket_mb:g} MiB: "
          f"export alone {export_s:.3f} s", flush=True)
    for name in a.timing_engines.split(","):
        kind, version = name.split("-")[0], name.split("-")[1]
        packed = not name.endswith("unpacked")
        if kind == "sglang":
            server = sglang_server(engines[f"sglang-{version}"], version, a.device).wait()
        else:
            server = VLLMServer(engines["vllm"], spec_of(expected(ex, bb, None, fast=True)), a.device).wait()
        try:
            sender = make_sender(kind, server.url, packed)
            sync(ex, sender, bucket_bytes=bb, progress=False)  # first: the engine allocates / warms up
            perturb(chunks, 1000)
            runs = []
            for _ in range(a.repeat):
                sync_dev()
                t = time.perf_counter()
                rep = sync(ex, sender, bucket_bytes=bb, progress=False)
                sync_dev()
                runs.append((time.perf_counter() - t, rep))
            sync_s, rep = min(runs, key=lambda r: r[0])
            err = compare(expected(ex, bb, None, fast=True), engine_weights(kind, server.url, fast=True))
            out["engines"][name] = dict(sync_s=sync_s, overhead_s=sync_s - export_s, send_s=rep.send_s,
                                        buckets=rep.buckets, check=err or "every byte equal",
                                        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
                                        else 0.0)
            print(f"timing {name}: whole sync {sync_s:.3f} s (export alone {export_s:.3f} s, overhead "
                  f"{sync_s - export_s:.3f} s per sync; sender {rep.send_s:.3f} s, {rep.buckets} buckets); after the "
                  f"timed syncs: {err or 'every byte equal'}", flush=True)
        finally:
            server.stop()
    return out


def sync(*args, **kwargs):
    from mcore2hf.senders import sync as _sync

    return _sync(*args, **kwargs)


def job(a, engines: dict) -> dict:
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if not a.cpu else torch.device("cpu")
    res = {"device": torch.cuda.get_device_name() if not a.cpu else "cpu"}
    if not a.skip_cases:
        res["cases"] = cases(a, device, engines)
    if a.layers:
        res["timing"] = timing(a, device, engines)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU (gloo, CPU shared memory): the code path only")
    ap.add_argument("--engines", default=os.environ.get("MCORE2HF_ENGINES", os.path.join(REPO, ".engines")),
                    help="dir of <name>-<version>/ unpacked engines (else the cached wheels)")
    ap.add_argument("--pack", metavar="DIR", help="write DIR/engines.tar.xz (what the GPU machine needs) and exit")
    ap.add_argument("--layers", type=int, default=None, help="timing model layers (Qwen3-30B-A3B shapes; 0: none)")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timing-engines", default="sglang-0.5.23,sglang-0.5.20,vllm-0.33.0-packed")
    ap.add_argument("--skip-cases", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.pack:
        print(pack(a.pack))
        return
    if a.layers is None:
        a.layers = 1 if a.cpu else 20
    a.device = "cpu" if a.cpu else "cuda"
    engines = {f"sglang-{v}": engine_site(a.engines, "sglang", v) for v in SGLANG}
    engines["vllm"] = engine_site(a.engines, "vllm", VLLM)
    from mcore2hf.runtime.world import Layout, run_world

    t = time.perf_counter()
    res = run_world(job, Layout(), a, engines, backend="gloo" if a.cpu else "nccl", timeout=3000)[0]
    res["command"] = " ".join(sys.argv)
    print(f"\ndevice: {res['device']}; {time.perf_counter() - t:.0f} s")
    print(f"{'engine':<26} {'dtype':<6} {'tensors':>7} {'buckets':>7} {'sync 1':<18} {'sync 2':<18} {'result':>6}")
    ok = True
    for r in res.get("cases", []):
        ok &= r["ok"]
        print(f"{r['engine']:<26} {r['dtype']:<6} {r['tensors']:>7} {r['buckets']:>7} {r['syncs'][0][:18]:<18} "
              f"{r['syncs'][1][:18]:<18} {'PASS' if r['ok'] else 'FAIL':>6}")
    tm = res.get("timing")
    if tm:
        print(f"\nqwen3_moe (Qwen3-30B-A3B shapes) {tm['layers']} layers, {tm['gb']:.2f} GB bf16, buckets of "
              f"{tm['bucket_mb']:g} MiB; export alone {tm['export_s']:.3f} s")
        print(f"{'engine':<26} {'whole sync s':>12} {'overhead s':>11} {'sender s':>9} {'after timing':<20}")
        for name, e in tm["engines"].items():
            ok &= e["check"] == "every byte equal"
            print(f"{name:<26} {e['sync_s']:>12.3f} {e['overhead_s']:>11.3f} {e['send_s']:>9.3f} {e['check'][:20]:<20}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print("ALL PASS" if ok else "FAILURES")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
