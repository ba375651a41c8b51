"""Layout ops: how the TP shards of a Megatron tensor become its HF tensors and back, as pure functions on tensors
(`ops`: the column, row, QKV, gated and vocabulary ops; `gdn`: gated attention and the gated DeltaNet; `stacked`:
items of stacked HF tensors), and the pieces the engine-shard planner clips (`pieces`). Imports only the base
layer (errors)."""
