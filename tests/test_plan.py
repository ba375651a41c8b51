"""Plan once, run many: the plan is built with one metadata exchange and reused; the dry run is complete."""

import subprocess
import sys

import worlds

from mcore2hf.testing.world import Layout, run_world


def test_plan_reuse_dry_run_and_balance(qwen3_moe_ckpt):
    layout = Layout(tp=2, pp=2, ep=2, etp=1)
    r = run_world(worlds.plan_suite, layout, str(qwen3_moe_ckpt), layout)[0]
    assert r["buckets"] > 3
    assert r["pp_padding"] < 1.35, r  # bytes moved by the PP all-gather / bytes that must move


def test_cli_list_and_plan():
    out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "list"], capture_output=True, text=True, check=True)
    assert "qwen3_moe" in out.stdout
    out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "plan", "--hf-config", "tiny:qwen3_moe", "--tp", "2",
                          "--ep", "2", "--etp", "1"], capture_output=True, text=True, check=True)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in out.stdout
    assert "135 HF tensors" in out.stdout
