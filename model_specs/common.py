"""The model specs' base: `ModelSpec`, an architecture's HF config <-> Megatron TransformerConfig and layer spec,
with the defaults most architectures take; `Fields`, the field table from which a spec's TransformerConfig and
its structural checks both derive; `Decoder`, the Llama-style decoder (GQA, SwiGLU, RMSNorm, rope) with or without
MoE that most specs are, each saying only what differs; `TextOf`, a multimodal config's language model.

A spec is one object (`SPEC` in model_specs/<model_type>.py), registered with its architecture
(`arch.registry.Architecture`); its methods:
    dims(hf_config) -> ModelDims                      numbers the layout ops need
    fields(hf_config) -> Fields                       the field table (what transformer_config builds from)
    transformer_config(hf_config, **overrides)        the Megatron TransformerConfig mirroring the HF model
    structural_fields(hf_config) -> dict              the fields an exported model must match (plan.checks)
    is_moe_layer(hf_config, layer) -> bool            dense/MoE pattern
    gpt_kwargs(hf_config) -> dict                     GPTModel arguments (rope, tying)
    layer_spec(config, hf_config, vp_stage, use_te)   None: megatron-core's generic decoder block spec
    spec_backend(config, use_te)                      a BackendSpecProvider for the MTP block (None: megatron-core's)
    layout_problems(hf_config, expert_tp) -> list     what the architecture needs of a layout beyond sizes dividing
    index_share_stage_problems(hf_config, stages)     a pipeline split parting a layer from its DSA top-k source
    hybrid_layer_symbols(hf_config, layer) -> str     an HF layer in a hybrid pattern ('*-', '+E', 'DE', 'G-', ...)
    hybrid_mtp_symbols(hf_config) -> str              one MTP depth in a hybrid pattern
    native_vision_tower                               wraps the chunks with a native Megatron tower (None: none)
    non_te_modules                                    modules its layer spec builds without Transformer Engine
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from mcore2hf.arch.hf_config import get, partial_rotary_factor, rope_theta, text_config


def supported_kwargs(fn: Callable, **kwargs) -> dict:
    """The subset of kwargs `fn` accepts: megatron-core signatures change between releases."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def padded_vocab_size(vocab_size: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: a multiple of divisible_by * tp."""
    m = divisible_by * tp
    return (vocab_size + m - 1) // m * m


def parallel_fields() -> dict:
    """TransformerConfig's parallel sizes, from the initialized parallel state."""
    from megatron.core import parallel_state as ps

    return dict(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
    )


class Fields(dict):
    """A spec's field table for one HF config: TransformerConfig field -> value, each set as structural (a model
    built otherwise is not this architecture: `plan.checks` compares a Megatron model's config with them) or not
    (how it computes: routing, fusions, epsilons). A spec's TransformerConfig and its structural checks both derive
    from this one table, in the manner of Megatron-Bridge's `CONFIG_MAPPING` (0.3.1
    models/conversion/model_bridge.py:244, a list of (HF field, Megatron field) applied to every bridge)."""

    def __init__(self):
        super().__init__()
        self.checked: set[str] = set()
        self.deferred: list[Callable[[], dict]] = []

    def set(self, structural: bool = False, **values) -> Fields:
        """Set `values`, structural or not (a later set of a field decides)."""
        self.update(values)
        if structural:
            self.checked.update(values)
        else:
            self.checked.difference_update(values)
        return self

    def later(self, fields: Callable[[], dict]) -> Fields:
        """Fields that only building a model needs (routing, rope, kernels), computed when the TransformerConfig is
        built: where they cannot be (what Megatron cannot compute as transformers does), building refuses, while
        the structural check of a model built otherwise (e.g. by Megatron-Bridge) still runs."""
        self.deferred.append(fields)
        return self

    def add(self, other: Fields) -> Fields:
        """Every field of `other`, as structural as it is there."""
        for k, v in other.items():
            self.set(k in other.checked, **{k: v})
        self.deferred += other.deferred
        return self

    def resolved(self) -> dict:
        """Every field, the deferred ones computed (later ones win, as `set` does)."""
        out = dict(self)
        for fields in self.deferred:
            out.update(fields())
        return out

    def pop(self, key, *default):
        self.checked.discard(key)
        return super().pop(key, *default)

    def structural(self) -> dict:
        return {k: v for k, v in self.items() if k in self.checked}


def llama_like_fields(cfg) -> Fields:
    """TransformerConfig fields shared by Llama-style decoders (RMSNorm, SwiGLU, rope, GQA): the sizes structural."""
    return Fields().set(
        True,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=get(cfg, "num_key_value_heads", default=cfg.num_attention_heads),
        kv_channels=get(cfg, "head_dim", default=cfg.hidden_size // cfg.num_attention_heads),
        ffn_hidden_size=get(cfg, "intermediate_size"),
        add_qkv_bias=bool(getattr(cfg, "attention_bias", False)),
    ).set(
        normalization="RMSNorm",
        layernorm_epsilon=get(cfg, "rms_norm_eps", default=1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # fusions that need apex / TE / CUDA kernels: off, so the same config builds anywhere
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def moe_fields(cfg, num_experts: int, topk: int, moe_ffn: int, pattern: list[int]) -> Fields:
    """The MoE fields (the expert count and size structural; without experts, `num_moe_experts=None`)."""
    if not num_experts:
        return Fields().set(True, num_moe_experts=None)
    return Fields().set(True, num_moe_experts=num_experts, moe_ffn_hidden_size=moe_ffn).set(
        moe_router_topk=topk,
        # Megatron-LM's default --moe-layer-freq is the int 1; a model of MoE layers only built with it saves its
        # layers stacked under one key (transformer_block.py sharded_state_dict), one with a list per layer
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
    )


def make_config(fields: dict, overrides: dict, cls=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cls = cls or TransformerConfig
    merged = {**parallel_fields(), **fields, **overrides}
    merged.setdefault("pipeline_dtype", merged.get("params_dtype", torch.float32))
    if not merged.get("num_moe_experts"):  # a dense model has no expert grid (Megatron rejects EP > 1 for it)
        merged.update(expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    return cls(**supported_kwargs(cls.__init__, **merged))


def default_gpt_kwargs(cfg) -> dict:
    return dict(
        position_embedding_type="rope",
        rotary_percent=partial_rotary_factor(cfg),
        rotary_base=int(rope_theta(cfg)),
        share_embeddings_and_output_weights=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_sequence_length=int(get(cfg, "max_position_embeddings", default=4096)),
    )


def stage_ends(vp_stage: int | None) -> tuple[bool, bool]:
    """Whether this rank's chunk `vp_stage` holds the model's first (embedding) and last (head) layers."""
    from megatron.core import parallel_state as ps

    return tuple(fn(**supported_kwargs(fn, ignore_virtual=False, vp_stage=vp_stage))
                 for fn in (ps.is_pipeline_first_stage, ps.is_pipeline_last_stage))


def block_specs(spec: ModelSpec, hf_config, config, *, vp_stage: int | None = None, use_te: bool = False):
    """(decoder block spec, MTP block spec or None) of the chunk `vp_stage` of the model `config` describes: the
    spec's own `layer_spec` where it gives one, else megatron-core's generic decoder block spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    block = spec.layer_spec(config, hf_config, vp_stage=vp_stage, use_te=use_te)
    if block is None:
        block = get_gpt_decoder_block_spec(**supported_kwargs(
            get_gpt_decoder_block_spec, config=config, use_transformer_engine=use_te,
            normalization="RMSNorm", vp_stage=vp_stage))
    mtp = None
    backend = spec.spec_backend(config, use_te)
    if getattr(config, "mtp_num_layers", None) and backend is not None:  # the MTP layer's norms from that backend
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

        mtp = get_gpt_mtp_block_spec_for_backend(config=config, spec=block, backend=backend, vp_stage=vp_stage)
    elif getattr(config, "mtp_num_layers", None):
        mtp = get_gpt_mtp_block_spec(**supported_kwargs(
            get_gpt_mtp_block_spec, config=config, spec=block, use_transformer_engine=use_te, vp_stage=vp_stage))
    return block, mtp


def build_model(spec: ModelSpec, hf_config, *, vocab_size: int | None = None, use_te: bool = False,
                **overrides) -> list[torch.nn.Module]:
    """GPTModel chunks (one per virtual-PP stage of this rank) for `hf_config`.

    Needs an initialized Megatron parallel state. `vocab_size` is the padded vocab (default: HF vocab_size)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = spec.transformer_config(hf_config, **overrides)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for vp in range(vpp):
        vp_stage = vp if vpp > 1 else None
        pre, post = stage_ends(vp_stage)
        block, mtp = block_specs(spec, hf_config, config, vp_stage=vp_stage, use_te=use_te)
        kwargs = dict(spec.gpt_kwargs(hf_config))
        model = GPTModel(**supported_kwargs(
            GPTModel.__init__, config=config, transformer_layer_spec=block,
            vocab_size=vocab_size or text_config(hf_config).vocab_size, pre_process=pre, post_process=post,
            mtp_block_spec=mtp, vp_stage=vp_stage, **kwargs))
        chunks.append(model)
    return chunks


def base_dims(cfg, **extra):
    from mcore2hf.arch.mapping import ModelDims

    return ModelDims(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=get(cfg, "num_key_value_heads", default=cfg.num_attention_heads),
        head_dim=get(cfg, "head_dim", default=cfg.hidden_size // cfg.num_attention_heads),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        num_mtp_layers=int(getattr(cfg, "num_nextn_predict_layers", None) or 0),
        **extra,
    )


def sigmoid_router_fields(cfg, *, num_experts: int, topk: int) -> dict:
    """DeepSeek-style routing: sigmoid scores + expert bias for selection, group-limited top-k, normalized
    weights scaled by routed_scaling_factor. Raises where Megatron cannot compute what transformers computes."""
    from mcore2hf.errors import ConfigMismatchError

    if not getattr(cfg, "norm_topk_prob", True):
        raise ConfigMismatchError("sigmoid routing with norm_topk_prob=False has no Megatron equivalent "
                                  "(Megatron always renormalizes sigmoid top-k weights)")
    fields = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0))
    n_group = int(getattr(cfg, "n_group", 1) or 1)
    if n_group > 1:
        topk_group = int(cfg.topk_group)
        # HF scores a group by its top-2 experts; Megatron by its top (topk // group_topk)
        if topk // topk_group != 2:
            raise ConfigMismatchError(f"group-limited routing with num_experts_per_tok={topk}, topk_group={topk_group}: "
                                      "Megatron scores groups by their top topk//topk_group experts, HF by their top 2")
        fields.update(moe_router_num_groups=n_group, moe_router_group_topk=topk_group)
    return fields


def mtp_fields(cfg) -> dict:
    n = int(getattr(cfg, "num_nextn_predict_layers", None) or 0)
    return {"mtp_num_layers": n} if n else {}


class ModelSpec:
    """One architecture's HF config <-> Megatron TransformerConfig and layer spec, with the defaults most take
    (the module docstring lists the methods). `fields` is the one table: `transformer_config` builds from it (after
    `check` refused what Megatron cannot compute as transformers does) and `structural_fields` is its structural
    part, less `ffn_hidden_size` where every layer is MoE (a model of MoE layers only never uses it)."""

    #: the TransformerConfig class ("MLATransformerConfig" for multi-latent attention)
    config_class: str = "TransformerConfig"
    #: modules its layer spec builds without Transformer Engine under either spec (checkpoint_keys.KeyLayout)
    non_te_modules: tuple[str, ...] = ()
    #: `build_model(..., vision_tower="native")`: wraps the language-model chunks with a native Megatron tower
    native_vision_tower: Callable | None = None

    def dims(self, cfg):
        return base_dims(cfg)

    def is_moe_layer(self, cfg, layer: int) -> bool:
        return False

    def check(self, cfg) -> None:
        """Refuse (ConfigMismatchError) what a Megatron model cannot compute as transformers does."""

    def fields(self, cfg) -> Fields:
        raise NotImplementedError(f"{type(self).__name__}.fields")

    def transformer_config(self, cfg, **overrides):
        from megatron.core.transformer import transformer_config as tc

        self.check(cfg)
        return make_config(self.fields(cfg).resolved(), overrides, cls=getattr(tc, self.config_class))

    def structural_fields(self, cfg) -> dict:
        out = self.fields(cfg).structural()
        if all(self.is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)):
            out.pop("ffn_hidden_size", None)
        return out

    def gpt_kwargs(self, cfg) -> dict:
        return default_gpt_kwargs(cfg)

    def layer_spec(self, config, cfg, *, vp_stage=None, use_te=False):
        """The decoder block spec; None: megatron-core's generic one (`block_specs`)."""
        return None

    def spec_backend(self, config, use_te: bool):
        """A megatron-core BackendSpecProvider for the MTP block; None: megatron-core's local or TE one."""
        return None

    def layout_problems(self, cfg, expert_tp: int) -> list[str]:
        """What this architecture needs of a layout beyond the sizes dividing (checked before any process starts)."""
        return []

    def hybrid_layer_symbols(self, cfg, layer: int) -> str:
        """The hybrid-pattern symbols of HF layer `layer` (megatron-core 0.19.2 hybrid_layer_allocation.py
        `Symbols`): the mixer (gated DeltaNet 'G' on the layers `layer_types` marks linear, DSA 'D', MLA '+',
        attention '*') followed by an MLP ('-') or MoE ('E')."""
        dims = self.dims(cfg)
        types = getattr(text_config(cfg), "layer_types", None) or []
        if dims.linear_num_key_heads and types[layer] == "linear_attention":
            mixer = "G"
        elif dims.index_head_dim:
            mixer = "D"
        elif dims.kv_lora_rank:
            mixer = "+"
        else:
            mixer = "*"
        return mixer + ("E" if self.is_moe_layer(cfg, layer) else "-")

    def hybrid_mtp_symbols(self, cfg) -> str:
        """One MTP depth's hybrid pattern: the MTP layer is built like the last decoder layer (its HF tensors are
        that layer's kind: DeepSeek-V3's MLA + MoE, GLM-5's DSA with its own indexer)."""
        return self.hybrid_layer_symbols(cfg, text_config(cfg).num_hidden_layers - 1)

    def index_share_stage_problems(self, cfg, stages: list[list[int]]) -> list[str]:
        """How a pipeline split (`stages`: the HF layers of each stage or virtual chunk) parts a layer from the
        layer whose DSA top-k it reuses (GLM-5.2's IndexShare; none elsewhere)."""
        return []

    def build_model(self, cfg, **kwargs) -> list[torch.nn.Module]:
        """Megatron GPTModel chunks for this rank (see model_specs.common.build_model)."""
        return build_model(self, cfg, **kwargs)


class Decoder(ModelSpec):
    """A Llama-style decoder (GQA, SwiGLU, RMSNorm, rope), dense or with routed experts: what differs between the
    architectures are the hooks below (which layers are MoE, the expert count and size, the router, the attention
    options, shared experts, MTP)."""

    #: whether it has MTP layers (num_nextn_predict_layers)
    mtp = False

    def experts(self, cfg) -> int:
        """The routed experts per MoE layer (0: a dense model)."""
        return 0

    def moe_layer(self, cfg, layer: int) -> bool:
        """Whether `layer` is MoE, given the model has experts (default: every layer)."""
        return True

    def moe_ffn(self, cfg) -> int:
        return cfg.moe_intermediate_size

    def attention(self, cfg) -> dict:
        """Structural attention fields (qk_layernorm, add_qkv_bias)."""
        return {}

    def router(self, cfg) -> dict:
        """The routing fields; default: softmax over all experts, top-k, renormalized iff norm_topk_prob (Megatron:
        pre-softmax = no renormalization)."""
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not cfg.norm_topk_prob)

    def shared_experts(self, cfg) -> int | None:
        """The shared experts' FFN size (structural); None: the architecture has none."""
        return None

    def extra(self, cfg, fields: Fields) -> None:
        """The architecture's own fields, set on `fields` last."""

    def is_moe_layer(self, cfg, layer: int) -> bool:
        return self.experts(cfg) > 0 and self.moe_layer(cfg, layer)

    def dims(self, cfg):
        n = self.experts(cfg)
        return base_dims(cfg, num_experts=n) if n else base_dims(cfg)

    def fields(self, cfg) -> Fields:
        fields = llama_like_fields(cfg).set(True, **self.attention(cfg))
        n = self.experts(cfg)
        pattern = [int(self.is_moe_layer(cfg, i)) for i in range(cfg.num_hidden_layers)]
        fields.add(moe_fields(cfg, n, getattr(cfg, "num_experts_per_tok", 0), self.moe_ffn(cfg) if n else 0, pattern))
        if n:
            fields.later(lambda: self.router(cfg))
            shared = self.shared_experts(cfg)
            if shared is not None:
                fields.set(True, moe_shared_expert_intermediate_size=shared or None)
        if self.mtp:
            fields.set(**mtp_fields(cfg))
        self.extra(cfg, fields)
        return fields


class TextView:
    """A multimodal config's language model as a text model's spec reads it: the nested `text_config`
    (hf_config.text_config), with the outer config's `tie_word_embeddings` (the one transformers 5.24 ties by:
    modeling_utils.py `getattr(self.config, "tie_word_embeddings")` of the ForConditionalGeneration model, while
    e.g. Qwen3VLMoeTextConfig defaults its own to True) and `fields` (values the text spec needs under another
    name) laid over it."""

    def __init__(self, cfg, **fields):
        from mcore2hf.arch.hf_config import text_config

        self._text = text_config(cfg)
        if self._text is not cfg and getattr(cfg, "tie_word_embeddings", None) is not None:
            self.tie_word_embeddings = bool(cfg.tie_word_embeddings)
        self.__dict__.update(fields)

    def __getattr__(self, name: str):
        return getattr(self._text, name)




class TextOf(ModelSpec):
    """A multimodal config's language model: `text`'s spec on `view(cfg)` (TextView: the nested text_config with
    the outer config's tying and `fields` laid over it)."""

    def __init__(self, text: ModelSpec, **fields):
        self.text, self.view_fields = text, fields

    def text_spec(self, cfg) -> ModelSpec:
        return self.text

    def view(self, cfg):
        return TextView(cfg, **self.view_fields)

    @property
    def config_class(self) -> str:  # noqa: D102 - as the text spec's
        return self.text.config_class

    @property
    def non_te_modules(self) -> tuple[str, ...]:  # noqa: D102
        return self.text.non_te_modules

    def dims(self, cfg):
        return self.text_spec(cfg).dims(self.view(cfg))

    def is_moe_layer(self, cfg, layer: int) -> bool:
        return self.text_spec(cfg).is_moe_layer(self.view(cfg), layer)

    def check(self, cfg) -> None:
        self.text_spec(cfg).check(self.view(cfg))

    def fields(self, cfg) -> Fields:
        return self.text_spec(cfg).fields(self.view(cfg))

    def transformer_config(self, cfg, **overrides):
        return self.text_spec(cfg).transformer_config(self.view(cfg), **overrides)

    def structural_fields(self, cfg) -> dict:
        return self.text_spec(cfg).structural_fields(self.view(cfg))

    def gpt_kwargs(self, cfg) -> dict:
        return self.text_spec(cfg).gpt_kwargs(self.view(cfg))

    def layer_spec(self, config, cfg, *, vp_stage=None, use_te=False):
        return self.text_spec(cfg).layer_spec(config, self.view(cfg), vp_stage=vp_stage, use_te=use_te)

    def spec_backend(self, config, use_te: bool):
        return self.text.spec_backend(config, use_te)


class FullWidthRMSNorm(torch.nn.Module):
    """RMSNorm over all heads of a projection at once: HF MiniMax-M2's and OLMoE's `q_norm` / `k_norm`
    (RMSNorm(heads * head_dim) applied before the split into heads), which megatron-core has no module for.

    Megatron calls q/k norms on [s, b, heads on this rank, head_dim] (built with hidden_size=head_dim). The
    weight holds this rank's heads (TP-split by heads along dim 0, like a column-parallel bias), and the sum of
    squares is all-reduced over TP, so TP > 1 computes what TP 1 computes; the gradient is all-reduced too."""

    def __init__(self, hidden_size: int, config, eps: float = 1e-6, *, heads: int):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from mcore2hf.errors import ConfigMismatchError

        super().__init__()
        tp = config.tensor_model_parallel_size
        if heads % tp:
            raise ConfigMismatchError(f"a full-width q/k norm over {heads} heads needs TP dividing the head "
                                      f"count (Megatron replicates kv heads when TP > num_query_groups); got TP={tp}")
        self.head_dim, self.width, self.eps, self.tp = hidden_size, heads * hidden_size, eps, tp
        self.weight = torch.nn.Parameter(torch.ones(heads // tp * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        shape, dtype = x.shape, x.dtype
        x = x.float().flatten(-2)
        sq = x.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:  # forward all-reduce; backward all-reduce (every rank's heads depend on every rank's sum)
            sq = reduce_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(sq))
        x = x * torch.rsqrt(sq / self.width + self.eps)
        return (self.weight * x.to(dtype)).view(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Distributed checkpoints: the weight is TP-sharded along dim 0 (the default treats it as replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"weight": 0}, sharded_offsets)


#: the modules full_width_qk_norm replaces (names inside a layer)
FULL_WIDTH_QK_NORMS = ("self_attention.q_layernorm", "self_attention.k_layernorm")


def full_width_qk_norm(block, config):
    """A decoder block spec whose q/k norms are FullWidthRMSNorm over all query heads / all kv heads."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    block = copy.deepcopy(block)
    for spec in block.layer_specs:
        attn = spec.submodules.self_attention.submodules
        attn.q_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": config.num_attention_heads})
        attn.k_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": config.num_query_groups})
    return block


def full_width_layer_spec(config, cfg, *, vp_stage=None, use_te=False):
    """`layer_spec` of a model spec with full-width q/k norms (MiniMax-M2, OLMoE)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(**supported_kwargs(
        get_gpt_decoder_block_spec, config=config, use_transformer_engine=use_te, normalization="RMSNorm",
        vp_stage=vp_stage))
    return full_width_qk_norm(block, config)


class FullWidthQKNorms(Decoder):
    """An MoE decoder whose q/k norms are full width (MiniMax-M2, OLMoE): FullWidthRMSNorm under either spec,
    every layer MoE with experts of intermediate_size, no biases."""

    non_te_modules = FULL_WIDTH_QK_NORMS  # no TE `_extra_state` for them (checkpoint_keys.KeyLayout)

    def moe_ffn(self, cfg) -> int:
        return cfg.intermediate_size

    def attention(self, cfg) -> dict:
        return dict(qk_layernorm=True, add_qkv_bias=False)  # layer_spec makes the norms full width

    def layer_spec(self, config, cfg, *, vp_stage=None, use_te=False):
        return full_width_layer_spec(config, cfg, vp_stage=vp_stage, use_te=use_te)


class SequenceParallelNorm:
    """megatron-core's WrappedTorchNorm (torch LayerNorm / RMSNorm by `config.normalization`; the same parameter
    names) without its refusal of sequence parallelism (0.19.2 transformer/torch_norm.py:50). A norm sees only its
    rank's rows under sequence parallelism and normalizes each row alone, so the forward is unchanged; its weight
    (and bias) get `sequence_parallel = True`, as Megatron's fused norms set it (fusions/fused_layer_norm.py:119-120),
    so that finalize_model_grads all-reduces their gradients over TP (distributed/finalize_model_grads.py:452).
    For megatron-core >= 0.19's DSA models, whose absorbed MLA requires sequence parallelism at TP > 1."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds or config.layernorm_zero_centered_gamma:
            raise NotImplementedError(f"SequenceParallelNorm: normalization={config.normalization!r}, "
                                      f"zero-centred gamma {config.layernorm_zero_centered_gamma}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class DuplicatedLinear(torch.nn.Module):
    """A linear layer every tensor-parallel rank holds whole: what Transformer Engine's `TELinear(parallel_mode=
    "duplicated")` is, for the local spec (megatron-core 0.16.1's LocalSpecProvider has no `linear()`; the DSA
    indexer's linears need one, experimental_attention_variant_module_specs.py `get_dsa_module_spec_for_backend`).
    Same parameter name (`weight`), no TP attributes, returns (output, None) as Megatron's linears do."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False, parallel_mode=None,
                 **_):
        super().__init__()
        if bias or parallel_mode not in (None, "duplicated"):
            raise NotImplementedError(f"DuplicatedLinear: bias={bias}, parallel_mode={parallel_mode!r}")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if init_method is not None:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight), None


class SDPACoreAttention(torch.nn.Module):
    """Causal scaled-dot-product attention with separate q/k and v head dims ([s, b, h, d] in, [s, b, h*dv] out):
    the core attention of the local-spec MLA layer (megatron-core's `DotProductAttention` rejects MLA's `k_channels`
    / `v_channels` / `softmax_scale`); model_specs.deepseek_v3 puts it into the layer spec without Transformer
    Engine."""

    def __init__(self, config=None, layer_number=None, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, packed_seq_params=None, **_):
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped keys/values
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = None if attention_mask is None else ~attention_mask  # Megatron: True = masked out
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
