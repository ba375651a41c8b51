"""Declarative conversion tables: Megatron global names (patterns) -> HF names + a layout op.

A converter is one table of `Rule`s. Patterns name *canonical* Megatron parameters (see `naming`): local-spec
names with global indices, so one rule covers every PP/VPP/EP layout and both the local and the TE spec.

Placeholders in patterns: {L} decoder layer, {E} routed expert, {M} MTP layer, {V} vision-tower block, {D}
deepstack merger. In HF templates the same fields
are available; in MTP rules {L} is `num_hidden_layers + M`, the index HF checkpoints give MTP layers. In `copies`,
{MTP} expands to every MTP layer's HF index (e.g. the embedding copy DeepSeek-V3 / GLM-4.5 keep in layer N).
{NAME} is a dotted module path, the same on both sides: a vision tower that already carries HF names is one rule,
`vision_model.{NAME}` -> `model.visual.{NAME}` (`converters.common.hf_tower`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from ..errors import UnknownParametersError
from ..layouts.ops import LayoutOp, Replicated
from ..layouts.stacked import Stacked, StackedCols, StackedRows
from ..quantize.fp8 import FP8Policy

_PLACEHOLDER = regex.compile(r"\{([A-Z]+)\}")
#: the placeholder of a dotted name (string-valued); every other placeholder is an index
NAME = "NAME"
_NAME_PATTERN = r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*"


@dataclass(frozen=True)
class ModelDims:
    """The numbers layout ops need, read from the HF config by the architecture's model spec."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_mtp_layers: int = 0
    # multi-latent attention (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # gated DeltaNet layers (Qwen3-Next)
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    # DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5): head dim, and where the installed
    # megatron-core keeps its rotary rows ("first" as HF, "last", "last_interleaved": layouts.IndexerRope)
    index_head_dim: int | None = None
    indexer_rope: str | None = None
    # a native Megatron vision tower (Qwen3-VL's ViT): its attention heads and head dim (no GQA: groups == heads)
    vision_num_heads: int | None = None
    vision_head_dim: int | None = None
    #: its patch mergers' width: hidden_size x spatial_merge_size^2
    vision_merged_size: int | None = None


OpSpec = type[LayoutOp] | LayoutOp | Callable[[ModelDims], LayoutOp]


def compile_pattern(pattern: str) -> regex.Pattern:
    """A table pattern (`{layer}`-style placeholders for indices) as a regex with one named group each."""
    parts = _PLACEHOLDER.split(pattern)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(f"(?P<{part}>{_NAME_PATTERN})" if part == NAME else f"(?P<{part}>\\d+)")
        else:
            out.append(regex.escape(part))
    return regex.compile("".join(out))


def match_fields(m: regex.Match) -> dict[str, int | str]:
    """A matched pattern's placeholders: indices as ints, {NAME} as the dotted name it matched."""
    return {k: v if k == NAME else int(v) for k, v in m.groupdict().items()}


@dataclass
class Rule:
    """One Megatron tensor family -> its HF tensor(s).

    `hf` lists the op's outputs in order; `copies` are extra HF names that receive the same tensor as the
    first output on export (e.g. MTP layers' shared embedding) and are ignored on load."""

    megatron: str
    hf: str | Sequence[str]
    op: OpSpec = Replicated
    copies: Sequence[str] = ()
    #: HF keeps this tensor's dtype when an export casts (e.g. fp32 e_score_correction_bias in bf16 checkpoints)
    keep_dtype: bool = False
    #: a placeholder ("E") the HF names do not have: every Megatron tensor it numbers is one item of HF tensors
    #: stacked along a new dim 0 (gpt-oss's experts.gate_up_proj [E, ...]); the op becomes `Stacked`
    stack: str | None = None
    #: how the stacked items lie in each output: "items" (a new dim 0, `Stacked`), "rows" (along dim 0 of a 2-D
    #: output, `StackedRows`) or "cols" (interleaved by column, `StackedCols`): PEFT's 3-D expert LoRA factors
    stack_layout: str = "items"

    def __post_init__(self):
        self.hf = (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)
        self.copies = tuple(self.copies)
        self._regex = compile_pattern(self.megatron)

    def build_op(self, dims: ModelDims) -> LayoutOp:
        op = self.op
        if isinstance(op, LayoutOp):
            return op
        if isinstance(op, type) and issubclass(op, LayoutOp):
            return op.from_dims(dims)
        return op(dims)


@dataclass(frozen=True)
class Resolved:
    """A canonical Megatron name bound to its HF names and op."""

    megatron: str
    hf_names: tuple[str, ...]
    copies: tuple[str, ...]
    op: LayoutOp
    rule: Rule


@dataclass
class Converter:
    """The conversion table of one architecture (HF `model_type`)."""

    model_type: str
    rules: list[Rule]
    #: the architecture's model spec (HF config <-> TransformerConfig + layer spec: model_specs/<model_type>.py)
    spec: Any
    #: HF model_types that share this format (e.g. kimi_k2 -> deepseek_v3)
    aliases: tuple[str, ...] = ()
    #: HF name patterns (same placeholders) that loading may skip, beyond the rules' export-only copies
    ignore_on_load: tuple[str, ...] = ()
    #: which HF tensors stay unquantized in an FP8 export (None: FP8 export not supported for this architecture)
    fp8: FP8Policy | None = None
    #: regexes (full match) of HF tensors the published checkpoints hold and the Megatron model never holds by
    #: design (a text-only model's vision tower): loading skips and reports them; `save_pretrained(base=...)`
    #: copies them from the base checkpoint
    not_held: tuple[str, ...] = ()

    def __post_init__(self):
        templates = [t for rule in self.rules for t in rule.copies] + list(self.ignore_on_load)
        self._ignored = [compile_pattern(t) for t in templates]
        self._not_held = [regex.compile(p) for p in self.not_held]

    def maps(self, megatron_name: str) -> bool:
        """A rule of this table takes the canonical Megatron name (whatever the model's sizes)."""
        return any(rule._regex.fullmatch(megatron_name) for rule in self.rules)

    def ignored_on_load(self, hf_name: str, dims: ModelDims) -> bool:
        """HF tensors that have no Megatron counterpart to load into (copies the export writes, etc.)."""
        return any(p.fullmatch(hf_name) for p in self._ignored)

    def not_held_by_model(self, hf_name: str) -> bool:
        """An HF tensor of a part of the published model the Megatron model does not have (e.g. `model.visual.*`)."""
        return any(p.fullmatch(hf_name) for p in self._not_held)

    def not_held_except(self, produced) -> Callable[[str], bool]:
        """`not_held_by_model`, less every `not_held` pattern of which `produced` (HF names) holds a tensor: a model
        holding its vision tower is expected to produce all of it (Qwen3.5's MTP, a pattern of its own, stays not
        held)."""
        held = [p for p in self._not_held if any(p.fullmatch(n) for n in produced)]
        return lambda name: self.not_held_by_model(name) and not any(p.fullmatch(name) for p in held)

    def resolve(self, name: str, dims: ModelDims) -> Resolved | None:
        for rule in self.rules:
            m = rule._regex.fullmatch(name)
            if m is None:
                continue
            fields = match_fields(m)
            if "M" in fields:
                fields["L"] = dims.num_layers + fields["M"]
            hf = tuple(t.format(**fields) for t in rule.hf)
            copies = []
            for t in rule.copies:
                if "{MTP}" in t:
                    copies += [t.format(MTP=dims.num_layers + m, **fields) for m in range(dims.num_mtp_layers)]
                else:
                    copies.append(t.format(**fields))
            index = fields[rule.stack] if rule.stack else None
            return Resolved(name, hf, tuple(copies), _op_cache(rule, dims, index), rule)
        return None

    def resolve_all(self, names: Sequence[str], dims: ModelDims) -> dict[str, Resolved]:
        """Resolve every name; unknown names are reported all at once."""
        out, unknown = {}, []
        for name in names:
            r = self.resolve(name, dims)
            if r is None:
                unknown.append(name)
            else:
                out[name] = r
        if unknown:
            raise UnknownParametersError(self.model_type, unknown)
        return out


_OPS: dict[tuple[int, ModelDims, int | None], LayoutOp] = {}

#: how many items a stacking placeholder numbers
_STACK_COUNTS = {"E": lambda dims: dims.num_experts}


def _op_cache(rule: Rule, dims: ModelDims, index: int | None = None) -> LayoutOp:
    # one op object per rule and model (and stacked item): tens of thousands of expert tensors share a few ops
    key = (id(rule), dims, index)
    op = _OPS.get(key)
    if op is None:
        op = rule.build_op(dims)
        if index is not None:
            cls = {"items": Stacked, "rows": StackedRows, "cols": StackedCols}[rule.stack_layout]
            op = cls(op, index, _STACK_COUNTS[rule.stack](dims))
        _OPS[key] = op
    return op
