"""Colocated syncs over real CUDA IPC on one GPU, into the engines' own receive code (issue 27, part 2).

    python bench/gpu_ipc.py --pack .whl-ipc               # here: the engines' .py files and wheels to carry
    bash bench/on_device.sh "python3 bench/gpu_ipc.py"    # on a lent GPU, carrying .whl/ and .whl-ipc/
    python bench/gpu_ipc.py --cpu                         # the same code path on CPU (CPU shared memory)

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
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SGLANG = ("0.5.23", "0.5.20")
VLLM = "0.33.0"
SMALL = dict(num_hidden_layers=2, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=2,
             vocab_size=2048)


# ------------------------------------------------------------------------------------------------- engines' code

# What the engines' receive code imports beyond the GPU machines' image (their list: .library's KINDS.md; no
# registry there): carried as cp312 wheels by --pack. The versions are those the CPU contract tests run.
DEVICE_DEPS = ("pydantic==2.14.4", "pydantic_core==2.50.5", "typing-inspection==0.4.5", "annotated-types==0.8.0",
               "msgspec==0.22.0", "pybase64==1.5.1", "orjson==3.13.0", "dill==0.4.1", "cbor2==6.3.0",
               "pyzmq==27.3.0", "fastapi==0.136.3", "starlette==1.10.0", "uvicorn==0.54.0", "python-multipart==0.0.34",
               "openai==3.57.0", "jiter==0.19.0", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5",
               "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7", "xgrammar==0.2.8",
               "apache-tvm-ffi==0.1.15.post2", "llguidance==1.7.6", "cachetools==8.0.2", "sniffio==1.3.1",
               "watchfiles==1.3.0")


def engine_site(root: str | None, name: str, version: str) -> str:
    """The release's unpacked files: ROOT/<name>-<version> (ROOT a directory, or a --pack engines.tar.xz unpacked
    once into a temporary directory), else the contract tests' cached wheel (downloaded once)."""
    if root and root.endswith(".tar.xz") and os.path.isfile(root):
        dest = os.path.join(tempfile.gettempdir(), "mcore2hf-engines")
        if not os.path.isdir(dest):
            with tarfile.open(root) as tar:
                tar.extractall(dest + ".partial", filter="data")
            os.replace(dest + ".partial", dest)
        root = dest
    if root and os.path.isdir(os.path.join(root, f"{name}-{version}")):
        return os.path.join(root, f"{name}-{version}")
    from harness.wheels import unpacked_wheel

    include = ("sglang/*",) if name == "sglang" else ("vllm/*.py", "vllm-*.dist-info/*")
    return str(unpacked_wheel(name, version, include))


def pack(out_dir: str) -> str:
    """OUT_DIR/engines.tar.xz: the .py files (and dist-info) of the three releases, as <name>-<version>/...: the
    harness runs only Python code of the engines; their compiled kernels (most of the wheels' size) stay behind.
    And OUT_DIR/*.whl: DEVICE_DEPS for the GPU machines' Python 3.12."""
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
    # what the GPU suite reads from the wheel cache (MCORE2HF_WHEEL_CACHE, no registry there): the FP8 oracle
    # (tests/oracle.py: DeepGEMM's quantizer, one file of its wheel) and Megatron-Bridge 0.6.2's PEFT (its LoRA world)
    import shutil

    from harness.bridge_lora import BRIDGE_062, bridge_root
    from oracle import deepgemm

    for src in (os.path.dirname(os.path.dirname(os.path.dirname(deepgemm().__file__))), bridge_root(BRIDGE_062)):
        shutil.copytree(src, os.path.join(out_dir, "cache", os.path.basename(src)), dirs_exist_ok=True)
    platforms = [x for n in ("2_17", "2_24", "2_26", "2_27", "2_28", "2_31") for x in ("--platform", f"manylinux_{n}_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "--platform", "manylinux2014_x86_64", "--platform",
                    "manylinux1_x86_64", "-d", out_dir, *DEVICE_DEPS], check=True)
    return path


def engine_env(site: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.path.join(REPO, "tests"),
                                                         os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


class VLLMServer:
    """harness.vllm_real serve mode in its own process: one engine of TP 1 whose parameters are `spec` (zeros);
    with `draft` (a spec too) an MTP draft model beside it (tests/gpu/test_mtp_draft_ipc.py)."""

    def __init__(self, site: str, spec: list, device: str, draft: list | None = None):
        self.specs = []
        for s in (spec, draft) if draft is not None else (spec,):
            fd, path = tempfile.mkstemp(suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(s, f)
            self.specs.append(path)
        self.spec = self.specs[0]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.vllm_real", "--serve", self.spec, device,
                                      *self.specs[1:]],
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
        for path in self.specs:
            os.unlink(path)


def sglang_server(site: str, version: str, device: str):
    from harness.sglang_real import RealServer

    env = {k: v for k, v in engine_env(site).items() if k == "PYTHONPATH"}
    return RealServer(site, version, device=device, wait=False, env=env)


def http(url: str, path: str, method: str = "GET"):
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url + path, method=method), timeout=600) as r:
        return json.loads(r.read())


def _post(url: str, path: str, body: dict):
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
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


def spec_of(want: dict) -> list:
    return [[n, shape, dtype] for n, (_, dtype, shape) in want.items()]


def failed(e: BaseException) -> str:
    import traceback

    return f"{type(e).__name__}: {e}"[:1500] + "\n" + "".join(traceback.format_tb(e.__traceback__)[-3:])[-1500:]


def start(servers: dict, key: str, make) -> None:
    """Start one engine (not waited for); a failure to start is recorded as that engine's error."""
    try:
        servers[key] = make()
    except Exception as e:  # noqa: BLE001 - the other engines still run
        servers[key] = e


def ready(servers: dict, key: str):
    s = servers.get(key)
    if isinstance(s, BaseException):
        raise RuntimeError(f"engine {key} did not start: {s}")
    if not hasattr(s, "url"):
        try:
            s.wait()
        except Exception as e:  # noqa: BLE001
            servers[key] = e
            raise
    return s


def cases(a, device, engines: dict) -> list:
    """The correctness cases on the small model: every engine x bf16 / fp8 x two syncs with different bytes, and a
    control (one tensor loaded wrong on purpose must be reported by name). A case that fails is a FAIL row with its
    error; the others still run."""
    import torch
    from export_speed import PRESETS, random_model

    from mcore2hf import HFExporter

    cfg, chunks = random_model("qwen3_moe", dict(PRESETS["qwen3_moe"], **SMALL), 1, device)
    ex = HFExporter(chunks, cfg)
    bb = 1 << 20  # several buckets per sync
    rows, servers = [], {}
    try:
        for v in SGLANG:  # started together (each loads its release), waited for when first used
            start(servers, f"sglang-{v}", lambda v=v: sglang_server(engines[f"sglang-{v}"], v, a.device))
        for q in (None, "fp8"):
            spec = spec_of(expected(ex, bb, q, fast=False))
            start(servers, f"vllm-{q}", lambda spec=spec: VLLMServer(engines["vllm"], spec, a.device))
        step = 0
        for name, kind, packed in ([(f"sglang {v}", "sglang", True) for v in SGLANG]
                                   + [(f"vllm {VLLM} ipc packed", "vllm", True),
                                      (f"vllm {VLLM} ipc unpacked", "vllm", False)]):
            for q in (None, "fp8"):
                row = dict(engine=name, dtype=q or "bf16", tensors=0, buckets=0, syncs=["-", "-"], ok=False)
                try:
                    server = ready(servers, f"sglang-{name.split()[1]}" if kind == "sglang" else f"vllm-{q}")
                    sender = make_sender(kind, server.url, packed)
                    digests = []
                    for i in range(2):
                        step += 1
                        perturb(chunks, step)
                        want = expected(ex, bb, q, fast=False)
                        if kind == "sglang":
                            http(server.url, "/mcore2hf_reset", "POST")
                        rep = sync(ex, sender, bucket_bytes=bb, progress=False, quantize=q)
                        row["syncs"][i] = compare(want, engine_weights(kind, server.url, fast=False)) \
                            or "every byte equal"
                        digests.append(want)
                    # the second sync's bytes differ from the first's everywhere (a stale engine would fail)
                    same = sum(digests[0][n][0] == digests[1][n][0] for n in digests[0])
                    row.update(tensors=len(digests[1]), dtypes=sorted({d for _, d, _ in digests[1].values()}),
                               buckets=rep.buckets, unchanged_between_syncs=same, version=sender.version,
                               ok=row["syncs"] == ["every byte equal"] * 2 and same == 0 and sender.version == 2)
                except Exception as e:  # noqa: BLE001 - a FAIL row; the other cases still run
                    row["error"] = failed(e)
                rows.append(row)
                print(json.dumps(row), flush=True)
        # the check can fail: the engine's model loads one tensor with wrong bytes (the harness' "corrupt" fault,
        # +1 on every element) and exactly that tensor must be reported
        row = dict(engine=f"sglang {SGLANG[0]}", dtype="bf16", control=True, ok=False, syncs=["-", "-"])
        try:
            server = ready(servers, f"sglang-{SGLANG[0]}")
            perturb(chunks, step + 1)
            want = expected(ex, bb, None, fast=False)
            victim = sorted(want)[len(want) // 2]
            http(server.url, "/mcore2hf_reset", "POST")
            _post(server.url, "/mcore2hf_fault", {"kind": "corrupt", "name": victim})
            sync(ex, make_sender("sglang", server.url, True), bucket_bytes=bb, progress=False)
            err = compare(want, engine_weights("sglang", server.url, fast=False))
            row.update(tensors=len(want), syncs=[f"one corrupted: {err}", "-"],
                       ok=err is not None and "1 differ" in err and victim in err)
        except Exception as e:  # noqa: BLE001
            row["error"] = failed(e)
        rows.append(row)
        print(json.dumps(row), flush=True)
    finally:
        for s in servers.values():
            if not isinstance(s, BaseException):
                s.stop()
    del ex, chunks
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def module_scan_s(names: list[str]) -> tuple[int, float]:
    """(modules, seconds) of the scan SGLang 0.5.23 runs on every weight update (model_runner_components/
    weight_updater.py:55-61, `_unsupported_derived_weight_cache_error`: four getattr per module of the model) over
    a module tree shaped as the harness' recorder model builds it (one module per dotted prefix of each HF name; a
    real SGLang model fuses the experts into a few modules per layer)."""
    import torch

    root = torch.nn.Module()
    for name in names:
        m = root
        for part in name.split(".")[:-1]:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
    attrs = ("_hc_attn_tf32_parts", "_hc_ffn_tf32_parts", "_hc_attn_bf16_parts", "_hc_ffn_bf16_parts")
    t = time.perf_counter()
    any(any(getattr(m, a, None) is not None for a in attrs) for m in root.modules())
    return sum(1 for _ in root.modules()), time.perf_counter() - t


def timed_sync(ex, sender, bb: int, device, **kw) -> tuple[float, object]:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    rep = sync(ex, sender, bucket_bytes=bb, progress=False, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, rep


def timing(a, device, engines: dict) -> dict:
    """Qwen3-30B-A3B shapes, a.layers layers, bf16: export alone vs the whole colocated sync, per engine; then the
    cost of sync(verify=...) with the engines' own checkers (a.verify_engines)."""
    import torch
    from export_speed import PRESETS, random_model

    from mcore2hf import HFExporter

    config = dict(PRESETS["qwen3_moe"], num_hidden_layers=a.layers)
    if a.cpu:  # the code path only
        config.update(SMALL, num_hidden_layers=a.layers)
    cfg, chunks = random_model("qwen3_moe", config, 1, device)
    ex = HFExporter(chunks, cfg)
    bb = int(a.bucket_mb * 2**20)

    def export_alone() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for bucket in ex.buckets(bb):
            del bucket
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    export_alone()  # plan + compile
    export_s = min(export_alone() for _ in range(a.repeat))
    nbytes = ex.plan(bb).total_bytes
    modules, scan_s = module_scan_s([e.name for b in ex.plan(bb).buckets for e in b.output])
    out = {"layers": a.layers, "gb": nbytes / 1e9, "bucket_mb": a.bucket_mb, "export_s": export_s, "engines": {},
           "params_gib": sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()) / 2**30,
           "recorder_modules": modules, "module_scan_s": scan_s, "buckets": len(ex.plan(bb).buckets)}
    print(f"timing: qwen3_moe {a.layers} layers, {nbytes / 1e9:.2f} GB bf16, buckets of {a.bucket_mb:g} MiB: "
          f"export alone {export_s:.3f} s; SGLang 0.5.23's per-update module scan over the recorder's {modules} "
          f"modules: {scan_s * 1e3:.1f} ms (x {out['buckets']} buckets)", flush=True)
    for name in a.timing_engines.split(","):
        kind, version = name.split("-")[0], name.split("-")[1]
        packed = not name.endswith("unpacked")
        row = out["engines"][name] = {"check": "-"}
        server = None
        try:
            if kind == "sglang":
                server = sglang_server(engines[f"sglang-{version}"], version, a.device).wait()
            else:
                server = VLLMServer(engines["vllm"], spec_of(expected(ex, bb, None, fast=True)), a.device).wait()
            sender = make_sender(kind, server.url, packed)
            timed_sync(ex, sender, bb, device)  # first: the engine allocates / warms up
            perturb(chunks, 1000)
            runs = [timed_sync(ex, sender, bb, device) for _ in range(a.repeat)]
            sync_s, rep = min(runs, key=lambda r: r[0])
            err = compare(expected(ex, bb, None, fast=True), engine_weights(kind, server.url, fast=True))
            row.update(sync_s=sync_s, overhead_s=sync_s - export_s, send_s=rep.send_s, buckets=rep.buckets,
                       check=err or "every byte equal",
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0)
            print(f"timing {name}: whole sync {sync_s:.3f} s (export alone {export_s:.3f} s, overhead "
                  f"{sync_s - export_s:.3f} s per sync; sender {rep.send_s:.3f} s, {rep.buckets} buckets); after the "
                  f"timed syncs: {err or 'every byte equal'}", flush=True)
            # the engine now holds what the trainer holds: a proof is valid
            verify = dict((v.split(":") + ["checksum+proof"])[:2] for v in a.verify_engines.split(",") if v)
            if name in verify:
                for mode in verify[name].split("+"):
                    dt, _ = timed_sync(ex, sender, bb, device, verify=mode)
                    row[f"verify_{mode}_s"] = dt
                    print(f"timing {name}: sync(verify={mode!r}) {dt:.3f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded; the other engines still run
            row["error"] = failed(e)
            print(f"timing {name}: {row['error']}", flush=True)
        finally:
            if server is not None:
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
    ap.add_argument("--engines", default=os.environ.get("MCORE2HF_ENGINES", os.path.join(REPO, ".whl-ipc", "engines.tar.xz")),
                    help="the engines' files: --pack's engines.tar.xz, or a dir of <name>-<version>/ (else the "
                         "cached wheels)")
    ap.add_argument("--pack", metavar="DIR", help="write DIR/engines.tar.xz and the wheels the GPU machine needs, exit")
    ap.add_argument("--layers", type=int, default=None, help="timing model layers (Qwen3-30B-A3B shapes; 0: none)")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timing-engines", default="sglang-0.5.23,sglang-0.5.20,vllm-0.33.0-packed")
    # SGLang's checker on a GPU hashes with its Triton kernel, which the harness cannot load (harness.sglang_real
    # DEVICE): only vLLM's by default
    ap.add_argument("--verify-engines", default="vllm-0.33.0-packed:checksum",
                    help="also time sync(verify=...) into these (the engines' own checkers): ENGINE[:MODE+MODE],... "
                         "(modes checksum, proof; default both)")
    ap.add_argument("--skip-cases", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.pack:
        print(pack(a.pack))
        return
    if a.layers is None:
        a.layers = 1 if a.cpu else 24  # 24 of 48: 29 GiB on the trainer beside the engine's 29 GiB (an H100 holds both)
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
        if r.get("control"):
            print(f"{r['engine'] + ' (control)':<26} {r['dtype']:<6} {r.get('tensors', 0):>7} one tensor loaded wrong "
                  f"on purpose: {'reported by name' if r['ok'] else 'NOT REPORTED: ' + r['syncs'][0]} "
                  f"{'PASS' if r['ok'] else 'FAIL':>6}")
        else:
            print(f"{r['engine']:<26} {r['dtype']:<6} {r['tensors']:>7} {r['buckets']:>7} {r['syncs'][0][:18]:<18} "
                  f"{r['syncs'][1][:18]:<18} {'PASS' if r['ok'] else 'FAIL':>6}")
        if r.get("error"):
            print(f"    {r['error']}")
    tm = res.get("timing")
    if tm:
        print(f"\nqwen3_moe (Qwen3-30B-A3B shapes) {tm['layers']} layers, {tm['gb']:.2f} GB bf16 (params "
              f"{tm['params_gib']:.1f} GiB), {tm['buckets']} buckets of {tm['bucket_mb']:g} MiB; export alone "
              f"{tm['export_s']:.3f} s; 0.5.23's per-update module scan over the recorder's {tm['recorder_modules']} "
              f"modules {tm['module_scan_s'] * 1e3:.1f} ms")
        print(f"{'engine':<26} {'whole sync s':>12} {'overhead s':>11} {'sender s':>9} {'after timing':<17} "
              f"{'verify checksum s':>17} {'verify proof s':>14}")
        nan = float("nan")
        for name, e in tm["engines"].items():
            ok &= e["check"] == "every byte equal"
            print(f"{name:<26} {e.get('sync_s', nan):>12.3f} {e.get('overhead_s', nan):>11.3f} "
                  f"{e.get('send_s', nan):>9.3f} {e['check'][:17]:<17} {e.get('verify_checksum_s', nan):>17.3f} "
                  f"{e.get('verify_proof_s', nan):>14.3f}")
            if e.get("error"):
                print(f"    {e['error']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print("ALL PASS" if ok else "FAILURES")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
