"""Qwen2 / Qwen2.5 dense: q/k/v biases (always on in HF Qwen2)."""

from .common import dense_decoder, spec_builder

HF_ARCHITECTURE = "Qwen2ForCausalLM"


def attention(cfg) -> dict:
    return dict(qk_layernorm=False, add_qkv_bias=True)


is_moe_layer, dims, transformer_config, structural_fields, gpt_kwargs = dense_decoder(attention)
build_model = spec_builder(__name__)
