"""megatron-core's own Transformer Engine layer specs, as the oracle for te_naming's names.

Transformer Engine (TE) is not installable on the CPU machines, yet TE-built models are what most users train;
`te_naming.to_te_names` renames a local-spec model as a TE spec would have built it. Which names a TE model has
is decided by megatron-core's TE spec: which norms are IdentityOp because a TELayerNormColumnParallelLinear after
them holds the norm, whether experts are TEGroupedMLP. This module asks megatron-core itself:

* `te_spec_trees(configs)` runs, in a subprocess, the block and MTP specs that `build_model(use_te=True)` would
  use (model_specs.common.block_specs: megatron-core's gpt_layer_specs.py `get_gpt_decoder_block_spec`,
  experimental_attention_variant_module_specs.py for gated DeltaNet, plus the architectures' own tweaks), with
  grouped-GEMM experts (`moe_grouped_gemm=True`, what TE users train with). megatron-core picks TE classes at
  import time by the TE version (`HAVE_TE`, `is_te_min_version`), so the subprocess imports it with a stand-in
  `transformer_engine` package of version TE_VERSION: modules whose attributes are empty classes, enough for
  megatron-core's class definitions and version checks; no model is built there, only the spec functions run. The result is each
  layer's spec tree: the class at every submodule slot.
* `expected_te_names(chunk, tree)` walks a local-spec model chunk along that tree and lists the parameter names the
  TE model has: a slot whose TE class is IdentityOp has no parameters; TELayerNormColumnParallelLinear has its
  linear's plus `layer_norm_weight` (`layer_norm_bias` with LayerNorm); TEGroupedMLP holds expert i's
  `linear_fc1/2.weight` as `linear_fc1/2.weight{i}` (biases `bias{i}`); every other TE class has its local
  counterpart's names. Those parameter names are TE's (transformer_engine/pytorch/module/layernorm_linear.py,
  grouped_linear.py) and are spelled in megatron-core 0.16.1 too: extensions/transformer_engine.py
  (`fused_layer.layer_norm_weight` / `layer_norm_bias` in split_te_layernorm_column_parallel_linear,
  `f"weight{gemm_idx}"` in TEGroupedLinear's sharded_state_dict, `softmax_offset` in TEDotProductAttention's).
* `megatron_fused_norm_names(names)`: which separate norm each fused `layer_norm_weight` is, as megatron-core
  0.16.1 itself rewrites them (post_training/modelopt/gpt/state_dict_hooks.py
  `mcore_gpt_load_te_state_dict_pre_hook`; Megatron-Bridge copies that list).
* `bridge_patterns(model_type)`: a second, published oracle: the Megatron-side names of Megatron-Bridge 0.3.1's
  conversion tables for TE-built models (models/*/*_bridge.py), read with `ast` from its wheel, and
  `bridge_regex`, its wildcard rule (conversion/mapping_registry.py `_convert_pattern_to_regex`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import re
import subprocess
import sys
import types

from torch import nn

#: the TE version megatron-core is shown: megatron-core 0.16.1's `dev` extra requires
#: transformer-engine>=2.9.0a0,<2.12.0 (megatron_core-0.16.1.dist-info/METADATA)
TE_VERSION = "2.11.0"

#: a local module attribute that a spec field builds under another name (TransformerBlockSubmodules and
#: MultiTokenPredictionLayerSubmodules `layer_norm` -> `final_layernorm`, megatron-core 0.16.1)
_ATTR = {"layer_norm": "final_layernorm"}


# --- in the subprocess: megatron-core's TE spec ---------------------------------------------------------------


class _Stub:
    def __init__(self, *args, **kwargs):
        pass


class _StubModule(types.ModuleType):
    """A stand-in TE module: a capitalized attribute is an empty class, anything else a submodule."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            cls = type(name, (_Stub,), {"__module__": self.__name__})
            setattr(self, name, cls)
            return cls
        return importlib.import_module(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in ("transformer_engine", "transformer_engine_torch"):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        if module.__name__ == "transformer_engine":
            module.__version__ = TE_VERSION


def _tree(x) -> dict | None:
    """A spec slot as {"class": name, "sub": {field: tree}}; None for what builds no module (functions, maps)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(x, ModuleSpec):
        node = {"class": x.module.__name__}
        if x.submodules is not None and dataclasses.is_dataclass(x.submodules):
            node["sub"] = _fields(x.submodules)
        return node
    if isinstance(x, type):
        return {"class": x.__name__}
    if isinstance(x, functools.partial):  # megatron-core 0.19's builders: partial(Class or Class.as_mlp_submodule,
        func = x.func                      # submodules=...), models/gpt/moe_module_specs.py, gpt_layer_specs.py
        cls = func if isinstance(func, type) else getattr(func, "__self__", None)
        # 0.19.2 moe_module_specs.py:21-33 `_build_shared_experts` builds SharedExpertMLP (without the
        # grouped-GEMM shared expert option)
        name = cls.__name__ if isinstance(cls, type) else _BUILDERS.get(getattr(func, "__name__", ""))
        if name is None:
            return None
        node = {"class": name}
        sub = x.keywords.get("submodules")
        if sub is not None and dataclasses.is_dataclass(sub):
            node["sub"] = _fields(sub)
        return node
    return None


_BUILDERS = {"_build_shared_experts": "SharedExpertMLP"}


def _fields(sub) -> dict:
    import dataclasses

    out = {}
    for f in dataclasses.fields(sub):
        t = _tree(getattr(sub, f.name))
        if t is not None:
            out[f.name] = t
    return out


def _spec_trees(configs: dict[str, dict]) -> dict[str, dict]:
    """The TE spec tree of each HF config (runs where megatron-core sees the stand-in TE)."""
    import os
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore2hf.arch.hf_config import load_hf_config
    from mcore2hf.arch.registry import get_model_spec
    from mcore2hf.errors import ConfigMismatchError
    from mcore2hf.model_specs.common import block_specs

    with tempfile.TemporaryDirectory() as tmp:  # block specs read parallel sizes: a world of one
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        ps.initialize_model_parallel()
        try:
            out = {}
            for name, raw in configs.items():
                cfg = load_hf_config(raw)
                spec = get_model_spec(cfg.model_type)
                grouped = {"moe_grouped_gemm": True} if spec.dims(cfg).num_experts else {}
                config = spec.transformer_config(cfg, **grouped)
                try:
                    block, mtp = block_specs(spec, cfg, config, use_te=True)
                except ConfigMismatchError:  # an architecture this megatron-core cannot build (0.19: deepseek_v2)
                    continue
                out[name] = {"layers": [_tree(s) for s in block.layer_specs],
                             "final_layernorm": _tree(block.layer_norm),
                             "mtp": [_tree(s) for s in mtp.layer_specs] if mtp is not None else [],
                             "normalization": config.normalization}
            return out
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def _main() -> None:
    sys.meta_path.insert(0, _StubFinder())
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns about apex and fusions on import
    configs = json.load(sys.stdin)
    json.dump(_spec_trees(configs), sys.stdout)


def te_spec_trees(configs: dict[str, dict]) -> dict[str, dict]:
    """{name: HF config dict} -> {name: the TE spec tree of that model} (see the module docstring): "layers" (one
    tree per decoder layer, all pipeline stages), "mtp" (per MTP layer), "final_layernorm", "normalization".
    One subprocess for all configs (megatron-core must not see the stand-in TE in this process)."""
    r = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(configs), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"megatron-core TE spec subprocess failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout)


# --- in the model's process: the names a TE model built from that tree has -------------------------------------


def _grouped(module: nn.Module, prefix: str) -> list[str]:
    """TEGroupedMLP: expert i's local `local_experts.i.linear_fcN.weight` is TE GroupedLinear's `linear_fcN.weight{i}`."""
    out = []
    for n, _ in module.named_parameters():
        m = re.fullmatch(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)", n)
        if m is None:
            raise AssertionError(f"{prefix}{n}: not an expert linear of a SequentialMLP")
        out.append(f"{prefix}{m[2]}.{m[3]}{m[1]}")
    return out


def _walk(module: nn.Module, tree: dict, prefix: str, normalization: str) -> list[str]:
    """The TE names of `module`'s parameters, the module at a slot whose TE spec is `tree`."""
    cls = tree["class"]
    if cls == "IdentityOp":  # the TE spec builds nothing here: the norm is fused into the linear after it
        return []
    if cls == "TEGroupedMLP":
        return _grouped(module, prefix)
    names = []
    covered = set()
    for field, sub in tree.get("sub", {}).items():
        attr = _ATTR.get(field, field)
        child = module._modules.get(attr)  # absent where the module builds another slot (MLA's q projections)
        if child is not None:
            covered.add(attr)
            names += _walk(child, sub, f"{prefix}{attr}.", normalization)
    names += [prefix + n for n, _ in module.named_parameters() if n.split(".")[0] not in covered]
    if cls == "TELayerNormColumnParallelLinear":
        names.append(prefix + "layer_norm_weight")
        if normalization == "LayerNorm":
            names.append(prefix + "layer_norm_bias")
    return names


def expected_te_names(chunk: nn.Module, tree: dict) -> list[str]:
    """The parameter names of `chunk` (a local-spec GPTModel chunk) had its layers been built from the TE spec
    `tree` (one of te_spec_trees' values); decoder layers are matched by their global layer number, so any
    pipeline stage works."""
    norm = tree["normalization"]
    names = []
    layers = {f"decoder.layers.{i}.": (layer, tree["layers"][layer.layer_number - 1])
              for i, layer in enumerate(chunk.decoder.layers)} if getattr(chunk, "decoder", None) is not None else {}
    mtp = getattr(chunk, "mtp", None)
    if mtp is not None:
        layers.update({f"mtp.layers.{j}.": (m, tree["mtp"][j]) for j, m in enumerate(mtp.layers)})
    for prefix, (module, t) in layers.items():
        names += _walk(module, t, prefix, norm)
    names += [n for n, _ in chunk.named_parameters() if not any(n.startswith(p) for p in layers)]
    return names


def megatron_fused_norm_names(names: list[str]) -> dict[str, str]:
    """{TE name: the separate norm's name} for the fused norm names megatron-core's own TE -> separate-norm
    rewrite knows (megatron-core 0.16.1 post_training/modelopt/gpt/state_dict_hooks.py, run as it is)."""
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import (
        mcore_gpt_load_te_state_dict_pre_hook,
    )

    sd = {n: n for n in names}
    mcore_gpt_load_te_state_dict_pre_hook(sd, "", {}, True, [], [], [])
    return {te: local for local, te in sd.items() if local != te}


# --- Megatron-Bridge's published tables ------------------------------------------------------------------------

BRIDGE = ("megatron-bridge", "0.3.1")
#: our model_type -> the files of Megatron-Bridge 0.3.1 (megatron/bridge/models/) holding its mapping table;
#: glm4_moe_lite, mixtral, minimax_m2, qwen3_5 and qwen3_5_moe have no bridge in 0.3.1
BRIDGE_TABLES = {
    "qwen3_moe": ("qwen/qwen3_moe_bridge.py",), "qwen3": ("qwen/qwen3_bridge.py",), "qwen2": ("qwen/qwen2_bridge.py",),
    "qwen3_next": ("qwen/qwen3_next_bridge.py",), "llama": ("llama/llama_bridge.py",),
    "mistral": ("mistral/mistral_bridge.py",), "glm4_moe": ("glm/glm45_bridge.py",),
    "gpt_oss": ("gpt_oss/gpt_oss_bridge.py",), "olmoe": ("olmoe/olmoe_bridge.py",),
    "deepseek_v3": ("deepseek/deepseek_v3_bridge.py", "deepseek/common.py"),
    "deepseek_v2": ("deepseek/deepseek_v2_bridge.py", "deepseek/common.py"),
}
#: Bridge's tables are checked outside MTP: 0.3.1's DeepSeek tables have none ("TODO: mtp"), GLM-4.5's are built
#: by code, and Qwen3-Next's HF MTP names also begin with "mtp."
BRIDGE_ROOTS = ("decoder.", "embedding.", "output_layer.")


def _literal(node) -> str | None:
    """A string constant; an f-string with each field as Bridge's digit wildcard '*'."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    return None


def bridge_patterns(model_type: str) -> list[str]:
    """The Megatron-side parameter patterns (under BRIDGE_ROOTS) of Megatron-Bridge 0.3.1's table for
    `model_type` (its wheel, fetched once and cached): `megatron_param=` arguments (or the first positional
    argument) of its *Mapping(...) calls and the Megatron side of its dict literals (Megatron -> HF, or HF ->
    Megatron as in gpt_oss_bridge.py)."""
    from harness.wheels import unpacked_wheel

    root = unpacked_wheel(*BRIDGE, include=("megatron/bridge/models/*",)) / "megatron" / "bridge" / "models"
    out = set()
    for rel in BRIDGE_TABLES[model_type]:
        for node in ast.walk(ast.parse((root / rel).read_text())):
            found = []
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) or getattr(node.func, "attr", "")
                                               ).endswith("Mapping"):
                kw = {k.arg: k.value for k in node.keywords}
                found.append(_literal(kw["megatron_param"]) if "megatron_param" in kw else
                             _literal(node.args[0]) if node.args else None)
            elif isinstance(node, ast.Dict):
                found += [_literal(k) for k in (*node.keys, *node.values) if k is not None]
            out.update(p for p in found if p and p.startswith(BRIDGE_ROOTS))
    return sorted(out)


def bridge_regex(pattern: str) -> re.Pattern:
    """Megatron-Bridge 0.3.1's wildcard rule (conversion/mapping_registry.py `_convert_pattern_to_regex`): '**'
    any characters, '*' digits (layer indices, expert numbers)."""
    return re.compile("^" + re.escape(pattern).replace(r"\*\*", "(.*)").replace(r"\*", r"(\d+)") + "$")


def bridge_problems(model_type: str, names: list[str]) -> list[str]:
    """The names under BRIDGE_ROOTS that no pattern of Megatron-Bridge 0.3.1's `model_type` table matches."""
    patterns = [bridge_regex(p) for p in bridge_patterns(model_type)]
    return sorted({n for n in names if n.startswith(BRIDGE_ROOTS) and not any(r.match(n) for r in patterns)})


if __name__ == "__main__":
    _main()
