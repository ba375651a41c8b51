"""GLM-4.5 family: HF Glm4MoeConfig <-> Megatron TransformerConfig.

Dense first layers (first_k_dense_replace), shared experts, sigmoid group-limited routing with expert bias and
routed_scaling_factor, q/k/v biases, q/k norms, partial rotary embeddings, MTP layers."""

from .common import (
    base_dims,
    base_structural,
    default_gpt_kwargs,
    llama_like_fields,
    make_config,
    moe_fields,
    mtp_fields,
    sigmoid_router_fields,
    spec_builder,
)

HF_ARCHITECTURE = "Glm4MoeForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    return bool(cfg.n_routed_experts) and layer >= cfg.first_k_dense_replace


def dims(cfg):
    return base_dims(cfg, num_experts=cfg.n_routed_experts)


def transformer_config(cfg, **overrides):
    pattern = [int(is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)]
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=bool(cfg.use_qk_norm), add_qkv_bias=bool(cfg.attention_bias))
    fields.update(moe_fields(cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, pattern))
    fields.update(sigmoid_router_fields(cfg, num_experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok))
    if cfg.n_shared_experts:
        fields["moe_shared_expert_intermediate_size"] = cfg.n_shared_experts * cfg.moe_intermediate_size
    fields.update(mtp_fields(cfg))
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    out = base_structural(cfg)
    out.update(num_moe_experts=cfg.n_routed_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
               ffn_hidden_size=cfg.intermediate_size, qk_layernorm=bool(cfg.use_qk_norm),
               add_qkv_bias=bool(cfg.attention_bias),
               moe_shared_expert_intermediate_size=(cfg.n_shared_experts * cfg.moe_intermediate_size) or None)
    return out


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
