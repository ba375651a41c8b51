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
    live once per sync, or only with the first, only to the receivers; Bridge 0.3.1's Qwen3VLModel and
    GLM45VModel and 0.6.2's KimiK25VLModel (rebuilt) (layout 2) export the whole checkpoint, their tower once,
    from the first stage."""
    per_rank = run_world(worlds.in_layouts, LAYOUTS[0], LAYOUTS, worlds.vlm_archs, dict(vlm_ckpts), str(tmp_path),
                         bridge_vlm_root(), LAYOUTS[0], timeout=600)
    for layout in LAYOUTS:
        results = dict(per_rank[0][str(layout)])
        bridge = results.pop("bridge", None)
        bridge_glm = results.pop("bridge_glm", None)
        bridge_kimi = results.pop("bridge_kimi", None)
        saved = results.pop("dist", {})
        assert set(saved) == (set(ARCHS) if layout == LAYOUTS[0] else set()), sorted(saved)
        for mt, r in saved.items():
            _offline(mt, os.path.join(r["base"], "ckpt"), vlm_ckpts[mt], tmp_path)
        # the dry run (`mcore2hf plan`, one process, no world) is the plan the live ranks built
        dry = worlds.in_fresh_process(worlds.dry_run_plans, dict(vlm_ckpts), layout, "float32", 4096)
        for mt, (text, records, _) in dry.items():
            assert (text, records) == results[mt]["plan_4k"], mt
        assert (bridge is not None) == (bridge_glm is not None) == (bridge_kimi is not None) == (layout.vpp is None)
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
            # GLM-4.5V: Bridge's GLM45VModel holds transformers' tower at `visual`, on stage 0 only
            assert any(n.startswith("visual.") for n in bridge_glm["names"]), bridge_glm["names"][:3]
            assert not any(n.startswith("visual.") for n in per_rank[-1][str(layout)]["bridge_glm"]["names"])
            _loads_cleanly(bridge_glm["dir"], vlm_ckpts["glm4v_moe"])
            # Kimi-K2.5: Bridge 0.6.2's KimiK25VLModel, rebuilt (its tower is the checkpoint's remote code), holds
            # `vision_tower` and `mm_projector` beside `language_model`, on stage 0 only
            assert {n.split(".")[0] for n in bridge_kimi["names"]} == {"vision_tower", "mm_projector", "language_model"}
            assert all(n.startswith("language_model.") for n in per_rank[-1][str(layout)]["bridge_kimi"]["names"])
            _loads_cleanly(bridge_kimi["dir"], vlm_ckpts["kimi_k25"])
            # both offline as Qwen3VLModel's: Megatron's checkpoint of the wrapper exports bit for bit, `verify`
            # identical, `import --vision-tower hf` writes its keys and loads back (strict); the dry run is its plan
            for key, mt, tower in (("bridge_glm", "glm4v_moe", ("visual.", "model.visual.")),
                                   ("bridge_kimi", "kimi_k25", ("vision_tower.", "vision_tower."))):
                got = per_rank[0][str(layout)][key]
                text, records, _ = worlds.in_fresh_process(worlds.native_dry_run, vlm_ckpts[mt], layout, 4096, "hf")
                assert (text, records) == got["plan_4k"], f"dry run != {mt}'s live wrapper plan"
                assert [r[str(layout)][key]["dist"]["tensors"] for r in per_rank] == [len(
                    read_hf_checkpoint(vlm_ckpts[mt]))] * len(per_rank)
                base = got["dist"]["base"]
                check_wrapper_checkpoint(base, vlm_ckpts[mt], str(tmp_path / f"offline_{key}"),
                                         os.path.join(os.path.dirname(base), "import", mt), tower)


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
    from mcore2hf.arch.registry import get_converter

    return get_converter(model_type).not_held_by_model(name)


#: the vLLM release whose WeightsMapper and model classes load our exports (tests/harness/vllm_vlm_names.py)
VLLM = "0.33.0"
#: the architectures of the published checkpoints (their config.json), which SGLang and vLLM resolve their classes
#: by (SGLang's models/registry.py, vLLM's model_executor/models/registry.py)
ENGINE_ARCHS = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                "glm4v_moe": "Glm4vMoeForConditionalGeneration"}


def test_vllm_loads_the_names_we_send_for_qwen3_vl_and_qwen3_5(tmp_path):
    """vLLM 0.33.0's own WeightsMapper of Qwen3VLForConditionalGeneration / Qwen3_5ForConditionalGeneration
    (harness.vllm_vlm_names: read from the wheel, run on CPU) maps every name an export sends (language model and
    tower, checkpoint order) into the modules the class builds; Qwen3.5's MTP names it drops. vLLM's Fp8Config,
    given an FP8 export's quantization_config, keeps the tower of Qwen3-VL, GLM-4.5V and Kimi-K2.5 unquantized.
    vLLM's own Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE and GLM-4.5V classes, built on CPU from the wheel (same
    subprocess), load every tensor an export sends through their `load_weights` (harness.vlm_load.load_contract,
    the check SGLang's classes pass too): each into a parameter, whole copies exact, no parameter unfilled; a
    renamed tower tensor is caught."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from harness.vllm_vlm_names import MODULES
    from harness.wheels import unpacked_wheel

    from mcore2hf.arch.hf_config import hf_tensor_shapes

    repo = Path(__file__).resolve().parents[1]
    names = {mt: sorted(hf_tensor_shapes(tiny_config(mt))) for mt in ("qwen3_vl", "qwen3_5")}
    names["qwen3_5"].append("mtp.fc.weight")  # published Qwen3.5 checkpoints carry MTP weights (declared not held)
    from mcore2hf.arch.registry import get_converter
    from mcore2hf.quantize.scheme import SCHEMES

    names["fp8"] = {}
    for mt, cls in (("qwen3_vl", "Qwen3VLForConditionalGeneration"), ("glm4v_moe", "Glm4vMoeForConditionalGeneration"),
                    ("kimi_k25", "KimiK25ForConditionalGeneration")):
        shapes = hf_tensor_shapes(tiny_config(mt))
        qc = SCHEMES["fp8"].config(get_converter(mt).fp8, list(shapes.items()))  # what an FP8 export writes
        names["fp8"][mt] = [cls, sorted(n for n, s in shapes.items() if len(s) == 2 and n.endswith(".weight")), qc]
    # vLLM's own classes, built on CPU, load each checkpoint (the names and tensors an export sends)
    names["load"] = {}
    for mt, arch in ENGINE_ARCHS.items():
        ckpt = make_hf_checkpoint(tiny_config(mt), tmp_path / mt)
        names["load"][mt] = [_engine_config_view(mt, ckpt, arch, tmp_path), str(ckpt)]
    # the check can fail: one tower tensor under a name vLLM has no parameter for
    from safetensors.torch import save_file

    tensors = read_hf_checkpoint(tmp_path / "qwen3_vl")
    tensors["model.visual.blocks.0.attn.qkvx.weight"] = tensors.pop("model.visual.blocks.0.attn.qkv.weight")
    (tmp_path / "renamed").mkdir()
    save_file(tensors, str(tmp_path / "renamed" / "model.safetensors"))
    names["load"]["renamed"] = [names["load"]["qwen3_vl"][0], str(tmp_path / "renamed")]
    # and built with an FP8 export's quantization_config: which parameters they create in float8
    for mt in ("qwen3_vl", "glm4v_moe"):
        qc = names["fp8"][mt][2]
        names["load"][f"fp8:{mt}"] = [_engine_config_view(mt, tmp_path / mt, ENGINE_ARCHS[mt], tmp_path, qc), None]
    # the check can fail: without the tower's entries vLLM builds Qwen3-VL's tower in float8
    qc = dict(names["fp8"]["qwen3_vl"][2])
    qc["modules_to_not_convert"] = [m for m in qc["modules_to_not_convert"] if not m.startswith("model.visual")]
    (tmp_path / "no-tower").mkdir()
    names["load"]["fp8-no-tower:qwen3_vl"] = [
        _engine_config_view("qwen3_vl", tmp_path / "qwen3_vl", ENGINE_ARCHS["qwen3_vl"], tmp_path / "no-tower", qc), None]
    inp, out = tmp_path / "names.json", tmp_path / "mapped.json"
    inp.write_text(json.dumps(names))
    wheel = unpacked_wheel("vllm", VLLM, ("vllm/*.py", "vllm-*.dist-info/*"))
    # VLLM_TARGET_DEVICE: vLLM's CPU platform (platforms/__init__.py cpu_platform_plugin), whose attention and
    # MoE backends the classes pick when built
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(wheel), str(repo / "tests"), str(repo)]),
               VLLM_LOGGING_LEVEL="WARNING", VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run([sys.executable, "-m", "harness.vllm_vlm_names", str(inp), str(out)], env=env, cwd=repo,
                       capture_output=True, text=True, timeout=300)
    assert out.exists(), r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["vllm"] == VLLM and res["file"].startswith(str(wheel)), res
    for mt in ("qwen3_vl", "qwen3_5"):
        mapped = res[mt]
        assert any(n.startswith("model.visual.") for n in mapped) and len(mapped) == len(names[mt])
        bad = {n: m for n, m in mapped.items() if not (m is None and n.startswith("mtp.")) and
               not (m is not None and m.startswith(MODULES))}
        assert not bad, (mt, list(bad.items())[:4])
        assert mapped["lm_head.weight"] == "language_model.lm_head.weight", mt
    # FP8: vLLM keeps every tower / projector layer of our FP8 exports unquantized, and quantizes the language model
    for mt in ("qwen3_vl", "glm4v_moe", "kimi_k25"):
        skipped = res[f"fp8:{mt}"]
        tower = {n: k for n, k in skipped.items() if _tower(mt, n)}
        assert tower and all(tower.values()), (mt, [n for n, k in tower.items() if not k][:5])
        assert any(not k for n, k in skipped.items() if n not in tower), (mt, "nothing quantized")
    for mt, arch in ENGINE_ARCHS.items():
        # vLLM's tower at visual.*, its language model at language_model.model.* / language_model.lm_head.*
        problems = _load_contract_problems(mt, arch, res[f"load:{mt}"],
                                           ("visual.", "language_model.lm_head.", "language_model.model."))
        assert not problems, "\n".join(problems)
    # the renamed tower tensor is refused (AutoWeightsLoader raises on a name it has no parameter for) or, were it
    # skipped, reported as dropped with the parameter it should have filled left unfilled
    renamed = res["load:renamed"]
    assert "qkvx" in renamed.get("error", "") or (
        renamed["dropped"] and "visual.blocks.0.attn.qkv.weight" in renamed["unfilled"]), renamed
    # vLLM's classes built with our FP8 exports' quantization_config (its own Fp8Config and mapper, as its model
    # loader applies them): the language model in float8, no tower parameter
    for mt in ("qwen3_vl", "glm4v_moe"):
        got = res[f"load:fp8:{mt}"]
        assert "error" not in got, f"fp8 {mt}:\n{got.get('error')}"
        assert any(p.startswith("language_model.model.layers.") for p in got["float8"]), (mt, got["float8"][:4])
        assert not [p for p in got["float8"] if p.startswith("visual.")], (mt, got["float8"])
    assert "visual.blocks.0.attn.qkv.weight" in res["load:fp8-no-tower:qwen3_vl"].get("float8", []), res[
        "load:fp8-no-tower:qwen3_vl"]


def _engine_config_view(mt: str, ckpt: str, arch: str, tmp_path, quantization_config: dict | None = None) -> str:
    """The engines' view of the published config.json of `ckpt` (a directory holding only it): `architectures`
    (what SGLang and vLLM resolve the class by) and what published configs carry that transformers 5.24's
    save_pretrained of the tiny model drops. Qwen3.5: `full_attention_interval` beside `layer_types` (SGLang's
    configs/qwen3_next.py layers_block_type reads it; here layer_types alternate from linear) and the
    vision_config's `"deepstack_visual_indexes": []` (SGLang's configs/qwen3_vl.py defaults it to [8, 16, 24]).
    Qwen3-VL-MoE: the text_config's `"norm_topk_prob": true` (vLLM 0.33's models/qwen3_moe.py:210 reads it;
    transformers 5.24's Qwen3VLMoeTextConfig no longer defines it). GLM-4.5V: the text_config's
    `"use_qk_norm": false`, as GLM-4.5-Air's published config.json has it (vLLM 0.33's models/glm4_moe.py:350
    reads it; transformers 5.24's Glm4vMoeTextConfig does not define it). With `quantization_config`: an FP8
    export's, in 1 x 1 blocks (the tiny odd widths are not multiples of 128; the block size plays no part in which
    layers are skipped)."""
    import json
    from pathlib import Path

    view = tmp_path / f"{mt}-{'fp8-' if quantization_config else ''}view"
    view.mkdir()
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    raw["architectures"] = [arch]
    if quantization_config:
        raw["quantization_config"] = dict(quantization_config, weight_block_size=[1, 1])
    if mt.startswith("qwen3_5"):
        kinds = raw["text_config"]["layer_types"]
        raw["text_config"]["full_attention_interval"] = kinds.index("full_attention") + 1
        raw["vision_config"]["deepstack_visual_indexes"] = []
        assert all((k == "full_attention") == ((i + 1) % (kinds.index("full_attention") + 1) == 0)
                   for i, k in enumerate(kinds)), kinds
    if mt == "qwen3_vl_moe":
        raw["text_config"].setdefault("norm_topk_prob", True)
    if mt == "glm4v_moe":  # the tiny model, like GLM-4.5V's language model (GLM-4.5-Air's), has no q/k norm
        raw["text_config"].setdefault("use_qk_norm", False)
    (view / "config.json").write_text(json.dumps(raw))
    return str(view)


def _load_contract_problems(mt: str, arch: str, got: dict, where: tuple[str, str, str]) -> list[str]:
    """What is wrong in an engine class's harness.vlm_load.load_contract result for the tiny `mt` checkpoint:
    an error, another class, a sent name landing in no parameter, a whole-parameter copy not equal, a parameter
    left unfilled, or a name landing outside the module `where` names for it (tower, lm_head, language model)."""
    from mcore2hf.arch.hf_config import hf_tensor_shapes

    if "error" in got:
        return [f"{mt}: {got['error']}"]
    tower, head, lm = where
    problems = []
    if not (got["class"].endswith(arch) and got["visual_params"] > 0):
        problems.append(f"{mt}: class {got['class']}")
    if got["sent"] != len(hf_tensor_shapes(tiny_config(mt))):
        problems.append(f"{mt}: sent {got['sent']}")
    for key, what in (("dropped", "names the engine skipped"), ("mismatch", "loaded but not equal"),
                      ("unfilled", "parameters nothing we send fills")):
        if got[key]:
            problems.append(f"{mt}: {what}: {got[key][:5]}")
    for name, params in got["landed"].items():
        want = tower if name.startswith("model.visual.") else head if name == "lm_head.weight" else lm
        if not all(p.startswith(want) for p in params if not p.startswith(head)):
            problems.append(f"{mt}: {name} landed in {params}")
    return problems


#: the SGLang release whose model classes load our exports (tests/harness/sglang_vlm_load.py)
SGLANG = "0.5.23"


def test_sglang_loads_the_names_we_send_for_qwen3_vl_and_qwen3_5(tmp_path):
    """SGLang 0.5.23's own Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE and GLM-4.5V classes, built on CPU from the
    release's wheel (harness.sglang_vlm_load), load every tensor an export sends (the checkpoint's names, which
    exports equal bit for bit: test_vlm_language_models_towers_and_layouts), each into at least one of their
    parameters, a whole-parameter copy exactly; loading them all leaves no parameter unfilled. SGLang skips a name
    it has no parameter for silently, so a name we got wrong would otherwise go unnoticed until a proof sync.
    Built with an FP8 export's quantization_config, the Qwen3-VL and GLM-4.5V classes create no tower parameter in
    float8."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from harness.wheels import unpacked_wheel

    from mcore2hf.arch.hf_config import hf_tensor_shapes

    repo = Path(__file__).resolve().parents[1]
    cases = {}
    for mt, arch in ENGINE_ARCHS.items():
        cfg = tiny_config(mt)
        ckpt = make_hf_checkpoint(cfg, tmp_path / mt)
        assert set(read_hf_checkpoint(ckpt)) == set(hf_tensor_shapes(cfg)), mt  # the names an export sends
        cases[mt] = [_engine_config_view(mt, ckpt, arch, tmp_path), str(ckpt)]
    # FP8 exports keep the tower unquantized: SGLang, given an export's quantization_config, must build it so
    from mcore2hf.arch.registry import get_converter
    from mcore2hf.quantize.scheme import SCHEMES

    for mt, arch in (("qwen3_vl", ENGINE_ARCHS["qwen3_vl"]), ("glm4v_moe", "Glm4vMoeForConditionalGeneration")):
        cfg = tiny_config(mt)
        view = tmp_path / f"{mt}-fp8-config"
        view.mkdir()
        raw = cfg.to_dict()
        raw["architectures"] = [arch]
        (view / "config.json").write_text(json.dumps(raw))
        # what save_pretrained(quantize="fp8") writes (exporter.py: the policy's config over the export's names)
        qc = SCHEMES["fp8"].config(get_converter(mt).fp8, list(hf_tensor_shapes(cfg).items()))
        cases[f"fp8:{mt}"] = [str(view), qc]
        if mt == "glm4v_moe":  # without the tower's prefix entry SGLang quantizes the tower's fused qkv_proj
            per_module = [m for m in qc["modules_to_not_convert"] if m != "model.visual"]
            cases["fp8-per-module:glm4v_moe"] = [str(view), dict(qc, modules_to_not_convert=per_module)]
    inp, out = tmp_path / "cases.json", tmp_path / "loaded.json"
    inp.write_text(json.dumps(cases))
    site = unpacked_wheel("sglang", SGLANG, include=("sglang/*",))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo / "tests"), str(repo)]), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "harness.sglang_vlm_load", str(site), str(inp), str(out)], env=env,
                       cwd=repo, capture_output=True, text=True, timeout=600)
    assert out.exists(), (r.stdout[-2000:], r.stderr[-4000:])
    res = json.loads(out.read_text())
    assert res["sglang"] == SGLANG and res["file"].startswith(str(site)), res  # the wheel's own code
    for mt, arch in ENGINE_ARCHS.items():
        # the tower lands in SGLang's tower (visual.*, qkv -> qkv_proj), the language model in model.*
        problems = _load_contract_problems(mt, arch, res[mt], ("visual.", "lm_head.", "model."))
        assert not problems, "\n".join(problems)
    for mt in ("qwen3_vl", "glm4v_moe"):
        got = res[f"fp8:{mt}"]
        assert "error" not in got, f"fp8 {mt}:\n{got.get('error')}"
        assert any(p.startswith("model.layers.") for p in got["float8"]), (mt, got["float8"][:4])  # LM quantized
        assert not [p for p in got["float8"] if p.startswith("visual.")], (mt, got["float8"])
    assert "visual.blocks.0.attn.qkv_proj.weight" in res["fp8-per-module:glm4v_moe"]["float8"], res[
        "fp8-per-module:glm4v_moe"]


def test_kimi_k25_equivalent_follows_bridge_0_6_2():
    """harness.bridge_vlm.build_kimi_k25_equivalent rebuilds Megatron-Bridge 0.6.2's KimiK25VLModel (which cannot
    be built here: its tower classes are the checkpoint's remote code); the release's own source still builds
    what it rebuilds: `vision_tower` and `mm_projector` only under `if pre_process:`, and `language_model` from
    the provider's `provide_language_model` on every stage (models/kimi_vl/modeling_kimi_k25_vl.py __init__)."""
    import ast

    from harness.bridge_vision import BRIDGE_VISION_VERSION
    from harness.wheels import unpacked_wheel

    path = "megatron/bridge/models/kimi_vl/modeling_kimi_k25_vl.py"
    assert BRIDGE_VISION_VERSION == "0.6.2"
    root = unpacked_wheel("megatron-bridge", BRIDGE_VISION_VERSION, (path,))
    tree = ast.parse((root / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KimiK25VLModel")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")

    def assigned(nodes) -> dict[str, ast.expr]:
        return {t.attr: n.value for n in nodes if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self"}

    guarded = next(n for n in init.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "pre_process")
    assert {"vision_tower", "mm_projector"} <= set(assigned(ast.walk(guarded))), ast.dump(guarded)[:300]
    top = assigned(init.body)
    assert not {"vision_tower", "mm_projector"} & set(top)
    call = ast.unparse(top["language_model"])
    assert call.startswith("self.config.provide_language_model("), call


def test_import_vision_tower_refusals(vlm_ckpts, tmp_path):
    """`mcore2hf import --vision-tower`: a model whose table has no such tower (GLM-4.5V and Kimi-K2.5 have no
    native Megatron tower: Bridge's GLM45VModel and KimiK25VLModel hold transformers' / the remote code's tower) or
    an unknown value is refused in one line, before anything is written."""
    import contextlib
    import io

    from mcore2hf.cli import main
    from mcore2hf.errors import UsageError
    from mcore2hf.importer import import_checkpoint

    for mt, value, words in (("glm4v_moe", "native", "no native Megatron tower and an embedded tower under visual."),
                             ("kimi_k25", "native", "an embedded tower under mm_projector., vision_tower."),
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


#: the architectures whose published checkpoints differ from what transformers 5.24's own save_pretrained writes
#: (those registered with a `published_layout`, all of them: the test checks): Qwen3-VL-MoE's packed experts
#: transposed ([E, 2I, H] / [E, H, I] instead of [E, H, 2I] / [E, I, H]), Kimi-K2.5's language-model layers under
#: `blocks` and its projector under `model.`
OWN_SAVE = ("qwen3_vl_moe", "kimi_k25")


def test_checkpoints_as_transformers_saves_them_load_and_import(tmp_path):
    """A checkpoint written by transformers' own save_pretrained (a user who fine-tuned with transformers) is the
    same model to transformers as the published one (its loader reads both: conversion_mapping.py "qwen3_vl_moe"
    `Transpose(1, 2, check_dims=True)`, "kimi_k25"'s renames), and to mcore2hf: load_hf_weights at TP2 x EP2
    (sliced reads of the transposed experts) and `import` give the published tensors bit for bit, and the
    import's export is the published directory."""
    from transformers import AutoModelForImageTextToText

    from mcore2hf.arch.registry import architectures
    from mcore2hf.importer import import_checkpoint
    from mcore2hf.offline import export_checkpoint

    assert set(OWN_SAVE) == {mt for mt, a in architectures().items() if a.published_layout}
    dirs = {}
    for mt in OWN_SAVE:
        published = make_hf_checkpoint(tiny_config(mt), tmp_path / f"{mt}-published")
        own = make_hf_checkpoint(tiny_config(mt), tmp_path / f"{mt}-own", published=False)
        stored, want = read_hf_checkpoint(own), read_hf_checkpoint(published)
        differ = set(stored) ^ set(want) or {n for n in want if stored[n].shape != want[n].shape}
        assert differ, f"{mt}: transformers now saves the published layout: drop its published_layout"
        a = AutoModelForImageTextToText.from_pretrained(own).state_dict()
        b = AutoModelForImageTextToText.from_pretrained(published).state_dict()
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in b), f"{mt}: transformers reads them apart"
        dirs[mt] = (own, published)
        import_checkpoint(own, tmp_path / f"{mt}-ckpt", progress=False)
        export_checkpoint(tmp_path / f"{mt}-ckpt", tmp_path / f"{mt}-export", published, base=published,
                          progress=False)
        got = read_hf_checkpoint(tmp_path / f"{mt}-export")
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), mt
    loaded = run_world(worlds.load_transformers_saved, Layout(tp=2, ep=2, etp=1), dirs, Layout(tp=2, ep=2, etp=1))
    assert all(r == loaded[0] and set(r) == set(OWN_SAVE) for r in loaded)
