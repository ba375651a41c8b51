"""Our vLLM senders against vLLM 0.33.0's own code (published wheel, .py files only, GPU-only calls stubbed): one
subprocess with the unpacked wheel on sys.path runs every scenario of harness.vllm_real (what is real
and what is stubbed is listed there); each test here asserts one scenario's outcome. The wheel is downloaded once
and cached; if it cannot be fetched these tests fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.vllm_real import SCENARIOS, make_bucket
from harness.wheels import unpacked_wheel

from mcore2hf.senders.vllm import VERIFIED_VLLM, bucket_fields, packed_chunk_ends

VLLM = "0.33.0"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    wheel = unpacked_wheel("vllm", VLLM, ("vllm/*.py", "vllm-*.dist-info/*"))
    out = tmp_path_factory.mktemp("vllm") / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(wheel), str(REPO / "tests"), str(REPO)]),
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_LOGGING_LEVEL="WARNING")
    r = subprocess.run([sys.executable, "-m", "harness.vllm_real", str(out)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert out.exists(), f"the vLLM harness died (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    res = json.loads(out.read_text())
    assert res["vllm"] == VLLM and res["vllm_file"].startswith(str(wheel)), res  # the wheel's code, not another
    return res


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_vllm_scenario(results, scenario):
    assert results.get(scenario) == "ok", f"{scenario}:\n{results.get(scenario, 'did not run')}"


def test_verified_version_is_the_pinned_one():
    assert VERIFIED_VLLM == VLLM


def test_packed_chunk_ends_examples():
    # a chunk closes once it exceeds the budget, the crossing tensor included (vllm packed_tensor.py)
    assert packed_chunk_ends([4, 4, 4], 8) == [12]
    assert packed_chunk_ends([4, 4, 4], 7) == [8, 12]
    assert packed_chunk_ends([10, 1], 4) == [10, 11]
    assert packed_chunk_ends([], 4) == []


def test_fp8_bucket_fields_in_flat_order():
    b = make_bucket(0, {"w": torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "w_scale_inv": torch.ones(2, 2)})
    f = bucket_fields(b)
    assert f == {"names": ["w_scale_inv", "w"], "dtype_names": ["float32", "float8_e4m3fn"],
                 "shapes": [[2, 2], [4, 4]]}
