"""Mixtral (HF `mixtral`): every layer MoE (num_local_experts, expert FFN size = intermediate_size), softmax
top-k routing renormalized over the chosen experts, GQA, no biases, no shared experts."""

from .common import (
    base_dims,
    base_structural,
    default_gpt_kwargs,
    llama_like_fields,
    make_config,
    moe_fields,
    spec_builder,
)
from .mistral import check_sliding_window

HF_ARCHITECTURE = "MixtralForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    return True


def dims(cfg):
    return base_dims(cfg, num_experts=cfg.num_local_experts)


def transformer_config(cfg, **overrides):
    check_sliding_window(cfg)
    pattern = [1] * cfg.num_hidden_layers
    fields = llama_like_fields(cfg)
    fields.update(moe_fields(cfg, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, pattern))
    # transformers 5.23 MixtralTopKRouter: softmax over all experts, top-k, renormalized = Megatron's softmax
    # over the top-k logits (moe_router_pre_softmax=False)
    fields.update(moe_router_score_function="softmax", moe_router_pre_softmax=False)
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    return base_structural(cfg, num_moe_experts=cfg.num_local_experts, moe_ffn_hidden_size=cfg.intermediate_size,
                           qk_layernorm=False, add_qkv_bias=False)


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
