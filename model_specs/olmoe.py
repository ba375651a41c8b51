"""OLMoE: HF OlmoeConfig <-> Megatron TransformerConfig.

Read in transformers 5.23.0 models/olmoe/{modeling,configuration}_olmoe.py: q_norm = RMSNorm(hidden_size) and
k_norm = RMSNorm(head_dim * num_key_value_heads) over all heads before the split (full width: FullWidthRMSNorm),
every layer MoE, softmax over all experts then top-k, renormalized iff norm_topk_prob (OLMoE-1B-7B: no)."""

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
    spec_builder,
)

HF_ARCHITECTURE = "OlmoeForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    return True


def dims(cfg):
    return base_dims(cfg, num_experts=cfg.num_experts)


def transformer_config(cfg, **overrides):
    if cfg.clip_qkv is not None or cfg.attention_bias:
        raise ConfigMismatchError(f"olmoe: clip_qkv={cfg.clip_qkv}, attention_bias={cfg.attention_bias} have no "
                                  "Megatron equivalent here (expected clip_qkv=None, attention_bias=False)")
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=True)  # the spec's layer_spec makes them full width
    fields.update(moe_fields(cfg, cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                             [1] * cfg.num_hidden_layers))
    # HF: softmax over all experts, top-k, renormalize iff norm_topk_prob. Megatron: pre-softmax = no renorm.
    fields.update(moe_router_score_function="softmax", moe_router_pre_softmax=not cfg.norm_topk_prob)
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    return base_structural(cfg, num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.intermediate_size,
                           qk_layernorm=True, add_qkv_bias=False)


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


layer_spec = full_width_layer_spec
#: its q/k norms are FullWidthRMSNorm under the TE spec too (no TE `_extra_state`: checkpoint_keys.KeyLayout)
NON_TE_MODULES = FULL_WIDTH_QK_NORMS
build_model = spec_builder(__name__)
