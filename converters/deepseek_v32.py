"""DeepSeek-V3.2 (HF `deepseek_v32`): DeepSeek-V3's table (multi-latent attention, dense first layers, shared
experts, expert bias, MTP layers with the embedding and head copies) plus DeepSeek sparse attention's indexer."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import deepseek_v32 as spec

from .common import THREE_WORLDS, dsa_indexer, fp8_policy
from .deepseek_v3 import DEEPSEEK_V3

DEEPSEEK_V32 = Converter(
    model_type="deepseek_v32",
    spec=spec.SPEC,
    rules=DEEPSEEK_V3.rules + dsa_indexer(),
    fp8=fp8_policy(mtp=True, list_not_converted=False, dsa_indexer=True,
                   source="DeepSeek-V3.2 FP8 checkpoints"),
)

# DeepSeek-V3.2 scaled down: DeepSeek-V3's MLA and routing plus the sparse-attention indexer with an odd head
# count (5), head dim 16 (a power of two: megatron-core's Hadamard rotation) holding the 8 rope dims, and
# index_topk 6 < the parity tests' 16 tokens, so each query attends to the indexer's choice (the sparse regime)
TINY = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, index_n_heads=5, index_head_dim=16, index_topk=6, num_nextn_predict_layers=1,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
register(Architecture(DEEPSEEK_V32, tiny=TINY, verified=THREE_WORLDS))
