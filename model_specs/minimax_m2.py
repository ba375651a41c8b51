"""MiniMax-M2: HF MiniMaxM2Config <-> Megatron TransformerConfig.

Read in transformers 5.23.0 models/minimax_m2/{modeling,configuration}_minimax_m2.py: q_norm / k_norm are
RMSNorm(heads * head_dim) over all heads before the split (full width: FullWidthRMSNorm), partial rotary
(rotary_dim -> partial_rotary_factor, rotate-half on the first dims), every layer MoE without shared experts,
sigmoid scores + e_score_correction_bias for the top-k choice, unbiased top-k scores renormalized (no scaling)."""

from mcore2hf.errors import ConfigMismatchError

from .common import (
    FULL_WIDTH_QK_NORMS,
    base_dims,
    base_structural,
    default_gpt_kwargs,
    full_width_layer_spec,
    llama_like_fields,
    make_config,
    moe_fields,
    sigmoid_router_fields,
    spec_builder,
)

HF_ARCHITECTURE = "MiniMaxM2ForCausalLM"

# the published config.json's own fields (transformers keeps them as attributes and computes only this variant)
_PUBLISHED = dict(scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer",
                  shared_intermediate_size=0)


def _check(cfg) -> None:
    wrong = {k: getattr(cfg, k) for k, v in _PUBLISHED.items() if getattr(cfg, k, v) != v}
    if wrong:
        raise ConfigMismatchError(f"minimax_m2: transformers' MiniMaxM2 computes {_PUBLISHED}; the config has {wrong}")


def is_moe_layer(cfg, layer: int) -> bool:
    return True


def dims(cfg):
    return base_dims(cfg, num_experts=cfg.num_local_experts)


def transformer_config(cfg, **overrides):
    _check(cfg)
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=True)  # the spec's layer_spec makes them full width
    fields.update(moe_fields(cfg, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                             [1] * cfg.num_hidden_layers))
    fields.update(sigmoid_router_fields(cfg, num_experts=cfg.num_local_experts, topk=cfg.num_experts_per_tok))
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    return base_structural(cfg, num_moe_experts=cfg.num_local_experts, moe_ffn_hidden_size=cfg.intermediate_size,
                           qk_layernorm=True, add_qkv_bias=False)


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


layer_spec = full_width_layer_spec
#: its q/k norms are FullWidthRMSNorm under the TE spec too (no TE `_extra_state`: checkpoint_keys.KeyLayout)
NON_TE_MODULES = FULL_WIDTH_QK_NORMS
build_model = spec_builder(__name__)
