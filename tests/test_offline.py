"""Offline export of Megatron torch_dist checkpoints (written by real models in gloo worlds, with Adam state)
equals, tensor for tensor and bit for bit, what HFExporter produces from the live model."""

import json
import os
import shutil

import pytest
import torch
import worlds
from oracle import logit_problems

from mcore2hf.errors import ConfigMismatchError, Mcore2HFError, ShapeMismatchError
from mcore2hf.offline import CheckpointError, export_checkpoint
from mcore2hf.runtime.tiny import read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world, same_on_every_rank

ARCHS = ["qwen3_moe", "glm4_moe", "deepseek_v3", "llama", "gpt_oss", "minimax_m2"]
ETP1_ONLY = {"gpt_oss"}  # expert biases: megatron-core builds them only at expert-TP 1
CASES = [  # (layout, singleton_local_shards, trained: worlds.as_trained)
    (Layout(tp=2, pp=2, ep=2, etp=1), False, False),
    (Layout(pp=2, vpp=2, ep=2, etp=1), False, False),
    # singleton_local_shards: per-expert keys, GLU fc1 saved as _w / _v; a bf16 model in megatron-core's
    # Float16Module and DistributedDataParallel with its DistributedOptimizer over 2 data-parallel ranks
    (Layout(tp=2, ep=2, etp=2), True, True),
]


def assert_same(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {bad[:5]}"


@pytest.fixture(scope="module")
def saved(ckpts, tmp_path_factory):
    """Per case: root with <arch>/ckpt (torch_dist + optimizer) and <arch>/live (HFExporter.save_pretrained)."""
    out = {}
    for layout, singleton, trained in CASES:
        root = tmp_path_factory.mktemp(f"dist-{layout}")
        source = {mt: ckpts[mt] for mt in ARCHS if layout.expert_tp == 1 or mt not in ETP1_ONLY}
        per_rank = run_world(worlds.for_each_arch, layout, worlds.save_dist_checkpoint, source, layout, str(root), 7,
                             singleton, "gpt", None, trained)
        # the model Megatron saved holds what mcore2hf loaded: its forward is transformers' (the oracle)
        problems = logit_problems([{mt: r.pop("logits") for mt, r in res.items()} for res in per_rank], source,
                                  worlds.TOKENS, str(layout))
        res = same_on_every_rank(per_rank)
        assert not problems, "\n".join(problems)
        out[(str(layout), singleton)] = {mt: r["base"] for mt, r in res.items()}
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{lay}{'-singleton' if s else ''}{'-trained' if t else ''}"
                                              for lay, s, t in CASES])
def test_offline_export_equals_live_export(case, saved, ckpts, tmp_path):
    """The offline export of each checkpoint equals the live export of the model that saved it and the HF
    source, bit for bit; a model trained as Megatron-LM does (bf16 in Float16Module and DDP, the distributed
    optimizer's state in the checkpoint) exports through its wrappers, live and offline, the source's bf16
    values."""
    layout, singleton, trained = case
    for mt, base in saved[(str(layout), singleton)].items():
        out = tmp_path / mt
        report = export_checkpoint(os.path.join(base, "ckpt"), out, ckpts[mt], progress=False)
        assert report.ignored_keys > 0  # the optimizer state is there and skipped
        got, src = read_hf_checkpoint(out), read_hf_checkpoint(ckpts[mt])
        assert_same(got, read_hf_checkpoint(os.path.join(base, "live")), f"{mt} {layout}")
        if trained:  # Float16Module's cast: every weight bf16, the router's expert bias (HF keeps it in fp32)
            # bf16-rounded and turned back to fp32 by megatron-core's router (moe/router.py, as Megatron saves it)
            assert {t.dtype for n, t in got.items() if n.endswith(".weight")} == {torch.bfloat16}, mt
            src = {n: t.to(torch.bfloat16).to(got[n].dtype) for n, t in src.items()}
        assert_same(got, src, f"{mt} {layout} vs source")


def _zero_checkpoint(cfg, out) -> str:
    """An HF directory of `cfg` whose tensors (the names and shapes transformers gives the model, bf16) are zeros:
    for a size, not for values."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        names = {n: p.shape for n, p in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    os.makedirs(out)
    cfg.save_pretrained(out)
    save_file({n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in names.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_offline_export_memory_is_bounded_by_the_bucket_not_the_checkpoint(tmp_path):
    """Peak RSS of `export` (docs/offline.md: near one bucket, whatever the model size), measured: two
    checkpoints of 4 and 10 layers (qwen3 with hidden 1024, bf16; imported by `mcore2hf import`), exported with
    8 MiB buckets in one fresh process. The export of the larger one raises the peak by under a quarter of its
    size, and by no more than the smaller one's (give or take an eighth of the size difference): the growth
    follows the bucket, not the checkpoint (measured 2026-11-28 on the 2-core machine: 31 and 24 MiB for
    checkpoints of 84 and 186 MiB)."""
    from mcore2hf.importer import import_checkpoint

    sizes, exports = [], []
    for layers in (4, 10):
        cfg = tiny_config("qwen3", hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
                          vocab_size=4096, num_attention_heads=16, num_key_value_heads=4, head_dim=64)
        src = _zero_checkpoint(cfg, tmp_path / f"src{layers}")
        import_checkpoint(src, tmp_path / f"ckpt{layers}", progress=False)
        sizes.append(sum(f.stat().st_size for f in (tmp_path / f"ckpt{layers}").rglob("*") if f.is_file()))
        exports.append((str(tmp_path / f"ckpt{layers}"), str(tmp_path / f"out{layers}"), src))
    growth = worlds.in_fresh_process(worlds.export_peak_growth, exports, 8 << 20)
    print(f"offline export peak RSS growth: {[g >> 20 for g in growth]} MiB for checkpoints of "
          f"{[s >> 20 for s in sizes]} MiB (8 MiB buckets)")
    assert growth[1] < sizes[1] / 4, (growth, sizes)
    assert growth[1] - growth[0] < (sizes[1] - sizes[0]) / 8, (growth, sizes)


def test_cli_export_dtype_iteration_and_tokenizer_files(saved, ckpts, tmp_path):
    base = saved[(str(CASES[0][0]), False)]["glm4_moe"]
    hf_dir = tmp_path / "hfcfg"
    shutil.copytree(ckpts["glm4_moe"], hf_dir)
    (hf_dir / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    out = tmp_path / "bf16"
    r = worlds.cli_run("export", os.path.join(base, "ckpt"), str(out),
                       "--hf-config", str(hf_dir), "--iteration", "7", "--dtype", "bf16", "--shard-size", "100KB",
                       "--bucket-size", "64KiB")
    assert r.returncode == 0, r.stderr
    assert "peak RSS" in r.stdout
    got, ref = read_hf_checkpoint(out), read_hf_checkpoint(ckpts["glm4_moe"])
    assert set(got) == set(ref)
    for k, v in ref.items():
        want = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        assert got[k].dtype == want, k
        assert torch.equal(got[k], v.to(want)), k
    assert (out / "tokenizer_config.json").is_file()
    assert len(list(out.glob("*.safetensors"))) > 3


def test_errors(saved, ckpts, tmp_path):
    base = saved[(str(CASES[0][0]), False)]["qwen3_moe"]
    ckpt = os.path.join(base, "ckpt")
    cfg = ckpts["qwen3_moe"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a Megatron checkpoint"):
        export_checkpoint(tmp_path / "empty", tmp_path / "o1", cfg, progress=False)
    with pytest.raises(CheckpointError, match=r"iteration 99 not found .*present: \['iter_0000007'\]"):
        export_checkpoint(ckpt, tmp_path / "o2", cfg, iteration=99, progress=False)
    with pytest.raises(ShapeMismatchError, match=r"linear_qkv.weight .*expected"):
        export_checkpoint(ckpt, tmp_path / "o3", tiny_config("qwen3_moe", num_key_value_heads=4), progress=False)
    with pytest.raises(ConfigMismatchError, match="HF config has 16 experts"):
        export_checkpoint(ckpt, tmp_path / "o4", tiny_config("qwen3_moe", num_experts=16), progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    with pytest.raises(Mcore2HFError, match="exists and is not empty"):
        export_checkpoint(ckpt, busy, cfg, progress=False)
    with pytest.raises(Mcore2HFError, match="not an HF directory"):  # overwrite replaces only an HF directory
        export_checkpoint(ckpt, busy, cfg, overwrite=True, progress=False)
    assert (busy / "x").read_text() == "keep"
    (busy / "config.json").write_text("{}")  # an earlier export
    (busy / "model-00001-of-00003.safetensors").write_text("old")  # a shard of it the new export does not write
    r = export_checkpoint(ckpt, busy, cfg, overwrite=True, progress=False)
    assert (busy / "x").read_text() == "keep" and not (busy / "model-00001-of-00003.safetensors").exists()
    assert r.notes == [f"kept 1 file(s) of {busy} that are not the checkpoint's: x"]  # the user's file, named

    # truncated and corrupt shards: a clear error, and nothing left behind
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    it = broken / "iter_0000007"
    md = FileSystemReader(str(it)).read_metadata()
    model_chunks = [md.storage_data[MetadataIndex(k, c.offsets)] for k, v in md.state_dict_metadata.items()
                    if k.startswith("decoder.") and hasattr(v, "chunks") for c in v.chunks]
    cut = max(model_chunks, key=lambda i: i.length)  # cut through a model weight, not optimizer state
    victim = it / cut.relative_path
    data = victim.read_bytes()
    victim.write_bytes(data[: cut.offset + cut.length // 2])
    with pytest.raises(CheckpointError, match="is truncated"):
        export_checkpoint(broken, tmp_path / "o5", cfg, progress=False)
    # zeros over the chunk's zip local header and data.pkl (the first bytes after its 30-byte fixed header): a chunk
    # the export reads, so the damage must be found (bytes of chunks it does not read, optimizer state, need not be)
    victim.write_bytes(data[:cut.offset + 30] + bytes(256) + data[cut.offset + 286:])
    with pytest.raises(CheckpointError, match="is corrupt"):
        export_checkpoint(broken, tmp_path / "o6", cfg, progress=False)
    # one flipped byte inside the largest model chunk's tensor data: only the CRC32 can tell
    big = cut
    path = it / big.relative_path
    raw = bytearray(data if path == victim else path.read_bytes())
    raw[big.offset + big.length // 2] ^= 0xFF  # the data entry dominates a large chunk
    path.write_bytes(bytes(raw))
    if path != victim:
        victim.write_bytes(data)
    with pytest.raises(CheckpointError, match="CRC32 mismatch"):
        export_checkpoint(broken, tmp_path / "o7", cfg, progress=False)
    assert not (tmp_path / "o5").exists() and not (tmp_path / "o6").exists() and not (tmp_path / "o7").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".o")], os.listdir(tmp_path)
    assert os.listdir(tmp_path / "empty") == []


def _listing(root) -> dict:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}


def test_output_overlapping_the_checkpoint_is_refused_before_anything_is_touched(saved, ckpts, tmp_path):
    base = saved[(str(CASES[0][0]), False)]["llama"]
    work = tmp_path / "work"
    shutil.copytree(base, work)
    ckpt = work / "ckpt"
    before = _listing(work)
    (tmp_path / "link").symlink_to(ckpt)
    for out in (ckpt, ckpt / "iter_0000007", ckpt / "new", work, tmp_path / "link", tmp_path / "link" / "x"):
        with pytest.raises(Mcore2HFError, match="overlaps the input"):
            export_checkpoint(ckpt, out, ckpts["llama"], overwrite=True, progress=False)
        with pytest.raises(Mcore2HFError, match="overlaps the input"):
            export_checkpoint(tmp_path / "link", out, ckpts["llama"], overwrite=True, progress=False)
        if os.path.realpath(out) not in (str(ckpt / "new"), str(ckpt / "x")):  # siblings of iter_* do not overlap it
            r = worlds.cli_run("export", str(ckpt / "iter_0000007"), str(out), "--hf-config", ckpts["llama"],
                               "--overwrite")
            assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "overlaps" in r.stderr, r.stderr
    assert _listing(work) == before
    with pytest.raises(Mcore2HFError, match="overlaps the input"):  # the HF config directory is an input too
        export_checkpoint(ckpt, os.path.join(ckpts["llama"], "out"), ckpts["llama"], progress=False)


def test_every_config_mismatch_is_reported_before_anything_is_written(saved, ckpts, tmp_path):
    base = saved[(str(CASES[0][0]), False)]
    ckpt = os.path.join(base["qwen3_moe"], "ckpt")
    with pytest.raises(ShapeMismatchError) as e:
        export_checkpoint(ckpt, tmp_path / "o1", tiny_config("qwen3_moe", hidden_size=96, moe_intermediate_size=48),
                          progress=False)
    for needle in ("model.embed_tokens.weight", "model.layers.{0-3}.mlp.experts.{0-7}.gate_proj.weight", "[48, 96]"):
        assert needle in str(e.value), str(e.value)
    assert len(str(e.value)) < 2000, str(e.value)  # 123 problems of 8 causes: grouped (errors.problem_list)
    glm = os.path.join(base["glm4_moe"], "ckpt")
    with pytest.raises(ShapeMismatchError, match=r"model.layers.0.mlp.gate_proj.weight: HF config implies shape \[128, 64\]"):
        export_checkpoint(glm, tmp_path / "o2", tiny_config("glm4_moe", intermediate_size=128), progress=False)
    # rows beyond vocab_size are dropped only when they are Megatron's padding (128 x TP 2 here)
    with pytest.raises(ShapeMismatchError, match="make_vocab_size_divisible_by 16 x TP 2 gives 128"):
        export_checkpoint(ckpt, tmp_path / "o3", ckpts["qwen3_moe"], make_vocab_size_divisible_by=16, progress=False)
    r = worlds.cli_run("export", ckpt, str(tmp_path / "o4"), "--hf-config", ckpts["qwen3_moe"],
                       "--make-vocab-size-divisible-by", "16")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "vocab_size" in r.stderr, r.stderr
    r = worlds.cli_run("export", ckpt, str(tmp_path / "o5"), "--hf-config", ckpts["qwen3_moe"],
                       "--shard-size", "garbage")
    assert r.returncode == 2 and "--shard-size" in r.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_config_tokenizer_and_quantization_config_as_the_user_has_them(saved, tmp_path):
    from test_outputs import _transformers4_style_config

    ckpt = os.path.join(saved[(str(CASES[0][0]), False)]["qwen3_moe"], "ckpt")
    src = tmp_path / "src"
    raw = _transformers4_style_config(src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    (src / "generation_config.json").write_text('{"do_sample": true}')
    out = tmp_path / "out"
    r = worlds.cli_run("export", ckpt, str(out), "--hf-config", str(src),
                       "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert "note: dropped the source config's quantization_config (quant_method=fp8)" in r.stdout
    written = json.loads((out / "config.json").read_text())
    want = {k: v for k, v in raw.items() if k != "quantization_config"}
    want["torch_dtype"] = "bfloat16"
    assert list(written.items()) == list(want.items())
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()


def test_verify_hf_directory_against_megatron_checkpoint(saved, ckpts, tmp_path):
    base = saved[(str(CASES[1][0]), False)]["deepseek_v3"]
    r = worlds.cli_run("verify", ckpts["deepseek_v3"], os.path.join(base, "ckpt"))
    assert r.returncode == 0 and "IDENTICAL" in r.stdout, r.stdout + r.stderr
    changed = tmp_path / "changed"
    shutil.copytree(ckpts["deepseek_v3"], changed)
    from safetensors.torch import load_file, save_file

    f = changed / "model-mtp.safetensors"
    t = load_file(f)
    name = sorted(t)[0]
    t[name] = t[name] + 1
    save_file(t, f, metadata={"format": "pt"})
    r = worlds.cli_run("verify", str(changed), os.path.join(base, "ckpt"))
    assert r.returncode == 1 and name in r.stdout and "values" in r.stdout, r.stdout + r.stderr


def test_name_filter_skips_tensors_at_plan_level(saved, ckpts, tmp_path):
    ckpt = os.path.join(saved[(str(CASES[0][0]), False)]["glm4_moe"], "ckpt")
    out = tmp_path / "no_mtp"
    r = worlds.cli_run("export", ckpt, str(out), "--hf-config", ckpts["glm4_moe"], "--exclude",
                       r"^model\.layers\.4\.")
    assert r.returncode == 0, r.stderr
    ref = {k: v for k, v in read_hf_checkpoint(ckpts["glm4_moe"]).items() if not k.startswith("model.layers.4.")}
    assert_same(read_hf_checkpoint(out), ref, "glm4_moe without MTP")
    with pytest.raises(ValueError, match="keeps only some"):
        export_checkpoint(ckpt, tmp_path / "split", ckpts["glm4_moe"], name_filter=lambda n: "k_proj" not in n,
                          progress=False)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["tp2-pp2-ep2", "tp2-ep2-etp2-singleton-trained"])
def test_offline_fp8_export_equals_the_reference_quantizer(case, saved, ckpts, tmp_path):
    """`export --quantize`: bit-identical to the reference quantizer on the full (cast) HF tensors, the CLI and
    the Python API, both scale formats, with quantization_config in config.json."""
    from mcore2hf.arch.registry import get_converter

    layout, singleton, trained = case
    for mt, base in saved[(str(layout), singleton)].items():
        source = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)  # --dtype bf16
                  for k, v in read_hf_checkpoint(ckpts[mt]).items()}
        if trained:  # the expert bias as Megatron saved it: bf16-rounded by Float16Module, fp32 (test above)
            source = {k: v.to(torch.bfloat16).float() if k.endswith("e_score_correction_bias") else v
                      for k, v in source.items()}
        policy = get_converter(mt).fp8
        if policy is None:  # gpt_oss: no FP8 table, refused before anything is written (tests/test_gpt_oss.py)
            continue
        for quantize in ("fp8", "fp8-ue8m0"):
            out = tmp_path / mt / quantize
            if quantize == "fp8" and mt == "glm4_moe":
                r = worlds.cli_run("export", os.path.join(base, "ckpt"), str(out), "--hf-config", ckpts[mt],
                                   "--dtype", "bf16", "--quantize", quantize, "--bucket-size", "64KiB", "--quiet")
                assert r.returncode == 0, r.stderr
            else:
                export_checkpoint(os.path.join(base, "ckpt"), out, ckpts[mt], dtype="bf16", quantize=quantize,
                                  bucket_bytes="64KiB", progress=False)
            assert_same(read_hf_checkpoint(out), worlds.reference_fp8(source, policy, quantize == "fp8-ue8m0"),
                        f"{mt} {layout} {quantize}")
            with open(out / "config.json") as f:
                config = json.load(f)
            qc = config["quantization_config"]
            assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128], qc
            assert ("scale_fmt" in qc) == (quantize == "fp8-ue8m0"), qc
            assert config.get("torch_dtype", config.get("dtype")) == "bfloat16", config
    with pytest.raises(ValueError, match=r"quantize must be one of \['fp8', 'fp8-ue8m0'\] or None, got 'int4'"):
        export_checkpoint(os.path.join(base, "ckpt"), tmp_path / "bad", ckpts[mt], quantize="int4", progress=False)
    assert not (tmp_path / "bad").exists()


def test_cli_export_base_is_checked_before_anything_is_written(saved, ckpts, tmp_path):
    """--base completes an output only with tensors the converter declares not held (tests/test_qwen3_5.py copies
    Qwen3.5's vision tower byte for byte, by save_pretrained and by the offline export): a base tensor qwen3_moe's
    converter does not explain, a base tensor of another shape than the model's, a quantized base and a quantized
    export are refused before anything is written, on the command line in one line."""
    from safetensors.torch import save_file

    root = saved[(str(CASES[0][0]), False)]["qwen3_moe"]

    def base_with(name: str, extra: dict) -> str:
        base = tmp_path / name
        shutil.copytree(ckpts["qwen3_moe"], base)
        save_file(extra, base / "extra.safetensors", metadata={"format": "pt"})
        own = {n: t for n, t in read_hf_checkpoint(base).items() if n not in extra}  # model.safetensors: no index yet
        save_file(own, base / "model.safetensors", metadata={"format": "pt"})  # a tensor is in one file only
        index = {"metadata": {}, "weight_map": {**dict.fromkeys(own, "model.safetensors"),
                                                **dict.fromkeys(extra, "extra.safetensors")}}
        (base / "model.safetensors.index.json").write_text(json.dumps(index))
        (base / "preprocessor_config.json").write_text("{}")
        return str(base)

    extra = {"model.visual.proj.weight": torch.randn(3, 5).bfloat16()}
    out = tmp_path / "out"
    r = worlds.cli_run("export", os.path.join(root, "ckpt"), str(out), "--hf-config", ckpts["qwen3_moe"],
                       "--base", base_with("base", extra), "--quiet")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "does not declare as not held" in r.stderr and "model.visual.proj.weight" in r.stderr, r.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    plain = base_with("plain", {})
    with pytest.raises(Mcore2HFError, match="quantized export cannot be completed from a base"):
        export_checkpoint(os.path.join(root, "ckpt"), out, ckpts["qwen3_moe"], progress=False, base=plain,
                          quantize="fp8")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method":
                                                                                                   "fp8"}}))
    with pytest.raises(Mcore2HFError, match="is quantized"):
        export_checkpoint(os.path.join(root, "ckpt"), out, ckpts["qwen3_moe"], progress=False, base=plain)
    assert not out.exists() and not list(tmp_path.glob(".out*"))

    bad = base_with("bad", {})  # a base whose model.norm.weight (in its one file) has another shape
    tensors = read_hf_checkpoint(bad)
    save_file({**tensors, "model.norm.weight": torch.zeros(7)}, os.path.join(bad, "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ShapeMismatchError, match=r"model\.norm\.weight: the model gives \[64\], the base has \[7\]"):
        export_checkpoint(os.path.join(root, "ckpt"), tmp_path / "refused", ckpts["qwen3_moe"], progress=False,
                          base=bad)
    assert not (tmp_path / "refused").exists() and not list(tmp_path.glob(".refused*"))
