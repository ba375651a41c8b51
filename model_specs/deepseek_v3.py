"""DeepSeek-V3 / R1 (and Kimi-K2, Moonlight: the same format): HF DeepseekV3Config <-> Megatron MLATransformerConfig.

Multi-latent attention (q_lora_rank may be null), dense first layers, shared experts, sigmoid group-limited
routing with expert bias, MTP layers. HF applies DeepSeek's interleaved rope (rope_interleave) by permuting q/k
rope dims at run time; Megatron's MLA does the same itself, so weights map one to one and rotary_interleaved
stays False.

The MLA family (deepseek_v2, glm4_moe_lite) reuses this module: `mla_transformer_config` takes the per-model
differences (which layers are MoE, the router fields) as data."""

import copy
from collections.abc import Callable

from mcore2hf.arch.hf_config import rope_parameters, rope_theta
from mcore2hf.errors import ConfigMismatchError

from .common import (
    SDPACoreAttention,
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

# transformers builds MLA's q_a_layernorm / kv_a_layernorm as `DeepseekV3RMSNorm(rank)`, i.e. with the class
# default eps=1e-6 whatever rms_norm_eps says (transformers 5.23: models/deepseek_v3/modeling_deepseek_v3.py lines
# 380 and 392; the same in deepseek_v2 lines 321/333 and glm4_moe_lite lines 253/265)
MLA_LATENT_NORM_EPS = 1e-6


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
    raise ConfigMismatchError(f"rope_type {kind!r} is not mapped to Megatron MLA (supported: default, yarn)")


def mla_transformer_config(cfg, moe_layer: Callable, router: dict, overrides: dict):
    """The MLATransformerConfig of an MLA model; `moe_layer(cfg, layer)` and the `router` fields are what
    differs between the family's members."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if getattr(cfg, "attention_bias", False):
        raise ConfigMismatchError("attention_bias=True: Megatron's MLA has no biases on its projections")
    pattern = [int(moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)]
    fields = llama_like_fields(cfg)
    fields.pop("kv_channels")  # MLA has its own head dims
    fields.update(num_query_groups=cfg.num_attention_heads, multi_latent_attention=True,
                  q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                  qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                  qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
                  add_qkv_bias=False, rotary_interleaved=False, **_rope_fields(cfg))
    fields.update(moe_fields(cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, pattern))
    fields.update(router)
    if cfg.n_shared_experts:
        fields["moe_shared_expert_intermediate_size"] = cfg.n_shared_experts * cfg.moe_intermediate_size
    fields.update(mtp_fields(cfg))
    return make_config(fields, overrides, cls=MLATransformerConfig)


def transformer_config(cfg, **overrides):
    router = sigmoid_router_fields(cfg, num_experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok)
    return mla_transformer_config(cfg, is_moe_layer, router, overrides)


def structural_fields(cfg) -> dict:
    return dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                num_moe_experts=cfg.n_routed_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                ffn_hidden_size=cfg.intermediate_size,
                moe_shared_expert_intermediate_size=(cfg.n_shared_experts * cfg.moe_intermediate_size) or None)


def with_eps(module, eps: float):
    """`module` (a class or a ModuleSpec of one) built with norm epsilon `eps`, whatever the config says: the
    `eps` argument (local norms) and the config's layernorm_epsilon (TE's fused layernorm-linear reads it)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(module, ModuleSpec):
        return ModuleSpec(module=with_eps(module.module, eps), params=module.params, submodules=module.submodules)
    if not isinstance(module, type) or module.__name__ == "IdentityOp":
        return module

    def fixed(kwargs: dict) -> dict:
        if "eps" in kwargs:
            kwargs["eps"] = eps
        if kwargs.get("config") is not None:
            kwargs["config"] = copy.copy(kwargs["config"])
            kwargs["config"].layernorm_epsilon = eps
        return kwargs

    def __new__(cls, *args, **kwargs):
        if module.__new__ is object.__new__:
            return object.__new__(cls)
        return module.__new__(cls, *args, **fixed(kwargs))  # Megatron's WrappedTorchNorm builds in __new__

    def __init__(self, *args, **kwargs):
        module.__init__(self, *args, **fixed(kwargs))

    return type(module.__name__, (module,), {"__new__": __new__, "__init__": __init__,
                                              "__module__": module.__module__})


def megatron_at_least(*version: int) -> bool:
    from megatron.core import __version__

    return tuple(int(x) for x in __version__.split(".")[:2]) >= version


def layer_spec(config, cfg, *, vp_stage=None, use_te=False):
    """The decoder block spec: MLA's latent norms with transformers' eps; without TE, a core attention that
    takes MLA's separate v head dim."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = copy.deepcopy(get_gpt_decoder_block_spec(**supported_kwargs(
        get_gpt_decoder_block_spec, config=config, use_transformer_engine=use_te, normalization="RMSNorm",
        vp_stage=vp_stage)))
    if config.q_lora_rank is None and megatron_at_least(0, 19):
        # megatron-core 0.19.2 mla_qk_norm_config.py `_resolve_mla_qk_layernorm`: with qk_layernorm and no
        # q_lora_rank, linear_q_proj must be Transformer Engine's fused norm+linear; unverified against HF
        raise ConfigMismatchError("q_lora_rank null (Moonlight, DeepSeek-V2-Lite): megatron-core >= 0.19 builds MLA "
                                  "without q_lora_rank only with a fused norm+linear q projection (Transformer "
                                  "Engine), not verified against the HF model; use megatron-core 0.16-0.18")
    # with TE the latent norms are fused into the up projections (TELayerNormColumnParallelLinear)
    latent = ("linear_q_up_proj", "linear_kv_up_proj") if use_te else ("q_layernorm", "kv_layernorm")
    for spec in block.layer_specs:
        attn = spec.submodules.self_attention.submodules
        for name in latent:
            setattr(attn, name, with_eps(getattr(attn, name), MLA_LATENT_NORM_EPS))
        if not use_te:
            attn.core_attention = SDPACoreAttention
    return block


def gpt_kwargs(cfg) -> dict:
    return default_gpt_kwargs(cfg)


build_model = spec_builder(__name__)
