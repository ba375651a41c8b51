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

The merged export (`lora="merged"`) writes W + (alpha / r) B A: computed on each base shard in fp32 and cast to the
base's dtype, with the one factor that is split along the other axis gathered over TP first (A of a
column-parallel base, B of a row-parallel base: both split on dim 0), never modifying the model's parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ConfigMismatchError, UsageError
from .layouts import QKV, Column, GatedColumn, LatentDown, Row
from .layouts_stacked import Fused
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
#: the router's LoRATopKRouter, 0.6.2's grouped-expert adapters are refused by name). megatron-bridge 0.6.2's
#: ParallelLinearAdapter (peft/utils.py:1006-1055) builds A and B as 0.3.1 does (utils.py:481-528): its wrappers'
#: names, shapes and split flags equal 0.3.1's on every rank (tests/test_lora.py test_lora_bridge_062, run on
#: megatron-core 0.19), and its own merge (LoRALinear.weight, lora_layers.py:35-58) equals the merged export
WRAPPER, ADAPTER_CLASS = "LoRALinear", "ParallelLinearAdapter"
#: megatron-bridge 0.6.2's grouped-expert adapters (3-D factors [experts, r, in] / [experts, out, r]: peft/utils.py
#: 1767-1894, 2477-2600), chosen by lora.py:163-184 only for grouped expert linears (`mlp.experts.linear_fc1`, not
#: `local_experts.N`). Their bases are Transformer Engine's TEColumnParallelGroupedLinear / TERowParallelGroupedLinear
#: (get_adapter_attributes_from_linear, utils.py:591-643: any other base raises at :643); megatron-core 0.19.2's local spec
#: builds SequentialMLP for every MoE (models/backends.py:133-142), so without TE they cannot be built or verified
GROUPED_ADAPTERS = ("GroupedExpertLinearAdapter", "SharedOuterGroupedExpertAdapter")


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
            grouped = sorted({type(sub).__name__ for _, sub in units} & set(GROUPED_ADAPTERS))
            if grouped:
                problems.append(f"{module}: {kinds}; Megatron-Bridge's grouped-expert adapters ({', '.join(grouped)}: "
                                "3-D factors on Transformer Engine's grouped expert linears) are not exported: only "
                                "one adapter per expert of the local spec's SequentialMLP is (docs/lora.md)")
                continue
            if (wrapper not in (WRAPPER, *SPLIT_WRAPPERS) or not units
                    or any(type(sub).__name__ != ADAPTER_CLASS for _, sub in units)
                    or any(f"{prefix}{name}.adapter{'.' + p if p else ''}.linear_in.weight" not in canonical
                           for p, _ in units)):
                problems.append(f"{module}: {kinds}; only LoRA ({WRAPPER}, or canonical LoRA's {'/'.join(SPLIT_WRAPPERS)}, "
                                f"with {ADAPTER_CLASS}: adapter[.adapter_x].linear_in / linear_out) is exported, not "
                                "DoRA or other variants")
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


def peft_config(info: LoraInfo, hf_names: list[str], num_layers: int, base_model: str | None) -> dict:
    """adapter_config.json (peft 0.21.2 LoraConfig fields). `target_modules`: HF module names as PEFT matches them
    (a name matches itself or any module ending in '.' + it): the leaf names when every layer has them, else the
    full module names, so PEFT adds no adapter the export does not hold."""
    modules = sorted({n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for n in hf_names})
    # PEFT's 3-D expert form: `<experts>.base_layer` / `<experts>` wrap the fused parameters (target_parameters)
    params = sorted({(m.removesuffix(".base_layer") + "." + STACKED_PARAMS[0 if m.endswith(".base_layer") else 1])
                     for m in modules if m.endswith((".experts.base_layer", ".experts"))})
    modules = [m for m in modules if not m.endswith((".experts.base_layer", ".experts"))]
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
        extra["target_parameters"] = sorted(chosen, key=lambda p: (STACKED_PARAMS.index(p.rsplit(".", 1)[1]), p))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, **extra,
        # an integral alpha as an int: peft's LoraConfig and vLLM 0.33's PEFTHelper (lora/peft_helper.py:29) type it int
        "r": info.r, "lora_alpha": int(info.alpha) if float(info.alpha).is_integer() else info.alpha,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "inference_mode": True, "init_lora_weights": True,
    }


class Merger:
    """The merged base weights' getters: W + (alpha / r) B A on each shard, from factors refreshed (one all-gather
    per TP / expert-TP group) before each export. Canonical LoRA's parts of a fused base combine as Bridge's forward
    does (canonical_lora.py:88-128 `_interleave_qkv` per query group; :158-160 [gate; up])."""

    def __init__(self, adapters: list[Adapter], local: dict[str, LocalTensor], info: LoraInfo, tp, etp):
        self.adapters, self.local, self.scale = adapters, local, info.scale
        self.groups = (tp, etp)
        self.full: dict[str, torch.Tensor] = {}  # adapter prefix -> its gathered factor (A or B)
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

    def refresh(self) -> None:
        """Collective over TP and expert-TP: the split-on-dim-0 factor of every adapter, gathered."""
        for expert, axis in ((False, self.groups[0]), (True, self.groups[1])):
            mine = [a for a in self.adapters if a.is_expert == expert]
            factors = [self.local[a.b if a.row_parallel else a.a].get() for a in mine]
            if axis.size == 1 or not factors:
                self.full.update({a.prefix: f for a, f in zip(mine, factors)})
                continue
            flat = torch.cat([f.reshape(-1) for f in factors])
            parts = [torch.empty_like(flat) for _ in range(axis.size)]
            dist.all_gather(parts, flat, group=axis.group)
            offset = 0
            for a, f in zip(mine, factors):
                n = f.numel()
                self.full[a.prefix] = torch.cat([p[offset:offset + n].view(f.shape) for p in parts])
                offset += n

    def _delta(self, a: Adapter) -> torch.Tensor:
        """B A of one adapter on this rank's shard (fp32)."""
        full = self.full[a.prefix]
        a_, b_ = (self.local[a.a].get(), full) if a.row_parallel else (full, self.local[a.b].get())
        return b_.float() @ a_.float()

    def getter(self, units: list[Adapter], base: LocalTensor) -> Callable[[], torch.Tensor]:
        def merged() -> torch.Tensor:
            w = base.get()
            deltas = [self._delta(a) for a in units]
            if len(deltas) == 3:  # canonical q, k, v: this shard's query groups, [q_g; k_g; v_g] each
                q, k, v = deltas
                d = units[0].head_dim
                groups = k.shape[0] // d
                delta = torch.cat([q.reshape(groups, -1, q.shape[1]), k.reshape(groups, d, -1),
                                   v.reshape(groups, d, -1)], dim=1).reshape(w.shape)
            else:  # one adapter, or canonical [gate_i; up_i]
                delta = torch.cat(deltas)
            return (w.float() + self.scale * delta).to(w.dtype)

        return merged

    def merged_local(self) -> dict[str, LocalTensor]:
        """The local table with each adapted base weight read merged (the parameters are not touched)."""
        out = dict(self.local)
        for module, units in self.by_module.items():
            base = self.local[module + ".weight"]
            out[base.name] = dataclasses.replace(base, get=self.getter(units, base), param=None)  # read by its getter
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
        raise UsageError(f"the model holds LoRA adapters (e.g. {example}): pass lora='adapter' (the adapters alone, "
                         "HF/PEFT form), lora='merged' (W + alpha/r B A) or lora='base' (the frozen base weights)")
    if mode is not None and not has_adapters:
        raise UsageError(f"lora={mode!r}, but the model holds no LoRA adapter (Megatron-Bridge's "
                         "<module>.adapter.linear_in / linear_out)")
