"""Plan once, run many: the plan is built with one metadata exchange and reused; the dry run is complete."""

import json
import subprocess
import sys

import worlds
from oracle import logit_problems

from mcore2hf.runtime.world import Layout, run_world, same_on_every_rank


def test_plan_reuse_dry_run_and_balance(qwen3_moe_ckpt):
    layout = Layout(tp=2, pp=2, ep=2, etp=1)
    per_rank = run_world(worlds.plan_suite, layout, str(qwen3_moe_ckpt), layout)
    # the model built without initialization and attributes, loaded by mcore2hf: the Megatron forward is right
    problems = logit_problems([{"qwen3_moe": r.pop("logits")} for r in per_rank], {"qwen3_moe": qwen3_moe_ckpt},
                              worlds.TOKENS, str(layout))
    assert not problems, problems
    r = same_on_every_rank(per_rank)
    assert r["buckets"] > 3
    assert r["pp_padding"] < 1.35, r  # bytes moved by the PP all-gather / bytes that must move


def test_cli_list_and_plan():
    out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "list"], capture_output=True, text=True, check=True)
    assert "qwen3_moe" in out.stdout
    out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "plan", "--hf-config", "tiny:qwen3_moe", "--tp", "2",
                          "--ep", "2", "--bucket-size", "64KiB"], capture_output=True, text=True, check=True)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in out.stdout
    assert "135 HF tensors" in out.stdout
    assert "at TP2 PP1 EP2 ETP2 (world size 4)" in out.stdout  # the ETP Megatron uses when none is given
    assert "extra memory per rank during an export" in out.stdout and "staging arena" in out.stdout


def test_cli_plan_json_with_te_names_and_filter():
    out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "plan", "--hf-config", "tiny:glm4_moe", "--pp", "2",
                          "--ep", "2", "--etp", "1", "--json", "--te-names", "--exclude", r"^model\.layers\.4\."],
                         capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert plan["layout"] == {"tp": 1, "pp": 2, "vpp": None, "ep": 2, "etp": 1, "world_size": 4}
    names = {t["name"]: t for t in plan["tensors"]}
    assert not [n for n in names if n.startswith("model.layers.4.")]  # MTP layer filtered out
    assert names["model.layers.1.input_layernorm.weight"]["megatron"].endswith("linear_qkv.layer_norm_weight")
    assert names["model.layers.2.mlp.experts.5.down_proj.weight"]["megatron"].endswith("linear_fc2.weight1")
    assert len(plan["memory"]) == 4 and all(m["arena_bytes"] > 0 and m["largest_bucket_bytes"] > 0
                                            for m in plan["memory"])
    assert plan["total_bytes"] == sum(t["bytes"] for t in plan["tensors"])
