"""Disaggregated engine-sharded delivery (issue 15 point 5): a trainer world of real megatron-core models (gloo, CPU)
and engine ranks in other processes (no Megatron, no default world) joined by one weight-update group built from a
TCPStore; every trainer rank sends its pieces straight to the engine ranks that load them, and the reference
receiver (`EngineShardReceiver`) rebuilds each engine rank's slices."""

from __future__ import annotations

import importlib.util
import os
import time

import torch
import torch.distributed as dist

from mcore2hf.runtime.world import Layout, run_world, worker_context

GROUP = "disagg_weight_update"
#: (engine, tp, ep): sglang TP2 without engine EP (experts split by expert TP), vllm TP2 with EP2 (whole experts)
PLACEMENTS = [("sglang", 2, 1), ("vllm", 2, 2)]
ENGINE_RANKS = 2
SYNCS = 2  # plan once, run twice
TIMEOUT = 120.0
BUCKET = 16 * 1024
BENCH = os.path.join(os.path.dirname(__file__), "..", "bench", "engine_shard_report.py")


def _join(port: int, rank: int, world: int):
    from datetime import timedelta

    from mcore2hf.senders.process_group import join_weight_update_group

    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the test process hosts the store
    return join_weight_update_group("127.0.0.1", port, rank, world, GROUP, "gloo", timedelta(seconds=TIMEOUT),
                                    store=store)


def _trainer(ckpt: str, layout: Layout, port: int, bucket_bytes: int) -> dict:
    import worlds

    from mcore2hf import HFExporter
    from mcore2hf.senders.engine_shard import EngineShardPusher, disaggregated_ranks

    cfg, chunks = worlds.build(ckpt, layout)
    worlds.load_hf_weights(chunks, ckpt)
    ex = HFExporter(chunks, cfg)
    me, world = dist.get_rank(), dist.get_world_size()
    pg = _join(port, me, world + ENGINE_RANKS)  # trainer rank r is group rank r
    out = []
    for engine, tp, ep in PLACEMENTS:
        pusher = EngineShardPusher(ex, disaggregated_ranks(world, engine, tp, ep), pg, me, bucket_bytes,
                                   timeout=TIMEOUT)
        planned = sum(r.piece.numel * ex.plan(bucket_bytes).sources[r.source].dtype.itemsize
                      for routes in pusher.plan.routes for r in routes if r.sender == me)
        out.append(dict(sent=[pusher.push()["sent_bytes"] for _ in range(SYNCS)], planned=planned))
    sources = {n: (s.holders, s.shard_shape, s.count, s.stages, s.ep, str(s.dtype))
               for n, s in ex.plan(bucket_bytes).sources.items()}
    return dict(placements=out, sources=sources)


def _engine(rank: int, world: int, port: int, path: str) -> None:
    from mcore2hf.senders.engine_shard import EngineShardReceiver

    torch.set_num_threads(1)
    rec = EngineShardReceiver(_join(port, rank, world), rank, "cpu", timeout=TIMEOUT)
    results = []
    for _ in PLACEMENTS:
        rec.setup()  # the program for the trainers' new plan, from trainer rank 0
        syncs = []
        for _ in range(SYNCS):
            before = rec.stats["received_bytes"]
            got, masked = {}, {}
            for b in rec.buckets():
                got.update((f"{name}|{list(sl.region)}", sl.tensor.clone()) for name, sl in b.slices())
                masked.update((name, t.clone()) for name, t in b.masked(debug=True))  # what load_weights takes
            syncs.append(dict(slices=got, masked=masked, received=rec.stats["received_bytes"] - before))
        results.append(dict(syncs=syncs, expected=rec.expected_bytes))
    torch.save(results, path)


def test_disaggregated_engine_shards_tp2_ep2_trainer_to_2_engine_ranks_every_holder_sends(tmp_path, capsys):
    """qwen3_moe at trainer TP2 x EP2 (expert TP 1, 2 gloo ranks, real megatron-core) -> 2 engine-rank processes
    (sglang TP2; vllm TP2 EP2), one weight-update group: on every engine rank, in both syncs of each plan, the
    slices equal the engine's slices of the source HF checkpoint (torch.equal) and are exactly its engine_regions; it
    receives exactly its regions' bytes; every trainer rank sends (no single source) exactly what the plan routes
    from it, and the trainers send what the engines receive."""
    from mcore2hf.arch.registry import get_model_spec
    from mcore2hf.plan.engine_shards import EnginePlacement, engine_regions, region_slices
    from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config

    t0 = time.time()
    cfg = tiny_config("qwen3_moe")
    ckpt = str(make_hf_checkpoint(cfg, tmp_path / "qwen3_moe"))
    layout = Layout(tp=2, ep=2, etp=1)
    world = layout.size + ENGINE_RANKS
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the OS picks the port
    ctx = worker_context()  # engine ranks forked from the workers' forkserver, as the trainer ranks are
    paths = [str(tmp_path / f"engine{j}.pt") for j in range(ENGINE_RANKS)]
    engines = [ctx.Process(target=_engine, args=(layout.size + j, world, store.port, paths[j]))
               for j in range(ENGINE_RANKS)]
    for p in engines:
        p.start()
    try:
        res = run_world(_trainer, layout, ckpt, layout, store.port, BUCKET)
        for p in engines:
            p.join(timeout=TIMEOUT)
        assert [p.exitcode for p in engines] == [0] * ENGINE_RANKS
    finally:
        for p in engines:
            if p.is_alive():
                p.kill()
    # the oracle: the HF checkpoint transformers wrote, which the model was loaded from
    full, dims = read_hf_checkpoint(ckpt), get_model_spec("qwen3_moe").dims(cfg)
    got = [torch.load(path, weights_only=True) for path in paths]
    lines = []
    for i, (engine, tp, ep) in enumerate(PLACEMENTS):
        received = 0
        for j in range(ENGINE_RANKS):
            placement = EnginePlacement(engine, j, tp, ep)
            want = {f"{n}|{[tuple(t) for t in region]}": full[n][region_slices(region)]
                    for n in full for region in engine_regions(n, full[n].shape, dims, placement, "qwen3_moe")}
            need = sum(v.numel() * v.element_size() for v in want.values())
            assert got[j][i]["expected"] == need, (engine, tp, ep, j)
            for sync in got[j][i]["syncs"]:
                have = sync["slices"]
                assert set(have) == set(want), (engine, tp, ep, j, sorted(set(have) ^ set(want))[:4])
                bad = [k for k in want if not torch.equal(have[k], want[k])]
                assert not bad, (engine, tp, ep, j, bad[:4])
                assert sync["received"] == need, (engine, tp, ep, j, sync["received"], need)
                for n, t in sync["masked"].items():  # masked full tensors: the regions written, NaN elsewhere
                    inside = torch.zeros(t.shape, dtype=torch.bool)
                    for region in engine_regions(n, t.shape, dims, placement, "qwen3_moe"):
                        inside[region_slices(region)] = True
                    assert torch.equal(t[inside], full[n][inside]) and t[~inside].isnan().all(), (engine, j, n)
                assert set(sync["masked"]) == set(full)  # every tensor, the same layout on every engine rank
            received += need
        sent = [r["placements"][i] for r in res]
        assert all(s["sent"] == [s["planned"]] * SYNCS and s["planned"] > 0 for s in sent), sent
        assert sum(s["planned"] for s in sent) == received, (sent, received)
        lines.append(f"{engine} TP{tp} EP{ep}: sent per trainer rank {[s['planned'] for s in sent]} bytes, "
                     f"received per engine rank {[got[j][i]['expected'] for j in range(ENGINE_RANKS)]}")
    # bench/engine_shard_report.py's synthesized rank records give this world's plan: same sources (holders,
    # shard shapes), same bytes from every trainer rank
    spec = importlib.util.spec_from_file_location("engine_shard_report", BENCH)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    export, _ = report.trainer_plan("qwen3_moe", {}, layout.tp, layout.pp, layout.ep, layout.etp, layout.size,
                                    BUCKET, "torch.float32")
    assert {n: (s.holders, s.shard_shape, s.count, s.stages, s.ep, str(s.dtype))
            for n, s in export.sources.items()} == res[0]["sources"]
    for i, (engine, tp, ep) in enumerate(PLACEMENTS):
        sim = report.simulate(export, dims, layout.size, engine, tp, ep, 1)
        assert sim["sent_gpu"] == [r["placements"][i]["planned"] for r in res], (engine, tp, ep, sim["sent_gpu"])
    with capsys.disabled():
        print(f"\ndisaggregated {layout} -> {ENGINE_RANKS} engine ranks ({time.time() - t0:.1f} s):\n"
              + "\n".join(lines))


def test_disaggregated_ranks_and_receive_program_refusals():
    """Engine ranks after the trainer ranks; a receive program for a rank that holds shards (colocated) is
    refused; the program is plain JSON-able data with the rank's regions' bytes."""
    import json

    import pytest

    from mcore2hf.plan.engine import plan_engine_shards
    from mcore2hf.plan.engine_shards import EngineShardError, colocated_ranks
    from mcore2hf.senders.engine_shard import (
        EngineShardReceiver,
        disaggregated_ranks,
        receive_plan,
        receive_program,
    )
    from mcore2hf.transfer.engine import EngineExecutor
    from mcore2hf.transfer.program import packed_bytes

    ranks = disaggregated_ranks(4, "sglang", 2, instances=2)
    assert [(er.instance, er.placement.tp_rank, er.rank) for er in ranks] == [(0, 0, 4), (0, 1, 5), (1, 0, 6),
                                                                               (1, 1, 7)]
    with pytest.raises(EngineShardError, match="instances >= 1"):
        disaggregated_ranks(4, "sglang", 2, instances=0)
    spec = importlib.util.spec_from_file_location("engine_shard_report", BENCH)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    export, dims = report.trainer_plan("qwen3_moe", {}, 2, 1, 2, 1, 2, BUCKET, "torch.float32")
    with pytest.raises(EngineShardError, match="group rank 0 holds shards"):
        receive_program(plan_engine_shards(export, colocated_ranks(2, "sglang", 2), dims), 0)
    eplan = plan_engine_shards(export, disaggregated_ranks(2, "vllm", 2, 2), dims)
    program = json.loads(json.dumps(receive_program(eplan, 3)))
    # the program sent is the engine rank's own per-bucket programs, plain JSON data, run as received
    sent = receive_plan(program)
    full = EngineExecutor(eplan, None, {}, torch.device("cpu"), rank=3).programs
    assert [p.to_dict() for p in sent] == [p.to_dict() for p in full] == program["buckets"]
    assert [(p.entries, p.layout, [(peer, [(it.source, it.dtype, it.entry, it.piece.start, it.piece.step,
                                            it.piece.count, it.piece.add) for it in items]) for peer, items in p.recvs])
            for p in sent] == \
        [(p.entries, p.layout, [(peer, [(it.source, it.dtype, it.entry, it.piece.start, it.piece.step,
                                         it.piece.count, it.piece.add) for it in items]) for peer, items in p.recvs])
         for p in full]
    assert not any(p.sends or p.local for p in full)
    assert sum(packed_bytes(items) for p in sent for _, items in p.recvs) == eplan.bytes_by_receiver()[3]["wire"] > 0
    with pytest.raises(EngineShardError, match="receive-only"):  # a trainer rank's program is not sent
        [p.to_dict() for p in EngineExecutor(eplan, None, dict.fromkeys(export.sources), torch.device("cpu"),
                                             rank=0).programs]
    # a receiver that has not received its program says so (no AttributeError), before any transfer
    idle = EngineShardReceiver(None, 3)
    with pytest.raises(EngineShardError, match="expected setup"):
        _ = idle.expected_bytes
    with pytest.raises(EngineShardError, match="expected setup"):
        next(idle.buckets())
