"""GLM-4.7-Flash (HF `glm4_moe_lite`): DeepSeek-V3's multi-latent attention and format with GLM's routing
(sigmoid + expert bias, n_group 1) and its MoE layers listed in `mlp_layer_types` ("dense" / "sparse")."""

from .common import sigmoid_router_fields, spec_builder
from .deepseek_v3 import dims, gpt_kwargs, layer_spec, mla_transformer_config, structural_fields  # noqa: F401

HF_ARCHITECTURE = "Glm4MoeLiteForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    # transformers 5.23 modeling_glm4_moe_lite.py: MoE iff mlp_layer_types[layer_idx] == "sparse"
    return bool(cfg.n_routed_experts) and cfg.mlp_layer_types[layer] == "sparse"


def transformer_config(cfg, **overrides):
    router = sigmoid_router_fields(cfg, num_experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok)
    return mla_transformer_config(cfg, is_moe_layer, router, overrides)


build_model = spec_builder(__name__)
