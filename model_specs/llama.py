"""Llama 2 / 3 dense (attention_bias as configured; tied embeddings for the small Llama 3.2)."""

from .common import Decoder


class Llama(Decoder):
    hf_architecture = "LlamaForCausalLM"

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=False, add_qkv_bias=bool(getattr(cfg, "attention_bias", False)))


SPEC = Llama()
