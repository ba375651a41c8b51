"""Registry of architectures: HF model_type (and its aliases) -> the one `Architecture` object registered for it
(converters/<model_type>.py): its rule table, its model spec, its tiny config, what the suite verifies and the
published checkpoints' layout. `catalog` holds a snapshot of what `mcore2hf list` shows of them, derived from here."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import UnsupportedArchitectureError
from .mapping import Converter


@dataclass(frozen=True)
class Architecture:
    """Everything mcore2hf holds of one architecture, registered once: the rule table (`converter`, whose `spec` is
    the model spec: HF config <-> TransformerConfig and layer spec), the HF config fields of a tiny model (`tiny`:
    what the tests and the demo build, runtime.tiny.tiny_config), what the test suite verifies (`verified`, shown by
    `mcore2hf list`) and where the published checkpoints' layout differs from what transformers saves
    (`published_layout`: (regex, action) pairs, action "transpose" (dims 1 and 2 swapped) or a replacement name;
    hf_config.published_layout applies them)."""

    converter: Converter
    tiny: dict
    verified: str
    published_layout: tuple[tuple[str, str], ...] = ()

    @property
    def model_type(self) -> str:
        return self.converter.model_type

    @property
    def spec(self):
        return self.converter.spec


_ARCHITECTURES: dict[str, Architecture] = {}
_loaded = False


def register(architecture: Architecture) -> Architecture:
    for name in (architecture.model_type, *architecture.converter.aliases):
        _ARCHITECTURES[name] = architecture
    return architecture


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        importlib.import_module("mcore2hf.converters")  # a failure here surfaces, and is retried next time
        _loaded = True


def list_architectures() -> list[str]:
    """Registered HF model_type names (aliases too), e.g. ["qwen3_moe", ...]."""
    _load_builtin()
    return sorted(_ARCHITECTURES)


def architectures() -> dict[str, Architecture]:
    """The registered architectures by their own model_type (no alias)."""
    _load_builtin()
    return {mt: a for mt, a in sorted(_ARCHITECTURES.items()) if mt == a.model_type}


def get_architecture(model_type: str) -> Architecture:
    _load_builtin()
    try:
        return _ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"no converter for HF model_type {model_type!r}; registered: {sorted(_ARCHITECTURES)}"
        ) from None


def get_converter(model_type: str) -> Converter:
    return get_architecture(model_type).converter


def get_model_spec(model_type: str):
    return get_architecture(model_type).spec


def canonical_model_type(model_type: str) -> str:
    """The registered model_type an alias stands for (e.g. kimi_k2 -> deepseek_v3); others unchanged."""
    _load_builtin()
    found = _ARCHITECTURES.get(model_type)
    return found.model_type if found is not None else model_type


def formats_mapping(names: Iterable[str]) -> list[str]:
    """The registered architectures (own model_types, aliases left out) whose rule tables map every canonical
    Megatron name in `names`: which architecture a checkpoint holds when it is not the one its HF config says."""
    names = list(names)
    return [mt for mt, a in architectures().items() if all(a.converter.maps(n) for n in names)]


def verified(model_type: str) -> str:
    """What the test suite verifies for `model_type` (an alias: its format's)."""
    return get_architecture(model_type).verified


def published_layout(model_type: str) -> tuple[tuple[str, str], ...]:
    """The registered architecture's published layout; () for a model_type not registered."""
    _load_builtin()
    found = _ARCHITECTURES.get(model_type)
    return () if found is None else found.published_layout
