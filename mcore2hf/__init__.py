"""mcore2hf: stream the weights of a live, sharded Megatron-Core model out as Hugging Face named tensors."""

from .buckets import Bucket
from .errors import (
    ConfigMismatchError,
    LayoutError,
    Mcore2HFError,
    MissingWeightsError,
    ParallelStateError,
    ShapeMismatchError,
    UnknownParametersError,
    UnsupportedArchitectureError,
)
from .exporter import DEFAULT_BUCKET_BYTES, HFExporter
from .loader import load_hf_weights
from .registry import get_converter, list_architectures

__version__ = "0.1.0"

__all__ = [
    "Bucket", "HFExporter", "load_hf_weights", "list_architectures", "get_converter", "DEFAULT_BUCKET_BYTES",
    "Mcore2HFError", "ConfigMismatchError", "LayoutError", "MissingWeightsError", "ParallelStateError",
    "ShapeMismatchError", "UnknownParametersError", "UnsupportedArchitectureError",
]
