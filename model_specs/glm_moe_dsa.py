"""GLM-5 (HF `glm_moe_dsa`): DeepSeek-V3.2's format (multi-latent attention with DeepSeek sparse attention's
indexer, dense first layers, shared experts, sigmoid routing with expert bias, MTP layers) with GLM's values and
two differences: the indexer applies interleaved rope (transformers 5.24 modeling_glm_moe_dsa.py
`GlmMoeDsaIndexer.forward`: `apply_rotary_pos_emb_interleave`), and GLM-5.2's IndexShare (`indexer_types`:
"shared" layers reuse the previous full layer's top-k and have no indexer tensors)."""

from .common import spec_builder
from .deepseek_v32 import dims as dsa_dims
from .deepseek_v32 import (  # noqa: F401
    dsa_core_attention,
    gpt_kwargs,
    index_share_sources,
    index_share_stage_problems,
    is_moe_layer,
    local_index_share_problems,
    shared_indexer_layers,
    spec_backend,
    structural_fields,
)
from .deepseek_v32 import layer_spec as dsa_layer_spec
from .deepseek_v32 import transformer_config as dsa_transformer_config

HF_ARCHITECTURE = "GlmMoeDsaForCausalLM"
INDEXER_ROPE_INTERLEAVED = True


def dims(cfg):
    return dsa_dims(cfg, INDEXER_ROPE_INTERLEAVED)


def transformer_config(cfg, **overrides):
    return dsa_transformer_config(cfg, INDEXER_ROPE_INTERLEAVED, **overrides)


def layer_spec(config, cfg, *, vp_stage=None, use_te=False):
    return dsa_layer_spec(config, cfg, vp_stage=vp_stage, use_te=use_te)


build_model = spec_builder(__name__)
