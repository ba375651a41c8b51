"""Give a local-spec Megatron model Transformer Engine's parameter names and parallel attributes.

Transformer Engine is not installable here, but TE-built models are what most users train. This rewrites a
local-spec model in place so that `named_parameters()` shows exactly what a TE spec shows, with the same
Parameter objects (so values are unchanged). Where each name comes from (megatron-core 0.16.1 unless said):

* fused norms: TE's spec builds the norm before a TELayerNormColumnParallelLinear as IdentityOp, and that linear
  holds it as `layer_norm_weight` (TE's LayerNormLinear parameter; megatron-core spells it in
  extensions/transformer_engine.py `split_te_layernorm_column_parallel_linear`). Which norm, per
  models/gpt/gpt_layer_specs.py `get_gpt_layer_with_transformer_engine_spec`:
  `input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`; for dense MLPs
  `pre_mlp_layernorm.weight` -> `mlp.linear_fc1.layer_norm_weight` (MoE layers keep a separate TENorm
  `pre_mlp_layernorm`); MLA keeps a separate input norm and fuses `q_layernorm`/`kv_layernorm` into
  `linear_q_up_proj`/`linear_kv_up_proj` `.layer_norm_weight`. Gated DeltaNet
  (models/gpt/experimental_attention_variant_module_specs.py `get_gated_delta_net_module_spec`, metainfo
  fuse_input_layernorm): `input_layernorm.weight` -> `self_attention.in_proj.layer_norm_weight`. The pairs are
  those of post_training/modelopt/gpt/state_dict_hooks.py `mcore_gpt_load_te_state_dict_pre_hook`. A native vision
  tower's ViT layers (Qwen3-VL, models/vision/vit_layer_specs.py): both LayerNorms' weight and bias likewise
  (`layer_norm_weight` / `layer_norm_bias`, Megatron-Bridge 0.6.2 qwen3_vl_bridge.py:131-134). MTP layers'
  transformer_layer is built from the decoder's last layer spec (`get_gpt_mtp_block_spec`): the same rules.
* grouped experts (`moe_grouped_gemm`, extensions/transformer_engine_spec_provider.py `grouped_mlp_modules`:
  TEGroupedMLP of TE GroupedLinears): `mlp.experts.local_experts.{i}.linear_fc{1,2}.weight` ->
  `mlp.experts.linear_fc{1,2}.weight{i}`, biases `bias{i}` (TEGroupedLinear's sharded_state_dict spells
  `weight{gemm_idx}`; Megatron-Bridge 0.3.1's tables `mlp.experts.linear_fc1.weight*` / gpt_oss_bridge.py `bias*`);
  shared experts keep their names (plain TE column/row linears);
* TE's attributes on expert weights: under explicit expert communication (expert-TP > 1 or EP > 1) TE gets
  no parallel_mode, so every expert weight is marked `partition_dim=0`, `partition_stride=1` - also the
  row-parallel `linear_fc2`, which Megatron really splits along dim 1 (the quirk exporters must correct).

The names are checked against megatron-core's own TE spec (testing/te_spec.py, on real models in every layout
world: tests/worlds.py `te_renamed`) and Megatron-Bridge 0.3.1's tables; the attributes are not (that needs TE).
The rewritten model is for naming, gathering and loading; its forward is not meant to run.
"""
from __future__ import annotations

import torch
from torch import nn


def _move(src: nn.Module, src_attr: str, dst: nn.Module, dst_attr: str) -> None:
    p = src._parameters.pop(src_attr)
    dst.register_parameter(dst_attr, p)


class _GroupedLinear(nn.Module):
    """Holds weight0..weight{n-1} like TE's GroupedLinear."""


class _GroupedExperts(nn.Module):
    def __init__(self, num_local_experts: int):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.linear_fc1 = _GroupedLinear()
        self.linear_fc2 = _GroupedLinear()


def _single_grouped(linear: nn.Module, n: int) -> None:
    """megatron-core 0.19's moe_single_grouped_weight / _bias: weight0..weight{n-1} -> one `weight` [n, ...]
    (and biases); a new Parameter holding the same values, with the first item's attributes."""
    for kind in ("weight", "bias"):
        items = [linear._parameters.pop(f"{kind}{i}", None) for i in range(n)]
        if items[0] is None:
            continue
        p = nn.Parameter(torch.stack([t.data for t in items]))
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(items[0], attr):
                setattr(p, attr, getattr(items[0], attr))
        linear.register_parameter(kind, p)


def _te_layer(layer: nn.Module, explicit_expert_comm: bool, single_grouped: bool = False,
              grouped: bool = True) -> None:
    attn = layer.self_attention
    if hasattr(attn, "linear_qkv"):
        if "weight" in layer.input_layernorm._parameters:
            _move(layer.input_layernorm, "weight", attn.linear_qkv, "layer_norm_weight")
        if "bias" in layer.input_layernorm._parameters:
            _move(layer.input_layernorm, "bias", attn.linear_qkv, "layer_norm_bias")
    elif hasattr(attn, "in_proj"):  # gated DeltaNet: the input norm fused into in_proj
        if "weight" in layer.input_layernorm._parameters:
            _move(layer.input_layernorm, "weight", attn.in_proj, "layer_norm_weight")
    elif not hasattr(getattr(attn, "core_attention", None), "indexer"):
        # MLA: separate input norm, q/kv norms fused into the up projections (not with DeepSeek sparse attention,
        # whose indexer reads the normalized query latent: model_specs/deepseek_v32.py layer_spec)
        for norm, proj in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
            if hasattr(attn, norm) and hasattr(attn, proj) and "weight" in getattr(attn, norm)._parameters:
                _move(getattr(attn, norm), "weight", getattr(attn, proj), "layer_norm_weight")
    mlp = layer.mlp
    experts = getattr(mlp, "experts", None)
    if experts is None:
        if hasattr(mlp, "linear_fc1") and "weight" in layer.pre_mlp_layernorm._parameters:
            _move(layer.pre_mlp_layernorm, "weight", mlp.linear_fc1, "layer_norm_weight")
            if "bias" in layer.pre_mlp_layernorm._parameters:  # LayerNorm (a ViT's)
                _move(layer.pre_mlp_layernorm, "bias", mlp.linear_fc1, "layer_norm_bias")
        return
    if not grouped:  # moe_grouped_gemm=False: SequentialMLP of TE linears, the local experts' names
        return
    local = experts.local_experts
    group = _GroupedExperts(len(local))
    for i, expert in enumerate(local):
        for fc in ("linear_fc1", "linear_fc2"):
            p = getattr(expert, fc)._parameters.pop("weight")
            if explicit_expert_comm:
                p.partition_dim = 0
                p.partition_stride = 1
            elif fc == "linear_fc1":
                p.partition_stride = 1  # TE's GroupedLinear does not carry Megatron's GLU stride
            getattr(group, fc).register_parameter(f"weight{i}", p)
            bias = getattr(expert, fc)._parameters.pop("bias", None)
            if bias is not None:  # expert biases (gpt-oss): TE's GroupedLinear names them bias{i}
                getattr(group, fc).register_parameter(f"bias{i}", bias)
    if single_grouped:
        _single_grouped(group.linear_fc1, len(local))
        _single_grouped(group.linear_fc2, len(local))
    mlp.experts = group


def to_te_names(model, single_grouped: bool = False, grouped: bool = True) -> None:
    """Rewrite a local-spec model (or its list of virtual-PP chunks) to TE's names and attributes, in place;
    `single_grouped`: as megatron-core 0.19 with moe_single_grouped_weight (new Parameters, same values);
    `grouped=False`: experts as Megatron-LM's default `--moe-grouped-gemm` False builds them (SequentialMLP of TE
    linears, extensions/transformer_engine_spec_provider.py `grouped_mlp_modules`), named as the local spec's."""
    from megatron.core import parallel_state as ps

    from ..arch.naming import language_model, unwrap_model

    explicit = ps.get_expert_tensor_parallel_world_size() > 1 or ps.get_expert_model_parallel_world_size() > 1
    for chunk in unwrap_model(model):
        # a native vision tower's ViT layers: megatron-core 0.16.1 vit_layer_specs.py
        # `get_vit_layer_with_transformer_engine_spec` fuses both LayerNorms (weight and bias) as the GPT spec does
        tower = getattr(getattr(chunk, "vision_model", None), "decoder", None)
        for layer in getattr(tower, "layers", []):
            _te_layer(layer, explicit, single_grouped, grouped)
        chunk = language_model(chunk)  # a vision-language wrapper: its GPT model
        layers = list(chunk.decoder.layers) if getattr(chunk, "decoder", None) is not None else []
        mtp = getattr(chunk, "mtp", None)
        if mtp is not None:
            for m in mtp.layers:
                inner = getattr(m, "transformer_layer", None) or m.mtp_model_layer
                # megatron-core 0.19's hybrid MTP depth: a HybridStack of its layers (multi_token_prediction.py:1018)
                layers.extend(inner.layers if hasattr(inner, "layer_type_list") else [inner])
        for layer in layers:
            _te_layer(layer, explicit, single_grouped, grouped)


def te_names_of(model) -> list[str]:
    from ..arch.naming import unwrap_model

    return [n for chunk in unwrap_model(model) for n, _ in chunk.named_parameters()]


__all__ = ["to_te_names", "te_names_of"]
