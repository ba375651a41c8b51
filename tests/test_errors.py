"""Bad input gets a clear error naming the parameter and the expected and actual shape/name."""

import os

import pytest
import torch
import worlds
from oracle import logit_problems

from mcore2hf import HFExporter, ParallelStateError, list_architectures
from mcore2hf.arch.hf_config import load_hf_config
from mcore2hf.arch.registry import get_converter
from mcore2hf.errors import UnsupportedArchitectureError
from mcore2hf.runtime.tiny import tiny_config
from mcore2hf.runtime.world import Layout, run_world, same_on_every_rank


def test_errors_in_a_tp2_ep2_world(qwen3_moe_ckpt, tmp_path):
    messages = run_world(worlds.error_suite, Layout(tp=2, ep=2, etp=1), str(qwen3_moe_ckpt), Layout(tp=2, ep=2, etp=1),
                         str(tmp_path))
    assert [len(m) for m in messages] == [2, 2]


def test_no_parallel_state():
    with pytest.raises(ParallelStateError, match="torch.distributed is not initialized"):
        HFExporter(torch.nn.Linear(2, 2), tiny_config("qwen3_moe"))


def test_unknown_architecture():
    with pytest.raises(UnsupportedArchitectureError, match="no converter for HF model_type 'gpt2'"):
        get_converter("gpt2")
    assert "qwen3_moe" in list_architectures()


def test_config_forms(tmp_path, qwen3_moe_ckpt):
    cfg = tiny_config("qwen3_moe")
    assert load_hf_config(cfg) is cfg
    assert load_hf_config(qwen3_moe_ckpt).num_experts == 8
    assert load_hf_config(f"{qwen3_moe_ckpt}/config.json").model_type == "qwen3_moe"
    assert load_hf_config({"model_type": "qwen3_moe", "num_experts": 4}).num_experts == 4
    with pytest.raises(FileNotFoundError):
        load_hf_config(tmp_path / "nope")


def test_save_pretrained_writes_the_users_config_and_files_and_filters_names(qwen3_moe_ckpt, tmp_path):
    import json
    import shutil

    from test_outputs import _transformers4_style_config

    src = tmp_path / "src"
    raw = _transformers4_style_config(src)
    for f in ("model.safetensors",):
        shutil.copy(os.path.join(qwen3_moe_ckpt, f), src / f)
    (src / "tokenizer.json").write_text("{}")
    (src / "generation_config.json").write_text("{}")
    layout = Layout(ep=2, etp=1)
    per_rank = run_world(worlds.outputs_suite, layout, str(qwen3_moe_ckpt), layout, str(src), str(tmp_path))
    problems = logit_problems([{"qwen3_moe": r.pop("logits")} for r in per_rank], {"qwen3_moe": qwen3_moe_ckpt},
                              worlds.TOKENS, str(layout))
    assert not problems, problems
    r = same_on_every_rank(per_rank)
    want = {k: v for k, v in raw.items() if k != "quantization_config"}  # fp32 model: the dtype stays
    assert list(r["config"].items()) == list(want.items()), json.dumps(r["config"])
    assert "tokenizer.json" in r["files"] and "generation_config.json" in r["files"]
    assert r["filtered_bytes"] < 0.85 * r["full_bytes"]
