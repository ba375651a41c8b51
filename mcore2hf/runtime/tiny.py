"""Tiny models for tests and the demo: HF configs and random HF checkpoints written by transformers itself."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig


def tiny_configs() -> dict[str, dict]:
    """Every registered architecture's tiny HF config fields (`Architecture.tiny`), by model_type."""
    from mcore2hf.arch.registry import architectures

    return {mt: a.tiny for mt, a in architectures().items()}


# Members of a registered family whose config.json is the family's format with other values (not an
# architecture of their own: tests run them where the values matter, logit parity). Scaled-down published values.
TINY_VARIANTS: dict[str, dict] = {
    # moonshotai/Kimi-K2-Instruct(-0905) config.json: model_type "kimi_k2" with an auto_map to its remote code
    # (configuration_deepseek.py / modeling_deepseek.py), yarn rope (factor 64, beta_fast 1, beta_slow 1,
    # mscale 1, mscale_all_dim 1, original 4096, rope_theta 50000), n_group 1, routed_scaling_factor 2.827,
    # no MTP layers (as listed by ParagEkbote/hf-model-inspector model_inspection_report.md)
    "kimi_k2": dict(
        model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModel": "modeling_deepseek.DeepseekV3Model",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
        rope_theta=50000.0, max_position_embeddings=262144, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # moonshotai/Moonlight-16B-A3B config.json: deepseek_v3 with q_lora_rank null, rms_norm_eps 1e-5 (MLA's
    # latent norms stay at 1e-6 in transformers), rope_theta 50000, n_group 1, routed_scaling_factor 2.446
    "moonlight": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModel": "modeling_deepseek.DeepseekV3Model",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=2.446,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
        rope_theta=50000.0, rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
}


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """A registered architecture's tiny config, or a family member's from TINY_VARIANTS (loaded as mcore2hf
    loads its config.json: kimi_k2 through its alias)."""
    if model_type in TINY_VARIANTS:
        from mcore2hf.arch.hf_config import load_hf_config

        return load_hf_config({**TINY_VARIANTS[model_type], **overrides})
    from mcore2hf.arch.registry import get_architecture

    kw = {**get_architecture(model_type).tiny, **overrides}
    return AutoConfig.for_model(model_type, **kw)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere, norms included, so a swapped or misplaced tensor cannot go unnoticed. Norms
    initialized to zeros are zero-centred (gamma = 1 + w) and get w around 0, the others gamma around 1.

    Scales keep a few-layer fp32 forward well conditioned (for logit parity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if "norm" in name:  # around the norm's own identity: gamma 1, or w 0 where gamma = 1 + w (Qwen3-Next)
                t.copy_((0.0 if bool((t == 0).all()) else 1.0) + 0.1 * r)
            elif "bias" in name:
                t.copy_(0.1 * r)
            elif "embed" in name or "lm_head" in name:
                t.copy_(0.5 * r)
            else:
                t.copy_(r / max(t.shape[-1], 1) ** 0.5)


def make_hf_checkpoint(cfg: PretrainedConfig, out_dir: str | os.PathLike, *, seed: int = 0,
                       dtype: torch.dtype = torch.float32, published: bool = True) -> str:
    """An HF checkpoint directory of `cfg` with random weights, saved by transformers.

    transformers builds no MTP layers, so for configs with `num_nextn_predict_layers` the MTP tensors are added
    in the published layout (decoder layer, enorm, hnorm, eh_proj, shared_head, embedding/head copies). Where
    transformers saves another layout than the published checkpoints (its registered `published_layout`) the directory
    is rewritten into the published one, unless `published=False` (what a user's own save_pretrained writes)."""
    torch.manual_seed(seed)
    # a multimodal config (Qwen3.5) is saved as its published checkpoints are: the whole model, vision tower too
    auto = AutoModelForImageTextToText if getattr(cfg, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    model = model.to(dtype)
    out = os.fspath(out_dir)
    model.save_pretrained(out)
    if int(getattr(cfg, "num_nextn_predict_layers", 0) or 0):
        _add_mtp_tensors(cfg, out, seed)
    from ..arch.registry import published_layout

    if published and published_layout(cfg.model_type):  # where transformers saves another layout than the published one
        _to_published_layout(out, cfg.model_type)
    return out


def _to_published_layout(path: str, model_type: str) -> None:
    """Rewrite a checkpoint transformers saved into the published checkpoints' layout (its architecture's `published_layout`)."""
    from safetensors.torch import save_file

    from ..arch.hf_config import published_layout

    out = dict(published_layout(model_type, n, t) for n, t in read_hf_checkpoint(path).items())
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _add_mtp_tensors(cfg: PretrainedConfig, path: str, seed: int) -> None:
    import json

    from safetensors.torch import save_file

    sd = read_hf_checkpoint(path)
    n = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed + 1000)
    last = f"model.layers.{n - 1}."
    extra: dict[str, torch.Tensor] = {}
    for m in range(cfg.num_nextn_predict_layers):
        layer = f"model.layers.{n + m}."
        # the MTP block's decoder layer has the last layer's structure, then an indexer where the model has one
        # (GLM-5.2 IndexShare: also when the last layer is "shared"; hf_config.hf_tensor_shapes)
        parts = [(n[len(last):], t) for n, t in sd.items() if n.startswith(last)]
        parts += [(n[len("model.layers.0."):], t) for n, t in sd.items()
                  if n.startswith("model.layers.0.self_attn.indexer.") and layer + n[len("model.layers.0."):]
                  not in {layer + r for r, _ in parts}]
        for rest, t in parts:
            r = torch.randn(t.shape, generator=g)
            scale = 0.1 if t.dim() < 2 else 1.0 / max(t.shape[-1], 1) ** 0.5
            value = 1.0 + 0.1 * r if "norm" in rest else scale * r
            extra[layer + rest] = value.to(t.dtype)
        h = cfg.hidden_size
        dtype = sd["model.norm.weight"].dtype
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            extra[f"{layer}{norm}.weight"] = (1.0 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        extra[f"{layer}eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).to(dtype)
        extra[f"{layer}embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
        extra[f"{layer}shared_head.head.weight"] = sd["lm_head.weight"].clone()
    fname = "model-mtp.safetensors"
    save_file(extra, os.path.join(path, fname), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
    else:
        index = {"metadata": {}, "weight_map": dict.fromkeys(sd, "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(extra, fname))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def read_hf_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, as saved (hf_dir: validated, index or single file)."""
    from ..formats.hf_dir import read_all

    return read_all(path)
