"""FP8 block-quantized export (live): bit-identical to the reference quantizer (itself pinned bit for bit to
DeepGEMM's, test_quantize) applied to the full HF tensors, for every architecture over a layout matrix, with
weights larger than 128 and not multiples of it; transformers loads the output and its logits follow the Megatron
forward within the measured FP8 rounding."""

import json
import os

import pytest
import torch
import worlds
from conftest import ARCHS as ALL_ARCHS
from conftest import FORMAT_MATES, WORLD_ARCHS
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from mcore2hf.arch.registry import get_converter
from mcore2hf.quantize.fp8 import FP8Policy, dequantize_fp8
from mcore2hf.runtime.forward import logit_tolerance
from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world, same_on_every_rank

# gpt-oss has no FP8 table (its experts are published in MXFP4): refused, see test_gpt_oss.py
ARCHS = [mt for mt in ALL_ARCHS if mt != "gpt_oss"]

# dims over 128 and not multiples of it: edge blocks in both directions, 128-blocks that straddle TP / ETP shard
# boundaries (an ETP2 shard of the 160-row GLU half has 80 rows), MLA ranks 160 / 144
BIG = dict(hidden_size=192, intermediate_size=320, vocab_size=300)
BIG_ARCH = {
    "qwen3_moe": dict(moe_intermediate_size=256, head_dim=48),  # GLU halves of whole blocks: experts at ETP1
                                                                # are quantized before the EP gather
    "glm4_moe": dict(moe_intermediate_size=160, head_dim=48),
    "deepseek_v3": dict(moe_intermediate_size=160, q_lora_rank=160, kv_lora_rank=144, qk_nope_head_dim=48,
                        qk_rope_head_dim=16, v_head_dim=48),
    "qwen3": dict(head_dim=48), "qwen2": {}, "llama": {},
    "glm4_moe_lite": dict(moe_intermediate_size=160, q_lora_rank=160, kv_lora_rank=144, qk_nope_head_dim=48,
                          qk_rope_head_dim=16, v_head_dim=64),
    "deepseek_v2": dict(moe_intermediate_size=160, kv_lora_rank=144, qk_nope_head_dim=48, qk_rope_head_dim=16,
                        v_head_dim=48),
    "mixtral": dict(head_dim=48), "mistral": dict(head_dim=48),  # Mixtral's experts: intermediate_size 320
    "minimax_m2": dict(head_dim=48, rotary_dim=24), "olmoe": {},  # expert width: intermediate_size (320)
    # the DSA indexer: wq_b 5 x 64 = 320 rows (edge blocks), wk 64 rows, weights_proj kept bf16
    "deepseek_v32": dict(moe_intermediate_size=160, q_lora_rank=160, kv_lora_rank=144, qk_nope_head_dim=48,
                         qk_rope_head_dim=16, v_head_dim=48, index_head_dim=64),
    "glm_moe_dsa": dict(moe_intermediate_size=160, q_lora_rank=160, kv_lora_rank=144, qk_nope_head_dim=48,
                        qk_rope_head_dim=16, v_head_dim=64, index_head_dim=64),
}


@pytest.fixture(scope="module")
def big_bf16(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts_fp8")
    return {mt: make_hf_checkpoint(tiny_config(mt, **BIG, **BIG_ARCH[mt]), root / mt, seed=2, dtype=torch.bfloat16)
            for mt in ARCHS if mt in WORLD_ARCHS}


LAYOUTS = [
    Layout(tp=2, pp=2, ep=2, etp=1),  # TP, PP, EP, expert-TP != TP
    Layout(pp=2, vpp=2, ep=2, etp=1),  # virtual pipeline
    Layout(ep=2, etp=2),  # expert-TP > TP: 128-blocks straddle the ETP shards
]


SGLANG = "0.5.23"  # sglang/srt/weight_sync/tensor_bucket.py of the published wheel


def sglang_accepts_fp8_buckets(paths) -> None:
    """SGLang's own FlattenedTensorBucket (from its wheel) receives an FP8 bucket as sent: the receive buffer it
    allocates from (names, dtypes, shapes) has our offsets (fp8 weights and fp32 scales aligned), and the tensors
    it reconstructs from our flat buffer are ours; flattening our tensors its way gives our bytes."""
    import importlib.util

    from harness.wheels import unpacked_wheel

    root = unpacked_wheel("sglang", SGLANG, ("sglang/*",))
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket",
                                                  root / "sglang" / "srt" / "weight_sync" / "tensor_bucket.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for path in paths:
        saved = torch.load(path)
        flat, meta = saved["flat"], saved["meta"]
        dtypes = [m[2].removeprefix("torch.") for m in meta]
        assert "float8_e4m3fn" in dtypes and any(m[0].endswith("weight_scale_inv") for m in meta), path
        recv = mod.FlattenedTensorBucket.empty([m[0] for m in meta], dtypes, [m[1] for m in meta], "cpu")
        assert [(x.start_idx, x.end_idx) for x in recv.get_metadata()] == [(m[3], m[4]) for m in meta], path
        recv.flattened_tensor.copy_(flat)
        got = recv.reconstruct_tensors()
        ours = [(m[0], flat[m[3]:m[4]].view(getattr(torch, d)).view(m[1])) for m, d in zip(meta, dtypes)]
        assert [n for n, _ in got] == [n for n, _ in ours]
        assert all(a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for (_, a), (_, b) in zip(got, ours))
        again = mod.FlattenedTensorBucket(named_tensors=ours)
        assert torch.equal(again.get_flattened_tensor(), flat), path


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_fp8_export_bit_identical_to_reference_all_architectures(layout, big_bf16, tmp_path):
    source = big_bf16 if layout == LAYOUTS[0] else {mt: p for mt, p in big_bf16.items() if mt not in FORMAT_MATES}
    results = run_world(worlds.for_each_arch, layout, worlds.fp8_matrix, source, layout, "bfloat16",
                        str(tmp_path), layout == LAYOUTS[0], timeout=480)
    if layout == LAYOUTS[0]:
        sglang_accepts_fp8_buckets([tmp_path / mt / "bucket0.pt" for mt in source])
    for rank, per_arch in enumerate(results):
        for mt, r in per_arch.items():
            print(f"{mt} {layout}: {r['quantized']} of {r['tensors']} tensors fp8 ({r['on_shards']} quantized on the "
                  f"shards), bytes {r['bytes']} -> {r['fp8_bytes']}, received over collectives {r['wire']} -> "
                  f"{r['fp8_wire']} (rank {rank})")
            assert r["fp8_bytes"] < 0.75 * r["bytes"], (mt, rank, r)
            assert r["fp8_wire"] <= r["wire"], (mt, rank, r)
            # experts unsharded: quantized before the EP gather, about half the bytes
            if layout.expert_tp == 1 and mt == "qwen3_moe":
                assert r["on_shards"] >= 48 and r["fp8_wire"] < 0.7 * r["wire"], (rank, r)


def test_every_architecture_has_an_fp8_table():
    for mt in ARCHS:
        assert isinstance(get_converter(mt).fp8, FP8Policy), mt


def _json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def hf_fp8_logits(path, tokens):
    """transformers' own fine-grained FP8 loader, dequantizing on CPU (FineGrainedFP8Config(dequantize=True))."""
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True),
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits, model


# checkpoint names of the fused experts where they are not mlp.experts.E.{gate,up,down}_proj (transformers 5.23.0
# conversion_mapping.py: minimax_m2 = mixtral's block_sparse_moe.experts.E.w1 / w3 / w2)
CHECKPOINT_EXPERTS = {mt: ("block_sparse_moe", ("w1", "w3", "w2")) for mt in ("minimax_m2", "mixtral")}


def dequantized_reference_logits(ckpt, tokens, quantize):
    """transformers on the source weights, each quantized weight replaced by reference quantize -> dequantize:
    what the FP8 checkpoint holds, computed without the FP8 loader (and the FP8 rounding's effect on logits)."""
    from oracle import fp8_reference

    policy = get_converter(_json(os.path.join(ckpt, "config.json"))["model_type"]).fp8
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        exact = model(tokens).logits
        sd = read_hf_checkpoint(ckpt)
        params = dict(model.named_parameters())
        for name, t in sd.items():
            if name in params and policy.quantized(name, t.shape):
                q, s = fp8_reference(t, quantize == "fp8-ue8m0")
                params[name].copy_(dequantize_fp8(q, s))
        # transformers fuses MoE experts in memory: quantize them through its checkpoint-format names
        mlp, names = CHECKPOINT_EXPERTS.get(model.config.model_type, ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for mod_name, mod in model.named_modules():
            experts = getattr(mod, "gate_up_proj", None)
            if experts is not None and experts.dim() == 3:
                prefix = mod_name.replace(".mlp.", f".{mlp}.")
                n = experts.shape[0]
                gate, up, down = (torch.stack([sd[f"{prefix}.{e}.{w}.weight"] for e in range(n)]) for w in names)

                def qdq(w):
                    return torch.stack([dequantize_fp8(*fp8_reference(x, quantize == "fp8-ue8m0"))
                                        for x in w])

                fused = torch.cat([qdq(gate), qdq(up)], dim=1)
                assert fused.shape == experts.shape, (fused.shape, experts.shape)
                experts.copy_(fused)
                mod.down_proj.copy_(qdq(down))
        return exact, model(tokens).logits


QUANTIZE = ("fp8", "fp8-ue8m0")


@pytest.fixture(scope="module")
def fp8_exports(ckpts, tmp_path_factory):
    """One TP2 x EP2 world of every architecture (fp32 Megatron models, no MTP): its logits, and its FP8 export in
    each scale format under root/<format>/<arch>."""
    layout = Layout(tp=2, ep=2, etp=1)
    root = tmp_path_factory.mktemp("fp8_parity")
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    results = same_on_every_rank(run_world(worlds.for_each_arch, layout, worlds.fp8_parity,
                                           {mt: ckpts[mt] for mt in ARCHS if mt in ckpts}, layout, str(root), tokens,
                                           QUANTIZE))
    return root, tokens, results


@pytest.mark.parametrize("quantize", QUANTIZE)
def test_fp8_output_loads_in_transformers_and_logits_follow_megatron(quantize, ckpts, fp8_exports):
    """TP2 x EP2, fp32 Megatron models. Per architecture:
    1. transformers' FP8 loader reads every tensor (no missing / unexpected / mismatched keys) and its logits
       equal, bit for bit, those of the source model with reference-quantized-then-dequantized weights (the same
       weights in the same forward: measured 0.0);
    2. the difference to the Megatron forward is the FP8 rounding's own effect: (fp8 - Megatron) equals
       (reference qdq - exact) in transformers up to the family's fp32 Megatron-vs-transformers parity tolerance
       (runtime.forward.logit_tolerance: what remains is exact - Megatron). The rounding itself is large on these
       tiny random models (a 64-wide weight is one block
       with 3 mantissa bits, and MoE routing flips): measured 1.4-1.8 on logits of ~15 for the dense models,
       8-13 for the MoE models, so a bound on |fp8 - Megatron| alone would prove nothing."""
    root, tokens, results = fp8_exports
    problems = []
    for mt, megatron in results.items():
        out = root / quantize / mt
        qc = _json(out / "config.json")["quantization_config"]
        assert qc["quant_method"] == "fp8" and (qc.get("scale_fmt") == "ue8m0") == (quantize == "fp8-ue8m0")
        fp8_logits, _ = hf_fp8_logits(out, tokens)
        exact, qdq = dequantized_reference_logits(ckpts[mt], tokens, quantize)
        loader = (fp8_logits - qdq).abs().max().item()
        vs_megatron = (fp8_logits - megatron).abs().max().item()
        rounding = (qdq - exact).abs().max().item()
        beyond = ((fp8_logits - megatron) - (qdq - exact)).abs().max().item()
        print(f"{mt} {quantize}: |fp8 load - reference qdq| {loader:.2e}, |fp8 - Megatron fp32| {vs_megatron:.2e}, "
              f"FP8 rounding alone {rounding:.2e} (logit scale {exact.abs().max().item():.2f}), "
              f"difference beyond the rounding {beyond:.2e}")
        if not torch.equal(fp8_logits, qdq) or beyond > logit_tolerance(mt):
            problems.append((mt, loader, vs_megatron, rounding, beyond))
    assert not problems, problems


def test_dry_run_lists_quantized_weights_and_scale_shapes():

    r = worlds.cli_run("plan", "--hf-config", "tiny:qwen3_moe", "--ep", "2",
                       "--quantize", "fp8-ue8m0", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    tensors = {t["name"]: t for t in report["tensors"]}
    w = "model.layers.0.mlp.experts.3.gate_proj.weight"
    assert tensors[w]["dtype"] == "float8_e4m3fn" and tensors[w + "_scale_inv"]["shape"] == [1, 1]
    assert tensors[w + "_scale_inv"]["dtype"] == "float32"
    assert tensors["model.layers.0.mlp.gate.weight"]["dtype"] == "bfloat16"  # router gate stays bf16
    assert tensors["lm_head.weight"]["dtype"] == "bfloat16" and "lm_head.weight_scale_inv" not in tensors
    assert report["quantize"] == "fp8-ue8m0"
    down = "model.layers.0.mlp.experts.3.down_proj.weight"  # a whole expert tensor: before the EP gather
    assert down in report["quantized_on_shards"] and w not in report["quantized_on_shards"]  # 32-row GLU halves
    assert w in report["quantized"]  # ... are quantized after the gather
    r = worlds.cli_run("plan", "--hf-config", "tiny:qwen3_moe",
                       "--quantize", "fp8", "--limit", "3")
    assert r.returncode == 0 and "quantized (fp8, 128x128 blocks)" in r.stdout, r.stdout + r.stderr
