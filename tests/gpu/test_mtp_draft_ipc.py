"""GPU suite (tests/gpu: marked `gpu`, skipped without CUDA by its conftest): colocated syncs of a model holding an MTP layer over real CUDA IPC into
the engines' own receive code, the speculative-decoding draft included (issue 37).

The trainer is a one-rank megatron-core world on the GPU (bench/export_speed.py random_model: GLM-4.5-Air's
shapes scaled down, one MTP layer); each engine is another process on the same GPU running the contract tests'
harness with CUDA tensors (bench/gpu_ipc.py: the releases' .py files from --pack's engines.tar.xz or the cached
wheels):

* SGLang 0.5.23 with an MTP draft runner (harness.sglang_real --draft mtp): the release's weight updater fans each
  update out by its `selector`; after each sync the target runner holds every tensor but the MTP layer's and the
  draft runner exactly the MTP layer's own, every byte (sha256 in the engine process);
* vLLM 0.33.0 with an MTP draft model (harness.vllm_real --serve SPEC cuda DRAFT_SPEC): its IPC engine's target
  session, then its draft session (start_draft_weight_update), the draft getting the MTP layer and the embedding /
  head copies, every byte.

bf16 and block FP8 (`sync(quantize="fp8")`), two syncs each with different bytes, then one with draft="keep" after
which the draft still holds the previous sync's bytes while the target moved. Hang guard: the world's timeout and a
faulthandler traceback dump before it.

    bash bench/gpu_suite.sh -k mtp_draft                   # on a lent GPU machine, carrying .whl/ and .whl-ipc/
    MCORE2HF_DRAFT_IPC_DEVICE=cpu python tests/gpu/test_mtp_draft_ipc.py   # the same code path on CPU (about 1 min)
"""

from __future__ import annotations

import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
for path in (os.path.join(REPO, "bench"), os.path.join(REPO, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

#: "cpu" runs the same code path on CPU (gloo, CPU shared memory for the handles), as a script only (under pytest
#: the GPU suite's conftest skips it without a GPU)
DEVICE = os.environ.get("MCORE2HF_DRAFT_IPC_DEVICE", "cuda")

SMALL_GLM = dict(num_hidden_layers=2, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=128, n_routed_experts=8, num_experts_per_tok=2,
                 vocab_size=2048, num_nextn_predict_layers=1)
BUCKET = 1 << 20  # several buckets per pass
TIMEOUT = 1500  # s: the world; a traceback of every thread is dumped 60 s before


def _split(want: dict, mtp, copies: bool) -> tuple[dict, dict]:
    """(the target's tensors, the draft's) of an export's digests: the MTP layer (with its FP8 scales) to the draft,
    its embedding / head copies too where `copies` (vLLM), nowhere otherwise (SGLang's drafts read the target's)."""
    layer = {n for n in want if n in mtp.layer or n.removesuffix("_scale_inv") in mtp.layer}
    draft = layer | (set(mtp.copies) if copies else set())
    return ({n: v for n, v in want.items() if n not in layer | set(mtp.copies)},
            {n: v for n, v in want.items() if n in draft})


def _job(engines: dict) -> list:
    """One rank (the whole world): every engine x bf16 / fp8, as the module docstring says; a row per case."""
    import faulthandler

    from export_speed import PRESETS, random_model
    from gpu_ipc import VLLMServer, compare, engine_env, expected, failed, http, perturb, spec_of
    from harness.sglang_real import RealServer

    from mcore2hf import HFExporter
    from mcore2hf.senders import SGLangColocatedSender, VLLMColocatedSender, sync

    faulthandler.dump_traceback_later(TIMEOUT - 60, exit=True)
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    cfg, chunks = random_model("glm4_moe", dict(PRESETS["glm4_moe"], **SMALL_GLM), 1, device)
    ex = HFExporter(chunks, cfg)
    mtp = ex.draft_tensors(BUCKET)
    rows, step = [], 0
    for kind in ("sglang", "vllm"):
        for q in (None, "fp8"):
            row, server = {"engine": kind, "dtype": q or "bf16", "ok": False}, None
            try:
                want = expected(ex, BUCKET, q, fast=False)
                if kind == "sglang":
                    site = engines["sglang"]
                    server = RealServer(site, "0.5.23", device=DEVICE, extra=("--draft", "mtp"),
                                        env={"PYTHONPATH": engine_env(site)["PYTHONPATH"]})
                    sender = SGLangColocatedSender(server.url, 1, timeout=600)
                else:
                    target, draft = _split(want, mtp, copies=True)
                    server = VLLMServer(engines["vllm"], spec_of(target), DEVICE, spec_of(draft)).wait()
                    sender = VLLMColocatedSender(server.url, 1, timeout=600)
                held = []
                for draft_choice in ("auto", "auto", "keep"):
                    step += 1
                    perturb(chunks, step)  # new bytes everywhere: a stale target or draft shows
                    want = expected(ex, BUCKET, q, fast=False)
                    if kind == "sglang":
                        http(server.url, "/mcore2hf_reset", "POST")
                    rep = sync(ex, sender, bucket_bytes=BUCKET, progress=False, quantize=q, draft=draft_choice)
                    st = http(server.url, "/mcore2hf_state")
                    t_got, d_got = (st["weights"]["0"], st["draft_weights"]["0"]) if kind == "sglang" else \
                        (st["weights"], st["draft"])
                    t_want, d_want = _split(want, mtp, copies=kind == "vllm")
                    held.append({"draft": rep.draft, "target": compare(t_want, t_got) or "every byte equal",
                                 "draft_bytes": d_got, "draft_check": compare(d_want, d_got) or "every byte equal"})
                updated = [h["target"] == h["draft_check"] == "every byte equal" for h in held[:2]]
                # "keep": the target moved, the draft did not (SGLang's recorder: nothing loaded since the reset)
                kept = held[2]["target"] == "every byte equal" and (
                    held[2]["draft_bytes"] == {} if kind == "sglang" else held[2]["draft_bytes"] == held[1]["draft_bytes"])
                row.update(syncs=[(h["draft"], h["target"], h["draft_check"]) for h in held], tensors=len(want),
                           draft_tensors=len(_split(want, mtp, kind == "vllm")[1]), version=sender.version,
                           ok=all(updated) and kept and sender.version == 3)
            except Exception as e:  # noqa: BLE001 - a FAIL row; the other cases still run
                row["error"] = failed(e)
            finally:
                if server is not None:
                    server.stop()
            print(row, flush=True)
            rows.append(row)
    faulthandler.cancel_dump_traceback_later()
    return rows


def _engines() -> dict:
    from gpu_ipc import engine_site

    root = os.environ.get("MCORE2HF_ENGINES", os.path.join(REPO, ".whl-ipc", "engines.tar.xz"))
    return {"sglang": engine_site(root, "sglang", "0.5.23"), "vllm": engine_site(root, "vllm", "0.33.0")}


def test_mtp_draft_over_real_cuda_ipc():
    from mcore2hf.runtime.world import Layout, run_world

    rows = run_world(_job, Layout(), _engines(), backend="nccl" if DEVICE == "cuda" else "gloo", timeout=TIMEOUT)[0]
    bad = [r for r in rows if not r["ok"]]
    assert len(rows) == 4 and not bad, bad


if __name__ == "__main__":
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from mcore2hf.runtime.world import Layout, run_world

    result = run_world(_job, Layout(), _engines(), backend="nccl" if DEVICE == "cuda" else "gloo", timeout=TIMEOUT)[0]
    print("ALL PASS" if all(r["ok"] for r in result) else "FAILURES")
    sys.exit(0 if all(r["ok"] for r in result) else 1)
