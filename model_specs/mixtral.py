"""Mixtral (HF `mixtral`): every layer MoE (num_local_experts, expert FFN size = intermediate_size), softmax
top-k routing renormalized over the chosen experts, GQA, no biases, no shared experts."""

from .common import Decoder
from .mistral import check_sliding_window


class Mixtral(Decoder):
    hf_architecture = "MixtralForCausalLM"

    def experts(self, cfg) -> int:
        return cfg.num_local_experts

    def moe_ffn(self, cfg) -> int:
        return cfg.intermediate_size

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=False, add_qkv_bias=False)

    def router(self, cfg) -> dict:
        # transformers 5.23 MixtralTopKRouter: softmax over all experts, top-k, renormalized = Megatron's softmax
        # over the top-k logits (moe_router_pre_softmax=False)
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=False)

    def check(self, cfg) -> None:
        check_sliding_window(cfg)


SPEC = Mixtral()
