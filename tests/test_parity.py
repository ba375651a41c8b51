"""The exported directory as transformers loads it: export -> save_pretrained -> from_pretrained (no missing,
unexpected or mismatched keys) -> logits equal to the Megatron forward (fp32, tolerances in tests/oracle.py).

The layout worlds (test_layout_matrix and the others) compare their Megatron forward with transformers' forward of
the source; here the exported directory itself is loaded, from a model built without MTP layers (RL runs often
train without them: a checkpoint with MTP tensors loads into it, and the export has none), and the published forms
of the family members (Kimi-K2: yarn rope, n_group 1, the kimi_k2 alias; Moonlight: q_lora_rank null,
rms_norm_eps 1e-5 while MLA's latent norms keep 1e-6) are exported with their config.json as given."""

import json
import os

import torch
import worlds
from oracle import logit_problems

from mcore2hf.runtime.world import Layout, run_world

LAYOUT = Layout(tp=2, ep=2, etp=1)


def test_exported_directories_load_in_transformers_with_the_megatron_logits(ckpts, variant_ckpts, tmp_path):
    sources = {**ckpts, **variant_ckpts}
    megatron = run_world(worlds.for_each_arch, LAYOUT, worlds.parity, sources, LAYOUT, str(tmp_path), worlds.TOKENS)
    exported = {mt: str(tmp_path / os.path.basename(path)) for mt, path in sources.items()}
    problems = logit_problems(megatron, exported, worlds.TOKENS, f"{LAYOUT} exported, no MTP")
    assert not problems, "\n".join(problems)
    for name, path in variant_ckpts.items():
        with open(path + "/config.json") as f, open(tmp_path / name / "config.json") as g:
            assert json.load(f) == json.load(g), name  # written as the user's file, model_type and auto_map kept
    assert "kimi_k2" not in variant_ckpts or all(torch.is_tensor(rank["kimi_k2"]) for rank in megatron)
