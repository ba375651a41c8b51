"""The GPU suite: every export path users run on GPUs, on real megatron-core models in NCCL worlds (one process per
GPU), checked tensor by tensor on every rank against oracles that are not the code under test (gpu_jobs).

    bash bench/gpu_suite.sh            # on a lent GPU machine: 4 GPUs run all of it, 1 or 2 GPUs what fits

The layout matrix runs on 4 GPUs; the shapes are the tiny configs grown until a 1 MiB bucket holds a few experts,
so the planner makes every kind of bucket (test_the_matrix_reaches_every_bucket_kind checks it did)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mcore2hf.runtime.tiny import _QWEN3_VL_VISION
from mcore2hf.runtime.world import Layout, run_world

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUCKET = 1 << 20

#: grown tiny configs (gpu_jobs.suite_checkpoint): 1 MiB buckets hold a few experts, the embedding is a bucket alone
SHAPES = {
    "qwen3_moe": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16),
    "deepseek_v3": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, q_lora_rank=64,
                        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    "glm4_moe": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=32, n_routed_experts=16),
    "deepseek_v32": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         n_routed_experts=16),
    "gpt_oss": dict(vocab_size=4096, hidden_size=256, intermediate_size=256, num_local_experts=16),
    # the native tower at TP 2: 4 heads (the tiny tower's 3 do not split)
    "qwen3_vl": dict(vision_config=dict(_QWEN3_VL_VISION, hidden_size=64, intermediate_size=64, num_heads=4)),
}

L = Layout
#: (model type, layout, extra): every parallel dimension and their products on 4 GPUs
MATRIX = [
    ("qwen3_moe", L(tp=2, pp=2, ep=2, etp=1), {}),
    ("qwen3_moe", L(tp=1, pp=2, ep=2), {}),
    ("qwen3_moe", L(tp=1, pp=2, vpp=2, ep=2), {}),
    ("qwen3_moe", L(tp=1, pp=4, first_stage_layers=1, last_stage_layers=3), {}),
    ("qwen3_moe", L(tp=1, ep=4), {}),
    ("qwen3_moe", L(tp=2, ep=2, etp=1, world_size=4), {}),
    ("qwen3_moe", L(tp=1, pp=2, ep=1, etp=2), {}),
    ("qwen3_moe", L(tp=2, ep=4, etp=1), {}),
    ("deepseek_v3", L(tp=2, pp=2, ep=2, etp=1), {}),
    ("deepseek_v3", L(tp=1, pp=2, vpp=2, ep=2), {}),
    ("glm4_moe", L(tp=1, pp=2, ep=2), {}),
    ("glm4_moe", L(tp=2, pp=2, ep=1, etp=2), {}),
    ("deepseek_v32", L(tp=2, pp=2, ep=2, etp=1), {}),
    ("gpt_oss", L(tp=1, pp=2, ep=2), {"fp8": False}),  # no FP8 table: gpt-oss publishes MXFP4 experts
    ("qwen3_vl", L(tp=2, pp=2), {"vision_tower": "native"}),
]
ENGINE_MODELS = {"qwen3_moe", "deepseek_v3"}  # the engine-sharded export's slices checked in these worlds
KINDS: dict[str, list[str]] = {}


@pytest.fixture(scope="session")
def suite_ckpts(tmp_path_factory) -> dict[str, str]:
    from gpu_jobs import suite_checkpoint

    root = tmp_path_factory.mktemp("gpu_ckpts")
    return {mt: suite_checkpoint(mt, str(root / mt), **kw) for mt, kw in SHAPES.items()}


@pytest.mark.parametrize("model_type,layout,extra", MATRIX, ids=[f"{m}-{lay}" for m, lay, _ in MATRIX])
def test_export_matrix(model_type, layout, extra, suite_ckpts):
    if layout.size > GPUS:
        pytest.skip(f"needs {layout.size} GPUs, found {GPUS}")
    from gpu_jobs import export_matrix

    res = run_world(export_matrix, layout, suite_ckpts[model_type], layout, BUCKET, extra.get("fp8", True),
                    model_type in ENGINE_MODELS, extra.get("vision_tower"), backend="nccl", timeout=300)
    KINDS[f"{model_type}-{layout}"] = res[0]["kinds"]
    problems = {r: x["problems"] for r, x in enumerate(res) if x["problems"]}
    assert not problems, problems
    if model_type in ENGINE_MODELS:
        assert res[0]["engine"], "no engine placement ran"


def test_the_matrix_reaches_every_bucket_kind():
    """The shapes and bucket size make the planner produce every kind of bucket somewhere in the matrix."""
    if not KINDS:
        pytest.skip("the matrix did not run")
    reached = {k for kinds in KINDS.values() for k in kinds}
    want = {"direct", "staged", "experts-split", "oversize", "rounds", "pp-uneven-depends"}
    assert want <= reached, (sorted(want - reached), KINDS)


def test_lora_adapter_and_merged_export(suite_ckpts, tmp_path):
    """Megatron-Bridge's own LoRA (0.6.2 on megatron-core 0.19, 0.3.1 on 0.16) around the grown qwen3_moe at TP2 x
    PP2 x EP2 (expert-TP 1), adapters on attention and every expert: the adapter-only and merged exports
    (gpu_jobs.lora_export). Bridge's files: the wheel cache (bench/gpu_ipc.py --pack puts 0.6.2 there)."""
    layout = Layout(tp=2, pp=2, ep=2, etp=1)
    if layout.size > GPUS:
        pytest.skip(f"needs {layout.size} GPUs, found {GPUS}")
    from gpu_jobs import lora_export
    from harness.bridge_lora import BRIDGE_062, BRIDGE_VERSION, bridge_root
    from safetensors.torch import load_file, save_file
    from test_lora import TARGETS, expert_adapter

    from mcore2hf.model_specs.deepseek_v3 import megatron_at_least

    adapter = expert_adapter(suite_ckpts["qwen3_moe"], str(tmp_path / "adapter"), TARGETS["qwen3_moe"])
    path = os.path.join(adapter, "adapter_model.safetensors")
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(path).items()}, path)  # the model's dtype: exact
    bridge = bridge_root(BRIDGE_062 if megatron_at_least(0, 19) else BRIDGE_VERSION)
    res = run_world(lora_export, layout, suite_ckpts["qwen3_moe"], layout, adapter, bridge, TARGETS["qwen3_moe"],
                    BUCKET, backend="nccl", timeout=300)
    problems = {r: x["problems"] for r, x in enumerate(res) if x["problems"]}
    assert not problems, problems
    assert res[0]["adapters"] > 100


def _script(args: list[str], timeout: int) -> str:
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    text = out.stdout + out.stderr[-4000:]
    assert out.returncode == 0, text[-6000:]
    return text


def test_colocated_senders_over_cuda_ipc_into_the_engines_code():
    """bench/gpu_ipc.py's cases: SGLang 0.5.23 / 0.5.20 and vLLM 0.33.0 (packed and unpacked) receive code in engine
    processes on the trainer's GPU, bf16 and FP8, two syncs each, every byte checked on the engine side."""
    if GPUS < 1:
        pytest.skip("needs a GPU")
    text = _script(["bench/gpu_ipc.py", "--layers", "0"], 480)
    assert "ALL PASS" in text, text[-4000:]


def test_senders_with_engines_on_other_gpus():
    """bench/gpu_senders.py --hardest: a TP2 x EP2 trainer on 2 GPUs seeing them in reverse order, SGLang 0.5.23's
    receive code in engine processes that see only their own GPU, colocated over CUDA IPC and distributed over NCCL
    to an engine on the other GPU (the script without --hardest runs every combination)."""
    if GPUS < 2:
        pytest.skip("needs 2 GPUs")
    _script(["bench/gpu_senders.py", "--hardest"], 300)
