"""mcore2hf.formats.hf_dir, the one reader of HF directories, against the safetensors library (0.8, the format's own
reader) and transformers 5.24's save_pretrained (the writer of published checkpoints): unsharded and sharded
directories read back bit for bit, whole and sliced; a damaged directory is refused when it is opened, with the
file (and for a truncated file the byte range) named."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import safetensors
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import mcore2hf.formats.hf_dir as hf_dir
from mcore2hf.errors import HFDirectoryError, Mcore2HFError
from mcore2hf.formats.hf_dir import HFDirectory, read_all
from mcore2hf.runtime.tiny import randomize_, tiny_config


def test_pinned_versions():
    assert safetensors.__version__.startswith("0.") and transformers.__version__ == "5.24.0"


def _save(cfg_name: str, out, **kw) -> str:
    model = AutoModelForCausalLM.from_config(tiny_config(cfg_name), dtype=torch.float32)
    randomize_(model, 0)
    model.to(torch.bfloat16).save_pretrained(out, **kw)
    return str(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfdirs")
    return {"single": _save("qwen3", root / "single"), "sharded": _save("qwen3", root / "sharded", max_shard_size="40KB")}


def _oracle(path: str) -> dict[str, tuple[str, torch.Tensor]]:
    """{name: (file, tensor)} as the safetensors library reads every *.safetensors file of the directory."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            for name, t in load_file(os.path.join(path, f)).items():
                out[name] = (f, t)
    return out


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_reads_what_transformers_wrote_bit_for_bit(dirs, kind):
    path = dirs[kind]
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json")) == (kind == "sharded")
    want = _oracle(path)
    files = {f for f, _ in want.values()}
    assert len(files) == 1 if kind == "single" else len(files) > 2
    with HFDirectory(path) as d:
        assert sorted(d.names()) == sorted(want)
        for name, (f, t) in want.items():
            info = d.info(name)
            assert (info.file, info.shape, info.dtype) == (f, tuple(t.shape), t.dtype), name
            assert torch.equal(d.read(name), t), name
    got = read_all(path)
    assert all(torch.equal(got[n], t) for n, (_, t) in want.items())


def test_slices_equal_the_safetensors_slices(dirs, tmp_path, monkeypatch):
    path = dirs["sharded"]
    with HFDirectory(path) as d:
        name = next(n for n in d.names() if len(d.info(n).shape) == 2 and d.info(n).shape[1] > 8)
        info = d.info(name)
        with safe_open(info.path, "pt") as f:
            ref = f.get_slice(name)
            rows, cols = info.shape
            keys = [(slice(1, rows - 1),), (slice(None), slice(3, cols - 2)), (slice(2, 5), slice(1, 7)), (3,),
                    (slice(None),)]
            # runs of whole rows, a few rows, within a row; each row's selection read on its own
            for chunk, run in ((hf_dir.CHUNK_BYTES, 1 << 30), (3 * cols * 2, 1 << 30), (5, 1 << 30), (5, 2)):
                monkeypatch.setattr(hf_dir, "CHUNK_BYTES", chunk)
                monkeypatch.setattr(hf_dir, "RUN_BYTES", run)
                lazy = d.slice(name)
                assert lazy.get_shape() == list(info.shape) and lazy.dtype == torch.bfloat16
                for k in keys:
                    assert torch.equal(lazy[k], ref[k]), (chunk, k)
    stacked = torch.arange(4 * 6 * 10, dtype=torch.float32).view(4, 6, 10)  # gpt-oss style [E, ...]
    save_file({"e": stacked}, tmp_path / "model.safetensors")
    with HFDirectory(tmp_path) as d:
        for chunk, run in ((1 << 20, 1 << 30), (50, 1 << 30), (7, 1 << 30), (1 << 20, 4)):
            monkeypatch.setattr(hf_dir, "CHUNK_BYTES", chunk)
            monkeypatch.setattr(hf_dir, "RUN_BYTES", run)
            assert torch.equal(d.slice("e")[2:3, :, 4:9], stacked[2:3, :, 4:9])
            assert torch.equal(d.slice("e")[1, 2:4], stacked[1, 2:4])


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _refused(path, *needles: str) -> HFDirectoryError:
    with pytest.raises(HFDirectoryError) as e:
        HFDirectory(path)
    text = str(e.value)
    for needle in needles:
        assert needle in text, (needle, text)
    assert isinstance(e.value, Mcore2HFError)
    return e.value


def _shards(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_truncated_file_is_named_with_its_byte_range(dirs, tmp_path, kind):
    path = _copy(dirs[kind], tmp_path / "d")
    victim = os.path.join(path, _shards(path)[-1])
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the format's own reader refuses it too (its own error)
        safe_open(victim, "pt")
    e = _refused(path, victim, "is truncated", f"the file ends at byte {size - 100}", f"..{size}")
    assert e.path == path or e.path == victim
    with open(victim, "r+b") as f:
        f.truncate(5)
    _refused(path, victim, "shorter than the 8-byte header length")


def test_extra_bytes_and_bad_headers_are_refused(dirs, tmp_path):
    path = _copy(dirs["single"], tmp_path / "d")
    victim = os.path.join(path, "model.safetensors")
    with open(victim, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(Exception):  # noqa: B017, PT011 - safetensors refuses trailing bytes as well
        safe_open(victim, "pt")
    _refused(path, victim, "16 bytes after its last tensor")
    with open(victim, "r+b") as f:
        f.seek(8)
        f.write(b"#")
    _refused(path, victim, "not valid JSON")


def test_index_naming_a_missing_file(dirs, tmp_path):
    path = _copy(dirs["sharded"], tmp_path / "d")
    gone = _shards(path)[0]
    os.remove(os.path.join(path, gone))
    _refused(path, os.path.join(path, gone), "does not exist", "model.safetensors.index.json")


def test_tensor_in_two_files(dirs, tmp_path):
    path = _copy(dirs["sharded"], tmp_path / "d")
    first, second = _shards(path)[:2]
    a, b = load_file(os.path.join(path, first)), load_file(os.path.join(path, second))
    name = sorted(a)[0]
    save_file({**b, name: a[name]}, os.path.join(path, second), metadata={"format": "pt"})
    _refused(path, f"tensor {name} is in 2 files", os.path.join(path, first), os.path.join(path, second))


def test_index_and_headers_disagree(dirs, tmp_path):
    path = _copy(dirs["sharded"], tmp_path / "d")
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    first, second = _shards(path)[:2]
    name = next(n for n, f in index["weight_map"].items() if f == first)
    moved = {**index, "weight_map": {**index["weight_map"], name: second}}  # the index points at the wrong file
    with open(index_path, "w") as f:
        json.dump(moved, f)
    _refused(path, f"{os.path.join(path, first)} holds tensor {name}, which", f"maps to {second}")
    unlisted = {**index, "weight_map": {n: f for n, f in index["weight_map"].items() if n != name}}
    with open(index_path, "w") as f:
        json.dump(unlisted, f)
    _refused(path, f"holds tensor {name}, which", "does not list")
    with open(index_path, "w") as f:
        json.dump({**index, "weight_map": {**index["weight_map"], "ghost.weight": first}}, f)
    _refused(path, "ghost.weight", "whose header lacks it")
    with open(index_path, "w") as f:
        json.dump({**index, "weight_map": {**index["weight_map"], name: "../elsewhere.safetensors"}}, f)
    _refused(path, "'../elsewhere.safetensors'", "expected a file name in the directory")


def test_not_a_directory_or_no_weights(tmp_path):
    _refused(tmp_path / "nope", "is not a directory")
    _refused(tmp_path, "not an HF directory", "neither model.safetensors.index.json nor model.safetensors")


def test_many_problems_in_one_error(dirs, tmp_path):
    path = _copy(dirs["sharded"], tmp_path / "d")
    shards = _shards(path)
    os.remove(os.path.join(path, shards[0]))
    with open(os.path.join(path, shards[1]), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, shards[1])) - 1)
    e = _refused(path, "2 problems", os.path.join(path, shards[0]), os.path.join(path, shards[1]))
    assert len(e.problems) == 2
