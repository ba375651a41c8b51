"""gpt-oss (HF `gpt_oss`: gpt-oss-20b / 120b): attention sinks, q/k/v/o and expert biases, a router with bias,
and experts stored as one stacked tensor per layer (transformers 5.23 models/gpt_oss/modeling_gpt_oss.py,
GptOssExperts: `gate_up_proj` [E, hidden, 2 * ffn] with gate/up interleaved by column, `gate_up_proj_bias`
[E, 2 * ffn], `down_proj` [E, ffn, hidden], `down_proj_bias` [E, hidden]; no checkpoint conversion is registered
for gpt_oss in 5.23's conversion_mapping.py, so these are also the saved names. The published openai/gpt-oss-20b
checkpoint stores the same names with MXFP4 `_blocks` / `_scales` for the two weights)."""

from mcore2hf.arch.mapping import Converter, Rule
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.layouts.ops import Column, GatedInterleaved, Replicated, RowTransposed
from mcore2hf.model_specs import gpt_oss as spec

from .common import HL, L, embeddings, gqa_attention

_E, _HE = f"{L}.mlp.experts.{{E}}", f"{HL}.mlp.experts"

GPT_OSS = Converter(
    model_type="gpt_oss",
    spec=spec.SPEC,
    rules=embeddings() + gqa_attention() + [
        Rule(f"{L}.self_attention.linear_proj.bias", f"{HL}.self_attn.o_proj.bias"),
        # the learnable softmax offset per head: split by heads over TP like the query heads
        Rule(f"{L}.self_attention.core_attention.softmax_offset", f"{HL}.self_attn.sinks", Column),
        Rule(f"{L}.mlp.router.weight", f"{HL}.mlp.router.weight", Replicated),
        Rule(f"{L}.mlp.router.bias", f"{HL}.mlp.router.bias", Replicated),
        Rule(f"{_E}.linear_fc1.weight", f"{_HE}.gate_up_proj", GatedInterleaved, stack="E"),
        Rule(f"{_E}.linear_fc1.bias", f"{_HE}.gate_up_proj_bias", GatedInterleaved, stack="E"),
        Rule(f"{_E}.linear_fc2.weight", f"{_HE}.down_proj", RowTransposed, stack="E"),
        Rule(f"{_E}.linear_fc2.bias", f"{_HE}.down_proj_bias", Replicated, stack="E"),
    ],
    # no fp8 policy: gpt-oss publishes MXFP4 experts, and block-FP8 of the stacked [E, H, 2I] tensors (128x128
    # blocks of a 3-D tensor) is a format no engine loads for gpt_oss; quantize="fp8" is refused with an error
)

# attention sinks, biases, sliding window 4 on alternate layers (the parity tokens are longer), a clamp
# limit the random activations reach, yarn rope; experts stacked per layer in HF
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
    swiglu_limit=0.5, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=64),
)
VERIFIED = ("6 layout worlds (all at expert-TP 1); logits = transformers' at each, import loaded by "
            'Megatron, offline export, engine shards, demo')
register(Architecture(GPT_OSS, tiny=TINY, verified=VERIFIED))
