"""The all-ranks export's last all-gather lands in the output bucket (issue 15): each EP rank converts its experts
into its slot of the output and the all-gather runs in place there, so the gathered bytes are never copied again.
Bit-identical to the source and to the same plan through staging; prints the bytes each way moves."""

import worlds

from mcore2hf.testing.world import Layout, run_world


def test_ep2_all_gather_lands_in_the_output_bit_identical_and_copies_less(ckpts):
    layout = Layout(ep=2, etp=1)
    archs = {mt: ckpts[mt] for mt in ("qwen3_moe", "deepseek_v3")}
    results = run_world(worlds.direct_gather_suite, layout, archs, layout, 64 * 1024)
    for rank, res in enumerate(results):
        for mt, r in res.items():
            d, s = r["direct"], r["staged"]
            print(f"rank {rank} {mt}: {r['direct_buckets']}/{r['buckets']} buckets direct; bytes per export: "
                  f"received {d['received_bytes']} (staged {s['received_bytes']}), copied after the collectives "
                  f"{d['copied_bytes']} (staged {s['copied_bytes']}), packed {d['packed_bytes']} "
                  f"(staged {s['packed_bytes']})")
            assert r["direct_buckets"] > 0, (mt, r)
            assert d["received_bytes"] == s["received_bytes"], (mt, r)
            assert d["copied_bytes"] < s["copied_bytes"], (mt, r)
