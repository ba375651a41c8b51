"""Tiny models for tests and the demo: HF configs and random HF checkpoints written by transformers itself."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

TINY_CONFIGS: dict[str, dict] = {
    # vocab 100 (Megatron pads it), 4 layers so PP2 x VPP2 has a layer per chunk, 8 experts for EP4
    "qwen3_moe": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    kw = {**TINY_CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kw)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere, norms included, so a swapped or misplaced tensor cannot go unnoticed.

    Scales keep a few-layer fp32 forward well conditioned (for logit parity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                t.copy_(1.0 + 0.1 * r)
            elif "bias" in name:
                t.copy_(0.1 * r)
            elif "embed" in name or "lm_head" in name:
                t.copy_(0.5 * r)
            else:
                t.copy_(r / max(t.shape[-1], 1) ** 0.5)


def make_hf_checkpoint(cfg: PretrainedConfig, out_dir: str | os.PathLike, *, seed: int = 0,
                       dtype: torch.dtype = torch.float32) -> str:
    """An HF checkpoint directory of `cfg` with random weights, saved by transformers."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    model = model.to(dtype)
    model.save_pretrained(os.fspath(out_dir))
    return os.fspath(out_dir)


def read_hf_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, as saved."""
    import json

    from safetensors.torch import load_file

    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out
