"""Output directories and the CLI never lose or silently corrupt data, and fail in one clear line.

Fast tests (no Megatron world): sizes, the CLI's argument handling, the safetensors writer's guards, config.json
as the user wrote it, `mcore2hf verify` on HF directories. Checkpoint-based cases are in test_offline."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import worlds
from safetensors.torch import save_file
from test_senders import make_bucket

from mcore2hf.arch.hf_config import config_source, output_config
from mcore2hf.cli import build_parser
from mcore2hf.errors import Mcore2HFError
from mcore2hf.formats.safetensors import SafetensorsWriter, TensorInfo, check_target
from mcore2hf.runtime.tiny import tiny_config
from mcore2hf.sizes import parse_size

cli = worlds.cli_run  # `mcore2hf *args` in a fresh process


def test_sizes_in_every_usual_spelling():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("5GiB") == parse_size("5G") == parse_size("5 gib") == 5 * 2**30
    assert parse_size("512MB") == 512 * 10**6 and parse_size("512M") == 512 * 2**20
    assert parse_size("1.5KiB") == 1536 and parse_size("123") == 123 and parse_size(7) == 7
    for bad in ("garbage", "5X", "0", "-1", "", "GB", True, 0):
        with pytest.raises(ValueError, match="expected"):
            parse_size(bad)


def test_cli_imports_no_torch_and_answers_help_and_version():
    code = ("import sys, mcore2hf.cli as c\n"
            "try:\n    c.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("mcore2hf 0.")


def test_every_flag_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"mcore2hf {name} {action.option_strings or action.dest} has no help text"


def _one_line_error(r, code: int, *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_usage_errors_are_one_line_exit_2_and_create_nothing(tmp_path):
    for flag, value in (("--shard-size", "garbage"), ("--shard-size", "5X"), ("--bucket-size", "0")):
        r = cli("export", tmp_path / "ckpt", tmp_path / "out", "--hf-config", tmp_path, flag, value)
        _one_line_error(r, 2, flag, value)
    assert os.listdir(tmp_path) == []
    _one_line_error(cli("plan", "--hf-config", "tiny:qwen3_moe", "--ep", "3"), 2, "--ep 3 does not divide the 8 experts")
    _one_line_error(cli("plan", "--hf-config", "tiny:qwen3_moe", "--pp", "3"), 2, "--first-stage-layers")
    _one_line_error(cli("plan", "--hf-config", "tiny:qwen3_moe", "--dtype", "int3"), 2, "--dtype")
    _one_line_error(cli("plan", "--hf-config", "tiny:nope"), 2, "--model-type must be one of")
    _one_line_error(cli("demo", "--model-type", "gpt2"), 2, "gpt2")


def test_cli_runtime_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    tiny_config("qwen3_moe").save_pretrained(cfg_dir)
    r = cli("export", tmp_path / "nockpt", tmp_path / "out", "--hf-config", cfg_dir)
    _one_line_error(r, 1, "is not a directory")
    r = cli("--debug", "export", tmp_path / "nockpt", tmp_path / "out", "--hf-config", cfg_dir)
    assert r.returncode != 0 and "Traceback" in r.stderr
    r = cli("verify", tmp_path / "nope", cfg_dir)
    _one_line_error(r, 1, "not an HF directory")


# -- the writer: overlap, overwrite, permissions, stale temporary directories --------------------------------------

def _write(out, tensors, config=None, **kw) -> SafetensorsWriter:
    w = SafetensorsWriter(out, [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], config, **kw)
    w.send(make_bucket(tensors))
    w.finish()
    return w


def test_output_may_not_overlap_an_input(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000007").mkdir(parents=True)
    (ckpt / "iter_0000007" / "a.distcp").write_text("weights")
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    for out in (ckpt, ckpt / "iter_0000007", ckpt / "sub", tmp_path, link, link / "x"):
        with pytest.raises(Mcore2HFError, match="overlaps the input"):
            check_target(out, True, [ckpt])
    with pytest.raises(Mcore2HFError, match="overlaps the input"):
        check_target(ckpt, True, [link])
    check_target(tmp_path / "elsewhere", True, [ckpt])
    assert (ckpt / "iter_0000007" / "a.distcp").read_text() == "weights"


def test_overwrite_replaces_only_an_hf_directory(tmp_path):
    t = {"w": torch.ones(2, 3)}
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(Mcore2HFError, match="not an HF directory"):
        _write(home, t, overwrite=True)
    assert (home / "notes.txt").read_text() == "mine"
    out = tmp_path / "out"
    _write(out, t, tiny_config("llama"))
    _write(out, {"w": torch.zeros(2, 3)}, tiny_config("llama"), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["home", "out"]


def test_output_directory_honours_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        _write(tmp_path / "out", {"w": torch.ones(2)}, tiny_config("llama"))
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "out" / "config.json").stat().st_mode & 0o777 == 0o644


_STAGE = ("import sys, time\nfrom mcore2hf.formats.paths import Staging\nfrom mcore2hf.formats.safetensors import HF_OUTPUT\n"
          "s = Staging(sys.argv[1], HF_OUTPUT)\nopen(s.path + '/model-00001-of-00001.safetensors', 'wb').write(b'x')\n"
          "print(s.path, flush=True)\ntime.sleep(600)\n")


def _staging_process(target) -> tuple[subprocess.Popen, str]:
    """A process that stages an output for `target` and waits: (the process, its staging directory)."""
    proc = subprocess.Popen([sys.executable, "-c", _STAGE, str(target)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_staging_directories_of_killed_writers_are_removed_and_live_ones_block(tmp_path, caplog):
    """A writer killed with SIGKILL leaves its staging directory (beside a new target, inside an existing one):
    the next write removes it (one log line each); one whose writer still runs is an error naming it; a directory
    without our locked marker is never touched."""
    import signal

    for target in (tmp_path / "new", tmp_path / "existing"):
        if target.name == "existing":
            target.mkdir()
        proc, stage = _staging_process(target)
        assert os.path.isdir(stage) and (stage.startswith(str(target) + "/.mcore2hf-tmp-") if target.exists()
                                         else os.path.basename(stage).startswith(f".{target.name}.mcore2hf-tmp-"))
        with pytest.raises(Mcore2HFError, match=f"{stage} is in use by process {proc.pid}"):
            _write(target, {"w": torch.ones(2)})
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert os.path.isdir(stage)  # what a killed run leaves
        with caplog.at_level("WARNING", logger="mcore2hf.paths"):
            _write(target, {"w": torch.ones(2)})
        assert not os.path.exists(stage) and f"removed {stage}" in caplog.text
        assert sorted(os.listdir(target)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    foreign = tmp_path / ".other.mcore2hf-tmp-1-abc"  # named like ours, no marker: not ours
    foreign.mkdir()
    _write(tmp_path / "other", {"w": torch.ones(2)})
    assert foreign.exists()
    # killed between its mkdir and its marker: a dead pid, only the unfinished marker, older than a minute
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 120
    cases = {"abandoned": (".mcore2hf-staging.new", old), "fresh": (None, time.time()), "content": ("x", old)}
    for name, (content, mtime) in cases.items():
        stage = tmp_path / f".{name}.mcore2hf-tmp-{dead.pid}-abcd"
        stage.mkdir()
        if content:
            (stage / content).write_bytes(b"")
        os.utime(stage, (mtime, mtime))
        _write(tmp_path / name, {"w": torch.ones(2)})
        assert stage.exists() == (name != "abandoned"), name


def test_bad_shard_size_creates_nothing(tmp_path):
    with pytest.raises(ValueError, match="expected"):
        SafetensorsWriter(tmp_path / "out", [TensorInfo("w", (2,), torch.float32)], max_shard_size="5X")
    assert os.listdir(tmp_path) == []


# -- config.json as the user wrote it --------------------------------------------------------------------------------

def _transformers4_style_config(path) -> dict:
    """A Qwen3-MoE config.json as transformers 4.x writes it (num_experts, rope_theta, torch_dtype), keys in an
    order transformers would not produce, plus a published-style fp8 quantization_config."""
    d = tiny_config("qwen3_moe").to_dict()
    raw = {"torch_dtype": "float32", "num_experts": 8, "rope_theta": 1000000.0, "model_type": "qwen3_moe",
           "architectures": ["Qwen3MoeForCausalLM"]}
    for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "max_position_embeddings", "rms_norm_eps",
              "tie_word_embeddings"):
        raw[k] = d[k]
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return raw


def test_config_json_is_written_as_given(tmp_path):
    raw = _transformers4_style_config(tmp_path / "src")
    text, notes = output_config(config_source(tmp_path / "src"), torch.bfloat16)
    out = json.loads(text)
    want = {k: v for k, v in raw.items() if k != "quantization_config"}
    want["torch_dtype"] = "bfloat16"
    assert list(out.items()) == list(want.items())  # names, order and values; only the dtype value changed
    assert len(notes) == 1 and "quantization_config" in notes[0] and "fp8" in notes[0]
    # the key spelling of the input is kept
    raw2 = {k if k != "torch_dtype" else "dtype": v for k, v in raw.items()}
    with open(tmp_path / "src" / "config.json", "w") as f:
        json.dump(raw2, f)
    out = json.loads(output_config(config_source(tmp_path / "src"), torch.float32)[0])
    assert out["dtype"] == "float32" and "torch_dtype" not in out
    # an object loaded from that directory and unchanged is the user's file too
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tmp_path / "src")
    assert config_source(cfg).raw == raw2
    cfg.hidden_size = 128  # changed since: written as transformers writes the object
    assert config_source(cfg).raw is None


def test_writer_drops_quantization_config_and_logs_it(tmp_path, caplog):
    _transformers4_style_config(tmp_path / "src")
    with caplog.at_level("WARNING", logger="mcore2hf"):
        w = _write(tmp_path / "out", {"w": torch.ones(2, dtype=torch.bfloat16)}, config_source(tmp_path / "src"))
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in out and out["num_experts"] == 8 and out["rope_theta"] == 1e6
    assert w.notes and "quantization_config" in caplog.text


# -- verify -----------------------------------------------------------------------------------------------------------

def test_verify_two_hf_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ta = {"x": torch.arange(6.0).view(2, 3), "y": torch.ones(4), "z": torch.zeros(2)}
    for d, t in ((a, ta), (b, dict(ta))):
        d.mkdir()
        save_file(t, d / "model.safetensors")
    r = cli("verify", a, b)
    assert r.returncode == 0 and "IDENTICAL" in r.stdout, r.stdout + r.stderr
    tb = {"x": ta["x"].clone(), "y": ta["y"].to(torch.bfloat16), "w": torch.ones(1)}
    tb["x"][1, 2] += 0.5
    save_file(tb, b / "model.safetensors")
    r = cli("verify", a, b)
    assert r.returncode == 1, r.stdout + r.stderr
    for needle in ("z  ", "missing", "w  ", "unexpected", "dtype", "max |diff| 5.000e-01", "DIFFERENT"):
        assert needle in r.stdout, (needle, r.stdout)
    r = cli("verify", a, b, "--atol", "1")  # dtypes and values within atol agree; the names still differ
    assert r.returncode == 1 and "0 dtype, 0 values" in r.stdout and "1 missing, 1 unexpected" in r.stdout, r.stdout


def test_library_logging_is_silent_unless_configured():
    code = ("import logging, mcore2hf\n"
            "logging.getLogger('mcore2hf').warning('dropped the source config\\'s quantization_config')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    code += "logging.basicConfig()\nlogging.getLogger('mcore2hf').warning('now shown')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "now shown" in r.stderr and "quantization_config" not in r.stderr


def test_name_filter_keeps_whole_megatron_tensors():
    from mcore2hf.arch.naming import NameFilter, filter_outputs

    outs = [("qkv", ("q", "k", "v"), ()), ("emb", ("model.embed_tokens.weight",), ("model.layers.4.embed_tokens.weight",)),
            ("norm", ("model.norm.weight",), ())]
    assert filter_outputs(NameFilter(exclude=(r"^model\.layers\.4\.",)), outs) == {"qkv": (), "emb": (), "norm": ()}
    assert filter_outputs(NameFilter(include=(r"embed",)), outs) == {"emb": ("model.layers.4.embed_tokens.weight",)}
    with pytest.raises(ValueError, match=r"qkv -> \['q', 'k', 'v'\] \(kept: \['q', 'v'\]\)"):
        filter_outputs(NameFilter(exclude=("^k$",)), outs)
    with pytest.raises(ValueError, match="keeps no HF tensor"):
        filter_outputs(NameFilter(include=("nothing",)), outs)
    # an MTP draft's pass keeps the embedding's copy alone (not the target's embedding): only with copies_alone
    copy = NameFilter(include=(r"^model\.layers\.4\.",))
    with pytest.raises(ValueError, match=r"kept: \[\]"):
        filter_outputs(copy, outs)
    assert filter_outputs(copy, outs, copies_alone=True) == {"emb": ("model.layers.4.embed_tokens.weight",)}
    with pytest.raises(ValueError, match="not a regular expression"):
        NameFilter(include=("(",))
