"""Qwen3 dense: q/k norms, no biases."""

from .common import Decoder


class Qwen3(Decoder):
    hf_architecture = "Qwen3ForCausalLM"

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=True, add_qkv_bias=False)


SPEC = Qwen3()
