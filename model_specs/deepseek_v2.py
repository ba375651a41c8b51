"""DeepSeek-V2 / V2-Lite (HF `deepseek_v2`): DeepSeek-V3's multi-latent attention and format (V2-Lite: no
q_lora_rank, so a plain q_proj) with softmax routing and no expert bias, and no MTP layers."""

from mcore2hf.errors import ConfigMismatchError

from .deepseek_v3 import MLA


class DeepseekV2(MLA):
    hf_architecture = "DeepseekV2ForCausalLM"

    def moe_layer(self, cfg, layer: int) -> bool:
        # transformers 5.23 modeling_deepseek_v2.py: MoE iff layer_idx >= first_k_dense_replace (moe_layer_freq unused)
        return layer >= cfg.first_k_dense_replace

    def router(self, cfg) -> dict:
        """Softmax over all experts, top-k, times routed_scaling_factor (transformers 5.23 DeepseekV2TopkRouter)."""
        method = getattr(cfg, "topk_method", "greedy") or "greedy"
        if method != "greedy":
            # HF scores a group by its best expert, Megatron by the sum of its top topk // group_topk
            raise ConfigMismatchError(f"deepseek_v2 topk_method={method!r}: only 'greedy' is mapped to Megatron")
        if getattr(cfg, "norm_topk_prob", False):
            # transformers 5.23 ignores it and scales; DeepSeek's own MoEGate renormalizes and then does not scale:
            # the two disagree, so neither is verified (V2 and V2-Lite publish false)
            raise ConfigMismatchError("deepseek_v2 norm_topk_prob=True: transformers and DeepSeek's code route "
                                      "differently; only norm_topk_prob=False (as published) is mapped")
        # softmax over all experts, top-k without renormalizing (Megatron's pre-softmax top-k), times the factor
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                    moe_router_topk_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0))


SPEC = DeepseekV2()
