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
def test_logits_match_transformers(layout, ckpts, tmp_path):
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    results = run_world(worlds.for_each_arch, layout, worlds.parity, dict(ckpts), layout, str(tmp_path), tokens)[0]
    failed = {mt: r for mt, r in results.items() if isinstance(r, Exception)}
    assert not failed, "\n".join(f"--- {mt}:\n{r}" for mt, r in failed.items())
    diffs = {}
    for mt, logits in results.items():
        diffs[mt] = (logits - hf_logits(tmp_path / mt, tokens)).abs().max().item()
        print(f"{mt} {layout}: max |megatron - transformers| logit difference = {diffs[mt]:.3e}")
    assert all(d <= TOL for d in diffs.values()), diffs
