"""Every registered architecture is covered, in the manner of vLLM's tests/models/test_registry.py
`test_hf_registry_coverage` (the architectures vLLM registers less those with an example model in
tests/models/registry.py must be none): every model type registered here (`arch.registry.Architecture`) has a tiny
config transformers builds, a verified row that `mcore2hf list` prints, and a world of the suite that runs it; and
`mcore2hf list`'s catalog (`arch.catalog`, read without importing the converters) is the registry's snapshot.
Fast: no model is built, no process started."""

from __future__ import annotations

import importlib
import inspect

from conftest import ARCHS

from mcore2hf.arch import catalog
from mcore2hf.arch.hf_config import architecture_classes
from mcore2hf.arch.registry import architectures, get_converter, list_architectures, verified
from mcore2hf.runtime.tiny import tiny_config

#: the suite's worlds (a test module: the model types it runs there, as that module names them)
WORLDS = {
    "test_layout_matrix": lambda module: ARCHS,  # every layout world runs conftest.ARCHS (their `ckpts` fixture)
    "test_vlm": lambda module: module.ARCHS,
    "test_qwen3_5": lambda module: module.ARCHS,
    "test_qwen3_next": lambda module: ["qwen3_next"],  # its own layout world (LAYOUTS)
}


def world_model_types() -> dict[str, str]:
    """{model type: the test module whose world runs it}; each module must run worlds (run_world) at all."""
    out = {}
    for name, listed in WORLDS.items():
        module = importlib.import_module(name)
        assert "run_world(" in inspect.getsource(module), f"{name} runs no world"
        for mt in listed(module):
            out.setdefault(mt, name)
    return out


def test_every_registered_architecture_has_a_tiny_config_a_verified_row_and_a_world():
    registered = architectures()
    worlds = world_model_types()
    untested = sorted(set(registered) - set(worlds))
    assert not untested, f"registered model types no world of the suite runs (add them to one): {untested}"
    for mt, arch in registered.items():
        cfg = tiny_config(mt)
        assert cfg.model_type == mt and arch.tiny, mt
        assert verified(mt) == arch.verified and "world" in arch.verified, (mt, arch.verified)
        assert arch.spec is arch.converter.spec and arch.model_type == mt
    # aliases (kimi_k2) are their format's architecture, verified as it is
    for alias in set(list_architectures()) - set(registered):
        assert verified(alias) in {a.verified for a in registered.values()}, alias


def test_the_catalog_is_the_registry():
    """The catalog `mcore2hf list` reads is what the registered Architectures say now (model types and aliases,
    FP8 policy, verified text) with the class transformers 5.24 registers for each: one source of truth, the file
    its snapshot."""
    listed, derived = catalog.catalog(), catalog.derive()
    stale = sorted(mt for mt in set(listed) | set(derived) if listed.get(mt) != derived.get(mt))
    assert not stale, (f"mcore2hf/arch/catalog.json disagrees with the registry for {stale}: rewrite it with "
                       "`python -m mcore2hf.arch.catalog`")
    assert list(listed) == list_architectures()
    for name, entry in listed.items():
        conv = get_converter(name)
        assert entry.hf_class in architecture_classes(conv.model_type), (name, architecture_classes(conv.model_type))
        assert entry.format_of == (conv.model_type if conv.model_type != name else None), name
