"""Llama 2 / 3 dense (attention_bias as configured; tied embeddings for the small Llama 3.2)."""

from .common import dense_decoder, spec_builder

HF_ARCHITECTURE = "LlamaForCausalLM"


def attention(cfg) -> dict:
    return dict(qk_layernorm=False, add_qkv_bias=bool(getattr(cfg, "attention_bias", False)))


is_moe_layer, dims, transformer_config, structural_fields, gpt_kwargs = dense_decoder(attention)
build_model = spec_builder(__name__)
