"""Llama 2 / 3 dense (attention_bias as configured; tied embeddings for the small Llama 3.2)."""

from .common import (
    base_dims,
    base_structural,
    default_gpt_kwargs,
    llama_like_fields,
    make_config,
    spec_builder,
)

HF_ARCHITECTURE = "LlamaForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    return False


def dims(cfg):
    return base_dims(cfg)


def transformer_config(cfg, **overrides):
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=False)
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    return dict(base_structural(cfg), ffn_hidden_size=cfg.intermediate_size, num_moe_experts=None,
                qk_layernorm=False, add_qkv_bias=bool(getattr(cfg, "attention_bias", False)))


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
