"""Senders on real GPUs: CUDA IPC into engine processes on the same GPUs, NCCL broadcast to engines on others.

    python bench/gpu_senders.py        # 2 GPUs or more: trainer ranks on GPUs 0-1, remote engines on GPUs 2-3
                                       # (with 2 GPUs: one remote engine on GPU 1, outside the trainer's rank 0)

A 2-rank trainer world (NCCL, TP2 x EP2) holds a real megatron-core model loaded from a random HF checkpoint and
syncs it twice through each sender to fake engines (mcore2hf.testing.fake_engine: SGLang's endpoints and
deserialization, vLLM's worker-extension pattern) running as separate processes:

* SGLang colocated: every trainer rank's bucket goes as a CUDA IPC handle to the engine on its own GPU;
* vLLM colocated: the same through MCore2HFWorkerExtension, keyed by the GPU's UUID;
* SGLang distributed / vLLM distributed: trainer rank 0 (GPU 0) broadcasts each bucket over an NCCL group to
  engines on GPUs 2 and 3 (on GPU 1 when there are only 2 GPUs: an NCCL group holds one rank per GPU).

Each engine hashes every tensor it rebuilt; the script checks every byte of every tensor against the source
checkpoint on every engine and prints a table.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> None:
    import torch
    import worlds

    from mcore2hf.testing.fake_engine import EngineProcess, digest
    from mcore2hf.testing.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
    from mcore2hf.testing.world import Layout, free_port, run_world

    n_gpus = torch.cuda.device_count()
    assert n_gpus >= 2, "needs 2 GPUs or more"
    remote = (2, 3) if n_gpus >= 4 else (1,)
    work = tempfile.mkdtemp(prefix="mcore2hf-gpu-senders-")
    rows = []
    layout = Layout(tp=2, ep=2, etp=1)
    for arch in ("qwen3_moe", "glm4_moe"):
        ckpt = make_hf_checkpoint(tiny_config(arch, hidden_size=512, moe_intermediate_size=256,
                                              intermediate_size=768), os.path.join(work, arch), dtype=torch.bfloat16)
        ref = {n: (digest(t), str(t.dtype).removeprefix("torch."), list(t.shape))
               for n, t in read_hf_checkpoint(ckpt).items()}
        nbytes = sum(t.numel() * t.element_size() for t in read_hf_checkpoint(ckpt).values())
        for kind, gpus in (("sglang-colocated", (0, 1)), ("vllm-colocated", (0, 1)),
                           ("sglang-distributed", remote), ("vllm-distributed", remote)):
            engines = [EngineProcess(device=f"cuda:{g}") for g in gpus]
            try:
                t = time.perf_counter()
                run_world(worlds.sender_suite, layout, ckpt, layout, kind, [e.url for e in engines], 1, free_port(),
                          None, 4 * 2**20, 120.0, 2, "nccl", torch.bfloat16, backend="nccl", timeout=900)
                dt = time.perf_counter() - t
                ok = []
                for e in engines:
                    got = {n: tuple(v) for n, v in e.state()["weights"]["0"].items()}
                    ref_t = {n: tuple(v) for n, v in ref.items()}
                    ok.append(got == ref_t)
                    if got != ref_t:
                        bad = sorted(n for n in ref_t if got.get(n) != ref_t[n])
                        print(f"{arch} {kind} engine {e.url}: {len(bad)} of {len(ref_t)} differ, e.g. "
                              f"{[(n, got.get(n, 'missing')[1:], ref_t[n][1:]) for n in bad[:3]]}; "
                              f"extra {sorted(set(got) - set(ref_t))[:3]}")
                rows.append((arch, kind, f"GPUs {gpus}", len(ref), nbytes, all(ok), dt))
            finally:
                for e in engines:
                    e.stop()
    print(f"\n{'arch':<10} {'sender':<20} {'engines':<12} {'tensors':>8} {'MB':>8} {'every byte':>11} {'s (2 syncs)':>12}")
    for arch, kind, where, n, nb, ok, dt in rows:
        print(f"{arch:<10} {kind:<20} {where:<12} {n:>8} {nb / 2**20:>8.1f} {'PASS' if ok else 'FAIL':>11} {dt:>12.1f}")
    if not all(r[5] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
