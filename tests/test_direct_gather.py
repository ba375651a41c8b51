"""The all-ranks export's last all-gather lands in the output bucket (issue 15): each EP rank converts its experts
into its slot of the output and the all-gather runs in place there, so the gathered bytes are never copied again.
Bit-identical to the source and to the same plan through staging; prints the bytes each way moves."""

import worlds
from oracle import logit_problems

from mcore2hf.runtime.world import Layout, run_world


def test_ep2_all_gather_lands_in_the_output_bit_identical_and_copies_less(ckpts):
    layout = Layout(ep=2, etp=1)
    archs = {mt: ckpts[mt] for mt in ("qwen3_moe", "deepseek_v3")}
    results = run_world(worlds.direct_gather_suite, layout, archs, layout, 64 * 1024)
    logits = [{mt: r["logits"] for mt, r in res.items()} for res in results]
    problems = logit_problems(logits, archs, worlds.TOKENS, str(layout))
    assert not problems, "\n".join(problems)
    for rank, res in enumerate(results):
        for mt, r in res.items():
            d, s = r["direct"], r["staged"]
            print(f"rank {rank} {mt}: {r['direct_buckets']}/{r['buckets']} buckets direct; bytes per export: "
                  f"received {d['received_bytes']} (staged {s['received_bytes']}), copied after the collectives "
                  f"{d['copied_bytes']} (staged {s['copied_bytes']}), packed {d['packed_bytes']} "
                  f"(staged {s['packed_bytes']}); {r['cat_slots']} slots filled by one concatenation")
            assert r["direct_buckets"] > 0 and r["sync_buckets"] == r["buckets"], (mt, r)
            if mt == "qwen3_moe":  # its experts' fc1 [gate; up] and fc2 land as they are: one concatenation per slot
                assert r["cat_slots"] > 0, r
            assert d["received_bytes"] == s["received_bytes"], (mt, r)
            assert d["copied_bytes"] < s["copied_bytes"], (mt, r)
            # on CPU each all-gather is one round of one send and one receive per peer (EP 2: 2 messages), gloo's
            # own all-gather never (it copies the whole result out of a buffer of its own)
            assert d["collectives"] == 0 and d["messages"] == 2 * d["gathers"] > 0, (mt, r)


def _qwen3_moe_sources(ep: int, experts: int = 8, layers: int = 2):
    """The plan's sources of a tiny Qwen3-MoE at EP `ep` (TP 1), from rank records as each rank would send them."""
    from mcore2hf.plan import RankRecord, build_sources
    from mcore2hf.registry import get_converter, get_model_spec
    from mcore2hf.runtime.tiny import tiny_config

    cfg = tiny_config("qwen3_moe", num_experts=experts, num_hidden_layers=layers)
    h, i, hd = cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    dense = [("embedding.word_embeddings.weight", (cfg.vocab_size, h)), ("output_layer.weight", (cfg.vocab_size, h)),
             ("decoder.final_layernorm.weight", (h,))]
    for layer in range(layers):
        p = f"decoder.layers.{layer}."
        dense += [(p + "input_layernorm.weight", (h,)), (p + "pre_mlp_layernorm.weight", (h,)),
                  (p + "self_attention.q_layernorm.weight", (hd,)), (p + "self_attention.k_layernorm.weight", (hd,)),
                  (p + "self_attention.linear_qkv.weight", (qkv, h)),
                  (p + "self_attention.linear_proj.weight", (h, cfg.num_attention_heads * hd)),
                  (p + "mlp.router.weight", (experts, h))]
    records = []
    for r in range(ep):
        ts = [(n, n, shape, "torch.bfloat16", False, False, None, 1) for n, shape in dense]
        for layer in range(layers):
            for e in range(r * experts // ep, (r + 1) * experts // ep):
                p = f"decoder.layers.{layer}.mlp.experts.{e}."
                ts += [(p + "linear_fc1.weight", p, (2 * i, h), "torch.bfloat16", True, False, None, 1),
                       (p + "linear_fc2.weight", p, (h, i), "torch.bfloat16", True, False, None, 1)]
        records.append(RankRecord(r, 0, 0, r, 0, tuple(ts)))
    spec = get_model_spec("qwen3_moe")
    return build_sources(records, get_converter("qwen3_moe"), spec.dims(cfg), 1, 1)


def test_direct_layout_ep2_and_ep4_member_slots_tile_the_bucket():
    from mcore2hf.plan import assign_buckets

    for ep in (2, 4):
        sources = _qwen3_moe_sources(ep)
        expert = sources["decoder.layers.0.mlp.experts.0.linear_fc1.weight"].hf_nbytes
        # buckets of at least one expert per EP rank, closing at different phases of the rotation over EP ranks
        for budget in ((ep + 1) * expert, (2 * ep + 1) * expert + 100, 4 * ep * expert):
            buckets = assign_buckets(sources, budget)
            names = [e.name for b in buckets for e in b.entries]
            assert len(names) == len(set(names)) == sum(len(s.hf_names) for s in sources.values())
            staged = [b.index for b in buckets[:-1] if b.direct is None and any(s.is_expert for s in b.sources)]
            assert not staged, (ep, budget, staged)  # every EP all-gather but the last lands in its output
            for b in buckets:
                ends = [(e.start, e.start + e.nbytes) for e in b.entries]
                assert ends[0][0] == 0 and all(a[1] == c[0] for a, c in zip(ends, ends[1:])), ends  # tight, in order
                assert ends[-1][1] == b.nbytes and all(e.start % e.dtype.itemsize == 0 for e in b.entries)
                if b.direct is None:
                    continue
                of = {s.name: s for s in b.sources}
                for e in b.entries:  # member m's experts fill [m * slot, (m + 1) * slot), the rest follows
                    s = of[e.source]
                    if s.is_expert:
                        assert s.ep * b.direct <= e.start and e.start + e.nbytes <= (s.ep + 1) * b.direct, e.name
                    else:
                        assert e.start >= ep * b.direct, e.name
