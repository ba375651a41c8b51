"""Kimi-K2.5 (HF `kimi_k25`): DeepSeek-V3's language model (Kimi-K2) under the published checkpoints' names,
`language_model.model.*` and `language_model.lm_head.weight`, beside the vision tower `vision_tower.*` and its
projector `mm_projector.*` (transformers 5.24 conversion_mapping.py "kimi_k25": the published names it renames on
load, `language_model.model` -> `model.language_model`, `language_model.lm_head` -> `lm_head`, `vision_tower.*`,
`mm_projector.proj.{0,2}`). Exports use the published names, which transformers' Kimi_K25ForConditionalGeneration
and the engines load. No MTP layers (Kimi-K2's num_nextn_predict_layers is 0).

An HF tower embedded in the Megatron model keeps the published names under `vision_tower` / `mm_projector` (passed
through); without one, both are declared not held (docs/vlm.md)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import kimi_k25 as spec

from .common import (
    TINY_VL_MOE,
    VLM_FP8_SOURCE,
    dense_mlp,
    embeddings,
    fp8_policy,
    hf_tower,
    language_model,
    mla_attention,
    moe,
)

KIMI_K25 = Converter(
    model_type="kimi_k25",
    spec=spec.SPEC,
    rules=language_model(embeddings() + mla_attention() + dense_mlp() + moe(shared_experts=True, expert_bias=True),
                         model="language_model.model.", lm_head="language_model.lm_head.weight")
    + hf_tower("vision_tower", "vision_tower") + hf_tower("mm_projector", "mm_projector"),
    not_held=(r"vision_tower\..*", r"mm_projector\..*"),
    # DeepSeek-V3 / Kimi-K2's block-FP8 format (no modules_to_not_convert), the tower kept
    fp8=fp8_policy(list_not_converted=False, source=VLM_FP8_SOURCE, tower=("vision_tower.", "mm_projector.")),
)

# Kimi-K2.5: Kimi-K2's MLA text model (DeepseekV3Config) and its MoonViT tower with projector
TINY = dict(text_config=dict(
    vocab_size=101, hidden_size=44, intermediate_size=52, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=12, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
    topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, q_lora_rank=22, kv_lora_rank=18,
    qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=10, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
    max_position_embeddings=256, rope_scaling=None, tie_word_embeddings=False, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, **TINY_VL_MOE),
    vision_config=dict(patch_size=3, pos_emb_height=5, pos_emb_width=5, pos_emb_time=2, num_attention_heads=3,
                       num_hidden_layers=2, hidden_size=30, intermediate_size=26),
    projection_hidden_size=30, tie_word_embeddings=False)
VERIFIED = ('its own world (TP2 x PP2 x EP2, PP2 x VPP2 x EP2): the language model bit-identical, the tower '
            'completed from the multimodal checkpoint offline and live (once per sync or with the first), '
            'offline export and import, engine shards, the dry run, transformers loads every directory; '
            "logits (text tokens) = transformers' at both, demo, Megatron-Bridge 0.6.2's KimiK25VLModel "
            "(rebuilt) with its tower (TP2 x PP2); its wrapper's torch_dist checkpoint exported offline, "
            "verified and imported (--vision-tower hf), the wrapper's dry run")
# the published checkpoints' layout: the language model's layers as `language_model.model.layers` (transformers
# 5.24 reverts its "blocks" -> "layers" rename, meant for the vision tower, on the language model's names too
# when saving) and the projector norm under `mm_projector.`
PUBLISHED_LAYOUT = ((r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                    (r"^model\.mm_projector\.", "mm_projector."))
register(Architecture(KIMI_K25, tiny=TINY, verified=VERIFIED, published_layout=PUBLISHED_LAYOUT))
