"""Registry of architectures: HF model_type -> converter table (+ its model spec)."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import UnsupportedArchitectureError
from .mapping import Converter

_CONVERTERS: dict[str, Converter] = {}
_loaded = False


def register(converter: Converter) -> Converter:
    for name in (converter.model_type, *converter.aliases):
        _CONVERTERS[name] = converter
    return converter


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        importlib.import_module("mcore2hf.converters")  # a failure here surfaces, and is retried next time
        _loaded = True


def list_architectures() -> list[str]:
    """Registered HF model_type names, e.g. ["qwen3_moe", ...]."""
    _load_builtin()
    return sorted(_CONVERTERS)


def get_converter(model_type: str) -> Converter:
    _load_builtin()
    try:
        return _CONVERTERS[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"no converter for HF model_type {model_type!r}; registered: {sorted(_CONVERTERS)}"
        ) from None


def canonical_model_type(model_type: str) -> str:
    """The registered model_type an alias stands for (e.g. kimi_k2 -> deepseek_v3); others unchanged."""
    _load_builtin()
    converter = _CONVERTERS.get(model_type)
    return converter.model_type if converter is not None else model_type


def get_model_spec(model_type: str) -> ModuleType:
    return importlib.import_module(get_converter(model_type).spec)
