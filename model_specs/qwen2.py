"""Qwen2 / Qwen2.5 dense: q/k/v biases (always on in HF Qwen2)."""

from .common import Decoder


class Qwen2(Decoder):
    hf_architecture = "Qwen2ForCausalLM"

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=False, add_qkv_bias=True)


SPEC = Qwen2()
