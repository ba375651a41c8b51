"""MTP ("nextn") layer names and FP8 policy against the published checkpoints, not transformers (which drops MTP
tensors on load). tests/data/mtp_<model_type>.json holds the MTP layer of deepseek-ai/DeepSeek-V3 (layer 61) and
zai-org/GLM-4.5-FP8 (layer 92) as listed from their safetensors files, routed experts collapsed to `{E}`; the
files cite their source. Pure: the converter's rules on a tiny config, no Megatron world."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from mcore2hf.arch.hf_config import hf_tensor_shapes
from mcore2hf.arch.naming import canonical_layer_name
from mcore2hf.arch.registry import get_converter, get_model_spec
from mcore2hf.formats.hf_as_megatron import megatron_names
from mcore2hf.quantize.fp8 import scale_shape
from mcore2hf.runtime.tiny import tiny_config

DATA = Path(__file__).parent / "data"
MODEL_TYPES = ("deepseek_v3", "glm4_moe")
_EXPERT = re.compile(r"(\.mlp\.experts\.)(\d+)(\.)")
# MultiTokenPredictionLayer's own parameters (megatron-core 0.16.1 transformer/multi_token_prediction.py: enorm,
# hnorm, eh_proj, final_layernorm; its transformer_layer is built from the decoder's last layer spec,
# models/gpt/gpt_layer_specs.py get_gpt_mtp_block_spec_for_backend)
MTP_OWN = ("enorm", "hnorm", "eh_proj", "final_layernorm")


@functools.cache
def published(model_type: str) -> dict:
    return json.loads((DATA / f"mtp_{model_type}.json").read_text())


def published_names(pub: dict) -> set[str]:
    """The checkpoint's tensor names without the FP8 scales (the names of its unquantized form)."""
    suffix = pub["fp8"]["scale_suffix"]
    return {n for n in pub["tensors"] if not (n.endswith(suffix) and n.removesuffix(suffix) in pub["tensors"])}


@functools.cache
def exported_mtp_layer(model_type: str) -> tuple[frozenset[str], int, int]:
    """(HF names an export of the tiny config writes into MTP layer 0, that layer's HF index, routed experts).

    The MTP layer's Megatron parameters are `mtp.layers.0.{enorm,hnorm,eh_proj,final_layernorm}.weight` and
    `mtp.layers.0.transformer_layer.<p>` for each parameter <p> of the last decoder layer (MTP_OWN); they go through
    the canonicalization and the converter's rules an export runs, with the shared embedding and output layer,
    whose copies land in the MTP layer. Every name that is not the main model's embedding / lm_head must be in
    layer num_hidden_layers."""
    cfg = tiny_config(model_type)
    conv, dims = get_converter(model_type), get_model_spec(model_type).dims(cfg)
    assert dims.num_mtp_layers == 1
    found, unexplained = megatron_names(conv, dims, set(hf_tensor_shapes(cfg)))  # transformers' names, no MTP
    assert not unexplained, unexplained
    last = f"decoder.layers.{dims.num_layers - 1}."
    inner = [n[len(last):] for n in found if n.startswith(last)]
    canonical = [canonical_layer_name("mtp", 0, f"transformer_layer.{p}", dims.num_layers) for p in inner]
    canonical += [canonical_layer_name("mtp", 0, f"{p}.weight", dims.num_layers) for p in MTP_OWN]
    canonical += ["embedding.word_embeddings.weight", "output_layer.weight"]
    names = set()
    for r in conv.resolve_all(canonical, dims).values():
        names.update(r.hf_names, r.copies)
    layer = f"model.layers.{dims.num_layers}."
    assert names - {"model.embed_tokens.weight", "lm_head.weight"} == {n for n in names if n.startswith(layer)}
    return frozenset(n for n in names if n.startswith(layer)), dims.num_layers, dims.num_experts


def renumbered(names, layer: int, to_layer: int, num_experts: int) -> set[str]:
    """`names` of HF layer `layer` moved to `to_layer`, routed expert ids collapsed to `{E}`; every expert id
    0..num_experts-1 must be present for each collapsed name, and no other."""
    out, ids = set(), {}
    for n in names:
        assert n.startswith(f"model.layers.{layer}."), n
        n = f"model.layers.{to_layer}." + n[len(f"model.layers.{layer}."):]
        m = _EXPERT.search(n)
        if m:
            key = _EXPERT.sub(r"\1{E}\3", n)
            ids.setdefault(key, set()).add(int(m.group(2)))
            n = key
        out.add(n)
    assert all(v == set(range(num_experts)) for v in ids.values()), ids
    return out


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_exported_mtp_layer_names_are_the_published_ones(model_type):
    pub = published(model_type)
    assert pub["mtp_layer"] == pub["num_hidden_layers"]  # the published MTP layer follows the main layers
    ours, layer, experts = exported_mtp_layer(model_type)
    ours = renumbered(ours, layer, pub["mtp_layer"], experts)
    want = published_names(pub)
    assert ours == want, f"only ours: {sorted(ours - want)}; only published: {sorted(want - ours)}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_mtp_extras_shapes_are_the_published_ones(model_type):
    """The MTP-only tensors' shapes (the contract exports are checked against, hf_tensor_shapes), in units of
    hidden size and vocab: eh_proj is [h, 2h] (input [embedding; hidden] concatenated, multi_token_prediction.py)."""
    pub = published(model_type)
    cfg = tiny_config(model_type)
    n, h, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    shapes = hf_tensor_shapes(cfg, 1)
    units = {pub["hidden_size"]: "h", 2 * pub["hidden_size"]: "2h", pub["vocab_size"]: "v"}
    ours_units = {h: "h", 2 * h: "2h", v: "v"}
    for extra in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens", "shared_head.head"):
        pub_shape = pub["tensors"][f"model.layers.{pub['mtp_layer']}.{extra}.weight"][0]
        assert [units[d] for d in pub_shape] == [ours_units[d] for d in shapes[f"model.layers.{n}.{extra}.weight"]]


def _policy_vs_published(model_type: str) -> tuple[set[str], set[str]]:
    """(MTP weights our FP8 export quantizes, MTP weights the published FP8 checkpoint stores quantized)."""
    pub = published(model_type)
    policy = get_converter(model_type).fp8
    suffix = pub["fp8"]["scale_suffix"]
    tensors = pub["tensors"]
    # the policy's patterns read numbers where the data file collapsed expert ids
    ours = {n for n in published_names(pub) if policy.quantized(n.replace("{E}", "0"), tensors[n][0])}
    theirs = {n for n in tensors if n + suffix in tensors}
    assert all(tensors[n][1] == "float8_e4m3fn" for n in theirs)
    return ours, theirs


def test_fp8_mtp_policy_is_deepseek_v3s():
    """DeepSeek-V3's MTP layer: exactly the tensors with a weight_scale_inv are the ones we quantize (eh_proj,
    embed_tokens, shared_head.head and the router gate stay bf16, FP8_KEEP / FP8_KEEP_MTP), and each published
    scale has the block shape our quantizer writes."""
    ours, theirs = _policy_vs_published("deepseek_v3")
    assert ours == theirs, f"only ours: {sorted(ours - theirs)}; only published: {sorted(theirs - ours)}"
    tensors = published("deepseek_v3")["tensors"]
    for n in theirs:
        assert list(scale_shape(tensors[n][0])) == tensors[n + "_scale_inv"][0], n


def test_fp8_mtp_policy_against_glm45_fp8():
    """GLM-4.5-FP8 is not block FP8: compressed-tensors, per-channel weight_scale [out, 1] (see the data file).
    Its MTP layer quantizes the same linears as our block-FP8 export, plus shared_head.head, which ours keeps bf16
    as DeepSeek-V3 does (converters/common.py FP8_KEEP_MTP: block-FP8 engine loaders build it unquantized). This
    pins that one difference; any other is a change of the policy to look at."""
    ours, theirs = _policy_vs_published("glm4_moe")
    assert theirs - ours == {"model.layers.92.shared_head.head.weight"} and not ours - theirs, (ours, theirs)
