"""Tiny models for tests and the demo: HF configs and random HF checkpoints written by transformers itself."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

TINY_CONFIGS: dict[str, dict] = {
    # vocab 100 (Megatron pads it), 4 layers so PP2 x VPP2 has a layer per chunk, 8 experts for EP4
    "qwen3_moe": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # dense first layer, shared expert, sigmoid routing over 2 groups (top-2 per group), q/k/v bias, q/k norm,
    # partial rotary, one MTP layer
    "glm4_moe": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
        num_nextn_predict_layers=1, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_nextn_predict_layers=1, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_scaling=None, tie_word_embeddings=False,
    ),
    # attention sinks, biases, sliding window 4 on alternate layers (the parity tokens are longer), a clamp
    # limit the random activations reach, yarn rope; experts stacked per layer in HF
    "gpt_oss": dict(
        vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        swiglu_limit=0.5, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64),
    ),
    # MiniMax-M2's published config.json fields, scaled down: full-width q/k norm (q over 4 x 32 = 128 > hidden),
    # rotary_dim = head_dim / 2, sigmoid routing with e_score_correction_bias, no shared experts, rope_theta 5e6
    "minimax_m2": dict(
        vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rotary_dim=16, num_local_experts=8, num_experts_per_tok=2,
        rope_theta=5000000, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
        scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer",
        shared_intermediate_size=0, bos_token_id=None, eos_token_id=None,  # the published ids exceed vocab 100
    ),
    # OLMoE-1B-7B's fields, scaled down: full-width q/k norm, MHA, softmax top-k without renormalization
    "olmoe": dict(
        vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=None,  # the published id exceeds vocab 100
    ),
    "qwen3": dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False),
    # tied embeddings, as in Llama 3.2 1B/3B
    "llama": dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True),
    # GLM-4.7-Flash scaled down (its values are transformers 5.23's Glm4MoeLiteConfig defaults: MLA with
    # v_head_dim > qk_nope_head_dim, rms_norm_eps 1e-5, n_group 1, routed_scaling_factor 1.8, the first layer
    # dense via mlp_layer_types), with one MTP layer as published (num_nextn_predict_layers 1)
    "glm4_moe_lite": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32,
        # kv_b_proj has 4 x (12 + 20) = 128 rows: transformers' FP8 loader dequantizes only weights of whole
        # 128-blocks or smaller than 128 (see README), and the FP8 test loads this model
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_nextn_predict_layers=1, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=256, attention_bias=False, tie_word_embeddings=False,
    ),
    # DeepSeek-V3.2 scaled down: DeepSeek-V3's MLA and routing plus the sparse-attention indexer with an odd head
    # count (5), head dim 16 (a power of two: megatron-core's Hadamard rotation) holding the 8 rope dims, and
    # index_topk 6 < the parity tests' 16 tokens, so each query attends to the indexer's choice (the sparse regime)
    "deepseek_v32": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, index_n_heads=5, index_head_dim=16, index_topk=6, num_nextn_predict_layers=1,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # GLM-5 scaled down (transformers 5.24 GlmMoeDsaConfig defaults: v_head_dim > qk_nope_head_dim, rms_norm_eps 1e-5,
    # n_group 1, the first layers dense): its indexer applies interleaved rope; 7 indexer heads, index_topk 5
    "glm_moe_dsa": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        index_n_heads=7, index_head_dim=16, index_topk=5, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=256,
        attention_bias=False, tie_word_embeddings=False,
    ),
    # DeepSeek-V2-Lite scaled down (its published config.json: q_lora_rank null, softmax "greedy" routing without
    # renormalization, 2 shared experts, yarn rope factor 40, mscale 0.707); routed_scaling_factor 2.5 (published 1.0;
    # DeepSeek-V2 16.0) so the parity test sees the factor
    "deepseek_v2": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0},
    ),
    # Mixtral-8x7B scaled down: 8 experts, top-2, rms_norm_eps 1e-5, rope_theta 1e6, no sliding window
    "mixtral": dict(
        vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None,
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    # Mistral-7B-v0.3 scaled down: rms_norm_eps 1e-5, rope_theta 1e6, no sliding window
    "mistral": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        sliding_window=None, max_position_embeddings=256, tie_word_embeddings=False,
    ),
    # Qwen3-Next-80B-A3B scaled down: 3 gated DeltaNet layers then 1 gated attention layer (PP2 puts the boundary
    # between stages), more value heads than key heads (r = 2) and key / value head dims that differ, so TP2
    # splits both head counts and a mix-up of the grouping shows; partial rotary 0.25, gated shared expert
    "qwen3_next": dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}

# Qwen3.5 (Qwen/Qwen3.5-27B, -35B-A3B config.json layout): a multimodal config whose text_config is the language
# model mcore2hf converts; the small vision tower makes the tiny checkpoint a real base for `save_pretrained(base=)`.
# 4 layers, full attention every 2nd (published: every 4th), so PP2 stages both hold both layer kinds.
_QWEN3_5_TEXT = dict(
    vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, full_attention_interval=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
_QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                       num_position_embeddings=16, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
TINY_CONFIGS.update({
    "qwen3_5": dict(text_config=dict(_QWEN3_5_TEXT, intermediate_size=96), vision_config=_QWEN3_5_VISION,
                    tie_word_embeddings=False),
    "qwen3_5_moe": dict(text_config=dict(_QWEN3_5_TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         num_experts=8, num_experts_per_tok=2),
                        vision_config=_QWEN3_5_VISION, tie_word_embeddings=False),
})

# Vision-language models (docs/vlm.md), odd-shaped: no dimension a multiple of 8 (a transposition or a wrong
# split cannot hide behind equal sizes); TP2 still splits heads (4, 2 kv) and ffn, EP 2 and 4 the 12 experts. 4 layers so
# PP2 x VPP2 has a layer per chunk; ffn 52 and expert ffn 20 divide over engine TP 4; a vision tower of 3 patch-3 blocks with 2 deepstack mergers (Qwen3-VL).
_VL_TEXT = dict(vocab_size=101, hidden_size=44, intermediate_size=52, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
_VL_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 1]}
_QWEN3_VL_VISION = dict(depth=3, hidden_size=36, intermediate_size=30, num_heads=3, out_hidden_size=44,
                        num_position_embeddings=25, patch_size=3, temporal_patch_size=2, spatial_merge_size=2,
                        deepstack_visual_indexes=[0, 1])
_VL_IDS = dict(image_token_id=97, video_token_id=98, vision_start_token_id=99, vision_end_token_id=100)
_VL_MOE = dict(moe_intermediate_size=20, num_experts_per_tok=2)
TINY_CONFIGS.update({
    "qwen3_vl": dict(text_config=dict(_VL_TEXT, rope_parameters=_VL_MROPE), vision_config=_QWEN3_VL_VISION,
                     tie_word_embeddings=False, **_VL_IDS),
    "qwen3_vl_moe": dict(text_config=dict(_VL_TEXT, rope_parameters=_VL_MROPE, num_experts=12, decoder_sparse_step=1,
                                          mlp_only_layers=[], **_VL_MOE),
                         vision_config=_QWEN3_VL_VISION, tie_word_embeddings=False, **_VL_IDS),
    # GLM-4.5V: head_dim 12 (partial rotary 0.5 needs an even rotary dim), q/k/v bias, dense first layer, 1 shared
    "glm4v_moe": dict(text_config=dict(_VL_TEXT, head_dim=12, n_routed_experts=12, n_shared_experts=1,
                                       first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                                       attention_bias=True, rms_norm_eps=1e-5, **_VL_MOE,
                                       rope_parameters=dict(_VL_MROPE, partial_rotary_factor=0.5,
                                                            mrope_section=[1, 1, 1])),
                      vision_config=dict(depth=2, hidden_size=30, intermediate_size=26, num_heads=3, out_hidden_size=44,
                                         patch_size=3, temporal_patch_size=2, spatial_merge_size=2, image_size=9),
                      tie_word_embeddings=False),
    # Kimi-K2.5: Kimi-K2's MLA text model (DeepseekV3Config) and its MoonViT tower with projector
    "kimi_k25": dict(text_config=dict(
        vocab_size=101, hidden_size=44, intermediate_size=52, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=12, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, q_lora_rank=22, kv_lora_rank=18,
        qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=10, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_scaling=None, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **_VL_MOE),
        vision_config=dict(patch_size=3, pos_emb_height=5, pos_emb_width=5, pos_emb_time=2, num_attention_heads=3,
                           num_hidden_layers=2, hidden_size=30, intermediate_size=26),
        projection_hidden_size=30, tie_word_embeddings=False),
})

# Members of a registered family whose config.json is the family's format with other values (not an
# architecture of their own: tests run them where the values matter, logit parity). Scaled-down published values.
TINY_VARIANTS: dict[str, dict] = {
    # moonshotai/Kimi-K2-Instruct(-0905) config.json: model_type "kimi_k2" with an auto_map to its remote code
    # (configuration_deepseek.py / modeling_deepseek.py), yarn rope (factor 64, beta_fast 1, beta_slow 1,
    # mscale 1, mscale_all_dim 1, original 4096, rope_theta 50000), n_group 1, routed_scaling_factor 2.827,
    # no MTP layers (as listed by ParagEkbote/hf-model-inspector model_inspection_report.md)
    "kimi_k2": dict(
        model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModel": "modeling_deepseek.DeepseekV3Model",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
        rope_theta=50000.0, max_position_embeddings=262144, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # moonshotai/Moonlight-16B-A3B config.json: deepseek_v3 with q_lora_rank null, rms_norm_eps 1e-5 (MLA's
    # latent norms stay at 1e-6 in transformers), rope_theta 50000, n_group 1, routed_scaling_factor 2.446
    "moonlight": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModel": "modeling_deepseek.DeepseekV3Model",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=2.446,
        norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
        rope_theta=50000.0, rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False,
    ),
}


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """A registered architecture's tiny config, or a family member's from TINY_VARIANTS (loaded as mcore2hf
    loads its config.json: kimi_k2 through its alias)."""
    if model_type in TINY_VARIANTS:
        from mcore2hf.hf_config import load_hf_config

        return load_hf_config({**TINY_VARIANTS[model_type], **overrides})
    kw = {**TINY_CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kw)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere, norms included, so a swapped or misplaced tensor cannot go unnoticed. Norms
    initialized to zeros are zero-centred (gamma = 1 + w) and get w around 0, the others gamma around 1.

    Scales keep a few-layer fp32 forward well conditioned (for logit parity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if "norm" in name:  # around the norm's own identity: gamma 1, or w 0 where gamma = 1 + w (Qwen3-Next)
                t.copy_((0.0 if bool((t == 0).all()) else 1.0) + 0.1 * r)
            elif "bias" in name:
                t.copy_(0.1 * r)
            elif "embed" in name or "lm_head" in name:
                t.copy_(0.5 * r)
            else:
                t.copy_(r / max(t.shape[-1], 1) ** 0.5)


def make_hf_checkpoint(cfg: PretrainedConfig, out_dir: str | os.PathLike, *, seed: int = 0,
                       dtype: torch.dtype = torch.float32, published: bool = True) -> str:
    """An HF checkpoint directory of `cfg` with random weights, saved by transformers.

    transformers builds no MTP layers, so for configs with `num_nextn_predict_layers` the MTP tensors are added
    in the published layout (decoder layer, enorm, hnorm, eh_proj, shared_head, embedding/head copies). Where
    transformers saves another layout than the published checkpoints (hf_config.PUBLISHED_LAYOUT) the directory
    is rewritten into the published one, unless `published=False` (what a user's own save_pretrained writes)."""
    torch.manual_seed(seed)
    # a multimodal config (Qwen3.5) is saved as its published checkpoints are: the whole model, vision tower too
    auto = AutoModelForImageTextToText if getattr(cfg, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    model = model.to(dtype)
    out = os.fspath(out_dir)
    model.save_pretrained(out)
    if int(getattr(cfg, "num_nextn_predict_layers", 0) or 0):
        _add_mtp_tensors(cfg, out, seed)
    from ..hf_config import PUBLISHED_LAYOUT

    if published and cfg.model_type in PUBLISHED_LAYOUT:  # where transformers saves another layout than the published one
        _to_published_layout(out, cfg.model_type)
    return out


def _to_published_layout(path: str, model_type: str) -> None:
    """Rewrite a checkpoint transformers saved into the published checkpoints' layout (hf_config.PUBLISHED_LAYOUT)."""
    from safetensors.torch import save_file

    from ..hf_config import published_layout

    out = dict(published_layout(model_type, n, t) for n, t in read_hf_checkpoint(path).items())
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _add_mtp_tensors(cfg: PretrainedConfig, path: str, seed: int) -> None:
    import json

    from safetensors.torch import save_file

    sd = read_hf_checkpoint(path)
    n = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed + 1000)
    last = f"model.layers.{n - 1}."
    extra: dict[str, torch.Tensor] = {}
    for m in range(cfg.num_nextn_predict_layers):
        layer = f"model.layers.{n + m}."
        # the MTP block's decoder layer has the last layer's structure, then an indexer where the model has one
        # (GLM-5.2 IndexShare: also when the last layer is "shared"; hf_config.hf_tensor_shapes)
        parts = [(n[len(last):], t) for n, t in sd.items() if n.startswith(last)]
        parts += [(n[len("model.layers.0."):], t) for n, t in sd.items()
                  if n.startswith("model.layers.0.self_attn.indexer.") and layer + n[len("model.layers.0."):]
                  not in {layer + r for r, _ in parts}]
        for rest, t in parts:
            r = torch.randn(t.shape, generator=g)
            scale = 0.1 if t.dim() < 2 else 1.0 / max(t.shape[-1], 1) ** 0.5
            value = 1.0 + 0.1 * r if "norm" in rest else scale * r
            extra[layer + rest] = value.to(t.dtype)
        h = cfg.hidden_size
        dtype = sd["model.norm.weight"].dtype
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            extra[f"{layer}{norm}.weight"] = (1.0 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        extra[f"{layer}eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).to(dtype)
        extra[f"{layer}embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
        extra[f"{layer}shared_head.head.weight"] = sd["lm_head.weight"].clone()
    fname = "model-mtp.safetensors"
    save_file(extra, os.path.join(path, fname), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
    else:
        index = {"metadata": {}, "weight_map": dict.fromkeys(sd, "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(extra, fname))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def read_hf_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, as saved (hf_dir: validated, index or single file)."""
    from ..hf_dir import read_all

    return read_all(path)
