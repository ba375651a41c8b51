"""DeepSeek-V3.2 (HF `deepseek_v32`): DeepSeek-V3's multi-latent attention with DeepSeek sparse attention (DSA):
a lightning indexer per layer (`self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`) picks each query's top
`index_topk` keys. Megatron: MLATransformerConfig with experimental_attention_variant="dsa" (megatron-core >=
0.16.0, transformer/experimental_attention_variant/dsa.py `DSAttention` / `DSAIndexer`).

The DSA family (glm_moe_dsa) subclasses `DSA`: the indexer's rope is the class's, GLM-5.2's IndexShare comes from
the HF config."""

import copy

from mcore2hf.errors import ConfigMismatchError

from .common import Fields, parallel_fields
from .deepseek_v3 import megatron_at_least, mla_layer_spec, with_eps
from .glm4_moe_lite import Glm4MoeLite

# transformers 5.24 modeling_deepseek_v32.py `DeepseekV32Indexer.__init__`: `nn.LayerNorm(head_dim, eps=1e-6)`,
# whatever rms_norm_eps says; megatron-core 0.16.1 dsa.py builds k_norm with config.layernorm_epsilon
INDEXER_K_NORM_EPS = 1e-6


def indexer_rope_layout(interleaved_in_hf: bool) -> str:
    """Where the installed megatron-core keeps the indexer's rotary rows (layouts.IndexerRope): "first" (0.19: as
    HF, its `dsa_indexer_rope_interleaved` choosing the rope), else "last" (0.16-0.18 always interleave, as an
    interleaved-rope HF model does) or "last_interleaved" (a half-split HF rope, rows re-interleaved)."""
    try:
        first = megatron_at_least(0, 19)
    except ImportError:  # the offline tools run without megatron-core: the layout is the release's, not guessed
        raise ConfigMismatchError("DeepSeek sparse attention: where the indexer's rotary rows sit depends on the "
                                  "megatron-core release (0.16-0.18: last, 0.19: first); install the release that "
                                  "trains the model") from None
    if first:
        return "first"
    return "last" if interleaved_in_hf else "last_interleaved"


def shared_indexer_layers(cfg) -> list[int]:
    """GLM-5.2 IndexShare: the layers that reuse the previous full layer's top-k and have no indexer
    (transformers 5.24 configuration_glm_moe_dsa.py `indexer_types`)."""
    return [i for i, t in enumerate(getattr(cfg, "indexer_types", None) or []) if t == "shared"]


def index_share_sources(cfg) -> dict[int, int]:
    """Each shared layer -> the full layer whose top-k it reuses (the previous full layer: transformers 5.24
    GlmMoeDsaModel.forward passes the last top-k on; megatron-core 0.19.2 dsa.py `source_dsa_compute_layer`)."""
    shared, out, source = set(shared_indexer_layers(cfg)), {}, None
    for i in range(cfg.num_hidden_layers):
        if i in shared:
            if source is None:
                raise ConfigMismatchError(f"indexer_types: layer {i} is 'shared' with no full layer before it")
            out[i] = source
        else:
            source = i
    return out


def index_share_stage_problems(cfg, stages: list[list[int]]) -> list[str]:
    """IndexShare across pipeline stages: a shared layer must sit on its source layer's stage (the top-k is not
    sent between stages; megatron-core 0.19.2 experimental_attention_variant_module_specs.py
    `_validate_dsa_index_share_pipeline_split` refuses such a split). `stages`: the HF layers of each stage (or
    virtual chunk)."""
    where = {layer: s for s, layers in enumerate(stages) for layer in layers}
    return [f"layer {i} reuses layer {src}'s top-k but sits on pipeline stage/chunk {where[i]}, layer {src} on "
            f"{where[src]}" for i, src in index_share_sources(cfg).items()
            if i in where and src in where and where[i] != where[src]]


def index_share_fields(cfg) -> dict:
    """megatron-core 0.19.2's IndexShare (dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset,
    experimental_attention_variant/dsa.py `is_dsa_skip_topk_layer`: 1-based layer L reuses iff
    max(L - max(offset, 1), 0) % freq != 0) for the HF `indexer_types`; refused where no (freq, offset) gives them
    or the installed megatron-core has no IndexShare (< 0.19)."""
    shared = shared_indexer_layers(cfg)
    if not shared:
        return {}
    n = cfg.num_hidden_layers
    want = [i in shared for i in range(n)]
    if not megatron_at_least(0, 19):
        raise ConfigMismatchError(f"indexer_types marks layers {shared} 'shared' (IndexShare): megatron-core < 0.19 "
                                  "has no cross-layer top-k sharing (dsa_indexer_topk_freq); use megatron-core >= 0.19")
    for freq in range(2, n + 1):
        for offset in range(1, n + 1):
            if [(max(i + 1 - offset, 0) % freq) != 0 for i in range(n)] == want:
                return dict(dsa_indexer_topk_freq=freq, dsa_indexer_skip_topk_offset=offset)
    raise ConfigMismatchError(f"indexer_types {cfg.indexer_types}: no megatron-core (dsa_indexer_topk_freq, "
                              "dsa_indexer_skip_topk_offset) gives this pattern of shared layers")


def check_indexer_rope(cfg, rope_interleaved: bool) -> None:
    """A config.json may say which rope the indexer uses (`indexer_rope_interleave`, which sglang 0.5.23
    models/deepseek_v2.py reads: missing = half-split); transformers 5.24 fixes it per model_type. A value that
    contradicts transformers' class is refused: the two would compute different models."""
    said = getattr(cfg, "indexer_rope_interleave", None)
    if said is not None and bool(said) != rope_interleaved:
        raise ConfigMismatchError(f"indexer_rope_interleave={said}: transformers' {cfg.model_type} indexer applies "
                                  f"{'interleaved' if rope_interleaved else 'half-split (non-interleaved)'} rope")


def dsa_fields(cfg, rope_interleaved: bool) -> Fields:
    """The MLATransformerConfig fields of the indexer (names a release lacks are dropped by make_config): its head
    count and dim structural; its rope (checked against transformers') and IndexShare only for building."""

    def building() -> dict:
        check_indexer_rope(cfg, rope_interleaved)
        return dict(index_share_fields(cfg),
                    # megatron-core 0.19.2 transformer_config.py: the indexer's rope and k_norm eps as HF computes them
                    dsa_indexer_rope_interleaved=rope_interleaved, dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS)

    return Fields().set(True, dsa_indexer_n_heads=cfg.index_n_heads, dsa_indexer_head_dim=cfg.index_head_dim).set(
        experimental_attention_variant="dsa", dsa_indexer_topk=cfg.index_topk, dsa_indexer_loss_coeff=0.0,
    ).later(building)


def dsa_core_attention(use_te: bool):
    """megatron-core's DSAttention with its indexer (as `get_dsa_module_spec_for_backend` builds it), k_norm at
    transformers' eps; without Transformer Engine the duplicated linears are local modules."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttention,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .common import DuplicatedLinear

    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
        linear = backend.linear()
    else:
        backend, linear = LocalSpecProvider(), DuplicatedLinear
    k_norm = with_eps(backend.layer_norm(rms_norm=False, for_qk=True), INDEXER_K_NORM_EPS)
    return ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=ModuleSpec(
        module=DSAIndexer, submodules=DSAIndexerSubmodules(linear_wq_b=linear, linear_wk=linear, k_norm=k_norm,
                                                           linear_weights_proj=linear))))


def dsa_layer_spec(config, cfg, *, vp_stage=None, use_te=False):
    """The decoder block spec: megatron-core >= 0.19's own DSA block (`layer_spec_absorbed`), else the MLA decoder
    block spec (deepseek_v3.layer_spec) with DSAttention as every layer's core attention.

    The latent norms stay unfused (q_layernorm / kv_layernorm) with Transformer Engine too: the indexer reads the
    normalized query latent (HF `q_resid = q_a_layernorm(q_a_proj(x))`), which megatron-core 0.16-0.18's fused
    TE up projection never materializes (0.19's DSA spec unfuses them for this reason,
    experimental_attention_variant_module_specs.py `get_dsa_module_spec_for_backend`)."""
    from .deepseek_v3 import MLA_LATENT_NORM_EPS

    if megatron_at_least(0, 19):
        return layer_spec_absorbed(config, cfg, vp_stage=vp_stage, use_te=use_te)
    block = mla_layer_spec(config, cfg, vp_stage=vp_stage, use_te=use_te)
    core = dsa_core_attention(use_te)
    for spec in block.layer_specs:
        attn = spec.submodules.self_attention.submodules
        attn.core_attention = core
        if use_te:  # not run here (no Transformer Engine on these machines)
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            te = TESpecProvider()
            attn.linear_q_up_proj = attn.linear_kv_up_proj = te.column_parallel_linear()
            attn.q_layernorm = attn.kv_layernorm = with_eps(te.layer_norm(rms_norm=True, for_qk=True),
                                                            MLA_LATENT_NORM_EPS)
    return block


def local_index_share_problems(cfg, layers) -> list[str]:
    """IndexShare on one pipeline stage / virtual chunk holding the HF `layers` (in order): each shared layer's
    source must be an earlier layer of the same chunk (megatron-core 0.19.2
    experimental_attention_variant_module_specs.py:339-374 `_validate_dsa_index_share_pipeline_split`, which
    raises a RuntimeError; this says which layers and what to change)."""
    position = {layer: i for i, layer in enumerate(layers)}
    return [f"layer {i} reuses layer {src}'s top-k, which is not on its pipeline stage/chunk (layers {list(layers)})"
            for i, src in index_share_sources(cfg).items()
            if i in position and (src not in position or position[src] > position[i])]


def _local_dsa_backend():
    """megatron-core 0.19.2's LocalSpecProvider (models/backends.py:99-146) plus the `linear()` the DSA spec asks
    for (the indexer's duplicated linears): DuplicatedLinear, what TESpecProvider.linear()'s TELinear is there;
    and norms that allow the sequence parallelism absorbed MLA requires at TP > 1 (SequenceParallelNorm: the local
    WrappedTorchNorm refuses it)."""
    from megatron.core.models.backends import LocalSpecProvider

    from .common import DuplicatedLinear, SequenceParallelNorm

    class LocalDSASpecProvider(LocalSpecProvider):
        def linear(self) -> type:
            return DuplicatedLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
            return SequenceParallelNorm

    return LocalDSASpecProvider()


def layer_spec_absorbed(config, cfg, *, vp_stage=None, use_te=False):
    """megatron-core >= 0.19's DSA decoder block: every layer `AbsorbedMLASelfAttention` (unfused q_layernorm /
    kv_layernorm, K/V up projections absorbed at run time; the weights keep MLA's names and layouts) with
    `DSAttention`, dense / MoE MLPs by `moe_layer_freq`, IndexShare layers without an indexer
    (experimental_attention_variant_module_specs.py:156-325 `get_transformer_layer_with_experimental_attention_
    variant_spec` and the block around it). 0.19 builds that block only with Transformer Engine (`_get_backend_
    spec_provider` asserts transformer_impl="transformer_engine"), so the layers come from its per-layer function
    with a backend argument: TE's, or the local one (`_local_dsa_backend`). Changes to 0.19's spec: the latent
    norms with transformers' eps 1e-6, and without TE the latent down projections ColumnParallelLinear (what
    AbsorbedMLA accepts there, absorbed_mla.py:282-295; the local MLA spec's, gpt_layer_specs.py:413-416)."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from .deepseek_v3 import MLA_LATENT_NORM_EPS

    if use_te:  # not run here (no Transformer Engine on these machines)
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = _local_dsa_backend()
    layers = copy.deepcopy(eav.get_transformer_layer_with_experimental_attention_variant_spec(config, backend))
    if config.pipeline_model_parallel_layout is not None:  # as 0.19's block spec slices them (lines 307-314)
        ids = list(config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                           vp_stage=vp_stage))
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        ids = list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)))
    problems = local_index_share_problems(cfg, ids)
    if problems:
        raise ConfigMismatchError("GLM-5.2 IndexShare: a shared layer and the layer whose top-k it reuses must sit "
                                  "on one pipeline stage (megatron-core does not send top-k indices between "
                                  "stages); choose a layout where each stage starts on a full layer:\n  "
                                  + "\n  ".join(problems))
    done = set()
    for spec in layers:
        attn = spec.submodules.self_attention.submodules
        if id(attn) in done:  # one attention spec object is shared by the layers
            continue
        done.add(id(attn))
        attn.q_layernorm = with_eps(attn.q_layernorm, MLA_LATENT_NORM_EPS)
        attn.kv_layernorm = with_eps(attn.kv_layernorm, MLA_LATENT_NORM_EPS)
        if not use_te:
            attn.linear_q_down_proj = attn.linear_kv_down_proj = ColumnParallelLinear
    return TransformerBlockSubmodules(layer_specs=[layers[i] for i in ids],
                                      layer_norm=backend.layer_norm(rms_norm=True, for_qk=False))


class DSA(Glm4MoeLite):
    """DeepSeek sparse attention: MLA (MoE layers by `mlp_layer_types`, transformers 5.24) with the lightning
    indexer; `rope_interleaved`: whether the HF indexer applies interleaved rope (DeepSeek-V3.2
    `apply_rotary_pos_emb`, half-split; GLM-5 `apply_rotary_pos_emb_interleave`)."""

    hf_architecture = "DeepseekV32ForCausalLM"
    rope_interleaved = False
    # GLM-5.2's IndexShare, as the layout checks and the tests ask the spec
    index_share_sources = staticmethod(index_share_sources)
    index_share_stage_problems = staticmethod(index_share_stage_problems)
    local_index_share_problems = staticmethod(local_index_share_problems)

    def dims(self, cfg):
        import dataclasses

        check_indexer_rope(cfg, self.rope_interleaved)
        return dataclasses.replace(super().dims(cfg), index_head_dim=cfg.index_head_dim,
                                   indexer_rope=indexer_rope_layout(self.rope_interleaved))

    def extra(self, cfg, fields: Fields) -> None:
        fields.add(dsa_fields(cfg, self.rope_interleaved))

    def transformer_config(self, cfg, **overrides):
        if megatron_at_least(0, 19):
            # 0.19's AbsorbedMLASelfAttention asserts sequence_parallel at TP > 1 (absorbed_mla.py:166-168)
            tp = overrides.get("tensor_model_parallel_size") or parallel_fields()["tensor_model_parallel_size"]
            overrides = {"sequence_parallel": tp > 1, **overrides}
        return super().transformer_config(cfg, **overrides)

    def layer_spec(self, config, cfg, *, vp_stage=None, use_te=False):
        return dsa_layer_spec(config, cfg, vp_stage=vp_stage, use_te=use_te)

    def spec_backend(self, config, use_te: bool):
        """The backend of the MTP block (model_specs.common.block_specs): on megatron-core >= 0.19 without
        Transformer Engine the local DSA backend, whose norms allow sequence parallelism; else megatron-core's."""
        return _local_dsa_backend() if megatron_at_least(0, 19) and not use_te else None


SPEC = DSA()
