"""Qwen3-MoE (HF `qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B."""

from mcore2hf.layouts import QKV, GatedColumn, Replicated, Row, VocabRows
from mcore2hf.mapping import Converter, Rule
from mcore2hf.registry import register

A = "decoder.layers.{L}.self_attention"
HA = "model.layers.{L}.self_attn"
MLP = "decoder.layers.{L}.mlp"
HMLP = "model.layers.{L}.mlp"

QWEN3_MOE = register(Converter(
    model_type="qwen3_moe",
    spec="mcore2hf.model_specs.qwen3_moe",
    rules=[
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", VocabRows),
        Rule("output_layer.weight", "lm_head.weight", VocabRows),
        Rule("decoder.final_layernorm.weight", "model.norm.weight"),
        Rule("decoder.layers.{L}.input_layernorm.weight", "model.layers.{L}.input_layernorm.weight"),
        Rule(f"{A}.linear_qkv.weight", [f"{HA}.q_proj.weight", f"{HA}.k_proj.weight", f"{HA}.v_proj.weight"], QKV),
        Rule(f"{A}.linear_qkv.bias", [f"{HA}.q_proj.bias", f"{HA}.k_proj.bias", f"{HA}.v_proj.bias"], QKV),
        Rule(f"{A}.linear_proj.weight", f"{HA}.o_proj.weight", Row),
        Rule(f"{A}.q_layernorm.weight", f"{HA}.q_norm.weight"),
        Rule(f"{A}.k_layernorm.weight", f"{HA}.k_norm.weight"),
        Rule("decoder.layers.{L}.pre_mlp_layernorm.weight", "model.layers.{L}.post_attention_layernorm.weight"),
        Rule(f"{MLP}.router.weight", f"{HMLP}.gate.weight", Replicated),
        Rule(f"{MLP}.experts.{{E}}.linear_fc1.weight",
             [f"{HMLP}.experts.{{E}}.gate_proj.weight", f"{HMLP}.experts.{{E}}.up_proj.weight"], GatedColumn),
        Rule(f"{MLP}.experts.{{E}}.linear_fc2.weight", f"{HMLP}.experts.{{E}}.down_proj.weight", Row),
        # dense layers (mlp_only_layers / decoder_sparse_step)
        Rule(f"{MLP}.linear_fc1.weight", [f"{HMLP}.gate_proj.weight", f"{HMLP}.up_proj.weight"], GatedColumn),
        Rule(f"{MLP}.linear_fc2.weight", f"{HMLP}.down_proj.weight", Row),
    ],
))

__all__ = ["QWEN3_MOE"]
