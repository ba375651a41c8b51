"""gpt-oss: HF GptOssConfig <-> Megatron TransformerConfig (megatron-core 0.16.1's own features, local spec).

* attention sinks: `softmax_type="learnable"` (DotProductAttention's `softmax_offset`, one per head, SoftmaxOne
  appends it as an extra logit column and drops it after the softmax, as HF's eager_attention_forward does);
* sliding window on the layers `layer_types` marks: Megatron's window (left, 0) keeps keys j >= i - left, HF's
  sliding_window W keeps j > i - W, so left = W - 1 (checked by the logit parity test at seq > W);
* clamped SwiGLU: `quick_gelu` (x * sigmoid(1.702 x)) with `activation_func_clamp_value` = swiglu_limit and
  `glu_linear_offset` = 1 (HF: (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit);
* biases everywhere (`add_bias_linear`: q/k/v, o, router, experts); router: top-k of the logits, then softmax;
* yarn rope: GPTModel's `position_embedding_type="yarn"` reads `yarn_*` attributes of the config (not fields of
  TransformerConfig in 0.16.1), set here; HF's truncate=False is correction_range_round_to_int=False.
"""

from mcore2hf.arch.hf_config import get, rope_parameters
from mcore2hf.errors import ConfigMismatchError, LayoutError

from .common import Decoder, Fields, default_gpt_kwargs, parallel_fields

QUICK_GELU_ALPHA = 1.702  # megatron.core.fusions.fused_bias_geglu.quick_gelu's constant


def _window_fields(cfg) -> dict:
    types = list(getattr(cfg, "layer_types", None) or [])
    window = getattr(cfg, "sliding_window", None)
    if not window or "sliding_attention" not in types:
        return dict(window_size=None, window_attn_skip_freq=None)
    # is_layer_window_attention: a list entry that is true means "this layer uses the window"
    return dict(window_size=(int(window) - 1, 0), window_attn_skip_freq=[int(t == "sliding_attention") for t in types])


def _yarn(cfg) -> dict:
    rope = rope_parameters(cfg)
    if rope.get("rope_type", "default") in ("default", None):
        return {}
    if rope["rope_type"] != "yarn":
        raise ConfigMismatchError(f"gpt_oss rope_type {rope['rope_type']!r}: only 'yarn' and 'default' are supported")
    return dict(
        yarn_rotary_scaling_factor=float(rope["factor"]),
        yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0), yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
        yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
    )


def _quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


class GptOss(Decoder):
    hf_architecture = "GptOssForCausalLM"

    def experts(self, cfg) -> int:
        return int(get(cfg, "num_local_experts", "num_experts"))

    def moe_ffn(self, cfg) -> int:
        return cfg.intermediate_size

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=False)

    def router(self, cfg) -> dict:
        # HF GptOssTopKRouter: top-k of the (biased) logits, softmax over those k
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=False)

    def extra(self, cfg, fields: Fields) -> None:
        fields.set(True, add_bias_linear=True, softmax_type="learnable", **_window_fields(cfg))
        fields.set(add_qkv_bias=True, glu_linear_offset=1.0, activation_func_clamp_value=float(cfg.swiglu_limit))
        fields.later(lambda: dict(activation_func=_quick_gelu()))

    def check(self, cfg) -> None:
        alpha = float(getattr(cfg, "swiglu_alpha", QUICK_GELU_ALPHA))
        if alpha != QUICK_GELU_ALPHA:
            raise ConfigMismatchError(f"gpt_oss swiglu_alpha: Megatron's quick_gelu computes x * sigmoid(1.702 x), "
                                      f"expected {QUICK_GELU_ALPHA}, the config has {alpha}")
        if not getattr(cfg, "attention_bias", True):
            raise ConfigMismatchError("gpt_oss attention_bias: expected True (Megatron's add_bias_linear gives q/k/v, "
                                      "o, router and expert biases together), the config has False")

    def layout_problems(self, cfg, expert_tp: int) -> list[str]:
        if expert_tp != 1:  # megatron-core asserts "Bias in Moe is only supported when ETP==1"
            return [f"gpt_oss has expert biases, which megatron-core supports only at expert-TP 1; expected expert "
                    f"tensor-parallel size 1, got {expert_tp} (pass --etp 1: expert-TP defaults to --tp)"]
        return []

    def transformer_config(self, cfg, **overrides):
        self.check(cfg)
        etp = overrides.get("expert_tensor_parallel_size") or parallel_fields()["expert_tensor_parallel_size"]
        problems = self.layout_problems(cfg, 1 if etp is None else etp)
        if problems:
            raise LayoutError(problems[0])
        config = super().transformer_config(cfg, **overrides)
        for k, v in _yarn(cfg).items():  # read by GPTModel with getattr, not TransformerConfig fields in 0.16.1
            setattr(config, k, v)
        return config

    def gpt_kwargs(self, cfg) -> dict:
        out = default_gpt_kwargs(cfg)
        if _yarn(cfg):
            out["position_embedding_type"] = "yarn"
        return out


SPEC = GptOss()
