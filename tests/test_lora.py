"""LoRA adapters trained with Megatron-Bridge's own PEFT (megatron-bridge 0.3.1, tests/harness/bridge_lora.py) on
real megatron-core 0.16.1 models: the adapter-only export in HF/PEFT form against the PEFT source, the PEFT
directory loaded by peft (PeftModel.from_pretrained, pinned in tests/constraints.txt) with transformers' forward
against Megatron's with the adapters active, the merged export against peft's merge_and_unload (docs/lora.md)."""

import json
import os

import peft
import pytest
import torch
from harness.bridge_lora import bridge_root
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from worlds import LORA_ALPHA, LORA_R, LORA_TARGETS, TOKENS, lora_refusals, lora_suite, lora_values_suite

from mcore2hf.runtime.tiny import read_hf_checkpoint
from mcore2hf.runtime.world import Layout, run_world

#: HF modules of each Megatron linear Bridge targets (converters/common.py gqa_attention, glu_mlp)
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
#: max |merged export - peft merge_and_unload| (fp32): peft computes W + (B @ A) * scale over the full matrices,
#: the export W_i + scale * (B_i @ A) per TP shard (row-parallel: B @ A_i). Measured 0.0 (TP2, 2026-11-27: scale 2
#: is exact and each output element is the same r-term dot product); 1e-6 leaves room for a BLAS that blocks the
#: shard-sized products differently from the full one
MERGED_TOL = 1e-6
#: the issue's bound on |Megatron with adapters - transformers + peft| fp32 logits
LOGIT_TOL = 1e-4


def make_adapter(ckpt: str, out: str, seed: int = 0) -> str:
    """A random PEFT LoRA adapter for the HF model `ckpt`, saved by peft itself; the adapters of one fused Megatron
    linear (q/k/v, gate/up) share lora_A, as Megatron's single A does."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    targets = [m for t in LORA_TARGETS for m in HF_MODULES[t]]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=targets,
                                                    init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for m in pm.modules():
            for first, *rest in [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]:
                if hasattr(m, first) and all(hasattr(m, r) for r in rest):
                    for r in rest:
                        getattr(m, r).lora_A["default"].weight.copy_(getattr(m, first).lora_A["default"].weight)
    pm.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen3_adapter(ckpts, tmp_path_factory) -> tuple[str, str]:
    ckpt = ckpts["qwen3"]
    return ckpt, make_adapter(ckpt, str(tmp_path_factory.mktemp("lora") / "qwen3"))


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(pp=2, vpp=2)], ids=str)
def test_lora_export(qwen3_adapter, layout, tmp_path):
    ckpt, src = qwen3_adapter
    res = run_world(lora_suite, layout, ckpt, layout, src, str(tmp_path), bridge_root())[0]

    # the PEFT directory: the source's tensors bit for bit, and the config PEFT needs
    want = load_file(os.path.join(src, "adapter_model.safetensors"))
    got = load_file(os.path.join(res["dir"], "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(os.listdir(res["dir"])) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(res["dir"], "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (LORA_R, LORA_ALPHA, ckpt)
    assert sorted(config["target_modules"]) == sorted(m for t in LORA_TARGETS for m in HF_MODULES[t])

    # peft loads it with no missing or unexpected adapter key, and its forward is Megatron's
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32),
                                           res["dir"])
    result = peft.set_peft_model_state_dict(model, got)
    assert [k for k in result.missing_keys if "lora_" in k] == [] and result.unexpected_keys == []
    with torch.no_grad():
        hf_logits = model(TOKENS).logits.float()
    diff = (hf_logits - res["logits"]).abs().max().item()
    print(f"\nLoRA {layout}: |Megatron - transformers+peft| logits {diff:.2e}")
    assert diff < LOGIT_TOL
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)(TOKENS).logits
    assert (base_logits - hf_logits).abs().max() > 100 * LOGIT_TOL  # the adapters do move the logits

    # merged: peft's merge_and_unload
    merged = model.merge_and_unload().state_dict()
    assert sorted(res["merged"]) == sorted(k for k in merged if k in res["merged"]) and res["merged"]
    diffs = {k: (res["merged"][k] - merged[k]).abs().max().item() for k in res["merged"]}
    worst = max(diffs.values())
    print(f"LoRA {layout}: |merged - merge_and_unload| {worst:.2e}")
    assert worst <= MERGED_TOL


def test_lora_refusals(ckpts, tmp_path):
    """Refused by name, before anything is written (tests/worlds.py lora_refusals)."""
    got = run_world(lora_refusals, Layout(tp=2), ckpts["qwen3"], Layout(tp=2), bridge_root(), str(tmp_path))[0]
    print("\n" + "\n".join(got))
    dora, rank, unmapped, none = got
    assert "decoder.layers.0.self_attention.linear_proj: DoRALinear" in dora and "not DoRA" in dora
    assert "disagree on rank / alpha" in rank and "r=4 alpha=8" in rank and "r=8 alpha=16" in rank
    assert "output_layer" in unmapped and "VocabRows" in unmapped and "linear_qkv" not in unmapped
    assert "holds no LoRA adapter" in none


#: Bridge's target names for MLA (megatron-core 0.16.1 multi_latent_attention.py submodules) besides the MLP's
MLA_TARGETS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
               "linear_fc1", "linear_fc2")


@pytest.mark.parametrize("model_type,layout,targets", [
    pytest.param("qwen3_moe", Layout(tp=2, ep=2, etp=1), LORA_TARGETS, id="qwen3_moe-tp2-ep2-etp1"),
    pytest.param("deepseek_v3", Layout(tp=2, ep=2, etp=1), MLA_TARGETS, id="deepseek_v3-tp2-ep2-etp1"),
])
def test_lora_experts(ckpts, model_type, layout, targets, tmp_path):
    """Adapters on every expert (one per expert, HF/PEFT names per expert, as vLLM's and SGLang's loaders take
    them): the merged export, loaded by transformers, gives Megatron's logits with the adapters active; and every
    merged tensor is the base plus alpha/r B A of the exported adapter of that HF name."""
    ckpt = ckpts[model_type]
    res = run_world(lora_values_suite, layout, ckpt, layout, bridge_root(), str(tmp_path), targets)[0]
    adapters, base = res["adapters"], read_hf_checkpoint(ckpt)
    merged = read_hf_checkpoint(res["merged"])
    experts = [n for n in adapters if ".mlp.experts." in n]
    assert experts and all(n.startswith("base_model.model.model.layers.") for n in adapters)
    config = AutoConfig.from_pretrained(ckpt)
    if model_type == "deepseek_v3":  # q/kv down and up projections
        for module in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts"):
            assert any(f".{module}." in n for n in adapters), module
    if model_type == "qwen3_moe":  # every layer MoE: A, B x gate, up, down x experts x layers
        assert len(experts) == 2 * 3 * config.num_experts * config.num_hidden_layers
    scale = LORA_ALPHA / LORA_R
    checked = 0
    for name in merged:
        a = f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"
        if a in adapters:
            b = a.replace(".lora_A.", ".lora_B.")
            want = base[name] + scale * (adapters[b] @ adapters[a])
            assert (merged[name] - want).abs().max() <= MERGED_TOL, name
            checked += 1
        else:
            assert torch.equal(merged[name], base[name]), name
    assert checked == len(adapters) // 2
    model = AutoModelForCausalLM.from_pretrained(res["merged"], dtype=torch.float32)
    with torch.no_grad():
        diff = (model(TOKENS).logits.float() - res["logits"]).abs().max().item()
    print(f"\nLoRA {model_type} {layout}: |Megatron with adapters - transformers(merged)| logits {diff:.2e}")
    assert diff < LOGIT_TOL
