"""The checkpoint key scheme (mcore2hf.formats.checkpoint_keys), pure: what the import writes (`KeyLayout.key`, `part_key`)
reads back (`canonical_parts`) as exactly the canonical names and parts it came from, for every key form: stacked
and per-layer decoder layers, the key renames of both transformer_impls, gated DeltaNet layers and parts, MLA,
stacked and per-expert experts with GLU halves, MTP layers, hybrid stacks. That the forms are megatron-core's own is
tests/test_import.py's part (Megatron loads the import and re-saves the same keys)."""

import pytest

from mcore2hf.arch.naming import HybridLayout
from mcore2hf.arch.registry import get_model_spec
from mcore2hf.errors import ConfigMismatchError, UsageError
from mcore2hf.formats.checkpoint_keys import (
    GLU_PARTS,
    LOCAL,
    RENAMES,
    TOWER_PREFIXES,
    TRANSFORMER_ENGINE,
    KeyLayout,
    canonical_parts,
    check_transformer_impl,
    embedded_tower_rules,
    extra_state_key,
    layer_keys,
    parse_moe_layer_freq,
    part_key,
    pattern_text,
    split_part,
)
from mcore2hf.layouts.gdn import GDN_PARTS
from mcore2hf.runtime.tiny import tiny_config

E = 4  # experts
TOP = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
ATTENTION = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
             "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
             "self_attention.linear_proj.weight"]
MLA = ["input_layernorm.weight", "self_attention.linear_q_down_proj.weight", "self_attention.q_layernorm.weight",
       "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
       "self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.weight",
       "self_attention.linear_proj.weight"]
GDN = ["input_layernorm.weight", "self_attention.in_proj.weight", "self_attention.conv1d.weight",
       "self_attention.A_log", "self_attention.out_norm.weight", "self_attention.out_proj.weight"]
DENSE_MLP = ["pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
MOE = ["pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.router.expert_bias",
       "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
       *[f"mlp.experts.{e}.linear_fc{i}.{p}" for e in range(E) for i in (1, 2) for p in ("weight", "bias")]]
MTP = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
       "mtp.layers.0.final_layernorm.weight"]
#: a native vision tower (Qwen3-VL's): blocks, deepstack mergers, the merger, patch and position embeddings
_MERGER = ["patch_norm.weight", "patch_norm.bias", "linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight",
           "linear_fc2.bias"]
NATIVE_TOWER = ([f"vision_model.decoder.layers.{v}.{n}" for v in range(3) for n in (
    "input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")]
    + [f"vision_model.decoder.deepstack_merger_list.{d}.{n}" for d in range(2) for n in _MERGER]
    + [f"vision_model.merger.{n}" for n in _MERGER]
    + ["vision_model.patch_embed.proj.weight", "vision_model.patch_embed.proj.bias", "vision_model.pos_embed.weight"])
#: transformers' tower embedded in the wrapper (its HF module paths)
HF_TOWER = ["vision_model.blocks.0.attn.qkv.weight", "vision_model.blocks.0.norm1.weight",
            "vision_model.merger.linear_fc1.weight", "vision_model.deepstack_merger_list.0.norm.weight",
            "vision_model.patch_embed.proj.weight"]
NATIVE_WRAPPER = dict(vision_tower="native", vision_depth=3, vision_deepstack=2)


def names(layers: list[list[str]], mtp: list[str] | None = None) -> list[str]:
    """Canonical names of a model whose decoder layer i holds layers[i] (and one MTP layer holding `mtp`)."""
    out = TOP + [f"decoder.layers.{i}.{n}" for i, held in enumerate(layers) for n in held]
    if mtp is not None:
        out += MTP + [f"decoder.layers.{len(layers)}.{n}" for n in mtp]
    return out


def parts_of(name: str, layout: KeyLayout) -> tuple[str, ...]:
    """The parts the import saves a tensor as (its layout op's checkpoint_parts, GLU halves with singleton)."""
    if name.endswith(("self_attention.in_proj.weight",)):
        return GDN_PARTS
    if name.endswith("self_attention.conv1d.weight"):
        return GDN_PARTS[:3]
    if layout.singleton and name.endswith("linear_fc1.weight"):
        return GLU_PARTS
    return ("",)


def moe(*layers: int) -> frozenset[int]:
    return frozenset(layers)


CASES = {
    "dense, stacked layers": (dict(num_layers=3, stacked=True), names([ATTENTION + DENSE_MLP] * 3)),
    "dense, per layer": (dict(num_layers=3), names([ATTENTION + DENSE_MLP] * 3)),
    "all MoE, stacked layers and experts (moe_layer_freq=1)": (
        dict(num_layers=3, num_experts=E, stacked=True, moe_layers=moe(0, 1, 2)), names([ATTENTION + MOE] * 3)),
    "dense first layer, MoE, MTP": (dict(num_layers=3, num_experts=E, moe_layers=moe(1, 2, 3)),
                                    names([ATTENTION + DENSE_MLP] + [ATTENTION + MOE] * 2, ATTENTION + MOE)),
    "singleton: per expert, GLU halves": (dict(num_layers=3, num_experts=E, singleton=True, moe_layers=moe(1, 2, 3)),
                                          names([ATTENTION + DENSE_MLP] + [ATTENTION + MOE] * 2, ATTENTION + MOE)),
    "MLA, MTP": (dict(num_layers=2, num_experts=E, mla=True, moe_layers=moe(1, 2)),
                 names([MLA + DENSE_MLP, MLA + MOE], MLA + MOE)),
    "gated DeltaNet and full attention": (dict(num_layers=3, num_experts=E, gdn_layers=moe(0, 1), moe_layers=moe(0, 1, 2)),
                                          names([GDN + MOE, GDN + MOE, ATTENTION + MOE])),
    "hybrid stack": (dict(num_layers=3, num_experts=E, gdn_layers=frozenset({1}), hybrid=HybridLayout.parse("*-G*E"),
                          moe_layers=moe(2)), names([ATTENTION + DENSE_MLP, GDN, ATTENTION + MOE])),
    "hybrid stack with MLA and an MTP depth (megatron-core 0.19)": (
        dict(num_layers=2, num_experts=E, mla=True, hybrid=HybridLayout.parse("+-+E/+E"), moe_layers=moe(1, 2)),
        names([MLA + DENSE_MLP, MLA + MOE], MLA + MOE)),
    "vision-language wrapper, native tower, stacked": (dict(num_layers=2, stacked=True, **NATIVE_WRAPPER),
                                                        names([ATTENTION + DENSE_MLP] * 2) + NATIVE_TOWER),
    "vision-language wrapper, native tower, per index": (dict(num_layers=2, vision_stacked=False, **NATIVE_WRAPPER),
                                                          names([ATTENTION + DENSE_MLP] * 2) + NATIVE_TOWER),
    "vision-language wrapper, embedded HF tower": (dict(num_layers=2, num_experts=E, stacked=True, vision_tower="hf",
                                                        moe_layers=moe(0, 1)), names([ATTENTION + MOE] * 2) + HF_TOWER),
}


@pytest.mark.parametrize("impl", (TRANSFORMER_ENGINE, LOCAL))
@pytest.mark.parametrize("case", CASES)
def test_keys_read_back_as_the_names_they_were_written_from(case, impl):
    fields, canonical = CASES[case]
    layout = KeyLayout(**fields, transformer_impl=impl)
    written: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in canonical:
        key, lead, glob = layout.key(name)
        assert len(lead) == len(glob) and all(0 <= i < n for i, n in zip(lead, glob)), (name, key, lead, glob)
        for part in parts_of(name, layout):
            k = part_key(key, part)
            assert split_part(k) == (key, part)
            assert shapes.setdefault(k, (*glob, 2, 3)) == (*glob, 2, 3), k  # one global shape per key
            written.setdefault(name, {})[part] = (k, lead)
    pairs = [item for parts in written.values() for item in parts.values()]
    assert len(pairs) == len(set(pairs)), "two names written to one (key, index)"
    found, ignored = canonical_parts([*shapes, "optimizer.state.exp_avg.x", "rng_state"], shapes.__getitem__,
                                     layout.num_layers, layout.hybrid)
    assert found == written
    assert ignored == ["optimizer.state.exp_avg.x", "rng_state"]


def test_the_key_forms_are_megatrons():
    """Spot checks of each form against megatron-core 0.16.1's spelling (transformer_block.py, gpt_layer_specs.py
    local keys map, moe/experts.py, multi_token_prediction.py, gated_delta_net.py, mamba_block.py); the local impl's
    renames (transformer_engine's: test_transformer_engine_renames and tests/test_import.py's TE-spec oracle)."""
    stacked = KeyLayout(4, E, stacked=True, transformer_impl=LOCAL)
    assert stacked.key("decoder.layers.2.input_layernorm.weight") == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", (2,), (4,))
    assert stacked.key("decoder.layers.2.mlp.experts.3.linear_fc2.weight") == (
        "decoder.layers.mlp.experts.experts.linear_fc2.weight", (2, 3), (4, E))
    assert stacked.key("decoder.layers.4.pre_mlp_layernorm.weight") == (  # MTP: never stacked
        "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight", (), ())
    single = KeyLayout(4, E, singleton=True, transformer_impl=LOCAL)
    assert single.key("decoder.layers.1.mlp.experts.3.linear_fc1.weight") == (
        "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight", (), ())
    assert part_key("decoder.layers.1.mlp.linear_fc1.weight", "w") == "decoder.layers.1.mlp.linear_fc1.weight_w"
    assert KeyLayout(2, mla=True, transformer_impl=LOCAL).key("decoder.layers.0.input_layernorm.weight")[0] == \
        "decoder.layers.0.input_layernorm.weight"
    gdn = KeyLayout(2, gdn_layers=frozenset({0}), transformer_impl=LOCAL)
    assert gdn.key("decoder.layers.0.input_layernorm.weight")[0] == "decoder.layers.0.self_attention.in_proj.layer_norm_weight"
    assert part_key("decoder.layers.0.self_attention.in_proj.weight", "beta") == \
        "decoder.layers.0.self_attention.in_proj.weight.beta"
    hybrid = KeyLayout(2, hybrid=HybridLayout.parse("*-*-"), stacked=True,  # a hybrid stack is never stacked
                       transformer_impl=LOCAL)
    assert hybrid.key("decoder.layers.1.pre_mlp_layernorm.weight") == (
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight", (), ())
    assert hybrid.key("decoder.final_layernorm.weight")[0] == "decoder.final_norm.weight"
    # 0.19's hybrid MTP depth: its two-layer stack, `mtp_model_layer` kept in the keys (multi_token_prediction.py:
    # 1018-1033, 1549-1558)
    mtp = KeyLayout(2, E, hybrid=HybridLayout.parse("*-*E/*E"), moe_layers=moe(1, 2), transformer_impl=LOCAL)
    assert mtp.key("decoder.layers.2.input_layernorm.weight")[0] == (
        "mtp.layers.0.mtp_model_layer.layers.0.self_attention.linear_qkv.layer_norm_weight")
    assert mtp.key("decoder.layers.2.mlp.router.weight")[0] == "mtp.layers.0.mtp_model_layer.layers.1.mlp.router.weight"
    assert extra_state_key("decoder.layers.2.mlp.experts.3.linear_fc2.weight",
                           *stacked.key("decoder.layers.2.mlp.experts.3.linear_fc2.weight")) == \
        "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_2.3_4.4"
    assert extra_state_key("decoder.layers.0.pre_mlp_layernorm.weight",
                           *stacked.key("decoder.layers.0.pre_mlp_layernorm.weight")) is None  # a norm in fc1's key


def test_vision_language_wrapper_key_forms():
    """Megatron-Bridge's Qwen3VLModel (a MegatronModule: each child under its name): the GPT model's keys under
    `language_model.`; a native tower's blocks stacked as megatron-core's block stacks layers, TE's ViT spec fusing
    their norms (the local ViT spec has no keys map), its deepstack mergers stacked (Bridge 0.6.2
    transformer_block.py:393-465), linears with an `_extra_state`; an embedded transformers tower under its own
    names, no `_extra_state` (what tests/test_qwen3_vl_native.py and tests/test_vlm.py check against checkpoints
    Megatron saved of both)."""
    te = KeyLayout(2, stacked=True, **NATIVE_WRAPPER)
    local = KeyLayout(2, stacked=True, transformer_impl=LOCAL, **NATIVE_WRAPPER)
    assert te.key("decoder.layers.1.input_layernorm.weight")[0] == \
        "language_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert te.key("embedding.word_embeddings.weight")[0] == "language_model.embedding.word_embeddings.weight"
    block = "vision_model.decoder.layers.2.input_layernorm.bias"
    assert te.key(block) == ("vision_model.decoder.layers.self_attention.linear_qkv.layer_norm_bias", (2,), (3,))
    assert local.key(block) == ("vision_model.decoder.layers.input_layernorm.bias", (2,), (3,))
    merger = "vision_model.decoder.deepstack_merger_list.1.linear_fc1.weight"
    assert local.key(merger) == ("vision_model.decoder.deepstack_merger_list.linear_fc1.weight", (1,), (2,))
    assert local.extra_state(merger) == "vision_model.decoder.deepstack_merger_list.linear_fc1._extra_state/shard_1_2"
    assert local.extra_state("vision_model.merger.linear_fc2.bias") == "vision_model.merger.linear_fc2._extra_state/shard_0_1"
    assert local.extra_state("vision_model.merger.patch_norm.weight") is None
    assert te.extra_state("vision_model.merger.patch_norm.weight") == "vision_model.merger.patch_norm._extra_state/shard_0_1"
    assert local.key("vision_model.pos_embed.weight") == ("vision_model.pos_embed.weight", (), ())
    hf = KeyLayout(2, stacked=True, transformer_impl=LOCAL, vision_tower="hf")
    assert hf.key("vision_model.merger.linear_fc1.weight") == ("vision_model.merger.linear_fc1.weight", (), ())
    assert hf.extra_state("vision_model.merger.linear_fc1.weight") is None
    assert hf.extra_state("decoder.layers.0.self_attention.linear_qkv.weight") == \
        "language_model.decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"
    # GLM45VModel's `visual` and KimiK25VLModel's `vision_tower` / `mm_projector`: the tower under the child's name,
    # read back as the same canonical names, beside the language model's keys
    for name in ("visual.blocks.0.attn.qkv.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
                 "mm_projector.proj.0.weight"):
        assert hf.key(name) == (name, (), ()) and hf.extra_state(name) is None
        found, ignored = canonical_parts([name, "language_model.embedding.word_embeddings.weight"], lambda k: (3, 3), 2)
        assert found == {name: {"": (name, ())}, "embedding.word_embeddings.weight": {
            "": ("language_model.embedding.word_embeddings.weight", ())}} and not ignored


def test_every_embedded_tower_is_under_a_wrapper_child():
    """Each table's pass-through tower rule (`<child>.{NAME}`, converters.common.hf_tower) names a child the key
    scheme reads as a tower (TOWER_PREFIXES), and GLM-4.5V's and Kimi-K2.5's are Bridge's `visual` /
    `vision_tower` + `mm_projector`."""
    from mcore2hf.arch.registry import get_converter

    passes = {mt: sorted(r.megatron for r in get_converter(mt).rules if "{NAME}" in r.megatron)
              for mt in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v_moe", "kimi_k25")}
    assert all(p and sorted(r.megatron for r in embedded_tower_rules(get_converter(mt).rules)) == p and
               all(r.startswith(TOWER_PREFIXES) for r in p) for mt, p in passes.items()), passes
    assert passes["glm4v_moe"] == ["visual.{NAME}"]
    assert passes["kimi_k25"] == ["mm_projector.{NAME}", "vision_tower.{NAME}"]


def test_other_writers_spellings_are_read():
    """Read only: Transformer Engine's MLA fused norms (naming.TE_RENAMES), per-expert keys without `experts.`,
    megatron-core 0.19's `mtp_model_layer.`."""
    keys = {"decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight": (8,),
            "decoder.layers.0.mlp.experts.3.linear_fc1.weight": (4, 2),
            "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight": (4, 2)}
    found, _ = canonical_parts(keys, keys.__getitem__, 2)
    assert set(found) == {"decoder.layers.0.self_attention.q_layernorm.weight",
                          "decoder.layers.0.mlp.experts.3.linear_fc1.weight",
                          "decoder.layers.2.self_attention.linear_qkv.weight"}


def test_renames_read_back_whatever_the_layer_kind():
    """A key prefix names one canonical prefix, so reading needs no layer kind and no transformer_impl."""
    every = [r for table in RENAMES.values() for r in table]
    for r in every:
        assert all(o.canonical == r.canonical for o in every if o.key == r.key)


def test_transformer_engine_renames():
    """megatron-core 0.16.1 get_gpt_layer_with_transformer_engine_spec: the input norm fused into linear_qkv, a
    dense MLP's norm into linear_fc1, an MoE layer's pre-MLP norm separate; MLA: the input norm separate, q/kv
    norms fused into the up projections (also dense MLP norms); gated DeltaNet: the input norm into in_proj."""
    te = KeyLayout(3, E, stacked=True, moe_layers=moe(1, 2, 3))
    assert te.transformer_impl == TRANSFORMER_ENGINE  # Megatron-LM's default
    assert te.key("decoder.layers.1.pre_mlp_layernorm.weight")[0] == "decoder.layers.pre_mlp_layernorm.weight"
    assert te.key("decoder.layers.0.pre_mlp_layernorm.weight")[0] == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert te.key("decoder.layers.1.input_layernorm.weight")[0] == \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert te.key("decoder.layers.3.pre_mlp_layernorm.weight")[0] == "mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight"
    mla = KeyLayout(2, E, mla=True, moe_layers=moe(1))
    assert [mla.key(f"decoder.layers.{i}.{n}")[0] for i, n in (
        (0, "input_layernorm.weight"), (0, "self_attention.q_layernorm.weight"), (1, "self_attention.kv_layernorm.weight"),
        (0, "pre_mlp_layernorm.weight"), (1, "pre_mlp_layernorm.weight"))] == [
        "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
        "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight"]
    gdn = KeyLayout(2, E, gdn_layers=moe(0), moe_layers=moe(0, 1))
    assert gdn.key("decoder.layers.0.input_layernorm.weight")[0] == "decoder.layers.0.self_attention.in_proj.layer_norm_weight"
    assert gdn.key("decoder.layers.0.pre_mlp_layernorm.weight")[0] == "decoder.layers.0.pre_mlp_layernorm.weight"
    with pytest.raises(UsageError, match="transformer_impl must be one of transformer_engine, local"):
        check_transformer_impl("te")


def test_moe_layer_freq_spellings():
    """Megatron-LM's --moe-layer-freq (arguments.py moe_freq_type): ints, their strings, list expressions."""
    assert [parse_moe_layer_freq(v) for v in (1, "3", " [1]*2 ", "([1]*2+[0])*2", "[0]+[1]*3")] == \
        [1, 3, [1, 1], [1, 1, 0, 1, 1, 0], [0, 1, 1, 1]]
    assert pattern_text([0, 0, 0, 1, 1, 0]) == "[0]*3+[1]*2+[0]" and pattern_text([1]) == "[1]"
    for bad in ("__import__('os').system('true')", "[1]*2**40", "[1]*99999999", "0", "-1", "[2]", "[]", "[[1]]",
                "(1, 0)", "1.5", "x", True, [1, 2], "[1"):
        with pytest.raises(UsageError, match="moe_layer_freq"):
            parse_moe_layer_freq(bad)


@pytest.mark.parametrize("mt, freq, extra, form", [
    ("qwen3_moe", None, {}, "stacked (decoder.layers.<name>, layer axis sharded over PP): moe_layer_freq=1"),
    ("qwen3_moe", "([1]*4)", {}, "per layer: moe_layer_freq is a list ([1]*4)"),
    ("qwen3_moe", None, {"non_homogeneous": True}, "per layer: non_homogeneous_layers"),
    ("qwen3_moe", 1, {"singleton": True}, "per layer: singleton_local_shards"),
    ("glm4_moe", None, {}, "per layer: moe_layer_freq is a list ([0]+[1]*3)"),
    ("glm4_moe", [0, 1, 1, 1], {}, "per layer: moe_layer_freq is a list ([0]+[1]*3)"),
    ("qwen3", None, {}, "stacked (decoder.layers.<name>, layer axis sharded over PP): moe_layer_freq=1"),
    ("qwen3", 2, {}, "per layer: moe_layer_freq=2 > 1"),  # a dense model's freq still decides (transformer_block.py)
    ("qwen3", "[0]*4", {}, "per layer: moe_layer_freq is a list ([0]*4)"),
    ("qwen3_next", None, {}, "per layer: gated DeltaNet layers (linear_attention_freq is an int > 1 or a list)"),
    ("qwen3", None, {"hybrid": True}, "per layer: a hybrid model (every Megatron layer under its own index)"),
])
def test_layer_keys_decide_as_megatron_core(mt, freq, extra, form):
    cfg = tiny_config(mt)
    spec = get_model_spec(mt)
    kw = {"singleton": False, "non_homogeneous": False, "hybrid": False, **extra}
    stacked, why = layer_keys(spec, cfg, spec.dims(cfg), freq, **kw)
    assert (stacked, why) == (form.startswith("stacked"), form)


def test_layer_keys_refuse_a_freq_that_does_not_build_the_model():
    cfg, spec = tiny_config("glm4_moe"), get_model_spec("glm4_moe")
    with pytest.raises(ConfigMismatchError, match=r"moe_layer_freq=1 gives the dense \(0\) / MoE \(1\) layers \[1\]\*4, "
                                                  r"the HF config has \[0\]\+\[1\]\*3: pass the value the Megatron "
                                                  r"model is built with \('\[0\]\+\[1\]\*3' \(per-layer keys\)\)"):
        layer_keys(spec, cfg, spec.dims(cfg), 1, singleton=False, non_homogeneous=False, hybrid=False)
    with pytest.raises(UsageError, match="moe_layer_freq with model_class='hybrid'"):
        layer_keys(spec, cfg, spec.dims(cfg), 1, singleton=False, non_homogeneous=False, hybrid=True)
