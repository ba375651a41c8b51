"""The command line as a user meets it: the installed `mcore2hf` script in a subprocess, bad input refused before
anything runs, in one bounded line on stderr that names the file or the fix, with the right exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

CLI = os.path.join(os.path.dirname(sys.executable), "mcore2hf")


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess, code: int, *must: str, limit: int = 600) -> str:
    """The run failed with `code` and said why in one line of at most `limit` characters holding `must`."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert len(lines) == 1 and len(lines[0]) <= limit, r.stderr[-2000:]
    for text in must:
        assert text in lines[0], (text, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    good = tiny_config("qwen3").to_dict()
    cases = {"malformed": "{not json", "no_model_type": json.dumps({"hidden_size": 64}),
             "unknown": json.dumps({"model_type": "gpt2", "n_layer": 2}),
             "wrong_architectures": json.dumps({**good, "architectures": ["LlamaForCausalLM"]})}
    out = {}
    for name, text in cases.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(text)
        out[name] = str(d)
    return out


@pytest.mark.parametrize("case,must", [
    ("malformed", ["config.json is not valid JSON", "line 1"]),
    ("no_model_type", ["config.json", "no 'model_type'", "qwen3_moe"]),
    ("unknown", ["config.json", "'gpt2' has no converter", "qwen3_moe"]),
    ("wrong_architectures", ["config.json", "['LlamaForCausalLM'] disagree with model_type 'qwen3'"]),
])
def test_bad_config_is_named_in_one_line(bad_configs, case, must):
    line = one_error_line(run("plan", "--hf-config", bad_configs[case]), 1, bad_configs[case], *must)
    assert "Traceback" not in line


def test_layout_an_architecture_cannot_take_is_refused_at_once_with_the_fix():
    t = time.perf_counter()
    r = run("plan", "--hf-config", "tiny:gpt_oss", "--tp", "2", "--ep", "2")
    one_error_line(r, 2, "expert-TP 1", "pass --etp 1")
    assert time.perf_counter() - t < 60  # no worker process started (their start alone takes longer)
    help_text = run("demo", "--help").stdout
    assert "expert tensor-parallel size (default 1)" in " ".join(help_text.split())  # the demo's own default


def test_demo_refuses_a_non_empty_out_before_it_runs_and_overwrites_when_asked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    t = time.perf_counter()
    one_error_line(run("demo", "--out", str(out), "--tp", "1", "--ep", "1"), 1, str(out), "--overwrite")
    assert time.perf_counter() - t < 60 and os.listdir(out) == ["keep.txt"]
    assert "--overwrite" in run("demo", "--help").stdout


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> str:
    return make_hf_checkpoint(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("src") / "qwen3_moe")


@pytest.mark.parametrize("delay", [1.0, 4.0])
def test_ctrl_c_during_import_is_interrupted_exit_130_and_leaves_nothing(hf_source, tmp_path, delay):
    """SIGINT at any point of an import (interpreter start, imports, writing) is reported as 'interrupted', exit
    130 (not an internal error from torch's writer unwinding), and leaves no checkpoint behind."""
    target = tmp_path / "ckpt"
    proc = subprocess.Popen([CLI, "import", hf_source, str(target)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    if proc.poll() is not None:
        pytest.skip(f"the import finished within {delay} s (nothing to interrupt)")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == "mcore2hf import: interrupted", err[-2000:]
    leftovers = [f for f in (os.listdir(target) if target.exists() else []) if f.startswith("iter_")]
    assert not leftovers, leftovers
