"""SGLang senders on real GPUs, with trainer and engine processes that see different CUDA_VISIBLE_DEVICES.

    python bench/gpu_senders.py             # 2 GPUs, every combination below
    python bench/gpu_senders.py --hardest   # only CUDA_VISIBLE_DEVICES 1,0 beside engines seeing their own GPU

A 2-rank trainer world (NCCL, TP2 x EP2) holds a real megatron-core model loaded from a random HF checkpoint and
syncs it twice through each SGLang sender into SGLang 0.5.23's own receive code (harness.sglang_real on the GPU:
the release's SafeUnpickler, patch_torch's UUID-aware CUDA rebuild, flattened-bucket rebuild, WeightUpdater and
its NCCL weight-update group) running as separate processes:

* colocated: every trainer rank's bucket goes as a CUDA IPC handle to the engine on its own physical GPU;
* distributed: trainer rank 0 broadcasts each bucket over an NCCL group to an engine on the other GPU.

Each runs in every combination of the trainer's CUDA_VISIBLE_DEVICES ("0,1" or "1,0") and the engines' (all
GPUs visible, device = physical index; or only their own GPU, device cuda:0), as Ray deployments do: a device
index means different GPUs in the two processes, only the UUID names the right one. Each engine's parameters are
hashed where they live; the script checks every byte of every tensor against the source checkpoint on every
engine. The engine's files: bench/gpu_ipc.py --engines (its --pack carries them to the GPU machines). One GPU:
bench/gpu_ipc.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def visible(devices: str | None):
    """CUDA_VISIBLE_DEVICES for the processes spawned inside (they copy the environment when they start)."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    if devices is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def main() -> None:
    import torch
    import worlds
    from gpu_ipc import engine_site, http, sglang_server, sha256

    from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
    from mcore2hf.runtime.world import Layout, run_world

    site = engine_site(os.environ.get("MCORE2HF_ENGINES", os.path.join(REPO, ".whl-ipc", "engines.tar.xz")),
                       "sglang", "0.5.23")
    assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
    work = tempfile.mkdtemp(prefix="mcore2hf-gpu-senders-")
    rows = []
    layout = Layout(tp=2, ep=2, etp=1)
    arch = "qwen3_moe"
    ckpt = make_hf_checkpoint(tiny_config(arch, hidden_size=512, moe_intermediate_size=256, intermediate_size=768),
                              os.path.join(work, arch), dtype=torch.bfloat16)
    source = read_hf_checkpoint(ckpt)
    ref = {n: (sha256(t), str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in source.items()}
    nbytes = sum(t.numel() * t.element_size() for t in source.values())
    # --hardest (the GPU suite): only the trainer that sees the GPUs in reverse order beside engines that see their
    # own GPU only: every device index differs between the processes
    hardest = "--hardest" in sys.argv[1:]
    for trainer_cvd in ("1,0",) if hardest else ("0,1", "1,0"):
        phys = [int(g) for g in trainer_cvd.split(",")]  # trainer rank r runs on physical GPU phys[r]
        for isolated in (True,) if hardest else (False, True):
            for kind, gpus in (("sglang-colocated", phys), ("sglang-distributed", phys[1:])):
                engines = []
                for g in gpus:
                    with visible(str(g) if isolated else None):
                        engines.append(sglang_server(site, "0.5.23", "cuda:0" if isolated else f"cuda:{g}"))
                for e in engines:
                    e.wait()
                where = f"{'own GPU only' if isolated else 'all GPUs'}: physical {gpus}"
                try:
                    t = time.perf_counter()
                    with visible(trainer_cvd):
                        run_world(worlds.sender_suite, layout, ckpt, layout, kind, [e.url for e in engines], 1, 0,
                                  4 * 2**20, 120.0, 2, "nccl", torch.bfloat16, backend="nccl", timeout=900)
                    dt = time.perf_counter() - t
                    ok = []
                    for e in engines:
                        st = http(e.url, "/mcore2hf_state")
                        got = {n: tuple(v) for n, v in st["weights"]["0"].items()}
                        ref_t = {n: tuple(v) for n, v in ref.items()}
                        ok.append(got == ref_t and st["versions"][-1] == "2")
                        if got != ref_t:
                            bad = sorted(n for n in ref_t if got.get(n) != ref_t[n])
                            print(f"{kind} engine {e.url}: {len(bad)} of {len(ref_t)} differ, e.g. {bad[:3]}")
                    rows.append((kind, trainer_cvd, where, len(ref), nbytes, all(ok), dt))
                except Exception as err:  # noqa: BLE001 - one failed combination is a FAIL row, the others still run
                    print(f"{kind} trainer CVD={trainer_cvd} engines {where}: {type(err).__name__}: {err}"[:2000])
                    rows.append((kind, trainer_cvd, where, len(ref), nbytes, False, float("nan")))
                finally:
                    for e in engines:
                        e.stop()
    print(f"\n{'sender':<20} {'trainer CVD':<12} {'engines':<32} {'tensors':>8} {'MB':>7} {'every byte':>11} "
          f"{'s (2 syncs)':>12}")
    for kind, cvd, where, n, nb, ok, dt in rows:
        print(f"{kind:<20} {cvd:<12} {where:<32} {n:>8} {nb / 2**20:>7.1f} {'PASS' if ok else 'FAIL':>11} {dt:>12.1f}")
    if not all(r[5] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
