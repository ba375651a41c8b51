"""Quantized export formats behind one protocol (`scheme`: `QuantScheme`, what every part of the export asks of a
format, and the registry `get_scheme` reads): block FP8 (`fp8`: DeepGEMM's reference quantizer, the
per-architecture policy of what stays unquantized, quantization on the shards; `fp8_cuda`, its fused CUDA kernel).
Importing the package registers its schemes. Imports only the layouts and base layers."""

from . import fp8  # noqa: F401 - registers the block-FP8 schemes
