"""OLMoE: HF OlmoeConfig <-> Megatron TransformerConfig.

Read in transformers 5.23.0 models/olmoe/{modeling,configuration}_olmoe.py: q_norm = RMSNorm(hidden_size) and
k_norm = RMSNorm(head_dim * num_key_value_heads) over all heads before the split (full width: FullWidthRMSNorm),
every layer MoE, softmax over all experts then top-k, renormalized iff norm_topk_prob (OLMoE-1B-7B: no)."""

from mcore2hf.errors import ConfigMismatchError

from .common import FullWidthQKNorms


class Olmoe(FullWidthQKNorms):
    hf_architecture = "OlmoeForCausalLM"

    def experts(self, cfg) -> int:
        return cfg.num_experts

    def check(self, cfg) -> None:
        if cfg.clip_qkv is not None or cfg.attention_bias:
            raise ConfigMismatchError(f"olmoe: clip_qkv={cfg.clip_qkv}, attention_bias={cfg.attention_bias} have no "
                                      "Megatron equivalent here (expected clip_qkv=None, attention_bias=False)")


SPEC = Olmoe()
