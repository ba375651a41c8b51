"""Parity with the independent implementation: export -> save_pretrained -> transformers.from_pretrained,
no missing/unexpected keys, logits equal the Megatron forward on the same tokens (fp32)."""

import pytest
import torch
import worlds
from transformers import AutoModelForCausalLM

from mcore2hf.testing.world import Layout, run_world

TOL = 1e-4


def hf_logits(path, tokens):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2, ep=2, etp=1)], ids=str)
def test_qwen3_moe_logits_match_transformers(layout, qwen3_moe_ckpt, tmp_path):
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "exported"
    logits = run_world(worlds.parity, layout, str(qwen3_moe_ckpt), layout, str(out), tokens)[0]
    ref = hf_logits(out, tokens)
    diff = (logits - ref).abs().max().item()
    print(f"qwen3_moe {layout}: max |megatron - transformers| logit difference = {diff:.3e}")
    assert diff <= TOL
