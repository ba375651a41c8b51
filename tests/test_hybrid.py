"""megatron-core's hybrid models (0.16.1 MambaModel here; 0.19's HybridModel on the GPU machine, bench/hybrid_check.py)
hold each HF decoder layer as two Megatron layers, attention then MLP/MoE (pattern "*-*E..."). Built by
`build_model(..., model_class="hybrid")` from the HF config, they load and export exactly like the GPTModel of the
same weights: bit-identical to the HF source and to the GPTModel's export, at TP2, PP2 and TP2 x EP2 (names read in
megatron-core 0.16.1 ssm/mamba_block.py and 0.19.2 models/hybrid/hybrid_block.py, hybrid_layer_allocation.py)."""

import importlib.util
import os

import pytest
import worlds
from oracle import logit_problems

from mcore2hf.arch.hf_config import load_hf_config
from mcore2hf.arch.naming import HybridLayout
from mcore2hf.arch.registry import get_converter
from mcore2hf.errors import ConfigMismatchError, UsageError
from mcore2hf.importer import import_checkpoint
from mcore2hf.offline import export_checkpoint
from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world


def _megatron_at_least(major: int, minor: int) -> bool:
    import megatron.core

    return tuple(int(x) for x in megatron.core.__version__.split(".")[:2]) >= (major, minor)


@pytest.mark.parametrize("pattern, hf_layers", [
    ("*-*E", ["*-", "*E"]),
    ("*-|*-/*E/*E", ["*-", "*-"]),  # 0.19: pipeline separators and MTP depths
    ("M*-G-", ["M", "*-", "G-"]),  # a mixer without MLP is one HF layer
])
def test_hybrid_layout_parses_pattern_into_hf_layers(pattern, hf_layers):
    layout = HybridLayout.parse(pattern)
    assert layout.hf_layers() == hf_layers
    assert layout.num_layers == len(hf_layers)


@pytest.mark.parametrize("pattern", ["-*", "*--", "*-E", "*-/*-*-", "*-/*-/*E"])
def test_hybrid_layout_refuses_patterns_without_hf_layers(pattern):
    with pytest.raises(ConfigMismatchError, match="hybrid layer pattern"):
        HybridLayout.parse(pattern)


#: CI (its time budget): TP2 x PP2 x EP2 (expert-TP 1) for both, with the torch_dist checkpoint. By hand
#: (MCORE2HF_HYBRID_ALL=1): TP2, PP2 and TP2 x EP2 each alone.
LAYOUTS = [(Layout(tp=2, pp=2, ep=2, etp=1), ["qwen3", "qwen3_moe"])]
if os.environ.get("MCORE2HF_HYBRID_ALL"):
    LAYOUTS += [(Layout(tp=2), ["qwen3", "qwen3_moe"]), (Layout(pp=2), ["qwen3", "qwen3_moe"]),
                (Layout(tp=2, ep=2), ["qwen3_moe"])]


@pytest.mark.parametrize("layout, archs", LAYOUTS, ids=[f"{lay}-{'+'.join(a)}" for lay, a in LAYOUTS])
def test_hybrid_model_exports_and_loads_like_gpt_model(ckpts, layout, archs, tmp_path):
    dist_root = str(tmp_path / "dist") if layout.pp > 1 else None  # the hybrid model's torch_dist checkpoint
    import_root = None
    if layout.pp > 1:  # `mcore2hf import --model-class hybrid`, loaded into the hybrid model by Megatron
        import_root = tmp_path / "import"
        for mt in archs:
            import_checkpoint(ckpts[mt], import_root / mt, model_class="hybrid", progress=False,
                              transformer_impl="local")  # build_model builds the local spec
    source = {mt: ckpts[mt] for mt in archs}
    results = run_world(worlds.for_each_arch, layout, worlds.hybrid_suite, source, layout, dist_root,
                        None if import_root is None else str(import_root))
    # the GPTModel's forward at this layout is transformers' (the oracle), and the hybrid model's is the GPTModel's
    logits = [{mt: r["logits"] for mt, r in res.items()} for res in results]
    problems = logit_problems(logits, source, worlds.TOKENS, str(layout))
    assert not problems, "\n".join(problems)
    for mt in archs:
        for rank_results in results:
            assert rank_results[mt]["logits_max_diff"] == 0.0, rank_results[mt]["logits_max_diff"]
        r = results[0][mt]
        assert r["model_class"] == ("HybridModel" if _megatron_at_least(0, 19) else "MambaModel")
        assert r["pattern"] == ("*E" * 4 if mt == "qwen3_moe" else "*-" * 4)
        # every rank holds its stage's share of the 8 Megatron layers
        assert sum(x[mt]["megatron_layers_here"] for x in results) == 8 * layout.size // layout.pp
        if dist_root is not None:  # its layers saved under Megatron indices, `final_norm`: renumbered offline
            out = tmp_path / "offline" / mt
            export_checkpoint(os.path.join(dist_root, mt, "ckpt"), out, ckpts[mt])
            worlds.assert_same(read_hf_checkpoint(out), read_hf_checkpoint(ckpts[mt]), f"{layout} offline {mt}")
        if import_root is not None:  # the import, loaded strictly by Megatron, and exported back offline
            assert r["imported_tensors"]["tensors"] == len(read_hf_checkpoint(ckpts[mt]))
            out = tmp_path / "reexport" / mt
            export_checkpoint(import_root / mt, out, ckpts[mt])
            worlds.assert_same(read_hf_checkpoint(out), read_hf_checkpoint(ckpts[mt]), f"import -> offline {mt}")


def test_offline_export_refuses_hybrid_checkpoint_pattern_mismatch():
    from mcore2hf.arch.naming import checkpoint_hybrid_layout

    keys = ["decoder.final_norm.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.2.mlp.linear_fc1.weight",
            "decoder.layers.3.self_attention.linear_qkv.weight"]
    with pytest.raises(ConfigMismatchError, match="checkpoint layer 2 holds mlp.linear_fc1.weight"):
        checkpoint_hybrid_layout(keys, "*-*-")
    with pytest.raises(ConfigMismatchError, match="implies 6 Megatron layers"):
        checkpoint_hybrid_layout(keys, "*-*-*-")
    assert checkpoint_hybrid_layout(keys[1:], "*-*-") is None  # a GPTModel's checkpoint
    assert checkpoint_hybrid_layout(keys[:3], "*-").hf_layer == (0, 0)


def test_hybrid_import_keys_follow_the_pattern(ckpts, tmp_path):
    """The import's keys for a hybrid model: each HF layer's attention under its mixer layer, its MLP / MoE under the
    next Megatron layer, never stacked, `decoder.final_norm` (0.16.1 mamba_block.py, 0.19.2 hybrid_block.py)."""
    from mcore2hf.formats import open_checkpoint

    import_checkpoint(ckpts["qwen3"], tmp_path / "q", model_class="hybrid", progress=False)
    keys = set(open_checkpoint(str(tmp_path / "q" / "iter_0000000")).tensors)
    assert "decoder.final_norm.weight" in keys and "decoder.final_layernorm.weight" not in keys
    assert "output_layer._extra_state/shard_0_1" in open_checkpoint(str(tmp_path / "q" / "iter_0000000")).meta.state_dict_metadata
    assert {"decoder.layers.6.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.6.self_attention.linear_qkv.weight",
            "decoder.layers.7.mlp.linear_fc1.layer_norm_weight", "decoder.layers.7.mlp.linear_fc2.weight"} <= keys
    assert not any(k.startswith("decoder.layers.7.self_attention") or k.startswith("decoder.layers.6.mlp") or
                   k.startswith("decoder.layers.8.") for k in keys)
    with pytest.raises(UsageError, match="moe_layer_freq with model_class='hybrid'"):
        import_checkpoint(ckpts["qwen3"], tmp_path / "s", model_class="hybrid", moe_layer_freq=1, progress=False)
    assert not (tmp_path / "s").exists()


def test_hybrid_layout_megatron_layer_inverts_hf_layer():
    layout = HybridLayout.parse("*-G*E")
    assert [layout.megatron_layer(0, "self_attention.linear_qkv.weight"), layout.megatron_layer(0, "mlp.linear_fc1.weight"),
            layout.megatron_layer(1, "input_layernorm.weight"), layout.megatron_layer(2, "pre_mlp_layernorm.weight")] == [0, 1, 2, 4]
    with pytest.raises(ConfigMismatchError, match="HF layer 1 has no MLP layer"):
        layout.megatron_layer(1, "mlp.linear_fc1.weight")
    with pytest.raises(ConfigMismatchError, match="found a tensor of HF layer 3"):
        layout.megatron_layer(3, "input_layernorm.weight")


# --- every registered architecture megatron-core's hybrid stack can express (issue 38) -----------------------------

#: megatron-core 0.19's HybridModel; 0.16.1 (CI) has MambaModel, whose stack has one attention slot ('*'), no gated
#: DeltaNet, no MTP and no yarn position embedding (ssm/mamba_block.py, models/mamba/mamba_model.py)
MCORE_019 = _megatron_at_least(0, 19) if importlib.util.find_spec("megatron.core") else False
#: family members with their own tiny config (runtime.tiny.TINY_VARIANTS) or a config variant
VARIANTS = {"glm52": ("glm_moe_dsa", dict(index_topk_freq=2, index_skip_topk_offset=1)),  # GLM-5.2 IndexShare
            "kimi_k2": ("kimi_k2", {})}
#: CI: one world of the families whose blocks the hybrid stack holds as they are (MLA, DSA, full-width q/k norms,
#: MoE with shared experts, dense first layers); by hand (MCORE2HF_HYBRID_ALL=1) their format-mates
CI_ARCHS = ["deepseek_v3", "glm4_moe", "deepseek_v32", "minimax_m2"]
MATES = ["glm_moe_dsa", "glm4_moe_lite", "kimi_k2", "olmoe", "mixtral", "qwen2", "llama", "mistral"]
if not MCORE_019:
    MATES.append("deepseek_v2")  # MLA without q_lora_rank: 0.19 builds it only with TE's fused q projection
#: the vision-language architectures' language models (the tower not held: completed from the checkpoint, `base=`)
VLM_ARCHS = ["qwen3_vl", "qwen3_vl_moe", "glm4v_moe", "kimi_k25"]
#: megatron-core >= 0.19 only (the GPU machines' stack, or its wheel on PYTHONPATH): yarn rope (gpt-oss), gated
#: DeltaNet ('G'), GLM-5.2's IndexShare (0.19's DSA)
ONLY_019 = ["gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm52"]
#: MTP depths ('/' patterns), megatron-core >= 0.19: the MLA, GQA and DSA families with MTP layers
MTP_ARCHS = ["deepseek_v3", "glm4_moe", "deepseek_v32", "glm52"]

ARCH_WORLDS = [(Layout(tp=2, pp=2, ep=2, etp=1), CI_ARCHS + (ONLY_019 if MCORE_019 else []), False)]
if MCORE_019:
    ARCH_WORLDS.append((Layout(tp=2, pp=2, ep=2, etp=1), MTP_ARCHS, True))
if os.environ.get("MCORE2HF_HYBRID_ALL"):
    ARCH_WORLDS += [(Layout(tp=2, pp=2, ep=2, etp=1), MATES, False), (Layout(tp=2, pp=2, ep=2, etp=1), VLM_ARCHS, False),
                    (Layout(tp=2), CI_ARCHS, False), (Layout(pp=2), CI_ARCHS, False)]
    if MCORE_019:
        # GLM-5.2's shared layers sit beside their sources only at PP2 (4 layers), not in 4 virtual chunks
        ARCH_WORLDS += [(Layout(pp=2, vpp=2), CI_ARCHS + [a for a in ONLY_019 if a != "glm52"], False),
                        (Layout(tp=2, ep=2, etp=1), ONLY_019, False)]


@pytest.fixture(scope="module")
def arch_ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid_archs")
    names = sorted({mt for _, archs, _ in ARCH_WORLDS for mt in archs})
    return {mt: make_hf_checkpoint(tiny_config(*VARIANTS.get(mt, (mt, {}))[:1], **VARIANTS.get(mt, (mt, {}))[1]),
                                   root / mt) for mt in names}


@pytest.mark.parametrize("layout, archs, mtp", ARCH_WORLDS,
                         ids=[f"{lay}-{'+'.join(a)}{'-mtp' if m else ''}" for lay, a, m in ARCH_WORLDS])
def test_every_architecture_as_hybrid_model(arch_ckpts, layout, archs, mtp, tmp_path):
    """Each architecture's HybridModel (MLA '+', DSA 'D', gated DeltaNet 'G', MTP '/' on 0.19; on 0.16 every
    attention kind as '*') at `layout`: the live export bit-identical to the GPTModel's and to the HF source
    (local and TE names), the GPTModel's export loaded, a contradicting HF config refused, the forward equal to the
    GPTModel's bit for bit and to transformers' within the family tolerance (not with MTP: its forward needs
    labels); the hybrid model's torch_dist checkpoint exported offline equal to its live export; `mcore2hf import
    --model-class hybrid` loaded by Megatron (strict) and exported bit for bit, and exported back offline to the HF
    source; the one-process dry run (`mcore2hf plan --model-class hybrid`) equal to the live ranks' plan."""
    source = {mt: arch_ckpts[mt] for mt in archs}
    dist_root = str(tmp_path / "dist") if layout.pp > 1 else None
    import_root = tmp_path / "import"
    for mt in archs:  # the import follows the HF config: MTP depths as 0.19's HybridModel holds them
        import_checkpoint(source[mt], import_root / mt_type(source[mt]), model_class="hybrid", progress=False,
                          transformer_impl="local")
    results = run_world(worlds.for_each_arch, layout, worlds.hybrid_suite, source, layout, dist_root,
                        str(import_root), mtp)
    if not mtp:  # the GPTModel's forward is transformers' (the oracle), the hybrid model's is the GPTModel's
        logits = [{mt: r["logits"] for mt, r in res.items()} for res in results]
        problems = logit_problems(logits, source, worlds.TOKENS, f"{layout} hybrid")
        assert not problems, "\n".join(problems)
    dry = worlds.in_fresh_process(worlds.hybrid_dry_run, source, layout, mtp)
    for mt in archs:
        r = results[0][mt]
        assert r["model_class"] == ("HybridModel" if MCORE_019 else "MambaModel"), (mt, r["model_class"])
        assert all(x[mt]["logits_max_diff"] == (None if mtp else 0.0) for x in results), mt
        assert (r["mtp_pattern"] is not None) == mtp, (mt, r["mtp_pattern"])
        symbols = set(r["pattern"])
        print(f"{layout} {mt}: pattern {r['pattern']}{'/' + r['mtp_pattern'] if mtp else ''}, {r['tensors']} tensors")
        if not MCORE_019:
            assert symbols <= set("*-E"), (mt, r["pattern"])
        text, records, memory = dry[mt]
        live_text, live_records, _ = r["plan_4k"]
        assert records == live_records and text == live_text, mt
        assert memory == [x[mt]["plan_4k"][2] for x in results], mt
        assert r["imported_tensors"]["tensors"] == r["tensors"], (mt, r["imported_tensors"])
        ref = read_hf_checkpoint(source[mt])
        if dist_root is not None:  # Megatron indices, `final_norm`, 0.19's hybrid MTP keys: renumbered offline
            base = os.path.join(dist_root, mt_type(source[mt]))
            out = tmp_path / "offline" / mt
            export_checkpoint(os.path.join(base, "ckpt"), out, source[mt], progress=False)
            worlds.assert_same(read_hf_checkpoint(out), read_hf_checkpoint(os.path.join(base, "live")),
                               f"{layout} offline {mt}")
        out = tmp_path / "reexport" / mt  # the import (all of the HF config's tensors), exported back offline
        export_checkpoint(import_root / mt_type(source[mt]), out, source[mt], progress=False)
        conv = get_converter(mt_type(source[mt]))
        worlds.assert_same(read_hf_checkpoint(out), {n: t for n, t in ref.items() if not conv.not_held_by_model(n)},
                           f"import -> offline {mt}")


def mt_type(ckpt) -> str:
    return load_hf_config(ckpt).model_type


def test_hybrid_refusals_name_the_release():
    """What a release's hybrid stack cannot hold is refused before anything is built: on 0.16-0.18 gated
    DeltaNet layers, attention kinds mixed, MTP depths; the pattern check counts every attention kind as one."""
    from mcore2hf.arch.registry import get_model_spec
    from mcore2hf.model_specs.hybrid import hybrid_pattern_problems, release_symbols

    assert release_symbols(["+E", "+-"], True) == ["+E", "+-"]
    assert release_symbols(["+-", "+E"], False) == ["*-", "*E"]
    with pytest.raises(ConfigMismatchError, match="gated DeltaNet layers in a hybrid model need megatron-core >= 0.19"):
        release_symbols(["GE", "*E"], False)
    with pytest.raises(ConfigMismatchError, match="attention layers of several kinds"):
        release_symbols(["+E", "*E"], False)
    cfg = tiny_config("deepseek_v3")
    spec = get_model_spec("deepseek_v3")
    assert not hybrid_pattern_problems(HybridLayout.parse("*-*E*E*E"), spec, cfg)  # 0.16's '*' for MLA
    assert not hybrid_pattern_problems(HybridLayout.parse("+-+E+E+E"), spec, cfg)
    assert hybrid_pattern_problems(HybridLayout.parse("+E+E+E+E"), spec, cfg) == [
        "hybrid layer pattern, HF layer 0: HF config implies '+-', the model has '+E'"]
    if MCORE_019:  # IndexShare: every rank refuses a segment split that parts a shared layer from its source
        share = load_hf_config(tiny_config("glm_moe_dsa", index_topk_freq=2, index_skip_topk_offset=1).to_dict())
        refusals = run_world(worlds.hybrid_build_error, Layout(pp=2, vpp=2), share.to_dict())
        assert all(r.startswith("GLM-5.2 IndexShare in the hybrid pattern") for r in refusals), refusals
    qwen3_next = get_model_spec("qwen3_next")
    assert hybrid_pattern_problems(HybridLayout.parse("*E*E*E*E"), qwen3_next, tiny_config("qwen3_next"))[0] == (
        "hybrid layer pattern, HF layer 0: HF config implies 'GE', the model has '*E'")

