"""The oracles for Transformer Engine's parameter names (mcore2hf/testing/te_spec.py), read without a world.

megatron-core 0.16.1's own TE spec, seen with a stand-in TE 2.11: for every architecture, the rules
testing/te_naming.py applies hold in it (which norms are IdentityOp because a TELayerNormColumnParallelLinear holds
them, grouped experts). Whether te_naming's names equal the spec's exactly is checked on real models in every
layout world (worlds.layout_matrix / qwen3_5_suite, `te_renamed`). Megatron-Bridge 0.3.1's tables: read as its
published wheel spells them."""

import pytest
from conftest import TE_SPEC_ARCHS
from harness.te_spec import BRIDGE_TABLES, bridge_patterns, bridge_regex

from mcore2hf.model_specs.deepseek_v3 import megatron_at_least

LN_LINEAR = "TELayerNormColumnParallelLinear"


def _cls(tree: dict, path: str) -> str | None:
    for part in path.split("."):
        tree = tree.get("sub", {}).get(part)
        if tree is None:
            return None
    return tree["class"]


def _layer_rules(layer: dict) -> list[str]:
    """Where the TE spec layer `layer` breaks a rule te_naming applies."""
    bad = []

    def want(path, cls):
        if _cls(layer, path) != cls:
            bad.append(f"{path} is {_cls(layer, path)}, te_naming assumes {cls}")

    attention = _cls(layer, "self_attention")
    if attention == "SelfAttention":  # input norm fused into linear_qkv
        want("input_layernorm", "IdentityOp")
        want("self_attention.linear_qkv", LN_LINEAR)
    elif attention in ("MLASelfAttention", "AbsorbedMLASelfAttention") and \
            _cls(layer, "self_attention.core_attention") == "DSAttention":
        # DeepSeek sparse attention: the latent norms unfused (the indexer reads the normalized query latent;
        # model_specs/deepseek_v32.py; megatron-core 0.19's own DSA spec on AbsorbedMLASelfAttention alike), the
        # indexer's linears duplicated TELinear, k_norm a TENorm
        want("input_layernorm", "TENorm")
        for norm, proj in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
            want(f"self_attention.{norm}", "TENorm")
            want(f"self_attention.{proj}", "TEColumnParallelLinear")
        for lin in ("linear_wq_b", "linear_wk", "linear_weights_proj"):
            want(f"self_attention.core_attention.indexer.{lin}", "TELinear")
        want("self_attention.core_attention.indexer.k_norm", "TENorm")
    elif attention == "MLASelfAttention":  # separate input norm; q/kv latent norms fused into the up projections
        want("input_layernorm", "TENorm")
        for norm, proj in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
            want(f"self_attention.{norm}", "IdentityOp")
            want(f"self_attention.{proj}", LN_LINEAR)
    elif attention == "GatedDeltaNet":  # input norm fused into in_proj
        want("input_layernorm", "IdentityOp")
        want("self_attention.in_proj", LN_LINEAR)
    else:
        bad.append(f"self_attention is {attention}")
    mlp = _cls(layer, "mlp")
    if mlp == "MLP":  # dense: pre-MLP norm fused into linear_fc1
        want("pre_mlp_layernorm", "IdentityOp")
        want("mlp.linear_fc1", LN_LINEAR)
    elif mlp == "MoELayer":  # separate pre-MLP norm; grouped experts weight{i}; shared experts plain linears
        want("pre_mlp_layernorm", "TENorm")
        want("mlp.experts", "TEGroupedMLP")
        want("mlp.experts.linear_fc1", "TEColumnParallelGroupedLinear")
        want("mlp.experts.linear_fc2", "TERowParallelGroupedLinear")
        if _cls(layer, "mlp.shared_experts.linear_fc1") is not None:
            want("mlp.shared_experts.linear_fc1", "TEColumnParallelLinear")
    else:
        bad.append(f"mlp is {mlp}")
    return bad


def test_megatron_core_te_spec_has_the_fusions_te_naming_applies(te_specs):
    kinds = set()
    for mt in TE_SPEC_ARCHS:
        tree = te_specs.get(mt)
        if tree is None:  # megatron-core >= 0.19 cannot build MLA without q_lora_rank (model_specs/deepseek_v3.py)
            assert megatron_at_least(0, 19) and mt == "deepseek_v2", mt
            continue
        assert tree["normalization"] == "RMSNorm", mt  # TE's layer_norm_bias exists only with LayerNorm
        layers = tree["layers"] + [m["sub"]["transformer_layer"] for m in tree["mtp"]]
        for i, layer in enumerate(layers):
            bad = _layer_rules(layer)
            assert not bad, (mt, i, bad)
            kinds.add((_cls(layer, "self_attention"), _cls(layer, "mlp")))
        for m in tree["mtp"]:
            assert [_cls(m, s) for s in ("enorm", "hnorm", "eh_proj", "layer_norm")] == \
                ["TENorm", "TENorm", "TEColumnParallelLinear", "TENorm"], mt
    # every attention and MLP kind te_naming rewrites is present in some architecture
    # (megatron-core >= 0.19 builds the DSA models on AbsorbedMLASelfAttention, the other MLA models as before)
    assert {a for a, _ in kinds} - {"AbsorbedMLASelfAttention"} == {"SelfAttention", "MLASelfAttention",
                                                                    "GatedDeltaNet"}, kinds
    assert ("AbsorbedMLASelfAttention" in {a for a, _ in kinds}) == megatron_at_least(0, 19), kinds
    assert {m for _, m in kinds} == {"MLP", "MoELayer"}, kinds


@pytest.mark.parametrize("model_type", sorted(BRIDGE_TABLES))
def test_bridge_tables_spell_te_names(model_type):
    """The patterns read from Megatron-Bridge 0.3.1's wheel are its TE-model names: a fused norm in every table,
    grouped experts (`weight*`) in every MoE table."""
    patterns = bridge_patterns(model_type)
    assert any(p.endswith(".layer_norm_weight") for p in patterns), patterns
    moe = any(".mlp.router." in p for p in patterns)
    assert moe == any(p.endswith(".mlp.experts.linear_fc1.weight*") for p in patterns), patterns
    assert "embedding.word_embeddings.weight" in patterns


def test_bridge_wildcards_match_digits_only():
    r = bridge_regex("decoder.layers.*.mlp.experts.linear_fc1.weight*")
    assert r.match("decoder.layers.12.mlp.experts.linear_fc1.weight7")
    assert not r.match("decoder.layers.12.mlp.experts.linear_fc1.weight")  # megatron-core 0.19's single tensor
    assert not r.match("decoder.layers.12.mlp.experts.local_experts.7.linear_fc1.weight")
    assert not bridge_regex("decoder.layers.*.input_layernorm.weight").match("mtp.layers.0.input_layernorm.weight")
