"""Per-architecture model specs: HF config <-> Megatron TransformerConfig and layer spec."""
