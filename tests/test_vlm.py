"""Vision-language models (issue 26, docs/vlm.md): the language model of Qwen3-VL, Qwen3-VL-MoE, GLM-4.5V and
Kimi-K2.5 from their multimodal checkpoints (tiny odd-shaped configs, runtime/tiny.py, in the published checkpoint
layouts), the tower passed through where the Megatron model embeds transformers' tower (Megatron-Bridge 0.3.1's
Qwen3VLModel, tests/harness/bridge_vlm.py) and delivered from the checkpoint where it holds none. The oracle is
transformers 5.24: its classes load every exported directory with no missing, unexpected or mismatched keys."""

from __future__ import annotations

import os

import pytest
import torch
import worlds
from conftest import VLM_ARCHS
from harness.bridge_vlm import bridge_vlm_root
from oracle import logit_problems
from vlm_checks import check_wrapper_checkpoint

from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world

ARCHS = tuple(VLM_ARCHS)
#: one world of 4 processes runs both layouts in turn (CI time): TP2 x PP2 x EP2 (expert-TP 1; also Bridge's
#: Qwen3VLModel), and PP2 x VPP2 x EP2 (the virtual pipeline; Bridge 0.3.1's model takes no vp_stage)
LAYOUTS = [Layout(tp=2, pp=2, ep=2, etp=1), Layout(pp=2, vpp=2, ep=2, etp=1)]


@pytest.fixture(scope="module")
def vlm_ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vlm")
    return {mt: make_hf_checkpoint(tiny_config(mt), root / mt) for mt in ARCHS}


def _loads_cleanly(path: str, ckpt: str) -> None:
    """transformers' class loads the directory with nothing missing, unexpected or mismatched, and holds what
    the checkpoint it came from holds (the same model: every parameter equal)."""
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (path, info)
    base = AutoModelForImageTextToText.from_pretrained(ckpt)
    ours, theirs = model.state_dict(), base.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs), path


def test_vlm_language_models_towers_and_layouts(vlm_ckpts, tmp_path):
    """Every family's language model at TP2 x PP2 x EP2 and PP2 x VPP2 x EP2: text-token logits = transformers'
    class's on every rank; loading skips the tower, exports are
    the language model's tensors bit for bit, engine-sharded export at the world's placements, save_pretrained
    completed from the checkpoint equals it and loads in transformers; the frozen tower (layout 3) is delivered
    live once per sync, or only with the first, only to the receivers; Bridge's Qwen3VLModel (layout 2) exports
    the whole checkpoint, its tower once, from the first stage."""
    per_rank = run_world(worlds.in_layouts, LAYOUTS[0], LAYOUTS, worlds.vlm_archs, dict(vlm_ckpts), str(tmp_path),
                         bridge_vlm_root(), LAYOUTS[0], timeout=600)
    for layout in LAYOUTS:
        results = dict(per_rank[0][str(layout)])
        bridge = results.pop("bridge", None)
        saved = results.pop("dist", {})
        assert set(saved) == (set(ARCHS) if layout == LAYOUTS[0] else set()), sorted(saved)
        for mt, r in saved.items():
            _offline(mt, os.path.join(r["base"], "ckpt"), vlm_ckpts[mt], tmp_path)
        # the dry run (`mcore2hf plan`, one process, no world) is the plan the live ranks built
        dry = worlds.in_fresh_process(worlds.dry_run_plans, dict(vlm_ckpts), layout, "float32", 4096)
        for mt, (text, records, _) in dry.items():
            assert (text, records) == results[mt]["plan_4k"], mt
        assert (bridge is not None) == (layout.vpp is None)
        # the oracle that is not mcore2hf: the Megatron forward of text tokens at this layout = transformers' class
        logits = [{mt: res[str(layout)][mt]["logits"] for mt in results} for res in per_rank]
        problems = logit_problems(logits, {mt: vlm_ckpts[mt] for mt in results}, worlds.TOKENS, str(layout))
        assert not problems, "\n".join(problems)
        for mt, r in results.items():
            problems = worlds.engine_problems(mt, [res[str(layout)][mt]["engine"] for res in per_rank], layout)
            assert not problems, "\n".join(problems)
            tower_bytes = sum(t.nbytes for n, t in read_hf_checkpoint(vlm_ckpts[mt]).items() if _tower(mt, n))
            for rank, res in enumerate(per_rank):
                sent = res[str(layout)][mt]["tower"]
                want = tower_bytes if rank == 0 else 0  # receivers (0,): the others are handed nothing
                assert sent == {"first": [want, 0, 0], "every": [want] * 3}, (mt, layout, rank, sent)
            _loads_cleanly(r["dir"], vlm_ckpts[mt])
        if bridge is not None:
            # stage 0 holds the tower (its TP ranks a full copy each), the last stage none of it
            assert any(n.startswith("vision_model.") for n in bridge["names"]), bridge["names"][:3]
            assert not any(n.startswith("vision_model.") for n in per_rank[-1][str(layout)]["bridge"]["names"])
            _loads_cleanly(bridge["dir"], vlm_ckpts["qwen3_vl"])
            # `mcore2hf plan --vision-tower hf`: the one-process dry run is the plan Bridge's model built live
            text, records, _ = worlds.in_fresh_process(worlds.native_dry_run, vlm_ckpts["qwen3_vl"], layout, 4096, "hf")
            assert (text, records) == bridge["plan_4k"], "dry run != Bridge's live plan"
            # layout 2 offline: Megatron's checkpoint of Bridge's model, and the import loaded back into it
            assert [r[str(layout)]["bridge"]["dist"]["tensors"] for r in per_rank] == [len(
                read_hf_checkpoint(vlm_ckpts["qwen3_vl"]))] * len(per_rank)
            base = bridge["dist"]["base"]
            check_wrapper_checkpoint(base, vlm_ckpts["qwen3_vl"], str(tmp_path / "offline_bridge"),
                                     os.path.join(os.path.dirname(base), "import", "qwen3_vl"))


def _offline(model_type: str, ckpt_dir: str, hf_dir: str, tmp_path) -> None:
    """The offline export of the language model's torch_dist checkpoint (saved by Megatron at TP2 x PP2 x EP2),
    completed from the multimodal checkpoint, equals it; `mcore2hf verify` finds them identical but for the tower;
    `mcore2hf import` of the checkpoint (the tower skipped: not held) exported again equals it too."""
    from mcore2hf.importer import import_checkpoint
    from mcore2hf.offline import export_checkpoint
    from mcore2hf.verify import compare

    want = read_hf_checkpoint(hf_dir)
    out = tmp_path / "offline" / model_type
    export_checkpoint(ckpt_dir, out, hf_dir, progress=False, base=hf_dir)
    got = read_hf_checkpoint(out)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), model_type
    # `mcore2hf verify` of the checkpoint against Megatron's: identical, the tower the only tensors it lacks
    r = compare(hf_dir, ckpt_dir)
    assert r.compared and not r.rows and not r.unexpected and r.missing == sorted(
        n for n in want if _tower(model_type, n)), (model_type, r.rows[:3], r.unexpected[:3], r.missing[:3])
    imported = tmp_path / "imported" / model_type
    import_checkpoint(hf_dir, imported, progress=False)
    again = tmp_path / "reexported" / model_type
    export_checkpoint(imported, again, hf_dir, progress=False, base=hf_dir)
    got = read_hf_checkpoint(again)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), model_type


def _tower(model_type: str, name: str) -> bool:
    from mcore2hf.registry import get_converter

    return get_converter(model_type).not_held_by_model(name)


def test_vllm_loads_the_names_we_send_for_qwen3_vl_and_qwen3_5(tmp_path):
    """vLLM 0.33.0's own WeightsMapper of Qwen3VLForConditionalGeneration / Qwen3_5ForConditionalGeneration
    (harness.vllm_vlm_names: read from the wheel, run on CPU) maps every name an export sends (language model and
    tower, checkpoint order) into the modules the class builds; Qwen3.5's MTP names it drops."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from harness.vllm_vlm_names import MODULES
    from harness.wheels import unpacked_wheel

    from mcore2hf.hf_config import hf_tensor_shapes

    repo = Path(__file__).resolve().parents[1]
    names = {mt: sorted(hf_tensor_shapes(tiny_config(mt))) for mt in ("qwen3_vl", "qwen3_5")}
    names["qwen3_5"].append("mtp.fc.weight")  # published Qwen3.5 checkpoints carry MTP weights (declared not held)
    inp, out = tmp_path / "names.json", tmp_path / "mapped.json"
    inp.write_text(json.dumps(names))
    wheel = unpacked_wheel("vllm", "0.33.0", ("vllm/*.py", "vllm-*.dist-info/*"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(wheel), str(repo / "tests"), str(repo)]),
               VLLM_LOGGING_LEVEL="WARNING")
    r = subprocess.run([sys.executable, "-m", "harness.vllm_vlm_names", str(inp), str(out)], env=env, cwd=repo,
                       capture_output=True, text=True, timeout=300)
    assert out.exists(), r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["vllm"] == "0.33.0" and res["file"].startswith(str(wheel)), res
    for mt in ("qwen3_vl", "qwen3_5"):
        mapped = res[mt]
        assert any(n.startswith("model.visual.") for n in mapped) and len(mapped) == len(names[mt])
        bad = {n: m for n, m in mapped.items() if not (m is None and n.startswith("mtp.")) and
               not (m is not None and m.startswith(MODULES))}
        assert not bad, (mt, list(bad.items())[:4])
        assert mapped["lm_head.weight"] == "language_model.lm_head.weight", mt


def test_import_vision_tower_refusals(vlm_ckpts, tmp_path):
    """`mcore2hf import --vision-tower`: a model whose table has no such tower under Megatron-Bridge's
    `vision_model.` (GLM-4.5V: Bridge's GLM45VModel holds transformers' tower as `visual`, and no native one) or an
    unknown value is refused in one line, before anything is written."""
    import contextlib
    import io

    from mcore2hf.cli import main
    from mcore2hf.errors import UsageError
    from mcore2hf.importer import import_checkpoint

    for mt, value, words in (("glm4v_moe", "native", "no native Megatron tower"),
                             ("glm4v_moe", "hf", "no embedded tower under vision_model."),
                             ("qwen3_vl", "torch", "vision_tower must be one of native, hf")):
        out = tmp_path / f"{mt}-{value}"
        with pytest.raises(UsageError, match=words):
            import_checkpoint(vlm_ckpts[mt], out, vision_tower=value, progress=False)
        assert not out.exists()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["import", vlm_ckpts["glm4v_moe"], str(tmp_path / "cli"), "--vision-tower", "native", "--quiet"])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "no native Megatron tower" in lines[0], lines
    assert not (tmp_path / "cli").exists()
