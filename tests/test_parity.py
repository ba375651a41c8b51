"""Parity with the independent implementation: export -> save_pretrained -> transformers.from_pretrained,
no missing/unexpected keys, logits equal the Megatron forward on the same tokens (fp32)."""

import json
import os

import pytest
import torch
import worlds
from transformers import AutoModelForCausalLM

from mcore2hf.hf_config import load_hf_config
from mcore2hf.testing.world import Layout, run_world, same_on_every_rank

TOL = 1e-4


def hf_logits(path, tokens):
    # the config as mcore2hf reads it: Kimi-K2's kimi_k2 (unknown to transformers) is a DeepseekV3Config
    model, info = AutoModelForCausalLM.from_pretrained(path, config=load_hf_config(path), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2, ep=2, etp=1)], ids=str)
def test_logits_match_transformers(layout, ckpts, tmp_path):
    check_parity(layout, ckpts, tmp_path)


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2, ep=2, etp=1)], ids=str)
def test_family_members_logits_match_transformers(layout, variant_ckpts, tmp_path):
    """Kimi-K2 (yarn rope, n_group 1, the kimi_k2 alias) and Moonlight (q_lora_rank null, rms_norm_eps 1e-5 while
    MLA's latent norms keep 1e-6) as published: their config.json, exported as given."""
    check_parity(layout, variant_ckpts, tmp_path)
    for name, path in variant_ckpts.items():
        with open(path + "/config.json") as f, open(tmp_path / name / "config.json") as g:
            assert json.load(f) == json.load(g), name  # written as the user's file, model_type and auto_map kept


def check_parity(layout, ckpts, tmp_path):
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    results = same_on_every_rank(run_world(worlds.for_each_arch, layout, worlds.parity, dict(ckpts), layout,
                                           str(tmp_path), tokens))
    diffs = {}
    for mt, logits in results.items():
        diffs[mt] = (logits - hf_logits(tmp_path / os.path.basename(ckpts[mt]), tokens)).abs().max().item()
        print(f"{mt} {layout}: max |megatron - transformers| logit difference = {diffs[mt]:.3e}")
    assert all(d <= TOL for d in diffs.values()), diffs
