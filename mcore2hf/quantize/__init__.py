"""Quantized export formats: block FP8 (`fp8`: DeepGEMM's reference quantizer, the per-architecture policy of
what stays unquantized, quantization on the shards), its fused CUDA kernel (`fp8_cuda`). Imports only the layouts
and base layers."""
