"""LoRA adapters trained with Megatron-Bridge's PEFT, exported through the ordinary plan and executor.

Megatron-Bridge (megatron-bridge 0.3.1, peft/lora.py:94-176 `LoRA.transform`) wraps each targeted Megatron linear as
`LoRALinear(to_wrap, ParallelLinearAdapter)` (peft/lora_layers.py:34, peft/adapter_wrapper.py:93-103): the frozen
base at `<module>.to_wrap.weight`, A at `<module>.adapter.linear_in.weight`, B at `<module>.adapter.linear_out.weight`,
output = base(x) + (alpha / r) * B A x (peft/utils.py:648). `naming` names the base `<module>.weight`; the factors
are ordinary tensor-parallel tensors. How they are split (peft/utils.py:481-528 `ParallelLinearAdapter.__init__`,
`input_is_parallel` from get_adapter_attributes_from_linear, utils.py:166-173):

* column-parallel base (linear_qkv, linear_fc1, MLA up projections): A = ColumnParallelLinear(in, r,
  gather_output=True): [r/TP, in], split on r; B = ColumnParallelLinear(r, out, gather_output=False): [out/TP, r],
  split on out exactly as the base's rows (for fc1 each shard is [gate_i; up_i]: utils.py:698-701 applies
  megatron-core's apply_swiglu_sharded_factory to linear_out; for linear_qkv each shard holds its query groups);
* row-parallel base (linear_proj, linear_fc2): A = RowParallelLinear(in, r, input_is_parallel=True): [r, in/TP],
  split on in; B = ColumnParallelLinear(r, out, gather_output=True): [out/TP, r], split on out (gathered in forward);
* experts (`is_expert_linear`, utils.py:187-205): the same over the expert-TP group, one adapter per local expert
  with the local spec's SequentialMLP.

So the adapter rules are derived from the base rules (`lora_converter`): A of a column-parallel base is `Column`
(written once per HF tensor of a fused base: PEFT's q/k/v or gate/up adapters each hold the same A), A of a
row-parallel base is `Row`; B takes the base's own layout op (row-parallel base: `Column`). HF/PEFT names:
`base_model.model.<HF module>.lora_A.weight` [r, in] / `lora_B.weight` [out, r] (peft 0.21.2
utils/save_and_load.py get_peft_model_state_dict: the adapter name is removed on save).

Canonical LoRA (peft/canonical_lora.py) gives linear_qkv / linear_fc1 one adapter per HF tensor
(`adapter.adapter_{q,k,v}`, `adapter.adapter_{gate,up}`), each column-parallel over the rank's own heads / ffn
columns: `Column` for its A and its B.

The merged export (`lora="merged"`) writes W + (alpha / r) B A: computed on each base shard (products in fp32, added
to W in fp32, rounded once to the base's dtype: `add_delta`), with the one factor that is split along the other axis
gathered over TP first (A of a column-parallel base, B of a row-parallel base: both split on dim 0), never modifying
the model's parameters. Each merged weight is described (`Merge`, its `Term`s) for the executor core, which merges a
bucket's weights batched (transfer/lora_merges.py `LoRAMerges`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigMismatchError, UsageError, option
from ..layouts.ops import QKV, Column, GatedColumn, LatentDown, Row
from ..layouts.stacked import Fused
from .mapping import Converter, ModelDims, Rule
from .naming import LocalTensor

#: what HFExporter(lora=...) accepts: the adapters alone in HF/PEFT form, the merged weights, the base weights alone
LORA_MODES = ("adapter", "merged", "base")
ADAPTER = ".adapter."
A_SUFFIX, B_SUFFIX = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
#: a PEFT adapter directory (peft 0.21.2 PeftModel.save_pretrained: utils/constants.py SAFETENSORS_WEIGHTS_NAME,
#: CONFIG_NAME)
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
#: PEFT's prefix of a LoraModel's state dict (peft 0.21.2 tuners/lora/model.py: PeftModel.base_model.model)
PEFT_PREFIX = "base_model.model."
#: the Bridge wrapper / adapter classes exported, with SPLIT_WRAPPERS (DoRA's DoRALinear / ParallelLinearDoRAAdapter,
#: the router's LoRATopKRouter, 0.6.2's shared-outer grouped-expert adapter are refused by name). megatron-bridge 0.6.2's
#: ParallelLinearAdapter (peft/utils.py:1006-1055) builds A and B as 0.3.1 does (utils.py:481-528): its wrappers'
#: names, shapes and split flags equal 0.3.1's on every rank (tests/test_lora.py test_lora_bridge_062, run on
#: megatron-core 0.19), and its own merge (LoRALinear.weight, lora_layers.py:35-58) equals the merged export
WRAPPER, ADAPTER_CLASS = "LoRALinear", "ParallelLinearAdapter"
#: megatron-bridge 0.6.2's adapters of a grouped expert linear (TEGroupedMLP's `mlp.experts.linear_fc{1,2}`, not
#: `local_experts.N`: chosen at lora.py:163-184 by is_grouped_expert_linear, utils.py:676-679). Exported, one adapter
#: per local expert (naming splits their factors per expert, `_GROUPED_ADAPTER`): GroupedExpertLinearAdapter
#: (`share_expert_adapters=False`; 3-D factors, one pair per local expert, utils.py:1767-1893) and the default
#: ParallelLinearAdapter shared by every local expert (`share_expert_adapters=True`, lora.py:114; utils.py:1267-1270).
#: GroupedExpertLinearAdapter's forward (utils.py:2175-2215 per expert; its grouped_mm path :2217-2313 the same
#: products) is per expert e: fc1 B_e gather_r(A_e x), fc2 gather_out(B_e A_e x), times alpha / dim: the per-expert
#: ParallelLinearAdapter's products (tests/harness/bridge_grouped.py, docs/lora.md)
GROUPED_ADAPTER = "GroupedExpertLinearAdapter"
#: refused: SharedOuterGroupedExpertAdapter (`experts_shared_outer_loras=True`, utils.py:2477-2645): its per-expert
#: side (PackedPerExpertLinear, :2414-2475) is not split over expert-TP while its base is, and fc2's shared B is a
#: RowParallelLinear(r, out) (:2583-2592), split on r, which no adapter rule takes; it is not built in the tests
SHARED_OUTER = "SharedOuterGroupedExpertAdapter"


def is_adapter(name: str) -> bool:
    """A LoRA factor (canonical or local name)."""
    return ADAPTER in name


#: Megatron-Bridge's canonical LoRA (megatron-bridge 0.3.1 peft/canonical_lora.py:306-327): the sub-adapters of a
#: fused base, in the order of the base rule's HF tensors
CANONICAL = {QKV: ("adapter_q", "adapter_k", "adapter_v"), GatedColumn: ("adapter_gate", "adapter_up")}
#: Bridge's wrappers exported: plain LoRA, and canonical LoRA's split linear_qkv / linear_fc1
#: (canonical_lora.py:66 LoRALinearSplitQKV, :144 LoRALinearSplitFC1UpGate; the adapter a ModuleDict of
#: ParallelLinearAdapter, absent parts None)
SPLIT_WRAPPERS = ("LoRALinearSplitQKV", "LoRALinearSplitFC1UpGate")


def _family(op) -> str | None:
    """'column' or 'row' for the base ops an adapter can sit on (None: no PEFT form)."""
    if isinstance(op, type) and op in (Column, QKV, GatedColumn):
        return "column"
    if op is Row:
        return "row"
    if getattr(op, "__self__", None) is LatentDown:  # LatentDown.q_down / kv_down: column-parallel in the local spec
        return "column"
    return None


def peft_name(hf_weight: str, factor: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight`, "A" -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.lora_{factor}.weight"


#: the expert adapters' forms: one adapter per expert (`experts.E.gate_proj.lora_A`: what SGLang and vLLM's 2-D MoE
#: LoRA take) or PEFT's stacked 3-D form on transformers 5's fused expert parameters (`target_parameters`)
EXPERT_FORMS = ("per_expert", "stacked")
#: transformers 5's fused expert parameters in PEFT's wrapping order (target_parameters): the first wrapped is the
#: inner `experts.base_layer` (gate_up_proj), the second `experts` (down_proj), as vllm 0.33.0
#: lora/model_manager.py:962 reads them (modeling_qwen3_moe.py:219-220 Qwen3MoeExperts)
STACKED_PARAMS = ("gate_up_proj", "down_proj")
_EXPERT = ".experts.{E}."


def _stacked_rules(rule: Rule, family: str, module: str) -> list[Rule]:
    """PEFT's 3-D form of a routed expert linear's adapter (`LoraConfig(target_parameters=[...gate_up_proj,
    ...down_proj])` on transformers 5's fused experts; vLLM 0.33 `is_3d_lora_weight`): per layer
    `<experts>.base_layer.lora_{A,B}` (gate_up_proj: A [E*r, hidden], B [2*inter, r*E], gate and up sharing
    Megatron's one A) and `<experts>.lora_{A,B}` (down_proj). A of expert e at rows e*r (`StackedRows`), B's
    columns interleaved (`StackedCols`); fc1's B is [gate; up] fused (`Fused(GatedColumn)`)."""
    hf_module = rule.hf[0].split(_EXPERT)[0] + ".experts"
    inner = ".base_layer" if family == "column" else ""

    def fused(dims, base=rule):  # fc1's B: the base op's outputs (gate, up) as one [gate; up]
        return Fused(base.build_op(dims))

    b_op = fused if family == "column" else Column
    return [Rule(module + A_SUFFIX, f"{PEFT_PREFIX}{hf_module}{inner}.lora_A.weight",
                 Column if family == "column" else Row, stack="E", stack_layout="rows"),
            Rule(module + B_SUFFIX, f"{PEFT_PREFIX}{hf_module}{inner}.lora_B.weight", b_op, stack="E",
                 stack_layout="cols")]


def lora_rules(rules: list[Rule], experts: str = "per_expert") -> list[Rule]:
    """The adapter rules of a base table: for every weight rule of a column- or row-parallel linear, one rule for
    A and one for B (see the module docstring); routed experts per expert or, `experts="stacked"`, in PEFT's 3-D
    form (`_stacked_rules`)."""
    out = []
    for rule in rules:
        family = _family(rule.op)
        if family is None or not rule.megatron.endswith(".weight") or rule.stack:
            continue
        module = rule.megatron.removesuffix(".weight")
        if experts == "stacked" and _EXPERT in rule.megatron and all(_EXPERT in h for h in rule.hf):
            out += _stacked_rules(rule, family, module)
            continue
        a = [peft_name(h, "A") for h in rule.hf]
        b = [peft_name(h, "B") for h in rule.hf]
        out.append(Rule(module + A_SUFFIX, a[0], Column if family == "column" else Row, copies=a[1:]))
        out.append(Rule(module + B_SUFFIX, b, rule.op if family == "column" else Column))
        # canonical LoRA: one adapter per HF tensor of a fused base, each an ordinary column-parallel pair
        # (A [r/TP, in], B [part_out/TP, r] over the rank's own heads / ffn columns)
        for part, a_name, b_name in zip(CANONICAL.get(rule.op, ()), a, b):
            out.append(Rule(f"{module}.adapter.{part}.linear_in.weight", a_name, Column))
            out.append(Rule(f"{module}.adapter.{part}.linear_out.weight", b_name, Column))
    return out


_CONVERTERS: dict[tuple[int, str], Converter] = {}


def lora_converter(converter: Converter, experts: str = "per_expert") -> Converter:
    """The derived adapter table of an architecture (cached), expert adapters in the form `experts` names."""
    if experts not in EXPERT_FORMS:
        raise UsageError(f"lora_experts must be one of {EXPERT_FORMS}, got {experts!r}")
    derived = _CONVERTERS.get((id(converter), experts))
    if derived is None:
        derived = _CONVERTERS[(id(converter), experts)] = Converter(
            model_type=converter.model_type, rules=lora_rules(converter.rules, experts), spec=converter.spec,
            aliases=converter.aliases)
    return derived


def expert_form(names) -> str:
    """The expert form of adapter tensors given by HF/PEFT name ("stacked" if any is PEFT's 3-D form)."""
    return "stacked" if any(".experts.base_layer.lora_" in n or ".experts.lora_" in n for n in names) else \
        "per_expert"


@dataclass(frozen=True)
class Adapter:
    """One LoRA-wrapped linear of this rank."""

    module: str  # canonical module name (`decoder.layers.3.self_attention.linear_qkv`)
    local: str  # its name in the model chunk (with `chunk{i}.` under virtual PP)
    r: int
    alpha: float
    row_parallel: bool  # Bridge's input_is_parallel: A split on in, B on out
    is_expert: bool
    part: str | None = None  # canonical LoRA's sub-adapter (`adapter_q`, ...); None: one adapter for the module
    head_dim: int = 0  # kv_channels (canonical linear_qkv: its q/k/v interleave per query group)

    @property
    def prefix(self) -> str:
        """Canonical name prefix of its two factors (`<prefix>.linear_in.weight`, `<prefix>.linear_out.weight`)."""
        return f"{self.module}.adapter" + (f".{self.part}" if self.part else "")

    @property
    def a(self) -> str:
        return f"{self.prefix}.linear_in.weight"

    @property
    def b(self) -> str:
        return f"{self.prefix}.linear_out.weight"


def find_adapters(chunks: list[torch.nn.Module], local: list[LocalTensor]) -> tuple[list[Adapter], list[str]]:
    """This rank's LoRA adapters (one per ParallelLinearAdapter: canonical LoRA has several per module) and the
    problems found (variants that are not LoRA)."""
    canonical = {t.local_name: t.name for t in local}
    adapters, problems = [], []
    for vp, chunk in enumerate(chunks):
        prefix = f"chunk{vp}." if len(chunks) > 1 else ""
        for name, m in chunk.named_modules():
            if not (hasattr(m, "to_wrap") and hasattr(m, "adapter")):
                continue
            wrapper = type(m).__name__
            if wrapper in SPLIT_WRAPPERS:
                units = [(part, sub) for part, sub in m.adapter._modules.items() if sub is not None]
            else:
                units = [(None, m.adapter)]
            kinds = f"{wrapper} with {', '.join(sorted({type(sub).__name__ for _, sub in units})) or 'no adapter'}"
            first = f"{prefix}{name}.adapter" + (f".{units[0][0]}" if units and units[0][0] else "") + ".linear_in.weight"
            module = canonical.get(first, f"{prefix}{name}").split(ADAPTER)[0]
            if any(type(sub).__name__ == SHARED_OUTER for _, sub in units):
                problems.append(f"{module}: {kinds}; Megatron-Bridge's shared-outer grouped-expert adapter "
                                "(experts_shared_outer_loras) is not exported: its per-expert side is not split "
                                "over expert-TP and fc2's shared B is split on r (docs/lora.md)")
                continue
            # a grouped expert linear: its factors named per local expert (naming `_GROUPED_ADAPTER`)
            item = f"{prefix}{name}.adapter.linear_in.weight"
            experts = list(itertools.takewhile(lambda i, item=item: f"{item}{i}" in canonical, itertools.count()))
            if experts and wrapper == WRAPPER and type(m.adapter).__name__ in (GROUPED_ADAPTER, ADAPTER_CLASS):
                sub = m.adapter
                if not isinstance(getattr(sub, "activation", None), torch.nn.Identity):
                    problems.append(f"{module}: adapter activation {type(sub.activation).__name__}; LoRA has none")
                    continue
                for i in experts:
                    expert = canonical[f"{item}{i}"].split(ADAPTER)[0]
                    adapters.append(Adapter(expert, f"{prefix}{name}", int(sub.dim), float(sub.alpha),
                                            bool(sub.input_is_parallel), True))
                continue
            if (wrapper not in (WRAPPER, *SPLIT_WRAPPERS) or not units
                    or any(type(sub).__name__ != ADAPTER_CLASS for _, sub in units)
                    or any(f"{prefix}{name}.adapter{'.' + p if p else ''}.linear_in.weight" not in canonical
                           for p, _ in units)):
                problems.append(f"{module}: {kinds}; only LoRA ({WRAPPER}, or canonical LoRA's {'/'.join(SPLIT_WRAPPERS)}, "
                                f"with {ADAPTER_CLASS}, or {GROUPED_ADAPTER} on grouped experts: "
                                "adapter[.adapter_x].linear_in / linear_out) is exported, not DoRA or other variants")
                continue
            head_dim = int(getattr(getattr(m.to_wrap, "config", None), "kv_channels", 0) or 0)
            for part, sub in units:
                if not isinstance(getattr(sub, "activation", None), torch.nn.Identity):
                    problems.append(f"{module}: adapter activation {type(sub.activation).__name__}; LoRA has none "
                                    "(an adapter with an activation has no LoRA/PEFT form)")
                    continue
                adapters.append(Adapter(module, f"{prefix}{name}", int(sub.dim), float(sub.alpha),
                                        bool(sub.input_is_parallel), bool(sub.is_expert), part, head_dim))
    return adapters, problems


@dataclass(frozen=True)
class LoraInfo:
    """Every rank's adapters, agreed on: one rank r and one alpha (PEFT's r / lora_alpha)."""

    r: int
    alpha: float
    modules: tuple[str, ...]  # canonical adapter prefixes (`<module>.adapter[.adapter_q]`), all ranks

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def gather_adapters(chunks: list[torch.nn.Module], local: list[LocalTensor], converter: Converter,
                    dims: ModelDims, world_size: int) -> tuple[LoraInfo, list[Adapter]]:
    """Collective: every rank's adapters, checked together (every problem of every rank listed at once)."""
    mine, problems = find_adapters(chunks, local)
    derived = lora_converter(converter)
    for a in mine:
        if derived.resolve(a.a, dims) is None:
            base = converter.resolve(a.module + ".weight", dims)
            how = f"-> {list(base.hf_names)} with {type(base.op).__name__}" if base else "(no rule)"
            problems.append(f"{a.module}: a LoRA adapter on a module whose base weight {how} has no HF/PEFT "
                            "adapter form (adapters go on column- or row-parallel linears)")
    everyone = [(mine, problems)]
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (mine, problems))
    adapters = {a.prefix: a for ranks, _ in everyone for a in ranks}
    problems = sorted({p for _, ps in everyone for p in ps})
    pairs = sorted({(a.r, a.alpha) for a in adapters.values()})
    if len(pairs) > 1:
        by = {pair: [m for m, a in sorted(adapters.items()) if (a.r, a.alpha) == pair] for pair in pairs}
        problems.append("LoRA adapters disagree on rank / alpha (PEFT's adapter_config.json has one r and one "
                        "lora_alpha): " + "; ".join(f"r={r} alpha={al:g}: {ms[:3]}{'...' if len(ms) > 3 else ''}"
                                                   for (r, al), ms in by.items()))
    if problems:
        raise ConfigMismatchError("cannot export the LoRA adapters:\n  " + "\n  ".join(problems))
    r, alpha = pairs[0]
    return LoraInfo(r, alpha, tuple(sorted(adapters))), mine


#: the leaf names peft 0.21.2 renames in `target_modules` of an MoE model whose experts transformers 5 fuses
#: (utils/transformers_weight_conversion.py:332-345 `_MOE_TARGET_MODULE_MAPPING`, matched at :448 as the name or
#: a '.'-suffix, moved to `target_parameters` at :457-482, gate/up at twice r): a dense MLP's or a shared expert's
#: gate_proj in target_modules would become the fused experts' gate_up_proj
PEFT_V4_RENAMED = ("gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def peft_config(info: LoraInfo, hf_names: list[str], num_layers: int, base_model: str | None) -> dict:
    """adapter_config.json (peft 0.21.2 LoraConfig fields). `target_modules`: HF module names as PEFT matches them
    (a name matches itself or any module ending in '.' + it): the leaf names when every layer has them, else the
    full module names, so PEFT adds no adapter the export does not hold. With PEFT's stacked expert form, the other
    adapters whose leaf peft's v4 conversion renames (`PEFT_V4_RENAMED`: deepseek_v3's dense MLP and shared
    experts) go to `target_parameters` by full parameter name (`model.layers.0.mlp.gate_proj.weight`): peft's
    ParamWrapper on a 2-D weight is LoRA with lora_A [r, in], lora_B [out, r] under the same keys
    (tuners/lora/layer.py:2399-2400), and the conversion leaves target_parameters as they are."""
    modules = sorted({n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for n in hf_names})
    # PEFT's 3-D expert form: `<experts>.base_layer` / `<experts>` wrap the fused parameters (target_parameters)
    params = sorted({(m.removesuffix(".base_layer") + "." + STACKED_PARAMS[0 if m.endswith(".base_layer") else 1])
                     for m in modules if m.endswith((".experts.base_layer", ".experts"))})
    modules = [m for m in modules if not m.endswith((".experts.base_layer", ".experts"))]
    renamed = [m + ".weight" for m in modules if params and m.rsplit(".", 1)[-1] in PEFT_V4_RENAMED]
    modules = [m for m in modules if not (params and m.rsplit(".", 1)[-1] in PEFT_V4_RENAMED)]
    leaves: dict[str, set[str]] = {}
    for m in modules:
        parts = m.split(".")
        key = ".".join(parts[3:]) if parts[:2] == ["model", "layers"] else m
        leaves.setdefault(key, set()).add(m)
    full = all(len(v) == num_layers for v in leaves.values())
    targets = sorted({k.rsplit(".", 1)[-1] for k in leaves}) if full else modules
    if full and len(targets) != len(leaves):  # the same leaf at two places with different coverage: be exact
        targets = modules
    extra = {}
    if params:  # PEFT wraps them in this order (gate_up_proj first: the inner base_layer)
        layers = {p.split(".")[2] for p in params if p.startswith("model.layers.")}
        short = {".".join(p.split(".")[3:]) for p in params}
        whole = len(layers) == num_layers and all(sum(p.endswith("." + s) for p in params) == num_layers for s in short)
        chosen = short if whole else set(params)
        extra["target_parameters"] = sorted(chosen, key=lambda p: (STACKED_PARAMS.index(p.rsplit(".", 1)[1]), p)) + \
            renamed
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, **extra,
        # an integral alpha as an int: peft's LoraConfig and vLLM 0.33's PEFTHelper (lora/peft_helper.py:29) type it int
        "r": info.r, "lora_alpha": int(info.alpha) if float(info.alpha).is_integer() else info.alpha,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "inference_mode": True, "init_lora_weights": True,
    }


@dataclass(frozen=True, eq=False)
class Term:
    """One adapter's B A added to rows of a base shard [out, in]: rows `offset + g * stride + [0, rows)` for each of
    `groups` groups take rows `g * rows + [0, rows)` of B A. One adapter: the whole shard (1 group); canonical
    LoRA's q / k / v: the shard's query groups (`_interleave_qkv`); its gate / up: the two halves."""

    a: torch.Tensor  # [r, in]: the factor read at each export (a Parameter, or the gathered buffer `Merger.full`)
    b: torch.Tensor  # [groups * rows, r]
    groups: int
    rows: int
    stride: int  # rows from one group to the next (groups * stride == out)
    offset: int  # the first group's first row
    #: a factor that is an item of a larger parameter (a grouped expert's slice of Bridge's 3-D factors): read
    #: through its getter at each export, since training may swap that parameter's .data
    a_item: LocalTensor | None = None
    b_item: LocalTensor | None = None

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) as they are now."""
        return (self.a if self.a_item is None else self.a_item.get(),
                self.b if self.b_item is None else self.b_item.get())


@dataclass(frozen=True, eq=False)
class Merge:
    """How a merged base shard is computed: `base` (the frozen weight, unmerged) + `scale` * its terms. Read by the
    executor core, which merges a bucket's weights batched into its merge arena (`transfer.executor`)."""

    base: LocalTensor
    scale: float
    terms: tuple[Term, ...]

    def compute_dtype(self) -> torch.dtype:
        """The dtype of the factors' stacks and of the products: fp32 (the weight's dtype only at the end)."""
        return torch.float32

    def signature(self) -> tuple:
        """Merges with equal signatures run as one batched product per term."""
        return (self.base.shape, self.base.dtype, self.compute_dtype(), self.scale,
                tuple((tuple(t.a.shape), tuple(t.b.shape), t.groups, t.rows, t.stride, t.offset) for t in self.terms))


def term_rows(w: torch.Tensor, t: Term) -> torch.Tensor:
    """The rows of weights `w` [n, out, in] (back to back: strides [out * in, in, 1]) that term `t` adds to, as
    [n * groups, rows, in]."""
    n, _, cols = w.shape
    return w.as_strided((n * t.groups, t.rows, cols), (t.stride * cols, cols, 1), w.storage_offset() + t.offset * cols)


#: elements of the fp32 products one batched product writes at most (256 MiB) when the weights are bf16 / fp16
DELTA_CHUNK = 1 << 26


def add_delta(dst: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scale: float) -> None:
    """dst += scale * b @ a, batched (dst [N, rows, in], b [N, rows, r], a [N, r, in], b and a fp32): the products
    accumulated in fp32, added to the weight in fp32, rounded once into dst's dtype. An fp32 weight: one baddbmm
    in place. A bf16 / fp16 weight: fp32 products (bmm, in chunks of at most DELTA_CHUNK elements), then one add
    (computed in fp32, written in the weight's dtype). Either is bit-identical on CPU to the per-weight
    (W.float() + scale * (B.float() @ A.float())).to(W.dtype) (measured, docs/lora.md). A bf16 baddbmm into the
    weight itself is not used: on an H200 (cuBLAS, torch 2.11) it differed from that by 1 ulp in 16% of the
    elements."""
    if dst.dtype == b.dtype:
        dst.baddbmm_(b, a, alpha=scale)
        return
    per = max(1, DELTA_CHUNK // max(1, dst.shape[1] * dst.shape[2]))
    for i in range(0, dst.shape[0], per):
        dst[i:i + per].add_(torch.bmm(b[i:i + per], a[i:i + per]), alpha=scale)


def merge_weights(w: torch.Tensor, terms: list[tuple[Term, torch.Tensor, torch.Tensor]], scale: float) -> None:
    """Merge in place: weights `w` [n, out, in] (back to back) += scale * each term's B A, the terms' factors given
    stacked over the n weights ((term, b [n * groups, rows, r], a [n * groups, r, in]))."""
    for t, b, a in terms:
        add_delta(term_rows(w, t), b, a, scale)


def merged_tensor(m: Merge) -> torch.Tensor:
    """One merged shard, computed on its own (`merge_weights` on one weight): what the core batches."""
    w = m.base.get()
    out = w.detach().clone().unsqueeze(0)
    dt = m.compute_dtype()
    stacks = []
    for t in m.terms:
        a, b = t.factors()
        stacks.append((t, b.detach().to(dt).reshape(t.groups, t.rows, -1), a.detach().to(dt).expand(t.groups, *a.shape)))
    merge_weights(out, stacks, m.scale)
    return out[0]


def merged_whole(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A of one whole weight (the offline export), with `add_delta`'s arithmetic."""
    out = w.clone().unsqueeze(0)
    add_delta(out, b.float().unsqueeze(0), a.float().unsqueeze(0), scale)
    return out[0]


class Merger:
    """The merged base weights: W + (alpha / r) B A on each shard, described per weight (`Merge`) for the executor
    core, which computes a bucket's merges batched; the split-on-dim-0 factors are gathered (one all-gather per
    TP / expert-TP group) into buffers kept between exports, before each export. Canonical LoRA's parts of a fused
    base combine as Bridge's forward does (canonical_lora.py:88-128 `_interleave_qkv` per query group; :158-160
    [gate; up]): each part is a `Term` on its rows."""

    def __init__(self, adapters: list[Adapter], local: dict[str, LocalTensor], info: LoraInfo, tp, etp):
        self.adapters, self.local, self.scale = adapters, local, info.scale
        self.groups = (tp, etp)
        self.by_module: dict[str, list[Adapter]] = {}
        for a in adapters:
            self.by_module.setdefault(a.module, []).append(a)
        problems = []
        for module, units in self.by_module.items():
            parts = [a.part for a in units]
            if parts == [None]:
                continue
            order = next((o for o in CANONICAL.values() if set(o) == set(parts)), None)
            if order is None:
                problems.append(f"{module}: canonical LoRA on {parts}; the merge needs every part of the fused "
                                f"weight ({' / '.join(' '.join(p) for p in CANONICAL.values())})")
                continue
            units.sort(key=lambda a: order.index(a.part))  # Bridge's ModuleDict holds up before gate
        if problems:
            raise ConfigMismatchError("cannot merge the LoRA adapters:\n  " + "\n  ".join(problems))
        # the gathered factors: one buffer per adapter, kept (the executors' merges read fixed views of them)
        self.full: dict[str, torch.Tensor] = {}
        for a in adapters:
            axis = self.groups[1 if a.is_expert else 0]
            f = self._factor(a.b if a.row_parallel else a.a)
            self.full[a.prefix] = f if axis.size == 1 else \
                torch.zeros((axis.size * f.shape[0], *f.shape[1:]), dtype=f.dtype, device=f.device)

    def _factor(self, name: str) -> torch.Tensor:
        """A local factor as merges read it: the Parameter itself (its views follow in-place updates; a swapped
        .data is seen by the core's staleness check)."""
        lt = self.local[name]
        return lt.param if lt.param is not None else lt.get()

    def refresh(self) -> None:
        """Collective over TP and expert-TP: the split-on-dim-0 factor of every adapter, gathered into its buffer."""
        for expert, axis in ((False, self.groups[0]), (True, self.groups[1])):
            mine = [a for a in self.adapters if a.is_expert == expert]
            if axis.size == 1 or not mine:
                continue
            factors = [self._factor(a.b if a.row_parallel else a.a).detach() for a in mine]
            flat = torch.cat([f.reshape(-1) for f in factors])
            parts = [torch.empty_like(flat) for _ in range(axis.size)]
            dist.all_gather(parts, flat, group=axis.group)
            offset = 0
            for a, f in zip(mine, factors):
                n = f.numel()
                torch.cat([p[offset:offset + n].view(f.shape) for p in parts], out=self.full[a.prefix])
                offset += n

    def merge(self, units: list[Adapter], base: LocalTensor) -> Merge:
        """The merge of one base shard: a term per adapter, on its rows."""
        terms, row = [], 0
        for a in units:
            full = self.full[a.prefix]
            fa, fb = (self._factor(a.a), full) if a.row_parallel else (full, self._factor(a.b))
            # an item factor read where it lies: the one not gathered, and at TP 1 the other too (`full` is it)
            alone = self.groups[1 if a.is_expert else 0].size == 1
            item = {k: self.local[n] for k, n, where in (("a_item", a.a, a.row_parallel or alone),
                                                         ("b_item", a.b, not a.row_parallel or alone))
                    if where and self.local[n].param is None}
            out = fb.shape[0]
            if a.part in ("adapter_q", "adapter_k", "adapter_v"):  # this shard's query groups, [q_g; k_g; v_g] each
                d = a.head_dim
                q, k = (self._factor(u.b).shape[0] for u in units[:2])
                groups = k // d
                per = (q + 2 * k) // groups
                first = {"adapter_q": 0, "adapter_k": q // groups, "adapter_v": q // groups + d}[a.part]
                terms.append(Term(fa, fb, groups, out // groups, per, first, **item))
            else:  # one adapter (the whole shard), or canonical [gate_i; up_i]
                terms.append(Term(fa, fb, 1, out, base.shape[0], row, **item))
                row += out
        return Merge(base, self.scale, tuple(terms))

    def merged_local(self) -> dict[str, LocalTensor]:
        """The local table with each adapted base weight read merged (`merge`: batched by the executor core; its
        getter computes it alone). The parameters are not touched."""
        out = dict(self.local)
        for module, units in self.by_module.items():
            base = self.local[module + ".weight"]
            m = self.merge(units, base)
            out[base.name] = dataclasses.replace(base, get=lambda m=m: merged_tensor(m), param=None, merge=m)
        return out


def adapter_shapes(hf: dict[str, tuple[int, ...]], base: dict[str, tuple[int, ...]]) -> tuple[int | None, list[str]]:
    """The rank r of adapters given by HF/PEFT name and shape, checked against the base weights' HF shapes `base`
    (lora_A [r, in], lora_B [out, r] of a base [out, in]); the problems found."""
    problems, ranks = [], set()
    for name, shape in sorted(hf.items()):
        module = name.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
        want = base.get(module + ".weight")
        if want is None or len(want) != 2 or len(shape) != 2:
            problems.append(f"{name} {list(shape)}: no 2-D HF weight {module}.weight to adapt")
            continue
        r = shape[0] if ".lora_A." in name else shape[1]
        expected = (r, want[1]) if ".lora_A." in name else (want[0], r)
        ranks.add(r)
        if tuple(shape) != expected:
            problems.append(f"{name}: shape {list(shape)}, expected {list(expected)} for {module}.weight {list(want)}")
    if len(ranks) > 1:
        problems.append(f"LoRA adapters disagree on rank: {sorted(ranks)} (PEFT's adapter_config.json has one r)")
    return (ranks.pop() if len(ranks) == 1 else None), problems


def check_mode(mode: str | None, has_adapters: bool, example: str | None) -> None:
    if mode is not None and mode not in LORA_MODES:
        raise UsageError(f"lora must be one of {LORA_MODES} or None, got {mode!r}")
    if has_adapters and mode is None:
        raise UsageError(f"the model holds LoRA adapters (e.g. {example}): pass {option('lora', 'adapter')} (the "
                         f"adapters alone, HF/PEFT form), {option('lora', 'merged')} (W + alpha/r B A) or "
                         f"{option('lora', 'base')} (the frozen base weights)")
    if mode is not None and not has_adapters:
        raise UsageError(f"{option('lora', mode)}, but the model holds no LoRA adapter (Megatron-Bridge's "
                         "<module>.adapter.linear_in / linear_out)")
