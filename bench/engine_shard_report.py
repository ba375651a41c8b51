"""Disaggregated engine-shard delivery, simulated (issue 15 point 5): plans only, no weights, no GPU.

For real model shapes at trainer layouts of 8-GPU nodes and engine placements on other nodes, the EngineShardPlan
(the planner the library runs, with engine ranks after the trainer ranks: `disaggregated_ranks`) says what every
trainer GPU sends and every engine GPU receives. Printed per case: bytes per trainer GPU / node, per engine GPU /
node, and the predicted time at 50 GB/s per NIC against broadcast from trainer rank 0.

Network model (stated, not measured):
* every byte from a trainer GPU to an engine GPU crosses nodes (engines run on their own nodes);
* NIC per GPU (rail-optimized, e.g. DGX H100: 8 x 400 Gb/s = 8 x 50 GB/s per node): a transfer takes the larger of
  the busiest sending and busiest receiving NIC's bytes / 50 GB/s (a lower bound: no congestion, full overlap);
  the "1 NIC/node" column repeats it with one 50 GB/s NIC per node (node totals);
* broadcast from trainer rank 0 (today's SGLang/vLLM distributed path): NCCL pipelines the broadcast over a ring
  or tree, so rank 0's NIC sends the whole model M once and every engine GPU receives M once: M / 50 GB/s in both
  NIC models (its best case; a naive star, rank 0 sending to each engine rank, would be N x M / 50 GB/s).

Trainer ExportPlans are built without a Megatron world: each rank's shard names and shapes are synthesized from the
HF config with the HF-as-Megatron name table (`megatron_names`, `full_shape`: the same rules the offline importer
writes checkpoints with) and Megatron's rank order (tp-cp-ep-dp-pp), then `build_sources` / `assign_buckets` /
`plan_engine_shards` run as in a live export.

    python bench/engine_shard_report.py                     # every model and case below (a few minutes on CPU)
    python bench/engine_shard_report.py --models qwen3-30b-a3b --quick
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

NIC = 50e9  # bytes/s per NIC
GPUS_PER_NODE = 8

#: real shapes (config.json values of the published models); deepseek-v3-4L: DeepSeek-V3's shapes with 4 layers
#: (1 dense + 3 MoE, no MTP) to keep the planning time small; its bytes scale with the layer count
MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)),
    "qwen3-8b": ("qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128)),
    "deepseek-v3-4L": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8,
        first_k_dense_replace=1, n_shared_experts=1, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_nextn_predict_layers=0)),
}

#: trainer layouts per model: (tp, pp, ep, etp, world)
LAYOUTS = {
    "qwen3-30b-a3b": [(1, 1, 8, 1, 8), (2, 2, 8, 1, 16)],
    "qwen3-8b": [(4, 1, 1, None, 8), (4, 2, 1, None, 16)],
    "deepseek-v3-4L": [(8, 1, 8, 1, 16)],
}

#: engine placements: (engine, tp, ep, instances)
ENGINES = {
    "moe": [("sglang", 4, 1, 2), ("sglang", 8, 1, 1), ("sglang", 8, 8, 1), ("vllm", 8, 8, 2)],
    "dense": [("sglang", 4, 1, 2), ("sglang", 8, 1, 1), ("vllm", 8, 1, 2)],
}

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def trainer_plan(model_type: str, overrides: dict, tp: int, pp: int, ep: int, etp: int | None, world: int,
                 bucket_bytes: int, dtype: str = "torch.bfloat16"):
    """(ExportPlan, dims) of the model (a registered architecture's tiny config with `overrides`) at the layout,
    from synthesized rank records (names, shard shapes; no data). tests/test_disaggregated.py checks them against
    a live megatron-core world's."""
    from mcore2hf.arch.hf_config import hf_tensor_shapes
    from mcore2hf.arch.registry import get_converter, get_model_spec
    from mcore2hf.formats.hf_as_megatron import full_shape, megatron_names
    from mcore2hf.model_specs.common import padded_vocab_size
    from mcore2hf.plan.export import ExportPlan, RankRecord, assign_buckets, build_sources
    from mcore2hf.runtime.tiny import tiny_config

    cfg = tiny_config(model_type, **overrides)
    dims = get_model_spec(model_type).dims(cfg)
    conv = get_converter(model_type)
    shapes = hf_tensor_shapes(cfg, dims.num_mtp_layers, conv.not_held_by_model)
    found, unexplained = megatron_names(conv, dims, set(shapes))
    assert not unexplained, unexplained[:4]
    etp = etp or tp
    padded = padded_vocab_size(dims.vocab_size, tp)
    per_stage = world // pp
    assert per_stage % tp == 0 and per_stage % (ep * etp) == 0, (tp, pp, ep, etp, world)
    layers_per_stage = dims.num_layers // pp
    experts_per_rank = (dims.num_experts or 1) // ep
    tensors = []  # (name, stage or None for every stage's ends, ep owner or -1, is_expert, op, full)
    for name, r in found.items():
        full = full_shape(r.op, [tuple(shapes[n]) for n in r.hf_names], padded)
        m = _LAYER.match(name)
        if m:
            stage = min(int(m.group(1)) // layers_per_stage, pp - 1)  # MTP layers (index >= L) on the last stage
        elif name.startswith("embedding."):
            stage = 0
        else:  # output layer, final norm, MTP parts
            stage = pp - 1
        e = _EXPERT.search(name)
        is_expert = e is not None
        tensors.append((name, stage, int(e.group(1)) // experts_per_rank if is_expert else -1, is_expert, r.op, full))
    records = []
    for rank in range(world):
        stage, i = rank // per_stage, rank % per_stage
        t_rank, e_rank, ep_rank = i % tp, i % etp, (i // etp) % ep
        mine = []
        for name, st, owner, is_expert, op, full in tensors:
            if st != stage or (is_expert and owner != ep_rank):
                continue
            group = etp if is_expert else tp
            shape = list(full)
            split = op.tp_dim is not None and group > 1
            if split:
                shape[op.tp_dim] //= group
            mine.append((name, name, tuple(shape), dtype, is_expert, split, op.tp_dim if split else None,
                         op.strides[0]))
        records.append(RankRecord(rank, stage, t_rank, ep_rank if ep > 1 else 0, e_rank, tuple(mine)))
    sources = build_sources(records, conv, dims, tp, etp)
    export = ExportPlan(model_type, sources, assign_buckets(sources, bucket_bytes), bucket_bytes, records, world)
    return export, dims


def simulate(export, dims, world: int, engine: str, tp: int, ep: int, instances: int) -> dict:
    from mcore2hf.plan.engine import plan_engine_shards
    from mcore2hf.senders.engine_shard import disaggregated_ranks

    ranks = disaggregated_ranks(world, engine, tp, ep, instances)
    eplan = plan_engine_shards(export, ranks, dims)
    sent: dict[int, int] = defaultdict(int)
    got: dict[int, int] = defaultdict(int)
    for routes in eplan.routes:
        for r in routes:
            n = r.piece.numel * export.sources[r.source].dtype.itemsize
            sent[r.sender] += n
            got[r.receiver] += n
    model = export.total_bytes
    t_gpu = [sent[g] for g in range(world)]
    t_node = [sum(t_gpu[k:k + GPUS_PER_NODE]) for k in range(0, world, GPUS_PER_NODE)]
    e_gpu = [got[er.rank] for er in ranks]
    # engine GPUs packed onto nodes in instance order (a TP 4 instance shares a node with the next one)
    e_node = [sum(e_gpu[k:k + GPUS_PER_NODE]) for k in range(0, len(e_gpu), GPUS_PER_NODE)]
    return dict(model=model, engine_gpus=len(ranks), sent_gpu=t_gpu, sent_node=t_node, got_gpu=e_gpu,
                got_node=e_node, t_shard=max(max(t_gpu), max(e_gpu)) / NIC,
                t_shard_node=max(max(t_node), max(e_node)) / NIC, t_bcast=model / NIC,
                t_star=len(ranks) * model / NIC)


def _g(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--quick", action="store_true", help="first trainer layout and two engine placements per model")
    ap.add_argument("--bucket-mb", type=int, default=1024)
    args = ap.parse_args()
    print(f"NIC {NIC / 1e9:.0f} GB/s, {GPUS_PER_NODE} GPUs/node; GB = 1e9 bytes; bf16; times are lower bounds "
          "(see the module docstring)")
    head = (f"{'model':<15} {'trainer':<17} {'engine':<18} {'model GB':>8} {'send/GPU max':>12} {'min':>6} "
            f"{'send/node max':>13} {'recv/GPU max':>12} {'recv/node max':>13} {'shard s':>8} {'bcast s':>8} "
            f"{'speedup':>7} {'1NIC/node s':>11}")
    print(head)
    for model in args.models:
        model_type = MODELS[model][0]
        layouts = LAYOUTS[model][:1] if args.quick else LAYOUTS[model]
        engines = ENGINES["moe" if "moe" in model_type or "deepseek" in model_type else "dense"]
        engines = engines[:2] if args.quick else engines
        for tp, pp, ep, etp, world in layouts:
            t0 = time.time()
            export, dims = trainer_plan(*MODELS[model], tp, pp, ep, etp, world, args.bucket_mb * 2**20)
            lay = f"TP{tp}PP{pp}EP{ep} w{world}"
            for engine, etp_, eep, inst in engines:
                r = simulate(export, dims, world, engine, etp_, eep, inst)
                eng = f"{engine} {inst}xTP{etp_}" + (f"EP{eep}" if eep > 1 else "")
                print(f"{model:<15} {lay:<17} {eng:<18} {_g(r['model']):>8} {_g(max(r['sent_gpu'])):>12} "
                      f"{_g(min(r['sent_gpu'])):>6} {_g(max(r['sent_node'])):>13} {_g(max(r['got_gpu'])):>12} "
                      f"{_g(max(r['got_node'])):>13} {r['t_shard']:>8.3f} {r['t_bcast']:>8.3f} "
                      f"{r['t_bcast'] / r['t_shard']:>6.1f}x {r['t_shard_node']:>11.3f}", flush=True)
            print(f"  ({model} {lay}: planned in {time.time() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
