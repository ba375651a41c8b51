"""Qwen2 / Qwen2.5 dense: q/k/v biases (always on in HF Qwen2)."""

from .common import (
    base_dims,
    base_structural,
    default_gpt_kwargs,
    llama_like_fields,
    make_config,
    spec_builder,
)

HF_ARCHITECTURE = "Qwen2ForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    return False


def dims(cfg):
    return base_dims(cfg)


def transformer_config(cfg, **overrides):
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=False, add_qkv_bias=True)
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    return dict(base_structural(cfg), ffn_hidden_size=cfg.intermediate_size, num_moe_experts=None,
                qk_layernorm=False, add_qkv_bias=True)


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
