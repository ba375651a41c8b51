"""GLM-4.5 family: HF Glm4MoeConfig <-> Megatron TransformerConfig.

Dense first layers (first_k_dense_replace), shared experts, sigmoid group-limited routing with expert bias and
routed_scaling_factor, q/k/v biases, q/k norms, partial rotary embeddings, MTP layers."""

from .common import Decoder, sigmoid_router_fields


class Glm4Moe(Decoder):
    hf_architecture = "Glm4MoeForCausalLM"
    mtp = True

    def experts(self, cfg) -> int:
        return cfg.n_routed_experts

    def moe_layer(self, cfg, layer: int) -> bool:
        return layer >= cfg.first_k_dense_replace

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=bool(cfg.use_qk_norm), add_qkv_bias=bool(cfg.attention_bias))

    def router(self, cfg) -> dict:
        return sigmoid_router_fields(cfg, num_experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok)

    def shared_experts(self, cfg) -> int:
        return cfg.n_shared_experts * cfg.moe_intermediate_size


SPEC = Glm4Moe()
