"""DeepSeek sparse attention (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`; megatron-core 0.16.1
transformer/experimental_attention_variant/dsa.py, transformers 5.24).

The indexer only matters when it chooses: with index_topk >= the sequence every query attends to every earlier
key (the dense regime), with index_topk below it (the tiny configs: 6 and 5 of 16 tokens, the sparse regime) the
logits depend on the indexer's choice, so on the indexer's weights and on where its rotary rows sit
(layouts.IndexerRope). Both regimes are compared with transformers' forward at TP 1 and TP 2 x EP 2 (the sparse one
at TP 2 x EP 2 in test_parity, exported and loaded by transformers), the sparse regime also in the layout matrix's
PP worlds (conftest.FORMAT_MATES: TP2 x PP2 x EP2, PP2 x VPP2, uneven PP). A negative
control shows the sparse oracle sees the indexer: the same weights with the indexer's rows left in HF order (what a
one-to-one copy would load on megatron-core 0.16-0.18) are far off.

GLM-5.2's IndexShare (layers marked "shared" reuse the previous full layer's top-k and have no indexer) exists in
megatron-core only from 0.19: on 0.16.1 build_model refuses it; its export is checked on a simulation of 0.19's
model structure (worlds.build_index_share) at TP 1 and TP 2 x PP 2 x EP 2 (stages that keep each shared layer with
its source, as 0.19 requires).

The same tests run on megatron-core >= 0.19 (the GPU machines' stack: `CUDA_VISIBLE_DEVICES= bash
bench/device_tests.sh .whl .whl-test -- tests/test_dsa.py`), where megatron-core builds DSA as absorbed MLA
(`AbsorbedMLASelfAttention`, unfused latent norms, sequence parallel at TP > 1) with the indexer's rotary rows in
HF's order, and IndexShare for real: there the tests marked `needs_019` also compare the IndexShare model's
forward with transformers' and export the real model."""

import pytest
import worlds
from oracle import hf_logits, logit_problems

from mcore2hf.arch.hf_config import load_hf_config
from mcore2hf.arch.registry import get_model_spec
from mcore2hf.errors import ConfigMismatchError
from mcore2hf.model_specs.deepseek_v3 import megatron_at_least
from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world

DSA = ("deepseek_v32", "glm_moe_dsa")
LAYOUTS = [Layout(), Layout(tp=2, ep=2, etp=1)]
MCORE_019 = megatron_at_least(0, 19)
#: megatron-core 0.19.2 experimental_attention_variant_module_specs.py:81-130 builds DSA on AbsorbedMLASelfAttention;
#: 0.16.1's DSAttention sits in MLASelfAttention (model_specs/deepseek_v32.py layer_spec)
ATTENTION = "AbsorbedMLASelfAttention/DSAttention" if MCORE_019 else "MLASelfAttention/DSAttention"
needs_019 = pytest.mark.skipif(not MCORE_019, reason="IndexShare's forward exists from megatron-core 0.19 (Python "
                               ">= 3.12: the GPU machines' stack, bench/device_tests.sh); 0.16-0.18 refuse it")


@pytest.fixture(scope="module")
def regimes(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per regime, a checkpoint per DSA architecture: sparse (the tiny configs) and dense (index_topk 64 > 16)."""
    root = tmp_path_factory.mktemp("dsa")
    return {regime: {mt: make_hf_checkpoint(tiny_config(mt, **over), root / regime / mt) for mt in DSA}
            for regime, over in (("sparse", {}), ("dense", {"index_topk": 64}))}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_logits_equal_transformers_dense_and_sparse(layout, regimes):
    """Both regimes at TP 1; at TP 2 x EP 2 the dense one (test_parity runs the sparse one there, exported), and
    at TP 1 the negative control."""
    problems = []
    runs = [("dense", False)] + ([("sparse", False), ("sparse", True)] if layout.size == 1 else [])
    for regime, scramble in runs:
        ckpts = regimes[regime]
        res = run_world(worlds.for_each_arch, layout, worlds.dsa_forward, ckpts, layout, scramble)
        for r in res:
            assert all(x["replicas_agree"] and x["indexer_tensors"] for x in r.values()), r
            assert all(x["attention"] == [ATTENTION] for x in r.values()), r
        logits = [{mt: x["logits"] for mt, x in r.items()} for r in res]
        if not scramble:
            problems += logit_problems(logits, ckpts, worlds.TOKENS, f"{layout} {regime}")
            continue
        for mt in ckpts:  # the indexer's choice changes the sparse logits by far more than the tolerance
            off = (logits[0][mt].double() - hf_logits(ckpts[mt], worlds.TOKENS)).abs().max().item()
            print(f"{layout} sparse {mt}, indexer rows moved the wrong way: max |diff| {off:.2f}")
            assert off > 1.0, (mt, off)
    assert not problems, "\n".join(problems)


def test_index_share_config_and_refusals():
    cfg = tiny_config("glm_moe_dsa", index_topk_freq=2, index_skip_topk_offset=1)
    assert cfg.indexer_types == ["full", "shared", "full", "shared"]
    spec = get_model_spec("glm_moe_dsa")
    assert spec.index_share_sources(cfg) == {1: 0, 3: 2}
    assert spec.index_share_stage_problems(cfg, [[0, 1], [2, 3]]) == []
    assert spec.index_share_stage_problems(cfg, [[0], [1, 2, 3]]) == [
        "layer 1 reuses layer 0's top-k but sits on pipeline stage/chunk 1, layer 0 on 0"]
    # one chunk's layers (megatron-core 0.19 _validate_dsa_index_share_pipeline_split, said before it raises)
    assert spec.local_index_share_problems(cfg, [0, 1]) == []
    assert spec.local_index_share_problems(cfg, [1, 2, 3]) == [
        "layer 1 reuses layer 0's top-k, which is not on its pipeline stage/chunk (layers [1, 2, 3])"]
    if MCORE_019:  # megatron-core 0.19.2 dsa.py is_dsa_skip_topk_layer: 1-based layers 2 and 4 reuse 1 and 3
        from mcore2hf.model_specs.deepseek_v32 import index_share_fields

        assert index_share_fields(cfg) == dict(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
        assert spec.dims(cfg).indexer_rope == "first"  # 0.19 keeps HF's order: no IndexerRope move
    else:
        with pytest.raises(ConfigMismatchError,
                           match=r"layers \[1, 3\] 'shared' \(IndexShare\): megatron-core < 0.19"):
            spec.transformer_config(cfg)
        assert spec.dims(cfg).indexer_rope == "last"
        assert get_model_spec("deepseek_v32").dims(tiny_config("deepseek_v32")).indexer_rope == "last_interleaved"
    # sglang reads indexer_rope_interleave; transformers fixes the rope per model_type: a contradiction is refused
    with pytest.raises(ConfigMismatchError, match="indexer_rope_interleave=False: transformers' glm_moe_dsa"):
        spec.dims(tiny_config("glm_moe_dsa", indexer_rope_interleave=False))
    with pytest.raises(ConfigMismatchError, match="indexer_rope_interleave=True: .* half-split"):
        get_model_spec("deepseek_v32").transformer_config(tiny_config("deepseek_v32", indexer_rope_interleave=True))
    assert get_model_spec("glm_moe_dsa").dims(tiny_config("glm_moe_dsa", indexer_rope_interleave=True))


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2, pp=2, ep=2, etp=1)], ids=str)
def test_index_share_exports_bit_identical(layout, tmp_path):
    from transformers import AutoModelForCausalLM

    # with the MTP layer (HF layer 4): megatron-core 0.19.2 numbers its inner layer 1 (multi_token_prediction.py:
    # 1036-1043), which always computes its own top-k, so it holds an indexer although the last decoder layer (3)
    # is "shared" (hf_config.hf_tensor_shapes); whether published GLM-5.2 checkpoints hold one there was not read
    cfg = tiny_config("glm_moe_dsa", index_topk_freq=2, index_skip_topk_offset=1)
    assert cfg.num_nextn_predict_layers == 1
    ckpt = make_hf_checkpoint(cfg, tmp_path / "src")
    hf = read_hf_checkpoint(ckpt)
    assert {n.split(".self_attn.indexer.")[0] for n in hf if ".indexer." in n} == {
        "model.layers.0", "model.layers.2", "model.layers.4"}
    res = run_world(worlds.index_share_matrix, layout, ckpt, layout, str(tmp_path))
    spec = get_model_spec("glm_moe_dsa")
    assert not spec.index_share_stage_problems(load_hf_config(ckpt), res[0]["stages"])
    _, info = AutoModelForCausalLM.from_pretrained(res[0]["out"], output_loading_info=True)
    # transformers builds no MTP layer (it drops the published one, layer 78: modeling_glm_moe_dsa.py
    # _keys_to_ignore_on_load_unexpected; the tiny model's is layer 4)
    unexpected = {k for k in info["unexpected_keys"] if not k.startswith("model.layers.4.")}
    assert not info["missing_keys"] and not unexpected and not info["mismatched_keys"], info


@needs_019
@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2, pp=2, ep=2, etp=1)], ids=str)
def test_index_share_forward_equals_transformers(layout, tmp_path):
    """megatron-core 0.19's real IndexShare model (shared layers without an indexer, reusing the source layer's
    top-k through DSAttention's per-forward holder) in the sparse regime against transformers 5.24's GLM-5.2 forward,
    at TP 1 and at TP 2 (sequence parallel) x PP 2 x EP 2 with each shared layer on its source's stage."""
    cfg = tiny_config("glm_moe_dsa", index_topk_freq=2, index_skip_topk_offset=1, num_nextn_predict_layers=0)
    ckpt = make_hf_checkpoint(cfg, tmp_path / "src")
    res = run_world(worlds.dsa_forward, layout, ckpt, layout)
    held = sorted({layer for r in res for layer in r["indexer_layers"]})
    assert held == [0, 2], held  # layers 1 and 3 are built without an indexer
    assert all(r["replicas_agree"] and r["attention"] == [ATTENTION] for r in res)
    problems = logit_problems([{"glm_moe_dsa": r["logits"]} for r in res], {"glm_moe_dsa": ckpt}, worlds.TOKENS,
                              f"{layout} IndexShare")
    assert not problems, "\n".join(problems)


def test_fp8_keeps_the_indexer_weights_proj_as_transformers_loads_it():
    """The published FP8 checkpoints keep `indexer.weights_proj` unquantized: transformers 5.24 loads them with
    `_keep_in_fp32_modules = ["indexer.weights_proj"]` on both models (modeling_deepseek_v32.py:666,
    modeling_glm_moe_dsa.py:640), which its FP8 loader adds to modules_to_not_convert
    (quantizers/quantizer_finegrained_fp8.py:122): a quantized weights_proj would not load there. mcore2hf's
    policy keeps exactly that one indexer weight in bf16 and quantizes wq_b and wk."""
    import transformers
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32PreTrainedModel
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaPreTrainedModel

    from mcore2hf.arch.registry import get_converter

    assert transformers.__version__ == "5.24.0"
    for cls in (DeepseekV32PreTrainedModel, GlmMoeDsaPreTrainedModel):
        assert cls._keep_in_fp32_modules == ["indexer.weights_proj"], cls
    for mt in DSA:
        policy = get_converter(mt).fp8
        for layer in (3, 61, 78):  # a decoder layer, and the published MTP layers (DeepSeek-V3.2: 61, GLM-5: 78)
            h = f"model.layers.{layer}.self_attn.indexer"
            assert not policy.quantized(f"{h}.weights_proj.weight", (64, 7168)), (mt, layer)
            assert policy.quantized(f"{h}.wq_b.weight", (8192, 1536)) and policy.quantized(f"{h}.wk.weight", (128, 7168))
