"""On-disk formats, one module each: HF directories (`hf_dir`, the one reader; `safetensors`, the streaming
writer), Megatron checkpoints (`checkpoint_keys`, the key scheme both ways; `legacy`, Megatron-LM's per-rank
`torch` files) and output directories (`paths`). Imports the plan and transfer layers (buckets) and below."""
