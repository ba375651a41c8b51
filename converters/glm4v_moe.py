"""GLM-4.5V (HF `glm4v_moe`: Glm4vMoeForConditionalGeneration): GLM-4.5's language model (dense first layers,
shared experts, expert bias, q/k/v biases, no q/k norm) under `model.language_model.`, experts in checkpoint format
(`mlp.experts.{E}.gate_proj.weight`: transformers 5.24 conversion_mapping.py maps glm4v_moe to qwen2_moe's expert
fusion), `lm_head.weight` at the top, the vision tower under `model.visual.` (models/glm4v_moe/modeling_glm4v_moe.py).

Megatron-Bridge 0.3.1's GLM45VModel (models/glm_vl/modeling_glm_45v.py) embeds transformers' Glm4vVisionModel at
`visual` beside `language_model` (its bridge maps `visual.**` -> `model.visual.**`): passed through (`hf_tower`).
Without a tower in the Megatron model, `model.visual.*` is declared not held (docs/vlm.md)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import glm4v_moe as spec

from .common import (
    TINY_VL_MOE,
    TINY_VL_MROPE,
    TINY_VL_TEXT,
    VLM_FP8_SOURCE,
    dense_mlp,
    embeddings,
    fp8_policy,
    gqa_attention,
    hf_tower,
    language_model,
    moe,
)

GLM4V_MOE = Converter(
    model_type="glm4v_moe",
    spec=spec.SPEC,
    rules=language_model(embeddings() + gqa_attention() + dense_mlp() + moe(shared_experts=True, expert_bias=True))
    + hf_tower("visual", "model.visual"),
    not_held=(r"model\.visual\..*",),
    fp8=fp8_policy(source=VLM_FP8_SOURCE, tower=("model.visual.",)),
)

# GLM-4.5V: head_dim 12 (partial rotary 0.5 needs an even rotary dim), q/k/v bias, dense first layer, 1 shared
TINY = dict(text_config=dict(TINY_VL_TEXT, head_dim=12, n_routed_experts=12, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                             attention_bias=True, rms_norm_eps=1e-5, **TINY_VL_MOE,
                             rope_parameters=dict(TINY_VL_MROPE, partial_rotary_factor=0.5,
                                                  mrope_section=[1, 1, 1])),
            vision_config=dict(depth=2, hidden_size=30, intermediate_size=26, num_heads=3, out_hidden_size=44,
                               patch_size=3, temporal_patch_size=2, spatial_merge_size=2, image_size=9),
            tie_word_embeddings=False)
VERIFIED = ('its own world (TP2 x PP2 x EP2, PP2 x VPP2 x EP2): the language model bit-identical, the tower '
            'completed from the multimodal checkpoint offline and live (once per sync or with the first), '
            'offline export and import, engine shards, the dry run, transformers loads every directory; '
            "logits (text tokens) = transformers' at both, demo, Megatron-Bridge 0.3.1's GLM45VModel with "
            "its HF tower (TP2 x PP2); its wrapper's torch_dist checkpoint exported offline, verified and "
            "imported (--vision-tower hf), the wrapper's dry run")
register(Architecture(GLM4V_MOE, tiny=TINY, verified=VERIFIED))
