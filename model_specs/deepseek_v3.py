"""DeepSeek-V3 / R1 (and Kimi-K2, Moonlight: the same format): HF DeepseekV3Config <-> Megatron MLATransformerConfig.

Multi-latent attention (q_lora_rank may be null), dense first layers, shared experts, sigmoid group-limited
routing with expert bias, MTP layers. HF applies DeepSeek's interleaved rope (rope_interleave) by permuting q/k
rope dims at run time; Megatron's MLA does the same itself, so weights map one to one and rotary_interleaved
stays False.

The MLA family (deepseek_v2, glm4_moe_lite, the DSA models) subclasses `MLA`: which layers are MoE and the router
are what differs."""

import copy

from mcore2hf.arch.hf_config import rope_parameters, rope_theta
from mcore2hf.errors import ConfigMismatchError

from .common import Decoder, Fields, SDPACoreAttention, base_dims, sigmoid_router_fields, supported_kwargs

# transformers builds MLA's q_a_layernorm / kv_a_layernorm as `DeepseekV3RMSNorm(rank)`, i.e. with the class
# default eps=1e-6 whatever rms_norm_eps says (transformers 5.23: models/deepseek_v3/modeling_deepseek_v3.py lines
# 380 and 392; the same in deepseek_v2 lines 321/333 and glm4_moe_lite lines 253/265)
MLA_LATENT_NORM_EPS = 1e-6


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


def mla_layer_spec(config, cfg, *, vp_stage=None, use_te=False):
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


class MLA(Decoder):
    """DeepSeek-V3's multi-latent attention decoder: MLATransformerConfig, dense first layers, routed and shared
    experts, MTP layers; the MLA head dims structural, MLA's own num_query_groups / kv_channels not."""

    hf_architecture = "DeepseekV3ForCausalLM"
    config_class = "MLATransformerConfig"
    mtp = True

    def experts(self, cfg) -> int:
        return cfg.n_routed_experts

    def moe_layer(self, cfg, layer: int) -> bool:
        freq = getattr(cfg, "moe_layer_freq", 1) or 1
        return layer >= cfg.first_k_dense_replace and layer % freq == 0

    def router(self, cfg) -> dict:
        return sigmoid_router_fields(cfg, num_experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok)

    def shared_experts(self, cfg) -> int:
        return cfg.n_shared_experts * cfg.moe_intermediate_size

    def dims(self, cfg):
        return base_dims(cfg, num_experts=cfg.n_routed_experts, q_lora_rank=cfg.q_lora_rank,
                         kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                         qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)

    def check(self, cfg) -> None:
        if getattr(cfg, "attention_bias", False):
            raise ConfigMismatchError("attention_bias=True: Megatron's MLA has no biases on its projections")

    def fields(self, cfg) -> Fields:
        fields = super().fields(cfg)
        fields.pop("kv_channels")  # MLA has its own head dims
        fields.set(True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                   qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)
        fields.set(num_query_groups=cfg.num_attention_heads, multi_latent_attention=True,
                   qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
                   add_qkv_bias=False, rotary_interleaved=False)
        return fields.later(lambda: _rope_fields(cfg))

    def layer_spec(self, config, cfg, *, vp_stage=None, use_te=False):
        return mla_layer_spec(config, cfg, vp_stage=vp_stage, use_te=use_te)


SPEC = MLA()
