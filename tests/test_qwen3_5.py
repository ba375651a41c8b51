"""Qwen3.5 (text): completing an output directory from its (multimodal) base checkpoint, and loading that
checkpoint into a text-only model. The oracle is transformers 5.23's Qwen3_5ForConditionalGeneration (the
published checkpoints' class: `model.language_model.*`, `model.visual.*`, `lm_head.weight`)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import worlds
from oracle import logit_problems, roundoff_problems
from test_senders import make_bucket

import mcore2hf.formats.safetensors as st
from mcore2hf.arch.hf_config import config_source
from mcore2hf.arch.registry import get_converter
from mcore2hf.errors import Mcore2HFError, ShapeMismatchError
from mcore2hf.formats.safetensors import SafetensorsWriter, TensorInfo
from mcore2hf.layouts.gdn import ColumnParts
from mcore2hf.offline import export_checkpoint
from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world

VISUAL = "model.visual."


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """A tiny multimodal Qwen3.5 checkpoint written by transformers, with the files a published one carries."""
    d = tmp_path_factory.mktemp("q35") / "base"
    make_hf_checkpoint(tiny_config("qwen3_5"), d, seed=0)
    with open(d / "preprocessor_config.json", "w") as f:
        json.dump({"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}, f)
    with open(d / "chat_template.jinja", "w") as f:
        f.write("{{ messages }}")
    return str(d)


def _text_tensors(seed: int) -> dict[str, torch.Tensor]:
    """What a text-only export produces: the language model's tensors, here of another random model."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        make_hf_checkpoint(tiny_config("qwen3_5"), d, seed=seed)
        return {n: t for n, t in read_hf_checkpoint(d).items() if not n.startswith(VISUAL)}


NOT_HELD = get_converter("qwen3_5").not_held_by_model


def test_writer_completes_the_output_from_the_base_and_transformers_loads_it(base_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    monkeypatch.setattr(st, "_COPY_CHUNK", 100)  # every base tensor copied in many chunks
    model = _text_tensors(seed=1)
    base = read_hf_checkpoint(base_dir)
    out = tmp_path / "out"
    w = SafetensorsWriter(out, [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in model.items()],
                          config_source(base_dir), max_shard_size="20KB", base=base_dir, not_held=NOT_HELD)
    assert {b.name for b in w.base} == {n for n in base if n.startswith(VISUAL)}
    w.send(make_bucket(model))
    w.finish()

    got = read_hf_checkpoint(out)
    want = {**{n: t for n, t in base.items() if n.startswith(VISUAL)}, **model}
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)  # the model's own tensors win, the rest is the base's
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(want) and len(set(index["weight_map"].values())) > 1
    for name in ("preprocessor_config.json", "chat_template.jinja", "generation_config.json"):
        assert os.path.isfile(out / name), name
    with open(out / "config.json") as f, open(os.path.join(base_dir, "config.json")) as g:
        assert json.load(f) == json.load(g)

    hf, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3_5ForConditionalGeneration"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_base_errors_come_before_anything_is_written(base_dir, tmp_path):
    model = _text_tensors(seed=1)
    infos = [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in model.items()]
    out = tmp_path / "out"
    with pytest.raises(Mcore2HFError, match="neither model.safetensors.index.json nor model.safetensors"):
        SafetensorsWriter(out, infos, config_source(base_dir), base=tmp_path, not_held=NOT_HELD)
    with pytest.raises(Mcore2HFError, match="is not a directory"):
        SafetensorsWriter(out, infos, config_source(base_dir), base=tmp_path / "nope", not_held=NOT_HELD)
    name = "model.language_model.norm.weight"
    bad = [TensorInfo(i.name, (7,), i.dtype) if i.name == name else i for i in infos]
    with pytest.raises(ShapeMismatchError, match=rf"{name}: the model gives \[7\], the base has \[64\]"):
        SafetensorsWriter(out, bad, config_source(base_dir), base=base_dir, not_held=NOT_HELD)
    with pytest.raises(Mcore2HFError, match="is a 'qwen3_5' checkpoint, the export is 'qwen3'"):
        SafetensorsWriter(out, infos, config_source(tiny_config("qwen3")), base=base_dir, not_held=NOT_HELD)
    with pytest.raises(Mcore2HFError, match=r"does not declare as not held .*'model\.visual\."):
        SafetensorsWriter(out, infos, config_source(base_dir), base=base_dir)  # a converter holding everything
    with pytest.raises(Mcore2HFError, match="overlaps the input"):
        SafetensorsWriter(os.path.join(base_dir, "sub"), infos, config_source(base_dir), base=base_dir, not_held=NOT_HELD)
    assert sorted(os.listdir(tmp_path)) == []  # no output, no temporary directory


# -- the layout op: GatedDeltaNet's per-shard segments <-> Qwen3.5's separate projections ---------------------------

def _gdn_shards(parts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    """Megatron's layout, built independently: shard i = [part_0 rows of shard i; part_1 rows of shard i; ...]
    (megatron-core 0.16.1 gated_delta_net.py: `torch.split(qkvzba, [qkv/tp, v/tp, nv/tp, nv/tp])`)."""
    return [torch.cat([p.chunk(tp)[i] for p in parts]) for i in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parts_in_proj_q8_k8_v16_z16_b4_a4_h6(tp):
    q, k, v, z, b, a = (torch.randn(n, 6) for n in (8, 8, 16, 16, 4, 4))
    op = ColumnParts((8, 8, 16, 16, 4, 4), groups=(3, 1, 1, 1))
    shards = _gdn_shards([q, k, v, z, b, a], tp)
    hf = [torch.cat([q, k, v]), z, b, a]
    out = op.hf_tensors(shards)
    assert all(torch.equal(x, y) for x, y in zip(out, hf, strict=True))
    assert all(torch.equal(op.shard_from_hf(hf, i, tp, (56, 6)), s) for i, s in enumerate(shards))
    assert op.full_shape(op.hf_shapes((56, 6))) == (56, 6)


@pytest.mark.parametrize("tp", [1, 2])
def test_column_parts_conv1d_q8_k8_v16_1x4(tp):
    q, k, v = (torch.randn(n, 1, 4) for n in (8, 8, 16))
    op = ColumnParts((8, 8, 16), groups=(3,))
    shards = _gdn_shards([q, k, v], tp)
    (out,) = op.hf_tensors(shards)
    assert torch.equal(out, torch.cat([q, k, v]))
    assert all(torch.equal(op.shard_from_hf([out], i, tp, (32, 1, 4)), s) for i, s in enumerate(shards))


def test_column_parts_rejects_wrong_rows_and_groups():
    with pytest.raises(ShapeMismatchError, match="expected 56, got 50"):
        ColumnParts((8, 8, 16, 16, 4, 4), groups=(3, 1, 1, 1)).hf_shapes((50, 6))
    with pytest.raises(ShapeMismatchError, match="summing to 3"):
        ColumnParts((8, 8, 16), groups=(2, 2))


# -- real megatron-core models (qwen3_next's hybrid spec) from the multimodal checkpoints ------------------------

ARCHS = ("qwen3_5", "qwen3_5_moe")
#: Logit parity (fp32): both forwards run the gated delta rule's chunked recurrence in fp32 in different summation
#: orders: the family's tolerance of transformers fp32 (tests/oracle.py) and the RMS roundoff bound against its fp64
#: forward (oracle.roundoff_problems); a wrong tensor moves logits by O(1).


@pytest.fixture(scope="module")
def q35_ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("q35ckpts")
    return {mt: make_hf_checkpoint(tiny_config(mt), root / mt) for mt in ARCHS}


#: one world of 2 processes runs every layout in turn (CI time): TP2 x EP2 (expert-TP 1), PP2, TP1 (x DP2)
LAYOUTS = [Layout(tp=2, ep=2, etp=1), Layout(pp=2), Layout(world_size=2)]


def test_layouts_base_completion_and_parity(q35_ckpts, te_specs, tmp_path):
    """Bit-identical exports at TP2 x EP2, PP2 and TP1; the output completed from the multimodal checkpoint
    equals it tensor for tensor and loads in transformers with no missing or unexpected keys; logits at every
    layout (the pipeline too); the offline export of a torch_dist checkpoint saved at TP2 x EP2, completed from the same base,
    equals the whole multimodal checkpoint; te_naming's names are megatron-core's TE spec's at every layout."""
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    per_rank = run_world(worlds.in_layouts, LAYOUTS[0], LAYOUTS, worlds.qwen3_5_archs, dict(q35_ckpts),
                         str(tmp_path), tokens, LAYOUTS[0], te_specs, timeout=600)
    by_layout = per_rank[0]
    for layout in LAYOUTS:
        results = dict(by_layout[str(layout)])
        saved = results.pop("dist", {})
        for mt, r in saved.items():
            root = r["base"]  # (its logits: the same model's as results[mt]["logits"], checked below)
            # offline: megatron-core's GDN part keys at TP2 x EP2 -> HF, completed from the multimodal checkpoint
            out = tmp_path / "offline" / mt
            export_checkpoint(os.path.join(root, "ckpt"), out, q35_ckpts[mt], progress=False, base=q35_ckpts[mt])
            got, want = read_hf_checkpoint(out), read_hf_checkpoint(q35_ckpts[mt])
            assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), mt
        for mt in results:
            for res in per_rank:
                r = res[str(layout)][mt]
                assert r["skipped"] > 0 and r["tensors"] > 0, r
            # engine-sharded export at this world's placements: every rank's slices and byte counts
            problems = worlds.engine_problems(mt, [res[str(layout)][mt]["engine"] for res in per_rank], layout)
            assert not problems, "\n".join(problems)
            out = tmp_path / mt / str(layout)  # the exported directory, completed from the multimodal checkpoint
            every_rank = [{mt: res[str(layout)][mt]["logits"]} for res in per_rank]
            problems = logit_problems(every_rank, {mt: out}, tokens, f"{layout} exported")
            for rank, logits in enumerate(every_rank):
                problems += roundoff_problems(logits[mt], out, tokens, f"{mt} {layout} rank {rank}")
            assert not problems, problems
