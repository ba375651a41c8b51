"""Layout invariance: the same HF weights, loaded into real megatron-core models at every parallel layout,
export bit-identical HF tensors (all-ranks and chosen-receiver modes, save_pretrained, TE names). The TE names
(testing/te_naming.py) are those of megatron-core's own TE spec (testing/te_spec.py; per rank, any layout), and
every one outside MTP is a name of Megatron-Bridge 0.3.1's published table where it has one for the architecture.

Every architecture runs in each layout's world (format-mates in three: conftest.FORMAT_MATES); GLM-4.5 and DeepSeek-V3 include their MTP layer, so MTP
tensors round-trip through load_hf_weights and export, names included.

Engine-sharded export (issue 15) in every world: each architecture is exported to colocated SGLang / vLLM engine
ranks (worlds.ENGINE_PLACEMENTS: engine TP 1/2/4, with and without engine EP, TP 4 > kv heads, spread over the
worlds); every rank's slices equal the engine's slices of the full HF tensors bit for bit, and it receives exactly
the bytes its engine rank loads minus those it holds."""

import os

import pytest
import worlds
from conftest import only_full
from harness.te_spec import BRIDGE_TABLES, bridge_problems
from oracle import logit_problems

from mcore2hf.runtime.world import Layout, run_world

# third field: the format-mates (conftest.FORMAT_MATES) run in this world too; fourth: a sequence-parallel model
LAYOUTS = [
    (Layout(), "float32", False, False),
    (Layout(tp=2, ep=2, etp=1), "float32", False, True),  # expert-TP != TP, sequence parallel
    (Layout(tp=2, pp=2, ep=2, etp=1), "float32", True, False),
    (Layout(pp=2, vpp=2, ep=2, etp=1), "float32", True, False),  # virtual pipeline
    (Layout(tp=2, pp=2, ep=4, etp=1), "bfloat16", False, False),  # 8 workers
    (Layout(pp=2, first_stage_layers=1), "float32", True, False),  # uneven pipeline: 1 + 3 layers
    (Layout(ep=2, etp=2), "float32", False, False),  # expert-TP > TP
]
ETP1_ONLY = {"gpt_oss"}


@pytest.mark.parametrize("layout,dtype,mates,sp", LAYOUTS,
                         ids=[f"{lay}-{dt}{'-sp' if sp else ''}" for lay, dt, _, sp in LAYOUTS])
def test_layout_invariance_all_architectures(layout, dtype, mates, sp, ckpts, ckpts_bf16, te_specs, tmp_path,
                                             capsys):
    source = ckpts_bf16 if dtype == "bfloat16" else ckpts
    source = source if mates else only_full(source)
    # gpt-oss's expert biases exist in megatron-core only at expert-TP 1 (its spec refuses more: test_gpt_oss.py)
    source = {mt: c for mt, c in source.items() if layout.expert_tp == 1 or mt not in ETP1_ONLY}
    results = run_world(worlds.for_each_arch, layout, worlds.layout_matrix, source, layout, dtype,
                        str(tmp_path), te_specs, sp, timeout=420)
    # the padding rows the load must zero exist (vocab_size is no multiple of 128 x TP for some architecture)
    assert sum(r[mt]["padding_rows"] for r in results for mt in r) > 0
    # the oracle that is not mcore2hf: the Megatron forward at this layout equals transformers' (same on every rank)
    logits = [{mt: r["logits"] for mt, r in res.items()} for res in results]
    problems = logit_problems(logits, source, worlds.TOKENS, str(layout))
    assert not problems, "\n".join(problems)
    for mt, r in results[0].items():
        assert r["buckets_4k"] > 1, mt
        # gpt-oss's stacked experts (16 KiB per expert) exceed 4 KiB buckets: gathered in rounds of one expert
        assert r["rounds_4k"] == (4 * 2 * 8 if mt == "gpt_oss" else 0), (mt, r)  # 4 layers x 2 weights x 8
        assert os.path.isdir(tmp_path / mt / str(layout))
        if mt in BRIDGE_TABLES:  # Megatron-Bridge's table for TE-built models names every TE name
            assert not bridge_problems(mt, r["te_names"]), (mt, bridge_problems(mt, r["te_names"]))
    # the dry run (`mcore2hf plan`), in one process without a world, is the plan the live ranks built: the same
    # rank records, describe() text and every rank's memory estimate
    dry = worlds.in_fresh_process(worlds.dry_run_plans, source, layout, dtype, 4096)
    for mt, (text, records, memory) in dry.items():
        live_text, live_records = results[0][mt]["plan_4k"]
        assert records == live_records, (mt, [r.rank for r, q in zip(records, live_records) if r != q])
        assert text == live_text, mt
        assert memory == [r[mt]["memory_4k"] for r in results], (mt, memory, [r[mt]["memory_4k"] for r in results])
    # engine-sharded export (issue 15) at this world's engine placements (worlds.ENGINE_PLACEMENTS)
    problems = [p for mt in results[0] for p in worlds.engine_problems(mt, [r[mt]["engine"] for r in results], layout)]
    assert not problems, "\n".join(problems)
    with capsys.disabled():  # the engine checks' share of this world's time (slowest rank, all architectures)
        print(f"\n{layout}: engine-sharded export checks "
              f"{sum(max(r[mt]['engine_s'] for r in results) for mt in results[0]):.1f} s")


def test_engine_placements_cover_tp_1_2_4_with_and_without_ep_for_every_architecture():
    """The engine placements spread over the worlds (worlds.ENGINE_PLACEMENTS) still give every architecture, the
    format-mates alone included, engine TP 1 (where both engines load everything) and, per engine, TP 2 and 4
    with and without engine EP (SGLang also EP 2 x expert TP 2), so editing the spread cannot drop a case."""
    from conftest import ARCHS, FORMAT_MATES

    want = {("sglang", 2, 1, None), ("sglang", 4, 1, None), ("vllm", 2, 1, None), ("vllm", 4, 1, None)}
    want_moe = {("sglang", 2, 2, None), ("sglang", 4, 4, None), ("sglang", 4, 2, 2), ("vllm", 2, 2, None),
                ("vllm", 4, 4, None)}
    for mt in ARCHS:
        got = {p for layout, _, mates, _ in LAYOUTS if mates or mt not in FORMAT_MATES
               if layout.expert_tp == 1 or mt not in ETP1_ONLY for p in worlds.engine_placements(layout)}
        assert any(tp == 1 for _, tp, _, _ in got), mt
        assert want | want_moe <= got, (mt, sorted((want | want_moe) - got, key=str))


def test_mcore2hf_list_states_these_worlds():
    """`mcore2hf list` says how many layout worlds run each architecture: the counts above, not a claim."""
    import re

    from conftest import ARCHS, FORMAT_MATES

    from mcore2hf.arch.registry import verified

    for mt in ARCHS:
        worlds_run = sum(1 for layout, _, mates, _ in LAYOUTS if (mates or mt not in FORMAT_MATES)
                         and (layout.expert_tp == 1 or mt not in ETP1_ONLY))
        stated = re.match(r"(\d+) layout worlds", verified(mt))
        assert stated and int(stated.group(1)) == worlds_run, (mt, worlds_run, verified(mt))

