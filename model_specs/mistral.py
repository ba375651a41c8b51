"""Mistral dense (HF `mistral`): Llama's layout with an explicit head_dim; no biases, no q/k norms."""

from mcore2hf.errors import ConfigMismatchError

from .common import dense_decoder, spec_builder

HF_ARCHITECTURE = "MistralForCausalLM"


def attention(cfg) -> dict:
    return dict(qk_layernorm=False, add_qkv_bias=False)


is_moe_layer, dims, _transformer_config, structural_fields, gpt_kwargs = dense_decoder(attention)


def check_sliding_window(cfg) -> None:
    """A sliding window changes the attention, not the weights: exports are fine, a Megatron model is not."""
    if getattr(cfg, "sliding_window", None) is not None:
        raise ConfigMismatchError(f"sliding_window={cfg.sliding_window}: sliding-window attention is not mapped "
                                  "to a Megatron TransformerConfig (Mistral 7B v0.2+ and Mixtral use null)")


def transformer_config(cfg, **overrides):
    check_sliding_window(cfg)
    return _transformer_config(cfg, **overrides)


build_model = spec_builder(__name__)
