"""Qwen3-MoE: HF Qwen3MoeConfig <-> Megatron TransformerConfig (q/k norm, GQA, top-k softmax routing)."""

from mcore2hf.arch.hf_config import get

from .common import Decoder


class Qwen3Moe(Decoder):
    hf_architecture = "Qwen3MoeForCausalLM"

    def experts(self, cfg) -> int:
        return int(get(cfg, "num_experts", "num_local_experts", default=0))

    def moe_layer(self, cfg, layer: int) -> bool:
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return layer not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer + 1) % step == 0

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=True, add_qkv_bias=False)


SPEC = Qwen3Moe()
