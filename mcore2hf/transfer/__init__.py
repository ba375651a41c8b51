"""Transfer: the per-rank programs an export runs (`program`: plain data, built by the all-ranks, receivers and
engine-shard builders in `builders` from the planner's decisions, routes included: `mcore2hf.plan.routes`), and the one
executor core (`executor`). Kept free of imports."""
