"""mcore2hf: stream the weights of a live, sharded Megatron-Core model out as Hugging Face named tensors.

Names are imported on first use (PEP 562), so `mcore2hf --help` and light modules (sizes, errors) load without
torch."""

from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"

logging.getLogger("mcore2hf").addHandler(logging.NullHandler())  # silent unless the application configures logging

_LAZY = {
    "Bucket": "transfer.buckets", "build_model": "arch.build", "DEFAULT_BUCKET_BYTES": "exporter", "HFExporter": "exporter",
    "load_hf_weights": "loader", "get_converter": "arch.registry", "list_architectures": "arch.registry",
    "Mcore2HFError": "errors", "ConfigMismatchError": "errors", "LayoutError": "errors",
    "MissingWeightsError": "errors", "ParallelStateError": "errors", "ShapeMismatchError": "errors",
    "UnknownParametersError": "errors", "UnsupportedArchitectureError": "errors", "HFDirectoryError": "errors",
    "HFDirectory": "formats.hf_dir", "ExportOptions": "plan.options",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mcore2hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
