"""DeepSeek-V3 / R1 (and Kimi-K2's format): HF DeepseekV3Config <-> Megatron MLATransformerConfig.

Multi-latent attention (q_lora_rank may be null), dense first layers, shared experts, sigmoid group-limited
routing with expert bias, MTP layers. HF applies DeepSeek's interleaved rope (rope_interleave) by permuting q/k
rope dims at run time; Megatron's MLA does the same itself, so weights map one to one and rotary_interleaved
stays False."""

import copy

from mcore2hf.hf_config import rope_parameters, rope_theta

from .common import (
    base_dims,
    default_gpt_kwargs,
    llama_like_fields,
    make_config,
    moe_fields,
    mtp_fields,
    sigmoid_router_fields,
    spec_builder,
    supported_kwargs,
)

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"


def is_moe_layer(cfg, layer: int) -> bool:
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    return bool(cfg.n_routed_experts) and layer >= cfg.first_k_dense_replace and layer % freq == 0


def dims(cfg):
    return base_dims(cfg, num_experts=cfg.n_routed_experts, q_lora_rank=cfg.q_lora_rank,
                     kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                     qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)


def _rope_fields(cfg) -> dict:
    rope = rope_parameters(cfg)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return dict(rope_type="rope", rotary_base=rope_theta(cfg))
    if kind == "yarn":
        return dict(rope_type="yarn", rotary_base=rope_theta(cfg), rotary_scaling_factor=rope["factor"],
                    original_max_position_embeddings=rope["original_max_position_embeddings"],
                    beta_fast=rope.get("beta_fast", 32), beta_slow=rope.get("beta_slow", 1),
                    mscale=rope.get("mscale", 1.0), mscale_all_dim=rope.get("mscale_all_dim", 0.0))
    raise NotImplementedError(f"rope_type {kind!r} is not mapped to Megatron MLA")


def transformer_config(cfg, **overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    pattern = [int(is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)]
    fields = llama_like_fields(cfg)
    fields.pop("kv_channels")  # MLA has its own head dims
    fields.update(num_query_groups=cfg.num_attention_heads, multi_latent_attention=True,
                  q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                  qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                  qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
                  add_qkv_bias=False, rotary_interleaved=False, **_rope_fields(cfg))
    fields.update(moe_fields(cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, pattern))
    fields.update(sigmoid_router_fields(cfg, num_experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok))
    if cfg.n_shared_experts:
        fields["moe_shared_expert_intermediate_size"] = cfg.n_shared_experts * cfg.moe_intermediate_size
    fields.update(mtp_fields(cfg))
    return make_config(fields, overrides, cls=MLATransformerConfig)


def structural_fields(cfg) -> dict:
    return dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                num_moe_experts=cfg.n_routed_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                ffn_hidden_size=cfg.intermediate_size,
                moe_shared_expert_intermediate_size=(cfg.n_shared_experts * cfg.moe_intermediate_size) or None)


def layer_spec(config, cfg, *, vp_stage=None, use_te=False):
    """The decoder block spec; without TE, MLA gets a core attention that takes its separate v head dim."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(**supported_kwargs(
        get_gpt_decoder_block_spec, config=config, use_transformer_engine=use_te, normalization="RMSNorm",
        vp_stage=vp_stage))
    if use_te:
        return block
    from mcore2hf.testing.cpu import SDPACoreAttention

    block = copy.deepcopy(block)
    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return block


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
