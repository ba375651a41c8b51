"""Qwen3-MoE: HF Qwen3MoeConfig <-> Megatron TransformerConfig (q/k norm, GQA, top-k softmax routing)."""

from mcore2hf.arch.hf_config import get

from .common import (
    base_dims,
    base_structural,
    default_gpt_kwargs,
    llama_like_fields,
    make_config,
    moe_fields,
    spec_builder,
)

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"


def num_experts(cfg) -> int:
    return int(get(cfg, "num_experts", "num_local_experts", default=0))


def is_moe_layer(cfg, layer: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (num_experts(cfg) > 0 and layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and (layer + 1) % step == 0)


def dims(cfg):
    return base_dims(cfg, num_experts=num_experts(cfg))


def transformer_config(cfg, **overrides):
    pattern = [int(is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)]
    fields = llama_like_fields(cfg)
    fields.update(qk_layernorm=True)
    fields.update(moe_fields(cfg, num_experts(cfg), cfg.num_experts_per_tok, cfg.moe_intermediate_size, pattern))
    # HF: softmax over all experts, top-k, renormalize iff norm_topk_prob. Megatron: pre-softmax = no renorm.
    fields.update(moe_router_score_function="softmax", moe_router_pre_softmax=not cfg.norm_topk_prob)
    return make_config(fields, overrides)


def structural_fields(cfg) -> dict:
    out = base_structural(cfg)
    out.update(num_moe_experts=num_experts(cfg), moe_ffn_hidden_size=cfg.moe_intermediate_size, qk_layernorm=True,
               add_qkv_bias=False)
    if not all(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)):
        out["ffn_hidden_size"] = cfg.intermediate_size
    return out


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
