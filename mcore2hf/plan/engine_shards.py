"""Engine sharding rules: which part of each HF tensor an inference-engine rank loads (SGLang, vLLM).

One table maps HF name patterns to a *sharding kind*; one function per kind turns (full shape, engine placement)
into the region(s) that engine rank's `weight_loader` narrows the full HF tensor to. Why a table keyed by HF name
and not a kind attached to the converters' rules: the engine side is a property of the HF tensor, not of the
Megatron layout (Megatron splits OLMoE's full-width q_norm and MTP's eh_proj over TP, both engines replicate them;
one Megatron fc1 becomes two HF tensors that both engines load as one merged column), and the converters stay
untouched while other architectures are being added.

Read from the engines' published code (the wheels tests/harness/wheels.py unpacks), per kind:

* sglang 0.5.23: srt/layers/linear.py (ColumnParallelLinear / MergedColumnParallelLinear / QKVParallelLinear /
  RowParallelLinear weight_loader), srt/layers/vocab_parallel_embedding.py (pad_vocab_size, padding_size *= tp
  when the padded vocab does not divide, VocabParallelEmbedding.weight_loader), srt/layers/moe/fused_moe_triton/
  layer.py (FusedMoE: moe_ep/moe_tp from distributed/parallel_state.py, _map_global_expert_id_to_local_expert_id,
  _load_w13, _load_w2), models/deepseek_v2.py (fused_qkv_a_proj_with_mqa ReplicatedLinear, q_b/kv_b column),
  models/deepseek_nextn.py and glm4_moe_nextn.py (eh_proj replicated), models/minimax_m2.py (MiniMaxM2RMSNormTP:
  q_norm by heads, k_norm by kv heads with replicas), models/olmoe.py (full-width RMSNorm, replicated),
  models/gpt_oss.py (sinks by heads), layers/attention/dsa/dsa_indexer.py (DSA indexer replicated); gated DeltaNet (Qwen3-Next, Qwen3.5): models/qwen3_next.py
  Qwen3GatedDeltaNet (in_proj_qkvz / in_proj_ba: _make_packed_weight_loader, a contiguous slice of the packed
  per-key-head groups; conv1d: layers/attention/mamba/mamba.py mamba_v2_sharded_weight_loader over the parts
  [q; k; v]; A_log / dt_bias: model_loader/weight_utils.py sharded_weight_loader(0); out_proj RowParallelLinear;
  norm RMSNormGated over head_v_dim, whole), models/qwen3_5.py Qwen3_5GatedDeltaNet (in_proj_qkv with shard
  ids (0, 1, 2) split into q, k, v and each narrowed; in_proj_z / in_proj_b / in_proj_a shard 3 / 0 / 1),
  Qwen3HybridAttentionDecoderLayer (QKVParallelLinear with 2 * heads query heads: q_proj is [q_h; gate_h] per
  head), models/qwen2_moe.py Qwen2MoeSparseMoeBlock (shared_expert MLP, shared_expert_gate replicated).
* vllm 0.33.0: model_executor/layers/linear.py (same narrowing, shard_rank = tp_rank // num_kv_head_replicas),
  vocab_parallel_embedding.py (pad to 64, no TP multiplier), fused_moe/expert_map_manager.py (determine_expert_map,
  "linear" placement: the first `E % ep` ranks own one more expert), fused_moe/routed_experts.py (_load_w13 /
  _load_w2), fused_moe/config.py (EP: expert TP 1), models/deepseek_mtp.py / glm4_moe_mtp.py (eh_proj nn.Linear),
  models/minimax_m2.py + layers/minimax_rms_norm/rms_norm_tp.py, models/olmoe.py, models/gpt_oss.py
  (_load_weights_other: stacked bf16 experts, sinks); gated DeltaNet: layers/mamba/gdn/qwen_gdn_linear_attn.py
  QwenGatedDeltaNetAttention (Qwen3-Next gqa_interleaved_layout: in_proj_qkvz / in_proj_ba one output size each,
  a contiguous column slice; Qwen3.5 flat: output sizes [k, k, v, v] / [nv, nv], models/qwen3_5.py's
  orig_to_new_stacked in_proj_qkv -> shard ids (0, 1, 2); conv1d layers/mamba/mamba_mixer2.py
  mamba_v2_sharded_weight_loader; A_log / dt_bias sharded_weight_loader(0)), models/qwen3_next.py
  (Qwen3NextAttention QKVParallelLinear with gated heads, Qwen3NextSparseMoeBlock shared_expert_gate
  ReplicatedLinear).
* Qwen3-VL's vision tower (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE: `model.visual.*`, ARCH_KINDS), with the
  engines' default tensor-parallel encoder: sglang 0.5.23 models/qwen3_vl.py (Qwen3_VisionBlock: VisionAttention
  with use_qkv_parallel=True, i.e. layers/attention/vision.py QKVParallelLinear `qkv_proj` over all heads, filled
  from the fused `attn.qkv` by its weight_loader without shard id (load_weights), RowParallelLinear `proj`;
  Qwen3_VisionMLP and Qwen3VLMoeVisionPatchMerger: ColumnParallelLinear `linear_fc1`, RowParallelLinear
  `linear_fc2`; Conv3dLayer patch embedding and LayerNorms whole; `pos_embed` a VocabParallelEmbedding over the
  attention-TP group: its rows padded and split as a vocabulary), vllm 0.33.0 models/qwen3_vl.py (the same linears:
  Qwen2_5_VisionAttention QKVParallelLinear `qkv`, AutoWeightsLoader passing the fused tensor without shard id;
  `pos_embed` an nn.Embedding, whole), models/qwen3_vl_moe.py and qwen3_5.py reusing Qwen3_VisionTransformer.
  The fused [q; k; v] splits into its three thirds, each narrowed to the rank's heads (QKVParallelLinear
  weight_loader with loaded_shard_id None). Not covered: the data-parallel encoders (sglang --mm-enable-dp-encoder,
  vllm mm_encoder_tp_mode="data": every tower tensor whole), and the GLM-4.5V / Kimi-K2.5 towers (refused by name).

The two engines differ only in the vocab padding rule, in expert placement when E % ep != 0 (SGLang refuses
it) and in gpt-oss's stacked experts under EP (vLLM: whole experts per EP rank; SGLang 0.5.23's
weight_loader_fused has no expert narrowing, so EP is refused there). SGLang's shared-experts fusion
(num_fused_shared_experts > 0, a server option) is not covered: the rules describe the unfused shared MLP
(column / row over TP, or replicated where the placement says so); the same for Qwen3-Next / Qwen3.5-MoE's
shared expert (sglang enable_shared_expert_fusion, vllm fuse_shared_experts: not covered). Qwen3.5-MoE's fused
checkpoint experts (`mlp.experts.gate_up_proj` [E, 2I, H], which sglang's models/qwen3_5.py also reads) are not in
the table: mcore2hf exports per-expert names. Both engines support Qwen3-Next, Qwen3.5 and Qwen3.5-MoE in these
versions (sglang EntryClass Qwen3NextForCausalLM, Qwen3_5[Moe]ForConditionalGeneration; vllm the same classes);
gated DeltaNet heads must divide over TP (refused otherwise, as the engines fail), DP attention / SGLang's
cp-tp group sharing (linear attention over "tp" instead of "attn_tp") are not covered.

A region is a tuple of (dim, offset, length) triples, one per narrowed dim (dims not named are whole); a rank
loads the union of its regions (an empty list: nothing). Regions of one rank never overlap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import regex
import torch

from ..arch.mapping import ModelDims
from ..errors import EngineShardError
from ..layouts.pieces import Piece

Region = tuple[tuple[int, int, int], ...]


class EngineRules:
    """How one engine's weight loaders differ where the two engines differ: vocab padding, expert placement when
    E % ep != 0, stacked experts under EP, the vision tower's position table, its expert-parallel layouts. One
    object per engine (`ENGINE_RULES`), so nothing branches on an engine's name."""

    name = ""

    def check(self, p: EnginePlacement) -> None:
        """Refuse a placement the engine cannot run."""

    def vocab_padding(self, padded: int, tp_size: int, padding: int) -> int:
        """The padding multiple of the engine's vocab (both: DEFAULT_VOCAB_PADDING_SIZE 64)."""
        return padding

    def expert_owner_range(self, num_experts: int, ep_size: int, ep_rank: int) -> range:
        raise NotImplementedError

    def stacked_experts_under_ep(self, hf_name: str, shape: tuple[int, ...], p: EnginePlacement) -> list[Region]:
        """gpt-oss's stacked experts when the engine runs expert parallelism."""
        raise NotImplementedError

    def check_intermediate(self, hf_name: str, inter: int, p: EnginePlacement) -> None:
        """The stacked experts' intermediate size against expert TP (no check: the engine cuts cdiv pieces)."""

    def position_rows(self, shape: tuple[int, ...], p: EnginePlacement) -> list[Region]:
        """The vision tower's position embedding table."""
        raise NotImplementedError


class SGLangRules(EngineRules):
    """sglang 0.5.23 (the module docstring's files)."""

    name = "sglang"

    def vocab_padding(self, padded: int, tp_size: int, padding: int) -> int:
        # vocab_parallel_embedding.py pad_vocab_size: padding_size *= tp when the padded vocab does not divide
        return padding * tp_size if padded % tp_size else padding

    def expert_owner_range(self, num_experts: int, ep_size: int, ep_rank: int) -> range:
        if num_experts % ep_size:
            raise EngineShardError(f"experts: expected num_experts {num_experts} divisible by ep_size {ep_size} "
                                   "(sglang FusedMoE asserts it)")
        n = num_experts // ep_size
        return range(ep_rank * n, (ep_rank + 1) * n)

    def stacked_experts_under_ep(self, hf_name: str, shape: tuple[int, ...], p: EnginePlacement) -> list[Region]:
        raise EngineShardError(f"{hf_name}: not declared for sglang with ep_size {p.ep_size}: sglang 0.5.23's "
                               "FusedMoE.weight_loader_fused loads stacked bf16 experts without expert narrowing")

    def check_intermediate(self, hf_name: str, inter: int, p: EnginePlacement) -> None:
        if inter % p.tp_size:
            raise EngineShardError(f"{hf_name}: expected the intermediate size {inter} divisible by expert TP "
                                   f"{p.tp_size} (sglang FusedMoE asserts it)")

    def position_rows(self, shape: tuple[int, ...], p: EnginePlacement) -> list[Region]:
        # a VocabParallelEmbedding of num_position_embeddings rows: its padded table over TP, real rows only
        per = padded_vocab(shape[0], p) // p.tp_size
        start, stop = p.tp_rank * per, min((p.tp_rank + 1) * per, shape[0])
        return [((0, start, stop - start),)] if stop > start else []


class VLLMRules(EngineRules):
    """vllm 0.33.0 (the module docstring's files)."""

    name = "vllm"

    def check(self, p: EnginePlacement) -> None:
        if p.ep_size not in (1, p.tp_size):
            # vllm 0.33.0 fused_moe/config.py FusedMoEParallelConfig.make: EP spans all of TP x DP, expert TP 1
            raise EngineShardError(f"vllm expert parallelism: expected ep_size 1 or tp_size={p.tp_size}, "
                                   f"found {p.ep_size}")

    def expert_owner_range(self, num_experts: int, ep_size: int, ep_rank: int) -> range:
        # fused_moe/expert_map_manager.py determine_expert_map, "linear": the first E % ep ranks own one more
        base, rem = divmod(num_experts, ep_size)
        start = ep_rank * base + min(ep_rank, rem)
        return range(start, start + base + (ep_rank < rem))

    def stacked_experts_under_ep(self, hf_name: str, shape: tuple[int, ...], p: EnginePlacement) -> list[Region]:
        # models/gpt_oss.py _load_weights_other: EP takes whole experts [ep*E/ep, ...)
        n = shape[0] // p.ep_size
        return [((0, p.ep_rank * n, n),)]

    def position_rows(self, shape: tuple[int, ...], p: EnginePlacement) -> list[Region]:
        return [()]  # an nn.Embedding, whole


#: the engines mcore2hf shards for, one rules object each
ENGINE_RULES: dict[str, EngineRules] = {r.name: r for r in (SGLangRules(), VLLMRules())}
ENGINES = tuple(ENGINE_RULES)


@dataclass(frozen=True)
class EnginePlacement:
    """One engine rank: attention/dense TP rank of tp_size, experts over ep_size ranks with expert TP `moe_tp`
    inside (default tp_size // ep_size). Ranks are laid out as SGLang's parallel_state does (moe_tp innermost:
    ep_rank = tp_rank // moe_tp, moe_tp_rank = tp_rank % moe_tp); vLLM's EP (ep_size == tp_size, expert TP 1) and
    no-EP (expert TP = tp_size) are the two ends of that layout."""

    engine: str
    tp_rank: int
    tp_size: int
    ep_size: int = 1
    moe_tp: int | None = None
    #: shared experts replicated on every rank instead of split over TP: sglang with a DeepEP-class
    #: moe_a2a_backend (models/deepseek_v2.py _shared_expert_use_tp1, glm4_moe.py parallel_group="replicated"),
    #: vllm with use_sequence_parallel_moe (models/deepseek_v2.py DeepseekV2MLP disable_tp); the same for the
    #: Qwen2-style shared_expert (sglang models/qwen2_moe.py parallel_group="replicated", vllm Qwen2MoeMLP)
    replicated_shared_experts: bool = False

    def __post_init__(self):
        if self.engine not in ENGINE_RULES:
            raise EngineShardError(f"engine: expected one of {ENGINES}, found {self.engine!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise EngineShardError(f"tp_rank: expected 0 <= tp_rank < tp_size={self.tp_size}, found {self.tp_rank}")
        if self.tp_size % self.ep_size:
            raise EngineShardError(f"ep_size: expected a divisor of tp_size={self.tp_size}, found {self.ep_size}")
        if self.moe_tp is None:
            object.__setattr__(self, "moe_tp", self.tp_size // self.ep_size)
        if self.moe_tp * self.ep_size != self.tp_size:
            raise EngineShardError(f"moe_tp: expected tp_size / ep_size = {self.tp_size // self.ep_size} "
                                   f"(no expert data parallelism), found {self.moe_tp}")
        self.rules.check(self)

    @property
    def rules(self) -> EngineRules:
        return ENGINE_RULES[self.engine]

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp


# ------------------------------------------------------------------------------------------------- the table

REPLICATED = "replicated"      # every rank loads the whole tensor (norms, routers, latent down-projections)
COLUMN = "column"              # dim 0 split evenly over TP (q, q_b, kv_b, gate/up, sinks, q/k/v biases of q)
KV_HEADS = "kv_heads"          # dim 0 split by kv heads; tp > kv heads: rank r gets head r // (tp / kv heads)
ROW = "row"                    # dim 1 split evenly over TP (o_proj, down_proj)
VOCAB = "vocab"                # dim 0 rows of the engine's padded vocab shard, real rows only
SHARED_COLUMN = "shared_column"  # shared experts' gate/up: COLUMN, or REPLICATED (replicated_shared_experts)
SHARED_ROW = "shared_row"        # shared experts' down: ROW, or REPLICATED
EXPERT_COLUMN = "expert_column"  # routed expert gate/up (w1/w3): owner rank under EP, dim 0 split over expert TP
EXPERT_ROW = "expert_row"        # routed expert down (w2): owner rank under EP, dim 1 split over expert TP
STACKED_GATE_UP = "stacked_gate_up"  # gpt-oss experts.gate_up_proj [E, H, 2I] (vllm)
STACKED_GATE_UP_BIAS = "stacked_gate_up_bias"  # [E, 2I]
STACKED_DOWN = "stacked_down"  # experts.down_proj [E, I, H]
STACKED_DOWN_BIAS = "stacked_down_bias"  # [E, H]
#: gated DeltaNet tensors split by linear-attention heads: COLUMN, after checking that TP divides the key and
#: value head counts (both engines view each rank's slice as num_k_heads / tp head groups)
LINEAR_HEADS = "linear_heads"
#: dim 0 is [q; k; v] of all linear heads (conv1d, Qwen3.5's in_proj_qkv): each part split over TP, so a rank's
#: region is three boxes (mamba_v2_sharded_weight_loader; MergedColumnParallelLinear shard ids 0, 1, 2)
LINEAR_QKV_PARTS = "linear_qkv_parts"
#: a vision tower's fused attention `qkv` [q; k; v] (no GQA: three equal parts), each part split by vision heads
VISION_QKV = "vision_qkv"
#: the vision tower's position embedding: sglang's VocabParallelEmbedding (rows of its padded table over TP, real
#: rows only), vllm's nn.Embedding (whole)
POSITION_ROWS = "position_rows"

# multimodal checkpoints keep the decoder under model.language_model. (Qwen3.5, Qwen3-VL, GLM-4.5V) or
# language_model.model. (Kimi-K2.5, whose head is language_model.lm_head)
_LM = r"(?:language_model\.)?model\.(?:language_model\.)?"
_L = rf"{_LM}layers\.\d+"
_LA = rf"{_L}\.linear_attn"
_MOE = rf"{_L}\.(?:mlp|block_sparse_moe)"

#: HF name pattern -> kind, first full match wins; a name no pattern matches is refused
KINDS: list[tuple[str, str]] = [
    # embeddings and heads, also MTP layers' copies (vocab_parallel_embedding.py)
    (rf"{_LM}embed_tokens\.weight|(?:language_model\.)?lm_head\.weight|{_L}\.embed_tokens\.weight"
     rf"|{_L}\.shared_head\.head\.weight", VOCAB),
    # attention: QKVParallelLinear (q column, k/v by kv heads), MLA's ColumnParallelLinear q_proj / q_b / kv_b
    (rf"{_L}\.self_attn\.q_proj\.(?:weight|bias)", COLUMN),
    (rf"{_L}\.self_attn\.[kv]_proj\.(?:weight|bias)", KV_HEADS),
    (rf"{_L}\.self_attn\.(?:q_b_proj|kv_b_proj)\.weight", COLUMN),
    (rf"{_L}\.self_attn\.o_proj\.weight", ROW),
    (rf"{_L}\.self_attn\.sinks", COLUMN),  # gpt-oss: one per query head, the rank's heads
    # MLA's latent down-projections: SGLang fused_qkv_a_proj_with_mqa / vLLM MergedReplicatedLinear
    (rf"{_L}\.self_attn\.(?:q_a_proj|kv_a_proj_with_mqa)\.weight", REPLICATED),
    (rf"{_L}\.self_attn\.o_proj\.bias", REPLICATED),
    # DeepSeek sparse attention's indexer: replicated whole in both engines (sglang layers/attention/dsa/
    # dsa_indexer.py ReplicatedLinear wq_b / wk / weights_proj (or their fused bf16 wk_weights_proj, filled whole
    # by models/deepseek_common/deepseek_weight_loader.py), LayerNorm k_norm; vllm models/deepseek_v32/attention.py
    # ReplicatedLinear wq_b, MergedColumnParallelLinear(disable_tp=True) wk_weights_proj, LayerNorm k_norm)
    (rf"{_L}\.self_attn\.indexer\.(?:wq_b|wk|weights_proj)\.weight|{_L}\.self_attn\.indexer\.k_norm\.(?:weight|bias)",
     REPLICATED),  # RowParallelLinear bias: no input_dim, loaded whole
    # norms (q_norm / k_norm: per-head or full-width replicated; MiniMax-M2 overrides below)
    (rf"{_L}\.(?:input_layernorm|post_attention_layernorm|enorm|hnorm|shared_head\.norm)\.weight"
     rf"|{_L}\.self_attn\.(?:q_norm|k_norm|q_a_layernorm|kv_a_layernorm)\.weight"
     rf"|{_LM}norm\.weight", REPLICATED),
    (rf"{_L}\.eh_proj\.weight", REPLICATED),  # MTP: nn.Linear in both engines' MTP models
    # dense and shared-expert MLPs: MergedColumnParallelLinear gate_up_proj, RowParallelLinear down_proj
    (rf"{_L}\.mlp\.shared_experts\.(?:gate_proj|up_proj)\.weight", SHARED_COLUMN),
    (rf"{_L}\.mlp\.shared_experts\.down_proj\.weight", SHARED_ROW),
    # Qwen2-MoE-style shared expert (Qwen3-Next, Qwen3.5-MoE) and its sigmoid gate [1, hidden] (ReplicatedLinear)
    (rf"{_L}\.mlp\.shared_expert\.(?:gate_proj|up_proj)\.weight", SHARED_COLUMN),
    (rf"{_L}\.mlp\.shared_expert\.down_proj\.weight", SHARED_ROW),
    (rf"{_L}\.mlp\.shared_expert_gate\.weight", REPLICATED),
    # gated DeltaNet (linear attention): packed per-key-head in_proj_qkvz / in_proj_ba (Qwen3-Next), flat
    # in_proj_z / in_proj_b / in_proj_a (Qwen3.5), per-value-head A_log / dt_bias, [q; k; v] parts, out_proj
    (rf"{_LA}\.(?:in_proj_qkvz|in_proj_ba|in_proj_z|in_proj_b|in_proj_a)\.weight|{_LA}\.(?:A_log|dt_bias)",
     LINEAR_HEADS),
    (rf"{_LA}\.(?:conv1d|in_proj_qkv)\.weight", LINEAR_QKV_PARTS),
    (rf"{_LA}\.out_proj\.weight", ROW),
    (rf"{_LA}\.norm\.weight", REPLICATED),  # RMSNormGated over head_v_dim, shared by all heads
    (rf"{_L}\.mlp\.(?:gate_proj|up_proj)\.weight", COLUMN),
    (rf"{_L}\.mlp\.down_proj\.weight", ROW),
    # MoE routers (ReplicatedLinear) and the expert score bias
    (rf"{_MOE}\.gate\.weight|{_MOE}\.e_score_correction_bias|{_MOE}\.gate\.e_score_correction_bias"
     rf"|{_L}\.mlp\.router\.(?:weight|bias)", REPLICATED),
    # routed experts (FusedMoE expert_params_mapping: gate/w1 and up/w3 -> w13, down/w2 -> w2)
    (rf"{_MOE}\.experts\.(?P<E>\d+)\.(?:gate_proj|up_proj|w1|w3)\.weight", EXPERT_COLUMN),
    (rf"{_MOE}\.experts\.(?P<E>\d+)\.(?:down_proj|w2)\.weight", EXPERT_ROW),
    # gpt-oss stacked experts (vllm models/gpt_oss.py _load_weights_other)
    (rf"{_L}\.mlp\.experts\.gate_up_proj", STACKED_GATE_UP),
    (rf"{_L}\.mlp\.experts\.gate_up_proj_bias", STACKED_GATE_UP_BIAS),
    (rf"{_L}\.mlp\.experts\.down_proj", STACKED_DOWN),
    (rf"{_L}\.mlp\.experts\.down_proj_bias", STACKED_DOWN_BIAS),
]

_VB = r"model\.visual\.blocks\.\d+"
_VM = r"model\.visual\.(?:merger|deepstack_merger_list\.\d+)"
#: Qwen3-VL's vision tower as both engines' qwen3_vl.py shard it by default (the module docstring)
QWEN3_VL_TOWER: list[tuple[str, str | None]] = [
    (rf"{_VB}\.attn\.qkv\.(?:weight|bias)", VISION_QKV),
    (rf"{_VB}\.attn\.proj\.weight|{_VB}\.mlp\.linear_fc2\.weight|{_VM}\.linear_fc2\.weight", ROW),
    (rf"{_VB}\.mlp\.linear_fc1\.(?:weight|bias)|{_VM}\.linear_fc1\.(?:weight|bias)", COLUMN),
    # RowParallelLinear biases (added after the reduction), LayerNorms, the Conv3d patch embedding: whole
    (rf"{_VB}\.(?:attn\.proj|mlp\.linear_fc2)\.bias|{_VM}\.linear_fc2\.bias|{_VB}\.norm[12]\.(?:weight|bias)"
     rf"|{_VM}\.norm\.(?:weight|bias)|model\.visual\.patch_embed\.proj\.(?:weight|bias)", REPLICATED),
    (r"model\.visual\.pos_embed\.weight", POSITION_ROWS),
]

#: per-architecture entries, checked before KINDS: MiniMax-M2's full-width q/k norms are split by heads in both
#: engines (sglang MiniMaxM2RMSNormTP, vllm MiniMaxText01RMSNormTP with weight_shard_rank = tp_rank // replicas);
#: Qwen3-VL's vision tower (and Qwen3.5's: the same tower, without deepstack mergers)
ARCH_KINDS: dict[str, list[tuple[str, str | None]]] = {
    "minimax_m2": [(rf"{_L}\.self_attn\.q_norm\.weight", COLUMN), (rf"{_L}\.self_attn\.k_norm\.weight", KV_HEADS)],
    "qwen3_vl": QWEN3_VL_TOWER,
    # Qwen3-VL-MoE's packed experts ([E, hidden, 2 * ffn], gate | up by column) are not gpt-oss's interleaved ones:
    # the engines' loaders for them are not in this table
    "qwen3_vl_moe": [(rf"{_L}\.mlp\.experts\.(?:gate_up_proj|down_proj)", None), *QWEN3_VL_TOWER],
    "qwen3_5": QWEN3_VL_TOWER,
    "qwen3_5_moe": QWEN3_VL_TOWER,
}

_COMPILED = [(regex.compile(p), k) for p, k in KINDS]
_ARCH_COMPILED = {a: [(regex.compile(p), k) for p, k in t] for a, t in ARCH_KINDS.items()}


def has_sharding_kind(hf_name: str, model_type: str | None = None) -> bool:
    """Whether the table says how the engines shard `hf_name` (`sharding_kind` raises where it does not)."""
    try:
        sharding_kind(hf_name, model_type)
    except EngineShardError:
        return False
    return True


@functools.lru_cache(maxsize=1 << 18)  # plans ask per name and engine rank: one regex scan per name
def sharding_kind(hf_name: str, model_type: str | None = None) -> tuple[str, int | None]:
    """The engine-sharding kind of an HF tensor, and its routed-expert index (None for non-expert tensors)."""
    for pattern, kind in _ARCH_COMPILED.get(model_type, []) + _COMPILED:
        m = pattern.fullmatch(hf_name)
        if m is not None and kind is None:  # declared not covered (ARCH_KINDS)
            raise EngineShardError(f"{hf_name}: not declared for {model_type}: the engines' loaders of this tensor "
                                   "are not in the engine sharding table (mcore2hf.plan.engine_shards.ARCH_KINDS)")
        if m is not None:
            e = m.groupdict().get("E")
            return kind, None if e is None else int(e)
    raise EngineShardError(f"{hf_name}: expected an HF tensor name of the engine sharding table "
                           f"(mcore2hf.plan.engine_shards.KINDS), found none that matches")


# ------------------------------------------------------------------------------------------------- regions

def _even(size: int, parts: int, rank: int, name: str, dim: int) -> tuple[int, int, int]:
    if size % parts:
        raise EngineShardError(f"{name}: expected dim {dim} ({size}) divisible by {parts} engine ranks")
    n = size // parts
    return (dim, rank * n, n)


def padded_vocab(vocab_size: int, placement: EnginePlacement, padding: int = 64) -> int:
    """The engine's padded vocabulary (DEFAULT_VOCAB_PADDING_SIZE 64 in both; SGLang multiplies the padding by
    tp_size when the padded vocab does not divide over TP, vLLM asserts it divides)."""
    pad = lambda v, p: (v + p - 1) // p * p  # noqa: E731
    padding = placement.rules.vocab_padding(pad(vocab_size, padding), placement.tp_size, padding)
    padded = pad(vocab_size, padding)
    if padded % placement.tp_size:
        raise EngineShardError(f"vocab: expected the padded vocab {padded} divisible by tp_size "
                               f"{placement.tp_size} ({placement.engine} refuses it)")
    return padded


def expert_owner_range(num_experts: int, placement: EnginePlacement) -> range:
    """The routed experts this rank's EP rank owns (sglang: E / ep each, E must divide; vllm "linear": the first
    E % ep ranks own one more)."""
    return placement.rules.expert_owner_range(num_experts, placement.ep_size, placement.ep_rank)


def engine_regions(hf_name: str, shape: Sequence[int], dims: ModelDims, placement: EnginePlacement,
                   model_type: str | None = None) -> list[Region]:
    """The region(s) of the full HF tensor `hf_name` (of `shape`) that the engine rank `placement` loads."""
    kind, expert = sharding_kind(hf_name, model_type)
    shape = tuple(shape)
    p, tp, r = placement, placement.tp_size, placement.tp_rank
    if kind in (SHARED_COLUMN, SHARED_ROW):
        kind = REPLICATED if p.replicated_shared_experts else COLUMN if kind == SHARED_COLUMN else ROW
    if kind == REPLICATED:
        return [()]
    if kind == COLUMN:
        return [(_even(shape[0], tp, r, hf_name, 0),)]
    if kind == ROW:
        if len(shape) != 2:
            raise EngineShardError(f"{hf_name}: expected a 2-D row-parallel weight, found shape {shape}")
        return [(_even(shape[1], tp, r, hf_name, 1),)]
    if kind == KV_HEADS:
        heads = dims.num_query_groups
        if shape[0] % heads:
            raise EngineShardError(f"{hf_name}: expected dim 0 ({shape[0]}) a multiple of {heads} kv heads")
        per_head = shape[0] // heads
        if tp >= heads:
            if tp % heads:
                raise EngineShardError(f"{hf_name}: expected tp_size {tp} a multiple of {heads} kv heads")
            return [((0, r // (tp // heads) * per_head, per_head),)]
        _, first, count = _even(heads, tp, r, hf_name, 0)
        return [((0, first * per_head, count * per_head),)]
    if kind == VOCAB:
        if shape[0] != dims.vocab_size:  # the engines assert the checkpoint holds exactly org_vocab_size rows
            raise EngineShardError(f"{hf_name}: expected {dims.vocab_size} rows (vocab_size), found {shape[0]}")
        per = padded_vocab(dims.vocab_size, p) // tp
        start, stop = r * per, min((r + 1) * per, shape[0])
        return [((0, start, stop - start),)] if stop > start else []
    if kind in (LINEAR_HEADS, LINEAR_QKV_PARTS):
        return _linear(kind, hf_name, shape, dims, p)
    if kind == VISION_QKV:
        return _vision_qkv(hf_name, shape, dims, p)
    if kind == POSITION_ROWS:  # sglang's VocabParallelEmbedding of num_position_embeddings rows, vllm's whole table
        return p.rules.position_rows(shape, p)
    if kind in (EXPERT_COLUMN, EXPERT_ROW):
        if expert not in expert_owner_range(dims.num_experts, p):
            return []
        dim = 0 if kind == EXPERT_COLUMN else 1
        return [(_even(shape[dim], p.moe_tp, p.moe_tp_rank, hf_name, dim),)]
    return _stacked(kind, hf_name, shape, dims, p)


def _linear(kind: str, hf_name: str, shape: tuple[int, ...], dims: ModelDims, p: EnginePlacement) -> list[Region]:
    # both engines build the gated DeltaNet with num_k_heads / tp and num_v_heads / tp heads per rank
    nk, nv = dims.linear_num_key_heads, dims.linear_num_value_heads
    if nk is None or nv is None:
        raise EngineShardError(f"{hf_name}: expected ModelDims with linear_num_key_heads / linear_num_value_heads "
                               f"(a gated DeltaNet model), found {nk} / {nv}")
    tp, r = p.tp_size, p.tp_rank
    if nk % tp or nv % tp:
        raise EngineShardError(f"{hf_name}: expected tp_size {tp} dividing the {nk} linear key heads and {nv} value "
                               f"heads ({p.engine} splits the gated DeltaNet by heads)")
    if kind == LINEAR_HEADS:
        return [(_even(shape[0], tp, r, hf_name, 0),)]
    parts = (nk * dims.linear_key_head_dim,) * 2 + (nv * dims.linear_value_head_dim,)
    if shape[0] != sum(parts):
        raise EngineShardError(f"{hf_name}: expected dim 0 = q + k + v = {' + '.join(map(str, parts))}, "
                               f"found {shape[0]}")
    if tp == 1:
        return [()]
    starts = (0, parts[0], 2 * parts[0])
    return [((0, start + r * n // tp, n // tp),) for start, n in zip(starts, parts)]


def _vision_qkv(hf_name: str, shape: tuple[int, ...], dims: ModelDims, p: EnginePlacement) -> list[Region]:
    # QKVParallelLinear(total_num_heads = total_num_kv_heads = vision heads): the fused tensor's thirds q, k, v, each
    # narrowed to heads [r * heads / tp, (r + 1) * heads / tp) (both engines divide the heads, asserting it)
    heads, head_dim = dims.vision_num_heads, dims.vision_head_dim
    if heads is None or head_dim is None:
        raise EngineShardError(f"{hf_name}: expected ModelDims with vision_num_heads / vision_head_dim (a model with "
                               f"a vision tower), found {heads} / {head_dim}")
    if shape[0] != 3 * heads * head_dim:
        raise EngineShardError(f"{hf_name}: expected dim 0 = 3 x {heads} heads x {head_dim} = {3 * heads * head_dim} "
                               f"([q; k; v]), found {shape[0]}")
    tp, r = p.tp_size, p.tp_rank
    if heads % tp:
        raise EngineShardError(f"{hf_name}: expected tp_size {tp} dividing the {heads} vision heads ({p.engine} "
                               "splits the vision tower's attention by heads; its data-parallel encoder is not covered)")
    n = heads * head_dim // tp
    return [((0, part * heads * head_dim + r * n, n),) for part in range(3)] if tp > 1 else [()]


def _stacked(kind: str, hf_name: str, shape: tuple[int, ...], dims: ModelDims, p: EnginePlacement) -> list[Region]:
    # vllm 0.33.0 models/gpt_oss.py _load_weights_other: EP takes whole experts [ep*E/ep, ...); otherwise the
    # intermediate dim is cut in cdiv(I, tp) pieces (gate/up interleaved by column: 2x that many columns).
    # sglang 0.5.23 models/gpt_oss.py _load_normal_weights -> FusedMoE.weight_loader_fused -> _load_w13/_load_w2:
    # the same cut with I / moe_tp exact, and no expert narrowing at all (so no EP for bf16 stacked experts)
    if p.ep_size > 1:
        return p.rules.stacked_experts_under_ep(hf_name, shape, p)
    if kind == STACKED_DOWN_BIAS:  # rank 0 loads it whole, the others zero what they were given
        return [()] if p.tp_rank == 0 else []
    inter = shape[1] if kind == STACKED_DOWN else shape[-1] // 2
    p.rules.check_intermediate(hf_name, inter, p)
    per = math.ceil(inter / p.tp_size)
    start, stop = p.tp_rank * per, min((p.tp_rank + 1) * per, inter)
    if stop <= start:
        return []
    if kind == STACKED_DOWN:
        return [((1, start, stop - start),)]
    return [((len(shape) - 1, 2 * start, 2 * (stop - start)),)]


# ------------------------------------------------------------------------------------------------- tensors

def region_slices(region: Region) -> tuple:
    """The region as an index for `tensor[...]`."""
    dims = {d: slice(o, o + n) for d, o, n in region}
    return tuple(dims.get(d, slice(None)) for d in range(max(dims, default=-1) + 1))


def region_numel(region: Region, shape: Sequence[int]) -> int:
    lengths = {d: n for d, _, n in region}
    return math.prod(lengths.get(d, s) for d, s in enumerate(shape))


def regions_bytes(regions: Sequence[Region], shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes an engine rank needs of a tensor: the sum over its (disjoint) regions."""
    return sum(region_numel(r, shape) for r in regions) * dtype.itemsize


def mask_to_engine(full: torch.Tensor, regions: Sequence[Region], debug: bool = False) -> torch.Tensor:
    """A full-shaped tensor holding `full` in `regions` only, as an unmodified engine's load_weights is fed: the
    rest is NaN when `debug` (so a read outside the regions shows), else left uninitialized (never read)."""
    if debug and not full.is_floating_point():
        raise EngineShardError(f"debug NaN fill: expected a floating-point tensor, found {full.dtype}")
    out = torch.full_like(full, float("nan")) if debug else torch.empty_like(full)
    for region in regions:
        index = region_slices(region)
        out[index] = full[index]
    return out


@dataclass(frozen=True)
class EngineSlice:
    """One raw slice for a custom engine: the (dim, offset, length) triples of the full tensor it covers."""

    region: Region
    tensor: torch.Tensor


def engine_slices(full: torch.Tensor, regions: Sequence[Region]) -> list[EngineSlice]:
    """The raw slices (views of `full`) an engine rank loads, with their (dim, offset, length) metadata."""
    return [EngineSlice(region, full[region_slices(region)]) for region in regions]


def place_slices(slices: Sequence[EngineSlice], out: torch.Tensor) -> torch.Tensor:
    """The inverse of engine_slices: writes each slice back at its region of `out` (full-shaped)."""
    for s in slices:
        out[region_slices(s.region)] = s.tensor
    return out


# ------------------------------------------------------------------------------------------------- pieces

def clip(piece: Piece, region: Region) -> Piece | None:
    """The part of `piece` inside the box `region` (None when they do not meet): per narrowed dim the
    progression is cut to the interval, and the source offset moves with it."""
    if not region:  # the whole tensor (replicated): the piece as it is
        return piece
    start, count, src = list(piece.start), list(piece.count), piece.src_offset
    for d, lo, n in region:
        a, q, k = start[d], piece.step[d], count[d]
        first = max(0, -((a - lo) // q))          # ceil((lo - a) / q)
        stop = min(k, -((a - lo - n) // q))       # ceil((lo + n - a) / q)
        if stop <= first:
            return None
        start[d], count[d] = a + first * q, stop - first
        src += first * piece.src_strides[d]
    # the constructor, not dataclasses.replace: plans clip every piece for every engine rank (2x faster)
    return Piece(piece.out, piece.shard, tuple(start), piece.step, tuple(count), piece.src_strides, src,
                 piece.add)


# ------------------------------------------------------------------------------------------------- engine ranks
# Which training process feeds each engine rank (disaggregated placements: senders/engine_shard.py).

@dataclass(frozen=True)
class EngineRank:
    """Where one engine rank's weights go: the training process (global rank) that feeds it."""

    placement: EnginePlacement
    instance: int  # engine replica (several engines share one training world)
    rank: int


def colocated_ranks(world_size: int, engine: str, tp_size: int, ep_size: int = 1,
                    groups: list[list[int]] | None = None, **placement) -> list[EngineRank]:
    """Colocated RL: engine instance k's rank r is fed by global rank `groups[k][r]`; default groups are
    consecutive trainer ranks (`[k*tp, (k+1)*tp)`, the GPUs the instance runs on). `placement` passes
    EnginePlacement fields (moe_tp, replicated_shared_experts)."""
    if groups is None:
        if world_size % tp_size:
            raise EngineShardError(f"colocated engines: expected engine TP {tp_size} to divide the world size "
                                   f"{world_size}")
        groups = [list(range(k, k + tp_size)) for k in range(0, world_size, tp_size)]
    flat = [r for g in groups for r in g]
    if len(set(flat)) != len(flat) or any(not 0 <= r < world_size for r in flat) or \
            any(len(g) != tp_size for g in groups):
        raise EngineShardError(f"engine rank groups: expected groups of {tp_size} distinct ranks in "
                               f"[0, {world_size}), found {groups}")
    return [EngineRank(EnginePlacement(engine, r, tp_size, ep_size, **placement), k, g[r])
            for k, g in enumerate(groups) for r in range(tp_size)]
