"""Qwen3 dense: q/k norms, no biases."""

from .common import dense_decoder, spec_builder

HF_ARCHITECTURE = "Qwen3ForCausalLM"


def attention(cfg) -> dict:
    return dict(qk_layernorm=True, add_qkv_bias=False)


is_moe_layer, dims, transformer_config, structural_fields, gpt_kwargs = dense_decoder(attention)
build_model = spec_builder(__name__)
