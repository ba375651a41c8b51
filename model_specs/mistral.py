"""Mistral dense (HF `mistral`): Llama's layout with an explicit head_dim; no biases, no q/k norms."""

from mcore2hf.errors import ConfigMismatchError

from .common import Decoder


def check_sliding_window(cfg) -> None:
    """A sliding window changes the attention, not the weights: exports are fine, a Megatron model is not."""
    if getattr(cfg, "sliding_window", None) is not None:
        raise ConfigMismatchError(f"sliding_window={cfg.sliding_window}: sliding-window attention is not mapped "
                                  "to a Megatron TransformerConfig (Mistral 7B v0.2+ and Mixtral use null)")


class Mistral(Decoder):
    hf_architecture = "MistralForCausalLM"

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=False, add_qkv_bias=False)

    def check(self, cfg) -> None:
        check_sliding_window(cfg)


SPEC = Mistral()
