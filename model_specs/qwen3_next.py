"""Qwen3-Next: HF Qwen3NextConfig <-> Megatron TransformerConfig + a hybrid layer spec (gated DeltaNet layers and
gated full-attention layers, MoE with a gated shared expert).

Read in transformers 5.23.0 models/qwen3_next/{modeling,configuration}_qwen3_next.py and megatron-core 0.16.1
megatron/core/ssm/gated_delta_net.py, megatron/core/models/gpt/experimental_attention_variant_module_specs.py:

* `layer_types[i]` ("linear_attention" / "full_attention") is Megatron's `linear_attention_freq` list (1 = GDN);
* every Qwen3NextRMSNorm computes x_hat * (1 + w) (zero-centred gamma, initialized to 0): Megatron's
  `layernorm_zero_centered_gamma=True`, the same stored value; megatron-core's local norm refuses it (torch_norm.py),
  so the local spec uses `ZeroCenteredRMSNorm` (what TE's RMSNorm(zero_centered_gamma=True) computes);
* the GDN output norm: transformers' Qwen3NextRMSNormGated stores gamma itself (initialized to 1), while
  megatron-core 0.16.1 builds GatedDeltaNet.out_norm from the config like every norm, so it is zero-centred too
  (gamma = 1 + w): the converter maps it with `ZeroCentered` (w_hf = w + 1);
* gated attention: `attention_output_gate=True` (q_proj holds [q_h; gate_h] per head, output * sigmoid(gate));
* MoE: softmax top-k (renormalized iff norm_topk_prob), a shared expert scaled by sigmoid(shared_expert_gate(x)):
  Megatron's `moe_shared_expert_gate=True`.

`hybrid_block_spec` and `ZeroCenteredRMSNorm` are shared with Qwen3.5 (same blocks, other HF projections).
"""

from __future__ import annotations

import torch

from mcore2hf.arch.hf_config import get
from mcore2hf.errors import ConfigMismatchError

from .common import Decoder, Fields, base_dims, supported_kwargs

#: fp32 logit parity bound with transformers (the demo's, tests/test_qwen3_next.py's). Measured on the tiny model
#: (|logits| <= 17): transformers' own fp32 forward is 1.24e-4 from its fp64 forward with 3 of 4 layers gated
#: DeltaNet, 2.3e-4 with 4 of 4, 1.3e-5 with none (the chunked delta-rule recurrence runs in fp32); Megatron vs
#: transformers 6.5e-5 (TP1) and 9.8e-5 (TP2 x EP2). So ~2.5x the measured round-off, not the 1e-4 of the others.
LOGIT_TOL = 3e-4


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with zero-centred gamma: y = x / rms(x) * (1 + w), in fp32, cast back to the input dtype (TE's
    RMSNorm with zero_centered_gamma=True; transformers' Qwen3NextRMSNorm). Megatron's local norm lacks it."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # Megatron all-reduces the gradients of sequence-parallel norms over TP
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def gdn_module_spec():
    """Local-spec GatedDeltaNet (megatron-core 0.16.1's TE spec fuses the input norm into in_proj; here it stays
    the layer's input_layernorm, the same parameter under its local name)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear))


def _local_layer(config, moe: bool, linear: bool):
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(**supported_kwargs(
        get_gpt_layer_local_spec, num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm, normalization="RMSNorm")))
    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    if linear:
        sub.self_attention = gdn_module_spec()
        # checkpoint keys as Transformer Engine's spec saves them (the input norm fused into in_proj), not
        # the local spec's linear_qkv name, which a GDN layer does not have
        sub.sharded_state_dict_keys_map = {**sub.sharded_state_dict_keys_map,
                                           "input_layernorm.": "self_attention.in_proj.layer_norm_"}
    elif config.qk_layernorm:
        sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
        sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    return spec


def _stage_layer_ids(config, vp_stage) -> list[int]:
    """Global indices of the layers this (virtual) pipeline stage builds, as Megatron's block specs slice them."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        return list(config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                            vp_stage=vp_stage))
    offset = get_transformer_layer_offset(**supported_kwargs(get_transformer_layer_offset, config=config,
                                                             vp_stage=vp_stage))
    n = get_num_layers_to_build(**supported_kwargs(get_num_layers_to_build, config=config, vp_stage=vp_stage))
    return list(range(offset, offset + n))


def hybrid_block_spec(config, *, vp_stage=None, use_te: bool = False):
    """Decoder block spec of a GDN / full-attention hybrid from `config.linear_attention_freq` (a list: 1 = GDN)
    and `config.moe_layer_freq`. With Transformer Engine: megatron-core's experimental spec itself."""
    if use_te:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    linear = list(config.linear_attention_freq)
    freq = config.moe_layer_freq
    moe = list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    if config.num_moe_experts is None:
        moe = [0] * config.num_layers
    layers = [_local_layer(config, bool(moe[i]), bool(linear[i])) for i in _stage_layer_ids(config, vp_stage)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)


def linear_pattern(cfg) -> list[int]:
    """1 where HF builds a gated DeltaNet layer (layer_types), 0 for full attention."""
    types = list(cfg.layer_types)
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != cfg.num_hidden_layers:
        raise ConfigMismatchError(f"{cfg.model_type} layer_types: expected {cfg.num_hidden_layers} entries of "
                                  f"linear_attention / full_attention, got {types}")
    return [int(t == "linear_attention") for t in types]


def gdn_fields(cfg) -> dict:
    """TransformerConfig fields of the gated DeltaNet layers (megatron-core 0.16.1 transformer_config.py)."""
    return dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=linear_pattern(cfg),
                linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, linear_key_head_dim=cfg.linear_key_head_dim,
                linear_value_head_dim=cfg.linear_value_head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
                linear_num_value_heads=cfg.linear_num_value_heads)


def gdn_dims(cfg) -> dict:
    """ModelDims fields of the gated DeltaNet layout ops."""
    return dict(linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
                linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim)


class Qwen3Next(Decoder):
    """Gated DeltaNet and gated attention layers (zero-centred norms), MoE with a gated shared expert: softmax
    top-k (renormalized iff norm_topk_prob)."""

    hf_architecture = "Qwen3NextForCausalLM"

    def experts(self, cfg) -> int:
        return int(get(cfg, "num_experts", default=0) or 0)

    def moe_layer(self, cfg, layer: int) -> bool:
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return layer not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer + 1) % step == 0

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=True, add_qkv_bias=False, layernorm_zero_centered_gamma=True,
                    attention_output_gate=True, **gdn_fields(cfg))

    def shared_experts(self, cfg) -> int:
        return int(cfg.shared_expert_intermediate_size)

    def extra(self, cfg, fields: Fields) -> None:
        if self.experts(cfg):
            fields.set(moe_shared_expert_gate=True)

    def dims(self, cfg):
        return base_dims(cfg, num_experts=self.experts(cfg), **gdn_dims(cfg))

    def check(self, cfg) -> None:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ConfigMismatchError(f"{cfg.model_type} hidden_act: expected silu (GatedDeltaNet's conv activation "
                                      f"and output gate are the config's activation), got {cfg.hidden_act}")
        if getattr(cfg, "attention_bias", False):
            raise ConfigMismatchError(f"{cfg.model_type} attention_bias: expected False, got True")
        if self.experts(cfg) and not int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0):
            raise ConfigMismatchError(f"{cfg.model_type} shared_expert_intermediate_size: transformers always builds a "
                                      "gated shared expert; expected > 0, got 0")

    def layer_spec(self, config, cfg, *, vp_stage=None, use_te=False):
        return hybrid_block_spec(config, vp_stage=vp_stage, use_te=use_te)


SPEC = Qwen3Next()
