"""Rule fragments shared by the converter tables (plain lists of `Rule`s, concatenated per architecture).

A rule for a parameter that a given config does not have (q/k norm, attention bias) is harmless: rules match
by name. Whether the model *should* have it is checked against the HF config by the model spec."""

import regex

from mcore2hf.arch.mapping import OpSpec, Rule
from mcore2hf.layouts.ops import (
    QKV,
    Column,
    GatedColumn,
    IndexerRope,
    LatentDown,
    LayoutOp,
    Replicated,
    Row,
    VocabRows,
    WholeOrSplit,
)
from mcore2hf.quantize.fp8 import FP8Policy

L = "decoder.layers.{L}"
HL = "model.layers.{L}"
#: the native Megatron vision tower's blocks and HF's (Qwen3-VL)
VL, HV = "vision_model.decoder.layers.{V}", "model.visual.blocks.{V}"


def embeddings(mtp_copies: bool = False) -> list[Rule]:
    """Embedding, final norm, output layer; with MTP, the copies HF checkpoints keep in each MTP layer."""
    return [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", VocabRows,
             copies=["model.layers.{MTP}.embed_tokens.weight"] if mtp_copies else []),
        Rule("output_layer.weight", "lm_head.weight", VocabRows,
             copies=["model.layers.{MTP}.shared_head.head.weight"] if mtp_copies else []),
        Rule("decoder.final_layernorm.weight", "model.norm.weight"),
    ]


def gqa_attention(qk_norm: type[LayoutOp] = Replicated, qkv: type[LayoutOp] = QKV) -> list[Rule]:
    """Fused QKV (weights and biases), output projection, optional q/k norms, the layer's two norms.

    `qk_norm=Column`: full-width q/k norms (MiniMax-M2, OLMoE), whose weight Megatron splits by heads over TP.
    `qkv=GatedQKV`: gated attention (Qwen3-Next), the output gate packed with the query."""
    a, h = f"{L}.self_attention", f"{HL}.self_attn"
    return [
        Rule(f"{L}.input_layernorm.weight", f"{HL}.input_layernorm.weight"),
        Rule(f"{a}.linear_qkv.weight", [f"{h}.q_proj.weight", f"{h}.k_proj.weight", f"{h}.v_proj.weight"], qkv),
        Rule(f"{a}.linear_qkv.bias", [f"{h}.q_proj.bias", f"{h}.k_proj.bias", f"{h}.v_proj.bias"], qkv),
        Rule(f"{a}.linear_proj.weight", f"{h}.o_proj.weight", Row),
        Rule(f"{a}.q_layernorm.weight", f"{h}.q_norm.weight", qk_norm),
        Rule(f"{a}.k_layernorm.weight", f"{h}.k_norm.weight", qk_norm),
        Rule(f"{L}.pre_mlp_layernorm.weight", f"{HL}.post_attention_layernorm.weight"),
    ]


def mla_attention() -> list[Rule]:
    """DeepSeek multi-latent attention (with or without q_lora_rank)."""
    a, h = f"{L}.self_attention", f"{HL}.self_attn"
    return [
        Rule(f"{L}.input_layernorm.weight", f"{HL}.input_layernorm.weight"),
        Rule(f"{a}.linear_q_down_proj.weight", f"{h}.q_a_proj.weight", LatentDown.q_down),
        Rule(f"{a}.q_layernorm.weight", f"{h}.q_a_layernorm.weight"),
        Rule(f"{a}.linear_q_up_proj.weight", f"{h}.q_b_proj.weight", Column),
        Rule(f"{a}.linear_q_proj.weight", f"{h}.q_proj.weight", Column),
        Rule(f"{a}.linear_kv_down_proj.weight", f"{h}.kv_a_proj_with_mqa.weight", LatentDown.kv_down),
        Rule(f"{a}.kv_layernorm.weight", f"{h}.kv_a_layernorm.weight"),
        Rule(f"{a}.linear_kv_up_proj.weight", f"{h}.kv_b_proj.weight", Column),
        Rule(f"{a}.linear_proj.weight", f"{h}.o_proj.weight", Row),
        Rule(f"{L}.pre_mlp_layernorm.weight", f"{HL}.post_attention_layernorm.weight"),
    ]


def indexer_rope(dims) -> LayoutOp:
    """The indexer's rows with rotary dims (wq_b, wk, k_norm) as the installed megatron-core keeps them
    (`ModelDims.indexer_rope`, from the model spec; layouts.IndexerRope)."""
    if dims.indexer_rope == "first":
        return Replicated()
    return IndexerRope(dims.index_head_dim, dims.qk_rope_head_dim, dims.indexer_rope == "last_interleaved")


def dsa_indexer() -> list[Rule]:
    """DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5): megatron-core >= 0.16
    experimental_attention_variant/dsa.py builds its linears with parallel_mode="duplicated" (every TP rank holds
    all of it: one copy is exported) and k_norm as a LayerNorm (weight and bias). Layers of GLM-5.2's IndexShare
    marked "shared" have none of these tensors (on either side). weights_proj has no rotary rows: a plain copy."""
    i, h = f"{L}.self_attention.core_attention.indexer", f"{HL}.self_attn.indexer"
    return [
        Rule(f"{i}.linear_wq_b.weight", f"{h}.wq_b.weight", indexer_rope),
        Rule(f"{i}.linear_wk.weight", f"{h}.wk.weight", indexer_rope),
        Rule(f"{i}.k_norm.weight", f"{h}.k_norm.weight", indexer_rope),
        Rule(f"{i}.k_norm.bias", f"{h}.k_norm.bias", indexer_rope),
        Rule(f"{i}.linear_weights_proj.weight", f"{h}.weights_proj.weight", Replicated),
    ]


def glu_mlp(megatron: str, hf: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """A SwiGLU MLP: fc1 = [gate; up] (TP shards [gate_i; up_i]) and fc2 = down; `names` are HF's (gate, up,
    down) module names (Mixtral's experts: w1, w3, w2)."""
    gate, up, down = names
    return [
        Rule(f"{megatron}.linear_fc1.weight", [f"{hf}.{gate}.weight", f"{hf}.{up}.weight"], GatedColumn),
        Rule(f"{megatron}.linear_fc2.weight", f"{hf}.{down}.weight", Row),
    ]


def dense_mlp() -> list[Rule]:
    return glu_mlp(f"{L}.mlp", f"{HL}.mlp")


def moe(shared_experts: bool = False, expert_bias: bool = False, hf_moe: str = "mlp",
        expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """Router, routed experts (local spec and TE grouped names are both canonicalized to experts.{E}),
    optional shared experts and the router's expert_bias buffer (HF e_score_correction_bias). `hf_moe` and
    `expert_names`: the HF MoE block's and experts' module names (Mixtral: block_sparse_moe, w1/w3/w2)."""
    rules = [Rule(f"{L}.mlp.router.weight", f"{HL}.{hf_moe}.gate.weight", Replicated)]
    rules += glu_mlp(f"{L}.mlp.experts.{{E}}", f"{HL}.{hf_moe}.experts.{{E}}", expert_names)
    if shared_experts:
        rules += glu_mlp(f"{L}.mlp.shared_experts", f"{HL}.mlp.shared_experts")
    if expert_bias:
        rules.append(Rule(f"{L}.mlp.router.expert_bias", f"{HL}.mlp.gate.e_score_correction_bias", Replicated,
                          keep_dtype=True))
    return rules


def block_sparse_moe(expert_bias: bool = False) -> list[Rule]:
    """Mixtral-style MoE names (Mixtral, MiniMax-M2): block_sparse_moe.gate, experts.{E}.w1 (gate) / w3 (up) / w2
    (down); optional block_sparse_moe.e_score_correction_bias (MiniMax-M2) from the router's expert_bias buffer."""
    rules = moe(hf_moe="block_sparse_moe", expert_names=("w1", "w3", "w2"))
    if expert_bias:
        rules.append(Rule(f"{L}.mlp.router.expert_bias", f"{HL}.block_sparse_moe.e_score_correction_bias",
                          Replicated, keep_dtype=True))
    return rules


def mtp() -> list[Rule]:
    """MTP layer M at HF layer num_hidden_layers + M (its inner decoder layer is named decoder.layers.{L})."""
    m, h = "mtp.layers.{M}", "model.layers.{L}"
    return [
        Rule(f"{m}.enorm.weight", f"{h}.enorm.weight"),
        Rule(f"{m}.hnorm.weight", f"{h}.hnorm.weight"),
        Rule(f"{m}.eh_proj.weight", f"{h}.eh_proj.weight", Column),
        Rule(f"{m}.final_layernorm.weight", f"{h}.shared_head.norm.weight"),
    ]


def language_model(rules: list[Rule], model: str = "model.language_model.", lm_head: str = "lm_head.weight") -> list[Rule]:
    """The same rules with the decoder's HF names `model.*` under `model` and `lm_head.weight` named `lm_head`:
    by default transformers 5's multimodal classes (Qwen3VLForConditionalGeneration, Qwen3_5ForConditionalGeneration,
    Glm4vMoeForConditionalGeneration: `model.language_model` beside `model.visual`, lm_head at the top)."""
    def move(name: str) -> str:
        if name == "lm_head.weight":
            return lm_head
        return model + name.removeprefix("model.") if name.startswith("model.") else name

    return [Rule(r.megatron, [move(n) for n in r.hf], r.op, copies=[move(n) for n in r.copies],
                 keep_dtype=r.keep_dtype, stack=r.stack) for r in rules]


def hf_tower(megatron: str, hf: str) -> list[Rule]:
    """A part of a vision-language wrapper that already carries HF's own names (layout 2 of docs/vlm.md: an HF
    vision tower embedded in the Megatron model, replicated on every TP rank of the first stage): every tensor
    under `megatron` passes through to the same path under `hf`, one copy, never gathered over TP."""
    return [Rule(f"{megatron}.{{NAME}}", f"{hf}.{{NAME}}", Replicated)]


def llama_like() -> list[Rule]:
    """Dense decoders: Llama, Qwen2, Qwen3 (and the dense layers of MoE models)."""
    return embeddings() + gqa_attention() + dense_mlp()


# FP8 block-quantized export: the 2-D weights the published FP8 checkpoints keep in bf16 (every other 2-D weight
# is quantized, 1-D tensors never are). Embeddings, lm_head and the MoE router gate stay bf16 in DeepSeek-V3,
# GLM-4.5-FP8 and Qwen3-*-FP8; in DeepSeek-V3's MTP layer eh_proj and the embedding / head copies stay bf16 while
# the MTP block's own linears are fp8 (SGLang and vLLM reject a quantized shared_head.head). GLM-4.5-FP8, a
# per-channel compressed-tensors checkpoint, also quantizes its MTP shared_head.head; the block-FP8 export keeps
# it bf16 as DeepSeek-V3 does (both pinned against the published tensors in tests/test_mtp_names.py).
FP8_KEEP = (r"model\.embed_tokens\.weight", r"lm_head\.weight", r"model\.layers\.\d+\.mlp\.gate\.weight")
FP8_KEEP_MTP = (r"model\.layers\.\d+\.(embed_tokens|eh_proj|shared_head\.head)\.weight",)


# DeepSeek sparse attention: the indexer's weights_proj (its per-head score weights) stays bf16 in the published FP8
# checkpoints while wq_b and wk are block-FP8: GLM-5.1-FP8 lists it in modules_to_not_convert and quantizes
# indexer.wk (sgl-project/sglang-jax#1111, which loads zai-org/GLM-5.1-FP8); DeepSeek-V3.2's FP8 checkpoint stores
# indexer.wk as FP8 with weight_scale_inv (ROCm/ATOM#788); transformers 5.24 keeps weights_proj in fp32 on load
# (modeling_deepseek_v32.py `_keep_in_fp32_modules = ["indexer.weights_proj"]`). The published config.json files
# themselves were not read here (no access): the exact modules_to_not_convert list of GLM-5-FP8 is not checked.
FP8_KEEP_DSA = (r"model\.layers\.\d+\.self_attn\.indexer\.weights_proj\.weight",)


def fp8_policy(mtp: bool = False, list_not_converted: bool = True, source: str = "",
               block_sparse_moe: bool = False, dsa_indexer: bool = False, tower: tuple[str, ...] = ()) -> FP8Policy:
    """Embeddings, lm_head and routers stay unquantized (Mixtral-style names: the router is block_sparse_moe.gate;
    `dsa_indexer`: and the sparse-attention indexer's weights_proj). `tower`: a vision-language model's tower and
    projector prefixes (e.g. "model.visual."), kept unquantized whole; its language model's names may also be
    under `model.language_model.` or `language_model.model.` (`language_model`)."""
    keep = FP8_KEEP + (FP8_KEEP_MTP if mtp else ()) + (FP8_KEEP_DSA if dsa_indexer else ())
    if block_sparse_moe:
        keep += (r"model\.layers\.\d+\.block_sparse_moe\.gate\.weight",)
    if tower:  # the same names under a multimodal model's language-model prefixes, and the tower whole
        keep = tuple(p.replace(r"model\.", r"(?:language_model\.)?model\.(?:language_model\.)?", 1)
                     .replace(r"lm_head\.", r"(?:language_model\.)?lm_head\.") for p in keep)
        keep += tuple(regex.escape(t) + ".*" for t in tower)
    return FP8Policy(keep=keep, list_not_converted=list_not_converted, source=source, tower=tower)


def vision_qkv(dims) -> LayoutOp:
    """The vision tower's `linear_qkv`: per head [q_h; k_h; v_h] (no GQA) -> HF's one `attn.qkv` [q; k; v]."""
    return QKV(dims.vision_num_heads, dims.vision_num_heads, dims.vision_head_dim, fused=True)


def merger_column(dims) -> LayoutOp:
    """The patch merger's `linear_fc1`: column-parallel natively, whole in an embedded HF tower (same name)."""
    return WholeOrSplit(dims.vision_merged_size, 0)


def merger_row(dims) -> LayoutOp:
    """The patch merger's `linear_fc2` weight: row-parallel natively, whole in an embedded HF tower."""
    return WholeOrSplit(dims.vision_merged_size, 1)


def _patch_merger(megatron: str, hf: str, column: OpSpec = Column, row: OpSpec = Row) -> list[Rule]:
    """A patch merger: LayerNorm (`patch_norm` -> `norm`), column-parallel fc1, GELU, row-parallel fc2 (its bias
    added once after the TP reduction: replicated)."""
    return [
        Rule(f"{megatron}.patch_norm.weight", f"{hf}.norm.weight"),
        Rule(f"{megatron}.patch_norm.bias", f"{hf}.norm.bias"),
        Rule(f"{megatron}.linear_fc1.weight", f"{hf}.linear_fc1.weight", column),
        Rule(f"{megatron}.linear_fc1.bias", f"{hf}.linear_fc1.bias", column),
        Rule(f"{megatron}.linear_fc2.weight", f"{hf}.linear_fc2.weight", row),
        Rule(f"{megatron}.linear_fc2.bias", f"{hf}.linear_fc2.bias"),
    ]


def native_vision_tower(deepstack: bool = True) -> list[Rule]:
    """Qwen3-VL's vision tower as Megatron builds it natively (layout 1 of issue 26): `vision_model.*`, megatron-core
    ViT layers (LayerNorm, biased linears, GELU MLP) tensor-parallel in the LM's TP group, on the first pipeline
    stage only -> `model.visual.*` (transformers 5.24 modeling_qwen3_vl.py Qwen3VLVisionModel).

    Names: Megatron-Bridge 0.6.2 models/qwen_vl/qwen3_vl_bridge.py:123-193 (Qwen3VLBridge.mapping_registry, the
    same in Qwen3VLMoEBridge) and mbridge's qwen3_vl (github ISEEKYAN/mbridge main, mbridge/models/qwen3_vl/
    __init__.py `_QWEN3VIT_*_MAPPING`; no PyPI release has it: 0.15.1 is the newest and ends at qwen2_5_vl),
    with TE's fused norms under their local-spec names (naming.TE_RENAMES: `linear_qkv.layer_norm_weight` is
    `input_layernorm.weight`, HF `norm1`; `mlp.linear_fc1.layer_norm_weight` is `pre_mlp_layernorm.weight`, HF
    `norm2`). Split rules: `linear_qkv` per head [q_h; k_h; v_h] -> one [q; k; v] (Bridge's
    ConcatenatedQKVMapping, mbridge base_bridge.py `_weight_to_hf_format`: view(heads, 3, ...).transpose(0, 1));
    the main merger's linears split or whole as the shard says (`WholeOrSplit`: an embedded HF tower has the
    same names, unsplit); `patch_embed.proj` (Conv3d) and `pos_embed` (nn.Embedding) replicated (Bridge's ReplicatedMapping;
    vision_model.py:144-145 builds them as plain torch modules); `linear_proj` / `linear_fc2` row-parallel with a
    replicated bias, `linear_fc1` column-parallel (Bridge's AutoMapping of TERowParallelLinear /
    TEColumnParallelLinear). `deepstack`: the Qwen3-VL deepstack mergers (transformer_block.py:89-99
    `Qwen3VLVisionTransformerBlock.deepstack_merger_list`), absent in Qwen3.5's tower."""
    a, h = f"{VL}.self_attention", f"{HV}.attn"
    rules = [
        Rule("vision_model.patch_embed.proj.weight", "model.visual.patch_embed.proj.weight"),
        Rule("vision_model.patch_embed.proj.bias", "model.visual.patch_embed.proj.bias"),
        Rule("vision_model.pos_embed.weight", "model.visual.pos_embed.weight"),
        Rule(f"{VL}.input_layernorm.weight", f"{HV}.norm1.weight"),
        Rule(f"{VL}.input_layernorm.bias", f"{HV}.norm1.bias"),
        Rule(f"{a}.linear_qkv.weight", f"{h}.qkv.weight", vision_qkv),
        Rule(f"{a}.linear_qkv.bias", f"{h}.qkv.bias", vision_qkv),
        Rule(f"{a}.linear_proj.weight", f"{h}.proj.weight", Row),
        Rule(f"{a}.linear_proj.bias", f"{h}.proj.bias"),
        Rule(f"{VL}.pre_mlp_layernorm.weight", f"{HV}.norm2.weight"),
        Rule(f"{VL}.pre_mlp_layernorm.bias", f"{HV}.norm2.bias"),
        Rule(f"{VL}.mlp.linear_fc1.weight", f"{HV}.mlp.linear_fc1.weight", Column),
        Rule(f"{VL}.mlp.linear_fc1.bias", f"{HV}.mlp.linear_fc1.bias", Column),
        Rule(f"{VL}.mlp.linear_fc2.weight", f"{HV}.mlp.linear_fc2.weight", Row),
        Rule(f"{VL}.mlp.linear_fc2.bias", f"{HV}.mlp.linear_fc2.bias"),
    ]
    # `vision_model.merger.linear_fc{1,2}` are also the names of an embedded HF tower's (whole) merger linears
    rules += _patch_merger("vision_model.merger", "model.visual.merger", merger_column, merger_row)
    if deepstack:
        rules += _patch_merger("vision_model.decoder.deepstack_merger_list.{D}", "model.visual.deepstack_merger_list.{D}")
    return rules


#: VLM FP8 exports keep the vision tower (and projector) in the export dtype, as the published FP8 releases do (read
#: in public sources quoting them; the hub's config.json files themselves are not reachable here): Qwen's FP8
#: releases list the tower's modules in modules_to_not_convert (Qwen3.6-35B-A3B-FP8, a qwen3_5_moe model:
#: "model.visual.blocks.0.attn.proj", ...; a Qwen3.8-27B-FP8 write-up: "model.visual.blocks.*"); GLM-4.5V-FP8
#: lists its tower's qkv under engine names (vllm-project/vllm#22949); Kimi-K2.5 has no FP8 release (its
#: checkpoint is compressed-tensors INT4, routed experts only). The engines agree: SGLang 0.5.23 builds the Qwen3-VL
#: tower with quant_config=None (models/qwen3_vl.py:1332-1340) and Kimi-K2.5's unquantized unless ModelSlim
#: (models/kimi_k25.py:680-686). FP8Policy(tower=) lists the tower for vLLM's and SGLang's matching (its docstring).
VLM_FP8_SOURCE = ("the text family's table under the language-model prefix; the tower and projector kept whole, "
                  "as the published Qwen3-VL / Qwen3.5 / GLM-4.5V FP8 releases keep them (docs/vlm.md)")


#: What the test suite verifies, shared by the architectures it verifies alike (each registration says its own:
#: `mcore2hf list`; docs/architectures.md has the detail). The layout worlds' counts are checked against
#: tests/test_layout_matrix.py, so these cannot drift from the suite.
EVERY = "logits = transformers' at each, import loaded by Megatron, offline export, engine shards, demo"
SEVEN_WORLDS = f"7 layout worlds (TP, PP, VPP, EP, expert-TP != TP, uneven PP, bf16); {EVERY}"
THREE_WORLDS = f"3 layout worlds (TP x PP x EP, PP x VPP, uneven PP: every parallel dimension); {EVERY}"

# Vision-language models (docs/vlm.md), odd-shaped: no dimension a multiple of 8 (a transposition or a wrong
# split cannot hide behind equal sizes); TP2 still splits heads (4, 2 kv) and ffn, EP 2 and 4 the 12 experts. 4 layers so
# PP2 x VPP2 has a layer per chunk; ffn 52 and expert ffn 20 divide over engine TP 4; a vision tower of 3 patch-3 blocks with 2 deepstack mergers (Qwen3-VL).
TINY_VL_TEXT = dict(vocab_size=101, hidden_size=44, intermediate_size=52, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=10, max_position_embeddings=256, rms_norm_eps=1e-6,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
TINY_VL_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 1]}
TINY_QWEN3_VL_VISION = dict(depth=3, hidden_size=36, intermediate_size=30, num_heads=3, out_hidden_size=44,
                            num_position_embeddings=25, patch_size=3, temporal_patch_size=2, spatial_merge_size=2,
                            deepstack_visual_indexes=[0, 1])
TINY_VL_IDS = dict(image_token_id=97, video_token_id=98, vision_start_token_id=99, vision_end_token_id=100)
TINY_VL_MOE = dict(moe_intermediate_size=20, num_experts_per_tok=2)
