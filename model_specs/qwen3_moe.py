"""Qwen3-MoE: HF Qwen3MoeConfig <-> Megatron TransformerConfig (q/k norm, GQA, top-k softmax routing)."""

from __future__ import annotations

from mcore2hf.hf_config import get
from mcore2hf.mapping import ModelDims

from .common import build_model as _build
from .common import default_gpt_kwargs, llama_like_fields, make_config, moe_fields

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"


def num_experts(cfg) -> int:
    return int(get(cfg, "num_experts", "num_local_experts", default=0))


def is_moe_layer(cfg, layer: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (num_experts(cfg) > 0 and layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and (layer + 1) % step == 0)


def dims(cfg) -> ModelDims:
    return ModelDims(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        head_dim=get(cfg, "head_dim", default=cfg.hidden_size // cfg.num_attention_heads),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), num_experts=num_experts(cfg),
    )


def transformer_config(cfg, **overrides):
    pattern = [int(is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)]
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=True)
    fields.update(moe_fields(cfg, num_experts(cfg), cfg.num_experts_per_tok, cfg.moe_intermediate_size, pattern))
    # HF: softmax over all experts, top-k, renormalize iff norm_topk_prob. Megatron: pre-softmax = no renorm.
    fields.update(moe_router_score_function="softmax", moe_router_pre_softmax=not cfg.norm_topk_prob)
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    out = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
               num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
               kv_channels=dims(cfg).head_dim, num_moe_experts=num_experts(cfg),
               moe_ffn_hidden_size=cfg.moe_intermediate_size)
    if not all(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)):
        out["ffn_hidden_size"] = cfg.intermediate_size
    return out


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


def build_model(cfg, **kwargs):
    """Megatron GPTModel chunks for this rank (see model_specs.common.build_model)."""
    import sys

    return _build(sys.modules[__name__], cfg, **kwargs)
