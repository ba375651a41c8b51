"""MiniMax-M2: HF MiniMaxM2Config <-> Megatron TransformerConfig.

Read in transformers 5.23.0 models/minimax_m2/{modeling,configuration}_minimax_m2.py: q_norm / k_norm are
RMSNorm(heads * head_dim) over all heads before the split (full width: FullWidthRMSNorm), partial rotary
(rotary_dim -> partial_rotary_factor, rotate-half on the first dims), every layer MoE without shared experts,
sigmoid scores + e_score_correction_bias for the top-k choice, unbiased top-k scores renormalized (no scaling)."""

from mcore2hf.errors import ConfigMismatchError

from .common import FullWidthQKNorms, sigmoid_router_fields

# the published config.json's own fields (transformers keeps them as attributes and computes only this variant)
_PUBLISHED = dict(scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer",
                  shared_intermediate_size=0)


class MiniMaxM2(FullWidthQKNorms):
    hf_architecture = "MiniMaxM2ForCausalLM"

    def experts(self, cfg) -> int:
        return cfg.num_local_experts

    def router(self, cfg) -> dict:
        return sigmoid_router_fields(cfg, num_experts=cfg.num_local_experts, topk=cfg.num_experts_per_tok)

    def check(self, cfg) -> None:
        wrong = {k: getattr(cfg, k) for k, v in _PUBLISHED.items() if getattr(cfg, k, v) != v}
        if wrong:
            raise ConfigMismatchError(f"minimax_m2: transformers' MiniMaxM2 computes {_PUBLISHED}; the config has "
                                      f"{wrong}")


SPEC = MiniMaxM2()
