"""The command line as a user meets it: bad input refused before anything runs, in one bounded line on stderr
that names the file or the fix, with the right exit code. Commands run through the script's own entry point in a
fresh process (`cli`: worlds.cli_run, mcore2hf.cli.main's stdout, stderr and exit code); the installed `mcore2hf`
script runs in a subprocess where the process itself is what is tested: its exit status, signals (Ctrl-C,
SIGKILL), resource limits, the umask, mount namespaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import worlds

from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

CLI = os.path.join(os.path.dirname(sys.executable), "mcore2hf")


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed script in a subprocess."""
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


cli = worlds.cli_run  # `mcore2hf *args` in a fresh process (no interpreter start, no import to pay)


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
    line = one_error_line(cli("plan", "--hf-config", bad_configs[case]), 1, bad_configs[case], *must)
    assert "Traceback" not in line


def test_layout_an_architecture_cannot_take_is_refused_before_any_worker_starts():
    """The dry run and the demo refuse gpt-oss at expert-TP 2 (the dry run's default: expert-TP = TP; the demo's
    is 1) with the fix, before a worker world starts; the installed script exits with status 2 (a usage error) and
    the same line."""
    line = one_error_line(cli("plan", "--hf-config", "tiny:gpt_oss", "--tp", "2", "--ep", "2"), 2, "expert-TP 1",
                          "pass --etp 1")
    one_error_line(cli("demo", "--model-type", "gpt_oss", "--tp", "2", "--ep", "2", "--etp", "2", workers=False), 2,
                   "expert-TP 1", "pass --etp 1")
    assert one_error_line(run("plan", "--hf-config", "tiny:gpt_oss", "--tp", "2", "--ep", "2"), 2) == line
    help_text = cli("demo", "--help").stdout
    assert "expert tensor-parallel size (default 1)" in " ".join(help_text.split())  # the demo's own default


def test_demo_refuses_a_non_empty_out_before_any_worker_starts(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = one_error_line(cli("demo", "--out", str(out), "--tp", "1", "--ep", "1", workers=False), 1, str(out),
                          "--overwrite")
    assert "overwrite=" not in line  # the command line's flag, not the Python keyword
    assert os.listdir(out) == ["keep.txt"]
    assert "--overwrite" in cli("demo", "--help").stdout


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> str:
    return make_hf_checkpoint(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("src") / "qwen3_moe")


def _stopped_when(proc: subprocess.Popen, ready, timeout: float = 300) -> bool:
    """Poll until `ready()` holds for the running `proc`, then SIGSTOP it there (waiting until it has stopped);
    False if it ended first. Where a process is when a signal arrives then depends on what it did, not on how fast
    the machine is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            proc.send_signal(signal.SIGSTOP)
            _, status = os.waitpid(proc.pid, os.WUNTRACED)
            return os.WIFSTOPPED(status)
        time.sleep(0.002)
    return False


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.parametrize("when", ["importing", "writing"])
def test_ctrl_c_during_import_is_interrupted_exit_130_and_leaves_nothing(hf_source, tmp_path, when):
    """SIGINT while the import loads its libraries (torch's library mapped into the process) or while it writes
    (its staging directory set up) is reported as 'interrupted', exit 130 (not an internal error from torch's
    writer unwinding), and leaves no checkpoint behind. The process is stopped at that point, then signalled and
    continued; a tiny import writes in milliseconds, so a run that got past the point first is run again."""
    import shutil

    target = tmp_path / "ckpt"

    def staging() -> bool:
        return os.path.isdir(target) and any(".mcore2hf-tmp-" in n and os.path.exists(target / n / ".mcore2hf-staging")
                                             for n in os.listdir(target))

    for _ in range(5):
        proc = subprocess.Popen([CLI, "import", hf_source, str(target)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        ready = (lambda pid=proc.pid: "libtorch_cpu" in _maps(pid)) if when == "importing" else staging
        if _stopped_when(proc, ready) and ready() and not (target / "latest_checkpointed_iteration.txt").exists():
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGCONT)
            try:
                out, err = proc.communicate(timeout=300)
            finally:
                proc.kill()
            break
        proc.kill()
        proc.communicate()
        shutil.rmtree(target, ignore_errors=True)
    else:
        pytest.fail(f"the import never was stopped while {when} in 5 tries")
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == "mcore2hf import: interrupted", err[-2000:]
    leftovers = [f for f in (os.listdir(target) if target.exists() else []) if f.startswith("iter_")]
    assert not leftovers, leftovers


# -- verify ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_export(hf_source, tmp_path_factory) -> dict[str, str]:
    """qwen3_moe in bf16 (the same seed as hf_source: its values rounded to bf16), imported to a Megatron checkpoint
    and exported as block-FP8 (the API the commands call; the commands themselves are timed in other tests)."""
    import torch

    from mcore2hf.importer import import_checkpoint
    from mcore2hf.offline import export_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    src16 = make_hf_checkpoint(tiny_config("qwen3_moe"), root / "src16", dtype=torch.bfloat16)
    import_checkpoint(src16, root / "ckpt", progress=False)
    export_checkpoint(root / "ckpt", root / "fp8", src16, dtype="bf16", quantize="fp8", progress=False)
    return {"src32": hf_source, "src16": src16, "fp8": str(root / "fp8"), "ckpt": str(root / "ckpt")}


def _passes(r: subprocess.CompletedProcess, *must: str) -> str:
    assert r.returncode == 0 and r.stdout.rstrip().endswith("IDENTICAL"), r.stdout[-3000:] + r.stderr[-2000:]
    for text in must:
        assert text in r.stdout, (text, r.stdout)
    return r.stdout


def _report(a: str, b: str, **kw) -> tuple[bool, str]:
    from mcore2hf.verify import compare, format_table

    r = compare(a, b, **kw)
    return r.identical, format_table(r)


def test_verify_fp8_export_against_its_bf16_source(fp8_export):
    """Each FP8 weight equals, bit for bit, the reference quantizer's of the source weight (the scale tensors are
    part of that comparison, not missing names); either side may be the FP8 one, B may be the Megatron
    checkpoint; fp8 against fp8 is exact; fp8="bound" accepts it too."""
    e = fp8_export
    _passes(cli("verify", e["fp8"], e["src16"]), "0 missing, 0 unexpected",
                  "112 x float8_e4m3fn+scale vs bfloat16, by the reference quantizer", "23 x bfloat16 vs bfloat16")
    for a, b, kw, must in [
        (e["src16"], e["fp8"], {}, "112 x bfloat16 vs float8_e4m3fn+scale, by the reference quantizer"),
        (e["fp8"], e["ckpt"], {}, "112 x float8_e4m3fn+scale vs bfloat16, by the reference quantizer"),
        (e["fp8"], e["fp8"], {}, "112 x float8_e4m3fn+scale vs float8_e4m3fn+scale, exactly"),
        (e["fp8"], e["src16"], {"fp8": "bound"}, "FP8 dequantized vs unquantized max |diff| "),
        # the fp32 source: its weights rounded to bf16 (the export's dtype) quantize to the same bytes; the bf16
        # norms and router gates are within bf16's rounding of the fp32 ones
        (e["fp8"], e["src32"], {"atol": 1e-2}, "23 x bfloat16 vs float32, in float32"),
    ]:
        same, text = _report(a, b, **kw)
        assert same and must in text and "0 missing, 0 unexpected" in text, text
    same, text = _report(e["fp8"], e["src32"])  # exact: the unquantized tensors' dtypes differ
    assert not same and "23 dtype" in text and "0 fp8 difference(s)" in text, text


def _flip(directory: str, name: str, element: int, bit: int) -> None:
    from mcore2hf.formats.hf_dir import HFDirectory

    with HFDirectory(directory) as d:
        info = d.info(name)
    with open(info.path, "r+b") as f:
        f.seek(info.offset + element)
        byte = f.read(1)[0]
        f.seek(info.offset + element)
        f.write(bytes([byte ^ (1 << bit)]))


def test_verify_names_a_corrupted_fp8_byte(fp8_export, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(fp8_export["fp8"], bad)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"  # [32, 64] float8_e4m3fn
    _flip(bad, name, 5 * 64 + 7, 0)  # the lowest mantissa bit: one FP8 step
    r = cli("verify", bad, fp8_export["src16"])
    assert r.returncode == 1 and "DIFFERENT" in r.stdout, r.stdout[-3000:]
    line = next(x for x in r.stdout.splitlines() if name in x)
    assert "1 of 2048 fp8 byte(s) and 0 of 1 scale(s) differ from the reference quantizer's" in line, line
    assert "first byte at [5, 7]" in line and "fp8 (1):" in r.stdout, r.stdout
    same, text = _report(bad, fp8_export["fp8"])  # fp8 against fp8
    assert not same and f"{name}  1 fp8 byte(s) and 0 scale(s) differ" in text, text
    _flip(bad, name, 5 * 64 + 7, 0)
    _flip(bad, name, 64 + 2, 7)  # the sign: beyond any quantization error, also for fp8="bound"
    same, text = _report(bad, fp8_export["src16"], fp8="bound")
    assert not same and name in text and "beyond half an FP8 step" in text and "first at [1, 2]" in text, text


def test_verify_truncated_file_is_named_in_one_line(fp8_export, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fp8_export["src16"], bad)
    victim = bad / "model.safetensors"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 10)
    line = one_error_line(cli("verify", str(bad), fp8_export["src16"]), 1, str(victim), "is truncated",
                          f"the file ends at byte {size - 10}", f"..{size})")
    assert "internal error" not in line and "SafetensorError" not in line


def test_verify_atol_across_dtypes_and_a_bounded_grouped_report(fp8_export):
    """bf16 against fp32: exact, every tensor differs in dtype and values (the report shows --limit of each kind
    and counts the rest); within --atol, compared in fp32 and identical; below the bf16 rounding error not."""
    e = fp8_export
    r = cli("verify", e["src16"], e["src32"], "--limit", "3")
    assert r.returncode == 1, r.stderr
    assert "135 dtype, 135 values" in r.stdout and "135 x bfloat16 vs float32, exactly" in r.stdout, r.stdout
    assert r.stdout.count("  ... and 132 more") == 2 and len(r.stdout.splitlines()) < 20, r.stdout
    out = _passes(cli("verify", e["src16"], e["src32"], "--atol", "4e-3"), "135 x bfloat16 vs float32, in float32",
                  "(atol 0.004)")
    worst = float(out.split("max |diff| ")[1].split()[0].rstrip(";"))
    assert 0 < worst <= 4e-3  # bf16 rounds these values (|x| < 2) by at most 2^-8
    same, text = _report(e["src16"], e["src32"], atol=worst / 2)
    assert not same and "by more than atol" in text, text
    one_error_line(cli("verify", e["src16"], e["src32"], "--atol", "-1"), 2, "expected a number >= 0")


def test_verify_streams_fp8_blocks_and_rows_in_bounded_runs(tmp_path, monkeypatch):
    """The same verdicts when tensors of several FP8 blocks are compared a few rows at a time (runs of whole
    blocks): a [300, 260] weight quantized by the reference quantizer, and its source."""
    import torch
    from safetensors.torch import save_file

    from mcore2hf import verify
    from mcore2hf.quantize.fp8 import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g).bfloat16()
    q, s = per_block_cast_to_fp8(w)
    norm = torch.randn(300, generator=g)
    (tmp_path / "q").mkdir()
    (tmp_path / "s").mkdir()
    save_file({"x.weight": q, "x.weight_scale_inv": s, "n": norm.bfloat16()}, tmp_path / "q" / "model.safetensors")
    save_file({"x.weight": w, "n": norm}, tmp_path / "s" / "model.safetensors")
    a, b = str(tmp_path / "q"), str(tmp_path / "s")
    whole = verify.compare(a, b, atol=1e-2, fp8="bound")
    monkeypatch.setattr(verify, "CHUNK_ELEMENTS", 300)
    runs = verify.compare(a, b, atol=1e-2, fp8="bound")
    assert runs.identical and verify.compare(a, b, atol=1e-2).identical
    assert whole.identical and runs.identical and whole.pairs == runs.pairs
    assert (runs.fp8_max_abs_diff, runs.max_abs_diff) == (whole.fp8_max_abs_diff, whole.max_abs_diff) != (0, 0)
    assert list(verify._row_runs((300, 260), 128)) == [(0, 128), (128, 256), (256, 300)]
    with open(tmp_path / "q" / "model.safetensors", "r+b") as f:  # one fp8 byte in the third block row
        from mcore2hf.formats.hf_dir import HFDirectory

        info = HFDirectory(a).info("x.weight")
        f.seek(info.offset + 270 * 260 + 3)
        byte = f.read(1)[0]
        f.seek(info.offset + 270 * 260 + 3)
        f.write(bytes([byte ^ 0x80]))
    r = verify.compare(a, b)
    assert [(n, k) for n, k, _ in r.rows] == [("n", "dtype"), ("n", "values"), ("x.weight", "fp8")], r.rows
    assert "1 of 78000 fp8 byte(s) and 0 of 9 scale(s) differ" in r.rows[2][2] and "[270, 3]" in r.rows[2][2]


def test_verify_exact_values_nan_signed_zero_integers_and_scalars(tmp_path):
    """Exact: -0.0 equals 0.0, NaN equals NaN where both hold one, NaN in one only is a difference; integers,
    bools and 0-d tensors compare exactly, also with atol."""
    import torch
    from safetensors.torch import save_file

    from mcore2hf.verify import compare

    base = {"f": torch.tensor([0.0, float("nan"), float("inf"), 1.0]), "i": torch.tensor([1, 2, 3]),
            "b": torch.tensor([True, False]), "s": torch.tensor(2.5, dtype=torch.bfloat16)}
    other = {**base, "f": torch.tensor([-0.0, float("nan"), float("inf"), 1.0])}
    for d, t in (("a", base), ("b", other)):
        (tmp_path / d).mkdir()
        save_file(t, tmp_path / d / "model.safetensors")
    assert compare(tmp_path / "a", tmp_path / "b").identical
    other.update(f=torch.tensor([0.0, 1.0, float("inf"), 1.0]), i=torch.tensor([1, 2, 4]),
                 s=torch.tensor(2.0, dtype=torch.bfloat16))
    save_file(other, tmp_path / "b" / "model.safetensors")
    r = compare(tmp_path / "a", tmp_path / "b", atol=10.0)
    assert sorted((n, k) for n, k, _ in r.rows) == [("f", "values"), ("i", "values")], r.rows
    assert "first at [1]" in dict((n, d) for n, _, d in r.rows)["f"] and r.max_abs_diff == float("inf")
    r = compare(tmp_path / "a", tmp_path / "b")
    assert sorted((n, k) for n, k, _ in r.rows) == [("f", "values"), ("i", "values"), ("s", "values")], r.rows


# -- output directories as users have them (mcore2hf.formats.paths) ---------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_ckpt(hf_source, tmp_path_factory) -> str:
    """A torch_dist checkpoint of the tiny model, written by `mcore2hf import` (what `export` reads)."""
    out = tmp_path_factory.mktemp("megatron") / "ckpt"
    r = cli("import", hf_source, str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    return str(out)


def export(ckpt: str, config: str, out, *args: str, preexec=None) -> subprocess.CompletedProcess:
    """`mcore2hf export ... --quiet`, after `preexec()` in its process (a umask, a resource limit)."""
    return cli("export", ckpt, str(out), "--hf-config", config, "--quiet", *args, preexec=preexec)


def _identity(path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_dev, st.st_mode, st.st_gid


def _umask_027():
    os.umask(0o027)


def test_export_into_an_existing_setgid_directory_keeps_it_and_the_users_files(megatron_ckpt, hf_source, tmp_path):
    """An existing directory is written into, never replaced: its inode, mode, setgid bit and group stay, the
    files get its group and the umask's mode; an overwrite replaces the earlier export's files only and names the
    user's file it kept."""
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o2770)
    if os.geteuid() == 0:  # root can give the directory another group: the files must get it, not root's
        os.chown(out, -1, 1)
    before = _identity(out)
    r = export(megatron_ckpt, hf_source, out, preexec=_umask_027)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert _identity(out) == before and before[2] & 0o2000
    files = sorted(os.listdir(out))
    assert files == ["config.json", "generation_config.json", "model-00001-of-00001.safetensors",
                     "model.safetensors.index.json"], files
    for f in files:
        st = os.stat(out / f)
        assert (st.st_mode & 0o777, st.st_gid) == (0o640, before[3]), (f, oct(st.st_mode), st.st_gid)

    (out / "README.md").write_text("mine")
    one_error_line(export(megatron_ckpt, hf_source, out), 1, str(out), "--overwrite")
    r = cli("export", megatron_ckpt, str(out), "--hf-config", hf_source, "--overwrite", "--shard-size",
            "300KB")  # notes: not --quiet
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"note: kept 1 file(s) of {out} that are not the checkpoint's: README.md" in r.stdout, r.stdout
    assert _identity(out) == before and (out / "README.md").read_text() == "mine"
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)], shards  # the old one removed
    assert not [f for f in os.listdir(out) if f.startswith(".")]


def _read_only(directory) -> None:
    """Make `directory` refuse new entries, also to root (the immutable attribute: chmod does not bind root)."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        return
    r = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"running as root, where a read-only mode does not bind, and chattr +i fails: {r.stderr.strip()}")


def _writable(directory) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        os.chmod(directory, 0o755)


def test_export_into_a_directory_whose_parent_is_read_only(megatron_ckpt, hf_source, tmp_path):
    """The output directory exists, its parent takes no new entries (a shared mount's root, a home directory's
    parent): the export is written inside it, never renamed beside it. A new directory there cannot be created:
    one line naming it, nothing left."""
    parent = tmp_path / "ro"
    (parent / "out").mkdir(parents=True)
    before = _identity(parent / "out")
    _read_only(parent)
    try:
        r = export(megatron_ckpt, hf_source, parent / "out")
        assert r.returncode == 0, r.stderr[-2000:]
        one_error_line(export(megatron_ckpt, hf_source, parent / "new"), 1, f"cannot write {parent / 'new'}", str(parent))
        assert sorted(os.listdir(parent)) == ["out"]
    finally:
        _writable(parent)
    assert _identity(parent / "out") == before and "model.safetensors.index.json" in os.listdir(parent / "out")


def _in_a_mount_namespace(ckpt: str, config: str, out: str) -> dict:
    """In a private mount namespace of this (fresh) process, as `unshare -m` makes one: a tmpfs mounted on `out`,
    the export into it; then a 256 KiB one and the export and the import onto it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x20000, 0x4000, 1 << 18
    if libc.unshare(clone_newns) or libc.mount(b"none", b"/", None, ms_rec | ms_private, None):
        raise OSError(ctypes.get_errno(), "unshare / mount --make-rprivate /")

    def mount(size):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=2775", "tmpfs", out], check=True)

    def ident():
        st = os.stat(out)
        return [st.st_ino, st.st_dev, st.st_mode]

    res = {}
    for key, size in (("fits", "8m"), ("full", "256k")):
        if key == "full":
            subprocess.run(["umount", out], check=True)
        mount(size)
        before = ident()
        rc, _, err = worlds.cli_main(["export", ckpt, out, "--hf-config", config, "--quiet"])
        res[key] = dict(rc=rc, err=err, files=sorted(os.listdir(out)), same=ident() == before)
    rc, _, err = worlds.cli_main(["import", config, os.path.join(out, "ckpt"), "--quiet"])
    res["import"] = dict(rc=rc, err=err, files=sorted(os.listdir(out)))
    return res


def test_export_into_an_empty_mount_point_and_onto_a_full_disk(megatron_ckpt, hf_source, tmp_path):
    """A tmpfs mounted on the output directory (in a private mount namespace): renaming a mount point gives
    EBUSY, so the export must write inside it; on a 256 KiB tmpfs the 1 MiB export meets a real ENOSPC: one
    line naming the directory, nothing left, the mount point as it was; the import likewise."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and unshare -m to mount a tmpfs on the output directory (the read-only-parent "
                    "test covers the never-renamed property without them)")
    out = tmp_path / "mnt"
    out.mkdir()
    res = worlds.in_fresh_process(_in_a_mount_namespace, megatron_ckpt, hf_source, str(out))
    fits, full, imp = res["fits"], res["full"], res["import"]
    assert fits["rc"] == 0 and fits["same"] and "model.safetensors.index.json" in fits["files"], fits
    assert full["rc"] == 1 and full["same"] and full["files"] == [], full
    lines = full["err"].strip().splitlines()
    assert len(lines) == 1 and f"cannot write {out}: [Errno 28] No space left on device" in lines[0], lines
    assert imp["rc"] == 1 and imp["files"] == [], imp
    lines = imp["err"].strip().splitlines()
    assert len(lines) == 1 and f"cannot write {out}/ckpt/iter_0000000: [Errno 28]" in lines[0], lines
    assert os.listdir(out) == []  # the namespace's mount is gone: the directory below it was never touched


def _file_size_limit():
    """Writes beyond 64 KiB fail with EFBIG (Python ignores SIGXFSZ, so write(2) returns the error): the same
    OSError path as a full disk, without privileges."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_write_error_is_one_line_naming_the_output_and_leaves_nothing(megatron_ckpt, hf_source, tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    before = _identity(existing)
    r = export(megatron_ckpt, hf_source, existing, preexec=_file_size_limit)
    one_error_line(r, 1, f"cannot write {existing}: [Errno 27] File too large", f"{existing} is as it was")
    assert os.listdir(existing) == [] and _identity(existing) == before
    r = export(megatron_ckpt, hf_source, tmp_path / "new", preexec=_file_size_limit)
    one_error_line(r, 1, f"cannot write {tmp_path / 'new'}: [Errno 27] File too large", "was not created")
    r = cli("import", hf_source, str(tmp_path / "ckpt"), "--quiet", preexec=_file_size_limit)
    one_error_line(r, 1, f"cannot write {tmp_path / 'ckpt' / 'iter_0000000'}: [Errno 27] File too large")
    assert sorted(os.listdir(tmp_path)) == ["existing"]


def _kill_when_staging(args: list[str], where, tries: int = 5) -> str:
    """Start `mcore2hf *args`, SIGKILL it while its staging directory exists in `where`; returns that directory.
    A tiny import writes in milliseconds, so the process is stopped (SIGSTOP) as soon as a staging directory shows,
    and killed only if that directory is still there; a run that ended or committed first is started again."""
    for _ in range(tries):
        proc = subprocess.Popen([CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            # a staging directory once it is set up (its locked marker in place): the import is writing
            found = [n for n in (os.listdir(where) if os.path.isdir(where) else []) if ".mcore2hf-tmp-" in n
                     and os.path.exists(os.path.join(where, n, ".mcore2hf-staging"))]
            if found:
                proc.send_signal(signal.SIGSTOP)
                _, status = os.waitpid(proc.pid, os.WUNTRACED)  # signals land asynchronously: wait until it stopped
                stage = os.path.join(where, found[0])
                still = os.WIFSTOPPED(status) and os.path.isdir(stage)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                if still:
                    return stage
                break
            time.sleep(0.002)
        else:
            if proc.poll() is None:
                proc.kill()
                pytest.fail("no staging directory appeared")
        proc.wait()
        _undo_completed_run(args, where)
    pytest.fail(f"mcore2hf {' '.join(args)} never was killed while staging in {tries} tries")


def _undo_completed_run(args: list[str], where) -> None:
    """Leave `where` as it was before a try that committed or was killed after its staging went (for the retry)."""
    import shutil

    where = str(where)
    if os.path.basename(where).startswith("iter_"):  # a re-import over an existing iteration: it is replaced anyway
        return
    shutil.rmtree(where, ignore_errors=True)


def test_import_killed_with_sigkill_then_run_again(hf_source, tmp_path):
    """SIGKILL leaves the staging directory; the next run removes it (one line saying so), with or without
    --overwrite, and the checkpoint directory holds nothing stale afterwards."""
    ckpt = tmp_path / "ckpt"
    stage = _kill_when_staging(["import", hf_source, str(ckpt), "--quiet"], ckpt)
    assert os.path.isdir(stage) and os.path.basename(stage).startswith(".iter_0000000.mcore2hf-tmp-")
    r = cli("import", hf_source, str(ckpt), "--quiet")
    assert r.returncode == 0 and r.stderr.splitlines() == [
        f"mcore2hf import: removed {stage}, left by an earlier run that was killed"], r.stderr[-2000:]
    assert sorted(os.listdir(ckpt)) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    files = sorted(os.listdir(ckpt / "iter_0000000"))

    stage = _kill_when_staging(["import", hf_source, str(ckpt), "--overwrite", "--quiet"], ckpt / "iter_0000000")
    r = cli("import", hf_source, str(ckpt), "--quiet")  # the earlier iteration is intact: --overwrite is needed
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"mcore2hf import: removed {stage}, left by an earlier run that was killed",
        f"mcore2hf import: error: {ckpt / 'iter_0000000'} exists (pass --overwrite to replace it)"]
    r = cli("import", hf_source, str(ckpt), "--overwrite", "--quiet")
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert sorted(os.listdir(ckpt)) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(ckpt / "iter_0000000")) == files


def test_many_problems_of_one_cause_are_one_bounded_line_naming_the_file(megatron_ckpt, hf_source, tmp_path):
    """A truncated shard makes every tensor in it unreadable: one group naming the file, not a line per tensor;
    a config that disagrees with every tensor: its causes grouped, each tensor family one pattern."""
    src = tmp_path / "sharded"
    assert export(megatron_ckpt, hf_source, src, "--shard-size", "300KB").returncode == 0
    shard = src / "model-00002-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:100_000])
    # the one HF reader checks every file against its header when it opens the directory (hf_dir.HFDirectory)
    line = one_error_line(cli("import", str(src), str(tmp_path / "c1")), 1, str(shard), "the file ends at byte 100000",
                          limit=2000)
    assert line.count(str(shard)) == 1, line
    one_error_line(cli("verify", hf_source, str(src)), 1, str(shard), "the file ends at byte 100000")
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    line = one_error_line(export(megatron_ckpt, str(tmp_path / "wide"), tmp_path / "o"), 1,
                          "model.layers.{0-3}.mlp.experts.{0-7}.gate_proj.weight: HF config implies shape [32, 96], "
                          "the checkpoint gives [32, 64]", limit=2000)
    assert sorted(os.listdir(tmp_path)) == ["sharded", "wide"], line


# -- list ----------------------------------------------------------------------------------------------------------------

def test_list_is_the_registry_at_once_in_lines_that_fit():
    """`mcore2hf list` reads the catalog only (no converter, torch or transformers import: it answers at once, not
    in 6 s), its lines fit the terminal (80 columns in a pipe); the catalog is the registry's snapshot
    (tests/test_registry_coverage.py checks that the two agree)."""
    from mcore2hf.arch.catalog import catalog

    listing = catalog()
    code = ("import sys; from mcore2hf.cli import main; main(['list']); "
            "print('IMPORTED', [m for m in ('torch', 'transformers', 'mcore2hf.arch.mapping', 'mcore2hf.arch.registry') "
            "if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "IMPORTED []", r.stdout[-500:] + r.stderr
    lines = r.stdout.strip().splitlines()[:-1]
    assert len(lines) == len(listing) + 1 and max(map(len, lines)) <= 80, max(lines, key=len)
    r = cli("list", "qwen3_vl")
    assert r.returncode == 0 and "Bridge 0.3.1's Qwen3VLModel" in r.stdout and max(map(len, r.stdout.splitlines())) <= 100
    one_error_line(cli("list", "qwen3-vl"), 2, "model_type must be one of", "'qwen3-vl'")


# -- what a new user gets wrong: another model's config, swapped arguments, two different models -----------------------

def test_a_checkpoint_of_another_architecture_is_named_as_such(hf_source, tmp_path):
    """A glm4_moe checkpoint exported with a qwen3_moe config: the error says the checkpoint is another
    architecture and which one its tensors map as (not that it has an MTP layer the config lacks), in one line."""
    glm = make_hf_checkpoint(tiny_config("glm4_moe"), tmp_path / "glm4_moe")
    assert cli("import", glm, str(tmp_path / "ckpt"), "--quiet").returncode == 0
    line = one_error_line(cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf-config", hf_source), 1,
                          "another architecture than the HF config's model_type 'qwen3_moe'", "maps as glm4_moe",
                          limit=2000)
    assert "MTP" not in line.split("Megatron parameter(s)")[0] and not (tmp_path / "out").exists()


def test_swapped_arguments_get_the_order_that_works(hf_source, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert cli("import", hf_source, str(ckpt), "--quiet").returncode == 0
    for args, must in ((("export", hf_source, str(tmp_path / "out"), "--hf-config", hf_source),
                        ["CKPT_DIR", "is an HF directory", "swapped", "mcore2hf import HF_DIR CKPT_DIR"]),
                       (("import", str(ckpt), str(tmp_path / "out")),
                        ["HF_DIR", "is a Megatron checkpoint", "swapped", "mcore2hf export CKPT_DIR OUT_DIR"]),
                       (("verify", str(ckpt), hf_source), ["swapped", f"mcore2hf verify {hf_source} {ckpt}"])):
        one_error_line(cli(*args), 2, *must)
    assert not (tmp_path / "out").exists()


def test_verify_names_two_different_models(tmp_path):
    """Two models of different types: the report names both types; where no tensor could be compared by value
    (every common name differs in shape) it says so instead of a max |diff| of 0."""
    import torch
    from safetensors.torch import save_file

    for name, model_type, n in (("a", "qwen3", 2), ("b", "llama", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": model_type}))
        save_file({"model.norm.weight": torch.ones(n)}, str(tmp_path / name / "model.safetensors"))
    r = cli("verify", str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.returncode == 1 and "different models: A is qwen3, B is llama" in r.stdout, r.stdout
    assert "max |diff|" not in r.stdout and "no values compared" in r.stdout, r.stdout


def test_every_command_help_shows_examples():
    for cmd in ("demo", "list", "plan", "export", "import", "verify"):
        text = cli(cmd, "--help").stdout
        assert "examples:\n" in text and f"\n  mcore2hf {cmd}" in text, (cmd, text[-500:])
    assert "COMMAND --help" in cli("--help").stdout
