"""Qwen3 dense: q/k norms, no biases."""

from .common import (
    base_dims,
    base_structural,
    default_gpt_kwargs,
    llama_like_fields,
    make_config,
    spec_builder,
)

HF_ARCHITECTURE = "Qwen3ForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    return False


def dims(cfg):
    return base_dims(cfg)


def transformer_config(cfg, **overrides):
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=True, add_qkv_bias=False)
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    return dict(base_structural(cfg), ffn_hidden_size=cfg.intermediate_size, num_moe_experts=None,
                qk_layernorm=True, add_qkv_bias=False)


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
