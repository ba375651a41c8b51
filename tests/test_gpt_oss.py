"""gpt-oss specifics: the dry run shows one stacked tensor per layer fed by every EP rank's experts, the layouts
megatron-core refuses for it are refused first with a clear error, and FP8 is refused (no FP8 table)."""


import pytest
import worlds

from mcore2hf.errors import LayoutError
from mcore2hf.model_specs import gpt_oss
from mcore2hf.offline import export_checkpoint
from mcore2hf.runtime.tiny import tiny_config


def test_cli_plan_shows_stacked_experts_from_both_ep_ranks():
    out = worlds.cli_run("plan", "--hf-config", "tiny:gpt_oss", "--tp", "2",
                         "--ep", "2", "--etp", "1", "--json", "--bucket-size", "4KiB", check=True)
    import json

    plan = json.loads(out.stdout)
    names = {t["name"]: t for t in plan["tensors"]}
    assert names["model.layers.3.mlp.experts.gate_up_proj"]["shape"] == [8, 64, 64]
    assert names["model.layers.3.mlp.experts.down_proj"]["shape"] == [8, 32, 64]
    assert names["model.layers.3.mlp.experts.gate_up_proj_bias"]["shape"] == [8, 64]
    assert names["model.layers.3.mlp.experts.down_proj_bias"]["shape"] == [8, 64]
    assert names["model.layers.0.self_attn.sinks"]["shards"] == 2  # split by heads over TP
    assert not [n for n in names if ".experts.0." in n]
    assert plan["num_tensors"] == len(names) == 71
    # the gate_up_proj (64 KiB in the plan's bf16) is one output, gathered in rounds of one expert: no rank stages
    # all of it (in one round the EP all-gather would stage 2 ranks x 4 experts x 8 KiB)
    gate_up = names["model.layers.3.mlp.experts.gate_up_proj"]["bytes"]
    assert gate_up == 8 * 64 * 64 * 2 and max(b["bytes"] for b in plan["buckets"]) == gate_up
    assert all(m["arena_bytes"] < gate_up for m in plan["memory"]), plan["memory"]


def test_expert_tp_above_1_is_refused_before_megatron_asserts():
    with pytest.raises(LayoutError, match=r"expert-TP 1; expected expert tensor-parallel size 1, got 2 \(pass --etp 1"):
        gpt_oss.SPEC.transformer_config(tiny_config("gpt_oss"), expert_tensor_parallel_size=2)


def test_fp8_export_is_refused(tmp_path, ckpts):
    with pytest.raises(ValueError, match="FP8 export is not supported for model_type 'gpt_oss'"):
        export_checkpoint(tmp_path / "no-ckpt", tmp_path / "out", ckpts["gpt_oss"], quantize="fp8", progress=False)
    assert not (tmp_path / "out").exists()
