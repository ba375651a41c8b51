"""Transfer: the per-rank programs an export runs (`program`: plain data, built by the all-ranks, receivers and
engine-shard builders in `builders`), the one route rule (`routes`), and the one executor core (`executor`).
Kept free of imports so that `routes`, a leaf, is importable from the plan."""
