"""Qwen3.5-MoE (HF `qwen3_5_moe`: Qwen3.5-35B-A3B, -397B-A17B), the text model: Qwen3.5's layers (see
converters/qwen3_5.py) with Qwen3-Next's MoE in every layer (router `mlp.gate`, experts `mlp.experts.{E}.*` in
checkpoint format, `mlp.shared_expert` and its sigmoid `mlp.shared_expert_gate`), read in transformers 5.23.0
models/qwen3_5_moe/modeling_qwen3_5_moe.py."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.layouts.gdn import GatedQKV
from mcore2hf.model_specs import qwen3_5 as spec

from . import qwen3_next
from .common import embeddings, gqa_attention, hf_tower, language_model, moe, native_vision_tower
from .qwen3_5 import NOT_HELD, TINY_TEXT, TINY_VISION, gated_delta_net

QWEN3_5_MOE = Converter(
    model_type="qwen3_5_moe",
    spec=spec.SPEC,
    rules=language_model(embeddings() + gqa_attention(qkv=GatedQKV) + gated_delta_net() + moe()
                         + qwen3_next.gated_shared_expert())
          + native_vision_tower(deepstack=False) + hf_tower("vision_model", "model.visual"),
    not_held=NOT_HELD,
)

TINY = dict(text_config=dict(TINY_TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             num_experts=8, num_experts_per_tok=2),
            vision_config=TINY_VISION, tie_word_embeddings=False)
VERIFIED = ("its own worlds (TP2 x EP2, PP2, TP1 x DP2); logits (and fp32 round-off) = transformers' at "
            'each, completed from the multimodal checkpoint, offline export, engine shards, demo; the '
            'native Megatron tower (TP2 x PP2): bit-identical with the tower, transformers loads it, text + '
            "image logits = transformers'")
register(Architecture(QWEN3_5_MOE, tiny=TINY, verified=VERIFIED))
