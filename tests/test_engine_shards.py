"""Engine sharding rules (mcore2hf.plan.engine_shards): pure-function tests, a coverage check over every registered
architecture, and the real-engine oracle: the engines' own layer classes and weight loaders, from sglang 0.5.23's
and vllm 0.33.0's published wheels on CPU (one subprocess per engine, GPU-only imports stubbed by
harness.sglang_real.install / vllm_real.install_gpu_stubs), fed (a) the full HF tensor and (b) our
NaN-filled tensor (only the rank's regions written) must end with identical, NaN-free parameters.

Run as a script (`python tests/test_engine_shards.py ENGINE SITE_DIR OUT.json`) it is that subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from mcore2hf.arch.mapping import ModelDims  # noqa: E402
from mcore2hf.plan.engine_shards import (  # noqa: E402
    EnginePlacement,
    EngineShardError,
    engine_regions,
    engine_slices,
    has_sharding_kind,
    mask_to_engine,
    padded_vocab,
    place_slices,
    region_slices,
    regions_bytes,
    sharding_kind,
)

SGLANG, VLLM = "0.5.23", "0.33.0"
TPS = (1, 2, 4)

# the oracle's shapes: 4 query heads and 2 kv heads (so TP 4 replicates kv heads), head_dim 4, hidden 8, vocab 100
# (padded to 128: TP 4's last rank holds 4 real rows), 8 experts of intermediate 12 (3 per rank at expert TP 4)
H, HEADS, KV, HD, VOCAB, E, INTER = 8, 4, 2, 4, 100, 8, 12
# gated DeltaNet: 4 key heads, 8 value heads (2 per key head), head dims 4, conv kernel 4: TP 1/2/4 all split heads
NK, NV, DK, DV, CK = 4, 8, 4, 4, 4
KD, VD = NK * DK, NV * DV
# a vision tower (Qwen3-VL's): the same 4 heads of 4 (no GQA), 25 position embeddings (sglang pads them to 64)
NPOS = 25
DIMS = ModelDims(hidden_size=H, num_layers=1, vocab_size=VOCAB, num_attention_heads=HEADS, num_query_groups=KV,
                 head_dim=HD, num_experts=E, linear_num_key_heads=NK, linear_num_value_heads=NV,
                 linear_key_head_dim=DK, linear_value_head_dim=DV, vision_num_heads=HEADS, vision_head_dim=HD)


def placements(engine: str, tp: int, moe: bool = False) -> list[EnginePlacement]:
    """Every rank of engine TP `tp`, without EP and (MoE, tp > 1) with EP over all of TP; SGLang also with
    expert TP inside EP (ep 2 x moe_tp 2 at TP 4)."""
    eps = [1] + ([tp] if moe and tp > 1 else []) + ([2] if moe and engine == "sglang" and tp == 4 else [])
    return [EnginePlacement(engine, r, tp, ep_size=ep) for ep in eps for r in range(tp)]


# ------------------------------------------------------------------------------------------------- pure functions

def test_placement_ranks_tp4_ep2_sglang_moe_tp_innermost():
    got = [(p.ep_rank, p.moe_tp_rank) for p in (EnginePlacement("sglang", r, 4, ep_size=2) for r in range(4))]
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1)]  # sglang distributed/parallel_state.py _MOE_EP / _MOE_TP groups


def test_placement_refusals():
    for bad in (dict(engine="trt", tp_rank=0, tp_size=1), dict(engine="vllm", tp_rank=2, tp_size=2),
                dict(engine="vllm", tp_rank=0, tp_size=4, ep_size=2), dict(engine="sglang", tp_rank=0, tp_size=4,
                                                                             ep_size=3),
                dict(engine="sglang", tp_rank=0, tp_size=4, ep_size=2, moe_tp=1)):
        try:
            EnginePlacement(**bad)
        except EngineShardError as e:
            assert "expected" in str(e)
        else:
            raise AssertionError(f"accepted {bad}")


def test_unknown_name_refused_with_the_table_named():
    try:
        sharding_kind("model.layers.0.mlp.mystery.weight")
    except EngineShardError as e:
        assert "model.layers.0.mlp.mystery.weight" in str(e) and "KINDS" in str(e)
    else:
        raise AssertionError("accepted")


def test_kv_heads_regions_8x8_tp4_two_kv_heads_replicated_in_pairs():
    regions = [engine_regions("model.layers.0.self_attn.k_proj.weight", (KV * HD, H), DIMS,
                              EnginePlacement("vllm", r, 4)) for r in range(4)]
    assert regions == [[((0, 0, 4),)], [((0, 0, 4),)], [((0, 4, 4),)], [((0, 4, 4),)]]


def test_vocab_regions_100x8_tp4_last_rank_4_real_rows():
    for engine in ("sglang", "vllm"):
        regions = [engine_regions("lm_head.weight", (VOCAB, H), DIMS, EnginePlacement(engine, r, 4))
                   for r in range(4)]
        assert regions == [[((0, 0, 32),)], [((0, 32, 32),)], [((0, 64, 32),)], [((0, 96, 4),)]]


def test_vocab_128x8_padded_rows_refused():
    try:
        engine_regions("model.embed_tokens.weight", (128, H), DIMS, EnginePlacement("sglang", 0, 2))
    except EngineShardError as e:
        assert "expected 100 rows" in str(e) and "found 128" in str(e)
    else:
        raise AssertionError("a padded embedding is not an HF tensor the engines load")


def test_padded_vocab_100_tp3_sglang_multiplies_padding_by_tp_vllm_refuses():
    assert padded_vocab(100, EnginePlacement("sglang", 0, 4)) == 128 == padded_vocab(100, EnginePlacement("vllm", 0, 4))
    assert padded_vocab(100, EnginePlacement("sglang", 0, 3)) == 192  # 128 % 3 != 0: padding 64 * 3
    try:
        padded_vocab(100, EnginePlacement("vllm", 0, 3))
    except EngineShardError as e:
        assert "128" in str(e) and "tp_size 3" in str(e)
    else:
        raise AssertionError("vllm asserts the padded vocab divides over TP")


def test_expert_regions_8_experts_ep2_moe_tp2_sglang():
    name = "model.layers.0.mlp.experts.5.gate_proj.weight"
    got = {r: engine_regions(name, (INTER, H), DIMS, EnginePlacement("sglang", r, 4, ep_size=2)) for r in range(4)}
    assert got == {0: [], 1: [], 2: [((0, 0, 6),)], 3: [((0, 6, 6),)]}


def test_expert_owner_vllm_linear_placement_uneven_7_experts_ep2():
    dims = ModelDims(hidden_size=8, num_layers=1, vocab_size=100, num_attention_heads=4, num_query_groups=2,
                     head_dim=2, num_experts=7)
    owners = [[r for r in range(2) if engine_regions(f"model.layers.0.mlp.experts.{e}.down_proj.weight", (8, 12),
                                                     dims, EnginePlacement("vllm", r, 2, ep_size=2))]
              for e in range(7)]
    assert owners == [[0], [0], [0], [0], [1], [1], [1]]  # expert_map_manager.py: the first E % ep get one more


def test_mask_to_engine_column_16x8_tp2_rank1_nan_outside():
    full = torch.randn(16, 8)
    regions = engine_regions("model.layers.0.self_attn.q_b_proj.weight", full.shape, DIMS,
                             EnginePlacement("sglang", 1, 2))
    out = mask_to_engine(full, regions, debug=True)
    assert torch.equal(out[8:], full[8:]) and out[:8].isnan().all()


def test_mask_to_engine_refuses_nan_debug_for_int_tensor_4x4():
    try:
        mask_to_engine(torch.zeros(4, 4, dtype=torch.int32), [()], debug=True)
    except EngineShardError as e:
        assert "torch.int32" in str(e)
    else:
        raise AssertionError("accepted")


def test_engine_slices_round_trip_row_8x16_tp4():
    full = torch.randn(8, 16)
    out = torch.zeros_like(full)
    for r in range(4):
        regions = engine_regions("model.layers.0.self_attn.o_proj.weight", full.shape, DIMS,
                                 EnginePlacement("vllm", r, 4))
        slices = engine_slices(full, regions)
        assert [s.region for s in slices] == [((1, 4 * r, 4),)] and slices[0].tensor.shape == (8, 4)
        place_slices(slices, out)
    assert torch.equal(out, full)


def test_stacked_gate_up_2x8x24_tp2_interleaved_columns_sglang_refuses_ep():
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for engine in ("sglang", "vllm"):
        got = [engine_regions(name, (2, H, 2 * INTER), DIMS, EnginePlacement(engine, r, 2)) for r in range(2)]
        assert got == [[((2, 0, 12),)], [((2, 12, 12),)]]
    assert engine_regions(name, (2, H, 2 * INTER), DIMS, EnginePlacement("vllm", 1, 2, ep_size=2)) == [((0, 1, 1),)]
    try:
        engine_regions(name, (2, H, 2 * INTER), DIMS, EnginePlacement("sglang", 0, 2, ep_size=2))
    except EngineShardError as e:
        assert "weight_loader_fused" in str(e) and "not declared" in str(e)
    else:
        raise AssertionError("sglang's stacked experts under EP are not declared: must be refused")


def test_shared_experts_12x8_tp2_split_or_replicated():
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert engine_regions(name, (H, INTER), DIMS, EnginePlacement("sglang", 1, 2)) == [((1, 6, 6),)]
    assert engine_regions(name, (H, INTER), DIMS,
                          EnginePlacement("vllm", 1, 2, replicated_shared_experts=True)) == [()]


def test_mask_to_engine_normal_mode_writes_regions_kv_8x8_tp4():
    full = torch.randn(KV * HD, H)
    regions = engine_regions("model.layers.0.self_attn.v_proj.weight", full.shape, DIMS, EnginePlacement("vllm", 3, 4))
    out = mask_to_engine(full, regions)
    assert regions == [((0, 4, 4),)] and torch.equal(out[4:], full[4:]) and out.shape == full.shape


def test_linear_qkv_parts_conv1d_64x1x4_tp2_three_boxes_per_rank():
    name = "model.layers.0.linear_attn.conv1d.weight"
    got = [engine_regions(name, (2 * KD + VD, 1, CK), DIMS, EnginePlacement("sglang", r, 2)) for r in range(2)]
    assert got == [[((0, 0, 8),), ((0, 16, 8),), ((0, 32, 16),)], [((0, 8, 8),), ((0, 24, 8),), ((0, 48, 16),)]]
    assert engine_regions(name, (2 * KD + VD, 1, CK), DIMS, EnginePlacement("vllm", 0, 1)) == [()]


def test_linear_heads_96x8_tp8_refused_when_tp_does_not_divide_key_heads():
    for name, shape in (("model.layers.0.linear_attn.in_proj_qkvz.weight", (2 * KD + 2 * VD, H)),
                        ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", (2 * KD + VD, H))):
        try:
            engine_regions(name, shape, DIMS, EnginePlacement("vllm", 0, 8))
        except EngineShardError as e:
            assert "tp_size 8" in str(e) and "4 linear key heads" in str(e)
        else:
            raise AssertionError(f"{name}: 8 ranks cannot split 4 key heads")


def test_linear_qkv_parts_72x8_wrong_part_sizes_refused():
    try:
        engine_regions("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", (72, H), DIMS,
                       EnginePlacement("sglang", 0, 2))
    except EngineShardError as e:
        assert "16 + 16 + 32" in str(e) and "found 72" in str(e)
    else:
        raise AssertionError("accepted")


def test_qwen3_5_language_model_names_and_qwen2_style_shared_expert_kinds():
    lm = "model.language_model"
    assert sharding_kind(f"{lm}.embed_tokens.weight") == ("vocab", None)
    assert sharding_kind(f"{lm}.norm.weight") == ("replicated", None)
    assert sharding_kind(f"{lm}.layers.3.self_attn.q_proj.weight") == ("column", None)  # [q_h; gate_h] per head
    assert sharding_kind(f"{lm}.layers.0.mlp.experts.7.down_proj.weight") == ("expert_row", 7)
    assert sharding_kind("model.layers.0.mlp.shared_expert.up_proj.weight") == ("shared_column", None)
    assert sharding_kind("model.layers.0.mlp.shared_expert_gate.weight") == ("replicated", None)
    assert sharding_kind(f"{lm}.layers.0.linear_attn.norm.weight") == ("replicated", None)
    for bad in ("model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"):  # not held, not sent
        try:
            sharding_kind(bad)
        except EngineShardError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_vision_tower_qkv_thirds_and_position_rows():
    """Qwen3-VL's tower: the fused attn.qkv [q; k; v] (48 rows: 4 heads of 4 each) is three boxes per rank at TP 2
    (QKVParallelLinear's thirds narrowed to the rank's heads), whole at TP 1, refused where the heads do not divide;
    pos_embed is sglang's VocabParallelEmbedding (25 rows padded to 64: TP 2's rank 0 holds every real row) and
    vllm's whole nn.Embedding; the tower is declared for the Qwen3-VL family only (GLM-4.5V's is not in the table)."""
    qkv = "model.visual.blocks.2.attn.qkv.weight"
    assert sharding_kind(qkv, "qwen3_vl") == ("vision_qkv", None)
    assert [engine_regions(qkv, (48, H), DIMS, EnginePlacement("vllm", r, 2), "qwen3_5") for r in (0, 1)] == [
        [((0, 0, 8),), ((0, 16, 8),), ((0, 32, 8),)], [((0, 8, 8),), ((0, 24, 8),), ((0, 40, 8),)]]
    assert engine_regions(qkv, (48, H), DIMS, EnginePlacement("sglang", 0, 1), "qwen3_vl") == [()]
    with pytest.raises(EngineShardError, match="dividing the 3 vision heads"):
        engine_regions(qkv, (36, H), dataclasses.replace(DIMS, vision_num_heads=3), EnginePlacement("sglang", 0, 2),
                       "qwen3_vl")
    with pytest.raises(EngineShardError, match="expected dim 0 = 3 x 4 heads x 4 = 48"):
        engine_regions(qkv, (40, H), DIMS, EnginePlacement("sglang", 0, 2), "qwen3_vl")
    pos = "model.visual.pos_embed.weight"
    assert [engine_regions(pos, (NPOS, H), DIMS, EnginePlacement("sglang", r, 2), "qwen3_vl") for r in (0, 1)] == [
        [((0, 0, NPOS),)], []]
    assert engine_regions(pos, (NPOS, H), DIMS, EnginePlacement("vllm", 1, 2), "qwen3_vl") == [()]
    assert sharding_kind("model.visual.deepstack_merger_list.1.linear_fc2.weight", "qwen3_vl_moe")[0] == "row"
    assert sharding_kind("model.visual.merger.linear_fc2.bias", "qwen3_5_moe")[0] == "replicated"
    with pytest.raises(EngineShardError, match="found none that matches"):
        sharding_kind(qkv, "glm4v_moe")


def _expected_multiplicity(kind: str, p: EnginePlacement, dims: ModelDims) -> int:
    """How many ranks of one engine load each element of a tensor of `kind`."""
    if kind in ("shared_column", "shared_row"):
        kind = "replicated" if p.replicated_shared_experts else "column"
    if kind == "position_rows":
        kind = "replicated" if p.engine == "vllm" else "column"
    if kind == "replicated":
        return p.tp_size
    if kind == "kv_heads" and p.tp_size > dims.num_query_groups:
        return p.tp_size // dims.num_query_groups
    return 1


def test_every_architecture_regions_cover_each_tensor_as_the_engine_loads_it(capsys):
    """For every registered architecture (tiny config, MTP layers included), engine TP 1/2/4 with and without EP:
    the ranks' regions cover every element of every HF tensor exactly as often as the engine loads it (replicated:
    every rank; kv heads under replication: tp / kv heads ranks; everything else: exactly one rank), and the
    bytes each rank needs are printed against the full model's bytes."""
    from mcore2hf.arch.hf_config import hf_tensor_shapes
    from mcore2hf.arch.registry import architectures, get_converter, get_model_spec
    from mcore2hf.runtime.tiny import tiny_config

    report, skipped, refused_towers = [], set(), set()
    for model_type in architectures():
        cfg = tiny_config(model_type)
        dims = get_model_spec(model_type).dims(cfg)
        # what the export sends: the language model, and a vision tower where the table covers it (a Megatron model
        # holding Qwen3-VL's or Qwen3.5's tower: layouts 1 and 2 of docs/vlm.md); never Qwen3.5's MTP
        conv = get_converter(model_type)
        shapes = hf_tensor_shapes(cfg, dims.num_mtp_layers)
        shapes = {n: v for n, v in shapes.items() if not conv.not_held_by_model(n)
                  or (n.startswith("model.visual.") and has_sharding_kind(n, model_type))}
        full_bytes = sum(torch.Size(s).numel() for s in shapes.values()) * 4
        for engine in ("sglang", "vllm"):
            for tp in TPS:
                if dims.num_attention_heads % tp:
                    continue
                if dims.linear_num_key_heads and dims.linear_num_key_heads % tp:  # both engines: heads / tp
                    gdn = next(n for n in shapes if ".linear_attn.in_proj" in n)
                    with pytest.raises(EngineShardError, match="linear key heads"):
                        engine_regions(gdn, shapes[gdn], dims, EnginePlacement(engine, 0, tp), model_type)
                    report.append(f"{model_type:14s} {engine:6s} tp{tp}: refused ({dims.linear_num_key_heads} "
                                  "linear key heads)")
                    continue
                for ep in sorted({ps.ep_size for ps in placements(engine, tp, dims.num_experts > 0)}):
                    ranks = [p for p in placements(engine, tp, dims.num_experts > 0) if p.ep_size == ep]
                    need = [0] * tp
                    for name, shape in shapes.items():
                        count = torch.zeros(shape, dtype=torch.int32)
                        try:
                            kind, _ = sharding_kind(name, model_type)
                            for p in ranks:
                                regions = engine_regions(name, shape, dims, p, model_type)
                                for region in regions:
                                    count[region_slices(region)] += 1
                                need[p.tp_rank] += regions_bytes(regions, shape, torch.float32)
                        except EngineShardError as err:
                            # the engines assert that their TP divides the tower's heads: all of it refused then
                            if name.startswith("model.visual.") and dims.vision_num_heads % tp:
                                refused_towers.add(f"{model_type} tp{tp}")
                                continue
                            if "not declared" not in str(err):
                                raise
                            skipped.add(f"{model_type} {engine} ep{ep} {name.split('.')[-1]}")
                            continue
                        want = _expected_multiplicity(kind, ranks[0], dims)
                        assert (count == want).all(), (model_type, engine, tp, ep, name, kind,
                                                       count.unique().tolist(), want)
                    report.append(f"{model_type:14s} {engine:6s} tp{tp} ep{ep}: full {full_bytes:8d} B, per rank "
                                  + " ".join(f"{b:8d}" for b in need)
                                  + f" (max {max(need) / full_bytes:.2f} of full)")
    # the towers covered (Qwen3-VL's 3 heads, Qwen3.5's 2): every tensor at TP 1 (Qwen3.5's at TP 2 too), refused
    # where their heads do not divide (Qwen3.5 at TP 4: already for its 2 linear key heads)
    assert refused_towers == {"qwen3_vl tp2", "qwen3_vl tp4", "qwen3_vl_moe tp2", "qwen3_vl_moe tp4"}, refused_towers
    covered = {line.split()[0] for line in report}
    assert {"qwen3_next", "qwen3_5", "qwen3_5_moe"} <= covered, covered  # the gated DeltaNet architectures
    with capsys.disabled():
        print("\nengine-rank bytes needed (fp32, tiny configs):\n" + "\n".join(report))
        print("not declared (refused):", sorted(skipped))
    # Qwen3-VL-MoE's packed experts: not in the table (engine_shards.ARCH_KINDS), at every placement
    packed = {s for s in skipped if s.startswith("qwen3_vl_moe ")}
    assert {s.split()[-1] for s in packed} == {"gate_up_proj", "down_proj"} and len(packed) >= 2 * 2, packed
    assert skipped - packed == {f"gpt_oss sglang ep{ep} {n}" for ep in (2, 4)
                                for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}, skipped


# ------------------------------------------------------------------------------------------------- real-engine oracle
# Each case: HF tensors (name -> full tensor) and how the engine's layer loads them. The harness builds the engine
# layer at every rank of TP 1/2/4 (and EP), loads (a) full tensors, (b) mask_to_engine(full, regions, debug=True),
# (c) all-NaN tensors (the loader must read something: NaN reaches the parameters, or the case proves nothing).

CASES = ("column", "row", "qkv", "merged_column", "vocab_embedding", "lm_head", "fused_moe", "minimax_qk_norm",
         "gpt_oss_experts", "mla_fused_a", "vocab_tp3", "gdn_qwen3_next", "gdn_qwen3_5", "gated_qkv", "dsa_indexer",
         "vision_tower")
#: engine TP sizes per case (vocab_tp3: 128 rows do not divide over 3: sglang pads to 192, vllm refuses)
CASE_TPS = {"vocab_tp3": (3,)}
Q_LORA, KV_LORA = 12, 6
IH, ID = 3, 8  # DeepSeek sparse attention's indexer: heads, head dim
#: the architecture whose per-architecture rules a case exercises
CASE_MODEL_TYPE = {"minimax_qk_norm": "minimax_m2", "gpt_oss_experts": "gpt_oss", "gdn_qwen3_next": "qwen3_next",
                   "gdn_qwen3_5": "qwen3_5", "gated_qkv": "qwen3_5", "vision_tower": "qwen3_vl"}
#: Qwen3.5's split DeltaNet inputs -> (packed engine parameter, shard id): sglang 0.5.23 models/qwen3_5.py
#: stacked_params_mapping, vllm 0.33.0 models/qwen3_5.py Qwen3_5Model.hf_to_vllm_mapper orig_to_new_stacked
#: (the vllm harness checks its table equals this one)
QWEN3_5_STACKED = {"in_proj_qkv": ("in_proj_qkvz", (0, 1, 2)), "in_proj_z": ("in_proj_qkvz", 3),
                   "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}
#: (engine, case): EP sizes the engine's rules do not declare for the case (engine_regions refuses them)
NOT_DECLARED_EP = {("sglang", "gpt_oss_experts")}


def _hf_tensors(case: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    L = "model.layers.0"
    if case == "column":
        return {f"{L}.self_attn.q_b_proj.weight": rnd(16, H)}
    if case == "row":
        return {f"{L}.self_attn.o_proj.weight": rnd(H, 16)}
    if case == "qkv":
        return {f"{L}.self_attn.{n}_proj.{w}": rnd(*((HEADS if n == "q" else KV) * HD,) + ((H,) if w == "weight"
                                                                                             else ()))
                for n in "qkv" for w in ("weight", "bias")}
    if case == "merged_column":
        return {f"{L}.mlp.gate_proj.weight": rnd(INTER, H), f"{L}.mlp.up_proj.weight": rnd(INTER, H)}
    if case == "vocab_embedding":
        return {"model.embed_tokens.weight": rnd(VOCAB, H)}
    if case == "lm_head":
        return {"lm_head.weight": rnd(VOCAB, H)}
    if case == "minimax_qk_norm":
        return {f"{L}.self_attn.q_norm.weight": rnd(HEADS * HD), f"{L}.self_attn.k_norm.weight": rnd(KV * HD)}
    if case == "vocab_tp3":
        return {"model.embed_tokens.weight": rnd(VOCAB, H)}
    if case == "mla_fused_a":
        return {f"{L}.self_attn.q_a_proj.weight": rnd(Q_LORA, H),
                f"{L}.self_attn.kv_a_proj_with_mqa.weight": rnd(KV_LORA, H)}
    if case == "dsa_indexer":  # transformers 5.24 DeepseekV32Indexer / GlmMoeDsaIndexer
        a = f"{L}.self_attn.indexer"
        return {f"{a}.wq_b.weight": rnd(IH * ID, Q_LORA), f"{a}.wk.weight": rnd(ID, H),
                f"{a}.k_norm.weight": rnd(ID), f"{a}.k_norm.bias": rnd(ID), f"{a}.weights_proj.weight": rnd(IH, H)}
    if case == "gdn_qwen3_next":  # transformers 5.23 Qwen3NextGatedDeltaNet: packed per key head, conv [q; k; v]
        a = f"{L}.linear_attn"
        return {f"{a}.in_proj_qkvz.weight": rnd(2 * KD + 2 * VD, H), f"{a}.in_proj_ba.weight": rnd(2 * NV, H),
                f"{a}.conv1d.weight": rnd(2 * KD + VD, 1, CK), f"{a}.A_log": rnd(NV), f"{a}.dt_bias": rnd(NV),
                f"{a}.norm.weight": rnd(DV), f"{a}.out_proj.weight": rnd(H, VD)}
    if case == "gdn_qwen3_5":  # transformers 5.23 Qwen3_5GatedDeltaNet: in_proj_qkv = [q; k; v], z, b, a apart
        a = "model.language_model.layers.0.linear_attn"
        return {f"{a}.in_proj_qkv.weight": rnd(2 * KD + VD, H), f"{a}.in_proj_z.weight": rnd(VD, H),
                f"{a}.in_proj_b.weight": rnd(NV, H), f"{a}.in_proj_a.weight": rnd(NV, H),
                f"{a}.conv1d.weight": rnd(2 * KD + VD, 1, CK), f"{a}.A_log": rnd(NV), f"{a}.dt_bias": rnd(NV),
                f"{a}.norm.weight": rnd(DV), f"{a}.out_proj.weight": rnd(H, VD)}
    if case == "gated_qkv":  # gated attention: q_proj is [q_h; gate_h] per head (2 * heads * head_dim rows)
        a = "model.language_model.layers.3.self_attn"
        return {f"{a}.q_proj.weight": rnd(2 * HEADS * HD, H), f"{a}.k_proj.weight": rnd(KV * HD, H),
                f"{a}.v_proj.weight": rnd(KV * HD, H)}
    if case == "vision_tower":  # transformers 5.24 Qwen3VLVisionBlock / Qwen3VLVisionPatchMerger (biased linears)
        b, m = "model.visual.blocks.0", "model.visual.merger"
        return {f"{b}.attn.qkv.weight": rnd(3 * HEADS * HD, H), f"{b}.attn.qkv.bias": rnd(3 * HEADS * HD),
                f"{b}.attn.proj.weight": rnd(H, HEADS * HD), f"{b}.attn.proj.bias": rnd(H),
                f"{b}.mlp.linear_fc1.weight": rnd(INTER, H), f"{b}.mlp.linear_fc1.bias": rnd(INTER),
                f"{b}.mlp.linear_fc2.weight": rnd(H, INTER), f"{b}.mlp.linear_fc2.bias": rnd(H),
                f"{m}.linear_fc1.weight": rnd(4 * H, 4 * H), f"{m}.linear_fc1.bias": rnd(4 * H),
                "model.visual.pos_embed.weight": rnd(NPOS, H)}
    if case == "gpt_oss_experts":  # transformers 5.23 GptOssExperts: stacked, gate/up interleaved by column
        x = f"{L}.mlp.experts"
        return {f"{x}.gate_up_proj": rnd(E, H, 2 * INTER), f"{x}.gate_up_proj_bias": rnd(E, 2 * INTER),
                f"{x}.down_proj": rnd(E, INTER, H), f"{x}.down_proj_bias": rnd(E, H)}
    return {f"{L}.mlp.experts.{e}.{n}.weight": rnd(*((H, INTER) if n == "down_proj" else (INTER, H)))
            for e in range(E) for n in ("gate_proj", "up_proj", "down_proj")}


class _Engine:
    """The engine's own layers and loaders at one rank; `load(case, tensors)` returns the parameters."""

    def __init__(self, engine: str):
        self.engine = engine

    def set_rank(self, p: EnginePlacement) -> None:
        raise NotImplementedError

    def layer(self, case: str):
        raise NotImplementedError


def _load_linear(lin, vpe, case: str, t: dict[str, torch.Tensor]) -> torch.nn.Module | None:
    """The layer classes SGLang 0.5.23 and vLLM 0.33.0 define with the same names and signatures (layers/linear.py,
    vocab_parallel_embedding.py), built and loaded as the engine's model code does; None for the other cases."""
    k = lambda s: next(v for n, v in t.items() if n.endswith(s))  # noqa: E731
    f32 = dict(params_dtype=torch.float32)
    if case == "column":
        m = lin.ColumnParallelLinear(H, 16, bias=False, **f32)
        m.weight.weight_loader(m.weight, k("q_b_proj.weight"))
    elif case == "row":
        m = lin.RowParallelLinear(16, H, bias=False, **f32)
        m.weight.weight_loader(m.weight, k("o_proj.weight"))
    elif case in ("qkv", "gated_qkv"):  # gated: both engines' qwen3_next.py build heads * (1 + gate)
        m = lin.QKVParallelLinear(H, HD, HEADS * (2 if case == "gated_qkv" else 1), KV, bias=case == "qkv", **f32)
        for s in "qkv":
            m.weight.weight_loader(m.weight, k(f"{s}_proj.weight"), s)
            if case == "qkv":
                m.bias.weight_loader(m.bias, k(f"{s}_proj.bias"), s)
    elif case == "merged_column":
        m = lin.MergedColumnParallelLinear(H, [INTER, INTER], bias=False, **f32)
        m.weight.weight_loader(m.weight, k("gate_proj.weight"), 0)
        m.weight.weight_loader(m.weight, k("up_proj.weight"), 1)
    elif case == "vision_tower":
        # Qwen3-VL's vision block and merger as both engines' models/qwen3_vl.py build them: QKVParallelLinear over
        # all heads (kv heads = heads) filled from the fused attn.qkv without shard id (sglang load_weights' default
        # branch, vllm AutoWeightsLoader), RowParallelLinear proj / linear_fc2, ColumnParallelLinear linear_fc1
        m = torch.nn.Module()
        m.qkv = lin.QKVParallelLinear(H, HD, HEADS, HEADS, bias=True, **f32)
        m.proj = lin.RowParallelLinear(HEADS * HD, H, bias=True, **f32)
        m.fc1 = lin.ColumnParallelLinear(H, INTER, bias=True, **f32)
        m.fc2 = lin.RowParallelLinear(INTER, H, bias=True, **f32)
        m.merger_fc1 = lin.ColumnParallelLinear(4 * H, 4 * H, bias=True, **f32)
        for mod, name in ((m.qkv, "attn.qkv"), (m.proj, "attn.proj"), (m.fc1, "mlp.linear_fc1"),
                          (m.fc2, "mlp.linear_fc2"), (m.merger_fc1, "merger.linear_fc1")):
            for w in ("weight", "bias"):
                param = getattr(mod, w)
                param.weight_loader(param, k(f"{name}.{w}"))
    elif case in ("vocab_embedding", "lm_head", "vocab_tp3"):
        cls = vpe.ParallelLMHead if case == "lm_head" else vpe.VocabParallelEmbedding
        m = cls(VOCAB, H, **f32)
        m.weight.weight_loader(m.weight, next(iter(t.values())))
    else:
        return None
    return m


def _sglang_engine():
    import sglang.srt.layers.linear as lin
    import sglang.srt.layers.moe.fused_moe_triton.layer as fm
    import sglang.srt.layers.vocab_parallel_embedding as vpe

    # the GPU path (is_cpu() is true here: SGLang's CPU engine pads params with narrow_padded_param_and_loaded_weight)
    lin._is_cpu = vpe._is_cpu = fm._is_cpu = False

    def set_rank(p: EnginePlacement) -> None:
        # what runtime_context.get_parallel() answers; linear._resolve_linear_group makes a _LogicalGroup of it
        ns = types.SimpleNamespace(tp_group=None, tp_rank=p.tp_rank, tp_size=p.tp_size, attn_tp_group=None,
                                   attn_tp_rank=p.tp_rank, attn_tp_size=p.tp_size)
        lin.get_parallel = vpe.get_parallel = lambda: ns

    def load(case: str, t: dict[str, torch.Tensor], p: EnginePlacement) -> dict[str, torch.Tensor]:
        set_rank(p)
        k = lambda s: next(v for n, v in t.items() if n.endswith(s))  # noqa: E731
        f32 = dict(params_dtype=torch.float32)
        m = _load_linear(lin, vpe, case, t)
        if m is not None and case == "vision_tower":  # models/qwen3_vl.py: pos_embed a VocabParallelEmbedding
            m.pos_embed = vpe.VocabParallelEmbedding(NPOS, H, **f32)
            m.pos_embed.weight.weight_loader(m.pos_embed.weight, k("pos_embed.weight"))
        elif m is not None:
            pass  # a layer class both engines define alike
        elif case == "mla_fused_a":
            # models/deepseek_v2.py fused_qkv_a_proj_with_mqa; deepseek_common/deepseek_weight_loader.py
            # concatenates q_a_proj and kv_a_proj_with_mqa (dim 0) before its weight_loader
            m = lin.ReplicatedLinear(H, Q_LORA + KV_LORA, bias=False, **f32)
            m.weight.weight_loader(m.weight, torch.cat([k("q_a_proj.weight"), k("kv_a_proj_with_mqa.weight")]))
        elif case == "dsa_indexer":
            # layers/attention/dsa/dsa_indexer.py Indexer.__init__ without the CUDA-only fused wk_weights_proj
            # (models/deepseek_common/deepseek_weight_loader.py fills that one whole, wk rows then weights_proj rows):
            # ReplicatedLinear wq_b / wk / weights_proj, LayerNorm k_norm (default_weight_loader)
            from sglang.srt.model_loader.weight_utils import default_weight_loader

            m = torch.nn.Module()
            m.wq_b = lin.ReplicatedLinear(Q_LORA, IH * ID, bias=False, **f32)
            m.wk = lin.ReplicatedLinear(H, ID, bias=False, **f32)
            m.weights_proj = lin.ReplicatedLinear(H, IH, bias=False, **f32)
            for n in ("wq_b", "wk", "weights_proj"):
                getattr(m, n).weight.weight_loader(getattr(m, n).weight, k(f"{n}.weight"))
            m.k_norm = torch.nn.LayerNorm(ID)
            for n in ("weight", "bias"):
                default_weight_loader(getattr(m.k_norm, n), k(f"k_norm.{n}"))
        elif case == "gpt_oss_experts":
            return _sglang_gpt_oss(fm, t, p)
        elif case in ("gdn_qwen3_next", "gdn_qwen3_5"):
            return _sglang_gdn(lin, case, t, p)
        elif case == "minimax_qk_norm":
            import sglang.srt.models.minimax_m2 as mm

            mm.get_parallel, mm._is_cpu = lin.get_parallel, False
            m = torch.nn.Module()
            m.q_norm = mm.MiniMaxM2RMSNormTP(HEADS * HD, num_heads=HEADS)  # as MiniMaxM2Attention builds them
            m.k_norm = mm.MiniMaxM2RMSNormTP(KV * HD, num_heads=KV)
            m.q_norm.weight.weight_loader(m.q_norm.weight, k("q_norm.weight"))
            m.k_norm.weight.weight_loader(m.k_norm.weight, k("k_norm.weight"))
        else:
            return _sglang_moe(fm, t, p)
        return {n: v.detach().clone() for n, v in m.named_parameters()}

    return load


def _engine_methods(path: str, cls_name: str, names: tuple[str, ...], namespace: dict) -> type:
    """The methods `names` of class `cls_name` compiled from the engine's own source file, for model modules that
    cannot be imported on CPU (their import pulls kernels and CUDA custom ops); `namespace` gives the module
    globals they read."""
    import ast

    tree = ast.parse(Path(path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == set(names), (cls_name, [n.name for n in body])
    module = ast.Module(body=[ast.ClassDef(name=cls_name, bases=[], keywords=[], body=body, decorator_list=[],
                                           type_params=[])], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), path, "exec"), namespace)  # noqa: S102
    return namespace[cls_name]


def _load_gdn(m: torch.nn.Module, t: dict[str, torch.Tensor], default_loader) -> dict[str, torch.Tensor]:
    """Each HF DeltaNet tensor into its engine parameter through the parameter's weight_loader (Qwen3.5's split
    inputs with their shard ids), as the models' load_weights do; the parameters after loading."""
    params = dict(m.named_parameters())
    for name, w in t.items():
        short = name.split(".linear_attn.")[1].removesuffix(".weight")
        target, shard = QWEN3_5_STACKED.get(short, (short, None))
        param = params[target if target in ("A_log", "dt_bias") else f"{target}.weight"]
        loader = getattr(param, "weight_loader", default_loader)
        loader(param, w) if shard is None else loader(param, w, shard)
    return {n: v.detach().clone() for n, v in m.named_parameters()}


def _sglang_gdn(lin, case: str, t: dict[str, torch.Tensor], p: EnginePlacement) -> dict[str, torch.Tensor]:
    """sglang 0.5.23's gated DeltaNet parameters as Qwen3GatedDeltaNet (models/qwen3_next.py) / Qwen3_5GatedDeltaNet
    (models/qwen3_5.py) __init__ builds them (same layer classes, sizes, parallel group "attn_tp"), with the
    classes' own packed-checkpoint loaders (compiled from the wheel's source: the model modules do not import on
    CPU), mamba_v2_sharded_weight_loader for conv1d and sharded_weight_loader(0) for A_log / dt_bias; loaded as
    their load_weights does (Qwen3-Next: no shard id; Qwen3.5: QWEN3_5_STACKED shard ids)."""
    import sglang.srt.layers.attention.mamba.mamba as mb
    import sglang.srt.layers.parameter as par
    import sglang.srt.model_loader.weight_utils as wu
    from sglang.srt.utils import set_weight_attrs

    mb.is_cpu = wu.is_cpu = lambda: False  # the GPU path (the CPU one pads for odd TP)
    g, tp = "attn_tp", p.tp_size
    m = torch.nn.Module()
    m.conv1d = lin.ColumnParallelLinear(CK, 2 * KD + VD, bias=False, parallel_group=g)
    m.conv1d.weight.data = m.conv1d.weight.data.unsqueeze(1)
    m.in_proj_qkvz = lin.MergedColumnParallelLinear(H, [KD, KD, VD, VD], bias=False, parallel_group=g)
    m.in_proj_ba = lin.MergedColumnParallelLinear(H, [NV, NV], bias=False, parallel_group=g)
    m.dt_bias = torch.nn.Parameter(torch.zeros(NV // tp))
    m.A_log = torch.nn.Parameter(torch.zeros(NV // tp))
    m.norm = torch.nn.Module()
    m.norm.weight = torch.nn.Parameter(torch.zeros(DV))  # RMSNormGated(head_v_dim): default_weight_loader
    m.out_proj = lin.RowParallelLinear(VD, H, bias=False, input_is_parallel=True, reduce_results=False,
                                       parallel_group=g)
    conv_loader = mb.mamba_v2_sharded_weight_loader([(KD, 0, False), (KD, 0, False), (VD, 0, False)], tp,
                                                    p.tp_rank)
    src = Path(lin.__file__).parents[1] / "models"  # the wheel's sglang/srt/models (a namespace package)
    if case == "gdn_qwen3_next":
        ns = dict(torch=torch, _is_cpu=False, _is_amx_available=False)
        cls = _engine_methods(str(src / "qwen3_next.py"), "Qwen3GatedDeltaNet",
                              ("_override_weight_loader", "_make_packed_weight_loader"), ns)
        cls._override_weight_loader(m.in_proj_qkvz, cls._make_packed_weight_loader(m.in_proj_qkvz))
        cls._override_weight_loader(m.in_proj_ba, cls._make_packed_weight_loader(m.in_proj_ba))
        delattr(m.conv1d.weight, "weight_loader")
        set_weight_attrs(m.conv1d.weight, {"weight_loader": conv_loader})
    else:
        ns = dict(torch=torch, _is_cpu=False, set_weight_attrs=set_weight_attrs,
                  BlockQuantScaleParameter=par.BlockQuantScaleParameter,
                  PerTensorScaleParameter=par.PerTensorScaleParameter)
        cls = _engine_methods(str(src / "qwen3_5.py"), "Qwen3_5GatedDeltaNet",
                              ("_override_weight_loader", "_bind_packed_weight_loaders", "_get_split_sizes_for_param",
                               "_make_packed_weight_loader"), ns)
        gdn = cls()
        gdn._bind_packed_weight_loaders(m.in_proj_qkvz)
        gdn._bind_packed_weight_loaders(m.in_proj_ba)
        gdn._override_weight_loader(m.conv1d.weight, conv_loader)
    for param in (m.A_log, m.dt_bias):
        set_weight_attrs(param, {"weight_loader": wu.sharded_weight_loader(0, parallel_group=g)})
    return _load_gdn(m, t, wu.default_weight_loader)


def _sglang_moe(fm, t, p):
    # FusedMoE needs the whole runtime context (runner backend, expert-location metadata) to be built; its own
    # expert ownership (_map_global_expert_id_to_local_expert_id) and TP narrowing (_load_w13, _load_w2) are
    # called on an object holding the attributes they read, as _weight_loader_impl calls them (expert_data =
    # param.data[local_expert], shard dim 0 for w1/w3, 1 for w2)
    local = E // p.ep_size
    self = types.SimpleNamespace(
        _expert_storage_rank=p.ep_rank, _num_local_routed=local, _num_global_routed=E, _has_fused_shared=False,
        moe_tp_size=p.moe_tp, moe_tp_rank=p.moe_tp_rank, use_padded_loading=False, use_presharded_weights=False,
        use_triton_kernels=False, moe_runner_config=types.SimpleNamespace(is_gated=True), weight_load_method=None,
        quant_method=types.SimpleNamespace(), quant_config=None)
    w13 = torch.zeros(local, 2 * INTER // p.moe_tp, H)
    w2 = torch.zeros(local, H, INTER // p.moe_tp)
    for name, v in t.items():
        e, proj = int(name.split(".")[5]), name.split(".")[6]
        le = fm.FusedMoE._map_global_expert_id_to_local_expert_id(self, e)
        if le == -1:
            continue
        if proj == "down_proj":
            fm.FusedMoE._load_w2(self, w2[le], 1, "w2", v)
        else:
            fm.FusedMoE._load_w13(self, w13[le], 0, "w1" if proj == "gate_proj" else "w3", v)
    return {"w13_weight": w13, "w2_weight": w2}


def _vllm_engine():
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.linear as lin
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    def load(case: str, t: dict[str, torch.Tensor], p: EnginePlacement) -> dict[str, torch.Tensor]:
        # vllm.distributed.get_tensor_model_parallel_rank/world_size read get_tp_group().rank_in_group/world_size
        ps._TP = types.SimpleNamespace(rank_in_group=p.tp_rank, world_size=p.tp_size)
        k = lambda s: next(v for n, v in t.items() if n.endswith(s))  # noqa: E731
        m = _load_linear(lin, vpe, case, t)
        if m is not None and case == "vision_tower":  # models/qwen3_vl.py: pos_embed an nn.Embedding, loaded whole
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            m.pos_embed = torch.nn.Embedding(NPOS, H)
            default_weight_loader(m.pos_embed.weight, k("pos_embed.weight"))
        elif m is not None:
            pass  # a layer class both engines define alike
        elif case == "mla_fused_a":
            from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear

            m = DeepSeekV2FusedQkvAProjLinear(H, [Q_LORA, KV_LORA])
            m.weight.weight_loader(m.weight, k("q_a_proj.weight"), 0)
            m.weight.weight_loader(m.weight, k("kv_a_proj_with_mqa.weight"), 1)
        elif case == "dsa_indexer":
            # models/deepseek_v32/attention.py Indexer.__init__: ReplicatedLinear wq_b, wk + weights_proj merged
            # into MergedColumnParallelLinear(disable_tp=True) wk_weights_proj (shard ids 0, 1), LayerNorm k_norm
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            m = torch.nn.Module()
            m.wq_b = lin.ReplicatedLinear(Q_LORA, IH * ID, bias=False)
            m.wq_b.weight.weight_loader(m.wq_b.weight, k("wq_b.weight"))
            m.wk_weights_proj = lin.MergedColumnParallelLinear(H, [ID, IH], bias=False, disable_tp=True)
            m.wk_weights_proj.weight.weight_loader(m.wk_weights_proj.weight, k("wk.weight"), 0)
            m.wk_weights_proj.weight.weight_loader(m.wk_weights_proj.weight, k("weights_proj.weight"), 1)
            m.k_norm = torch.nn.LayerNorm(ID)
            for n in ("weight", "bias"):
                default_weight_loader(getattr(m.k_norm, n), k(f"k_norm.{n}"))
        elif case == "minimax_qk_norm":
            import vllm.model_executor.layers.minimax_rms_norm.rms_norm_tp as rn
            from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

            m = torch.nn.Module()
            with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):  # a CustomOp
                m.q_norm = rn.MiniMaxText01RMSNormTP(HD * HEADS)
                if p.tp_size <= KV:  # vllm 0.33.0 models/minimax_m2.py MiniMaxM2Attention.__init__, both branches
                    m.k_norm = rn.MiniMaxText01RMSNormTP(HD * KV)
                else:
                    m.k_norm = rn.MiniMaxText01RMSNormTP(HD * KV, weight_shard_world_size=KV,
                                                         weight_shard_rank=p.tp_rank // (p.tp_size // KV))
            m.q_norm.weight.weight_loader(m.q_norm.weight, k("q_norm.weight"))
            m.k_norm.weight.weight_loader(m.k_norm.weight, k("k_norm.weight"))
        elif case == "gpt_oss_experts":
            return _vllm_gpt_oss(t, p)
        elif case in ("gdn_qwen3_next", "gdn_qwen3_5"):
            return _vllm_gdn(lin, case, t, p)
        else:
            # RoutedExperts' ownership (determine_expert_map, "linear") and TP narrowing (_load_w13, _load_w2) on an
            # object with the attributes they read, as _weight_loader_impl calls them (param.data[local], dims 0/1)
            _, expert_map, _ = determine_expert_map(p.ep_size, p.ep_rank, E)
            local = E if expert_map is None else int((expert_map >= 0).sum())
            self = types.SimpleNamespace(
                moe_config=types.SimpleNamespace(is_act_and_mul=True,
                                                 moe_parallel_config=types.SimpleNamespace(tp_size=p.moe_tp)),
                _get_hidden_dim=RoutedExperts._get_hidden_dim,
                _narrow_expert_data_for_padding=RoutedExperts._narrow_expert_data_for_padding)
            w13 = torch.zeros(local, 2 * INTER // p.moe_tp, H)
            w2 = torch.zeros(local, H, INTER // p.moe_tp)
            for name, v in t.items():
                e, proj = int(name.split(".")[5]), name.split(".")[6]
                le = e if expert_map is None else int(expert_map[e])
                if le == -1:
                    continue
                if proj == "down_proj":
                    RoutedExperts._load_w2(self, w2[le], 1, v, p.moe_tp_rank)
                else:
                    RoutedExperts._load_w13(self, w13[le], 0, "w1" if proj == "gate_proj" else "w3", v,
                                            p.moe_tp_rank)
            return {"w13_weight": w13, "w2_weight": w2}
        return {n: v.detach().clone() for n, v in m.named_parameters()}

    return load


def _vllm_gdn(lin, case: str, t: dict[str, torch.Tensor], p: EnginePlacement) -> dict[str, torch.Tensor]:
    """vllm 0.33.0's gated DeltaNet parameters as QwenGatedDeltaNetAttention.__init__ (layers/mamba/gdn/
    qwen_gdn_linear_attn.py) builds them: its own create_qkvz_proj / create_ba_proj (gqa_interleaved_layout True
    for Qwen3-Next, False for Qwen3.5), mamba_v2_sharded_weight_loader for conv1d, sharded_weight_loader(0) for
    A_log / dt_bias; Qwen3.5's split inputs loaded with the shard ids of Qwen3_5Model.hf_to_vllm_mapper."""
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn
    import vllm.model_executor.models.qwen3_5 as q35
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader, sharded_weight_loader
    from vllm.model_executor.utils import set_weight_attrs

    stacked = {k.removeprefix("."): v for k, v in q35.Qwen3_5Model.hf_to_vllm_mapper.orig_to_new_stacked.items()
               if k.startswith(".in_proj")}
    assert stacked == {k: ("." + n, s) for k, (n, s) in QWEN3_5_STACKED.items()}, stacked
    cls, tp = gdn.QwenGatedDeltaNetAttention, p.tp_size
    me = types.SimpleNamespace(gqa_interleaved_layout=case == "gdn_qwen3_next")
    me.maybe_disable_tp = lambda quant_config: cls.maybe_disable_tp(me, quant_config)
    m = torch.nn.Module()
    m.conv1d = lin.ColumnParallelLinear(CK, 2 * KD + VD, bias=False)
    m.conv1d.weight.data = m.conv1d.weight.data.unsqueeze(1)
    m.in_proj_qkvz = cls.create_qkvz_proj(me, H, KD, VD, None, "in_proj_qkvz")
    m.in_proj_ba = cls.create_ba_proj(me, H, NV, None, "in_proj_ba")
    m.conv1d.weight.weight_loader = mamba_v2_sharded_weight_loader([(KD, 0, False), (KD, 0, False), (VD, 0, False)],
                                                                   tp, p.tp_rank)
    m.dt_bias = torch.nn.Parameter(torch.zeros(NV // tp))
    m.A_log = torch.nn.Parameter(torch.zeros(NV // tp))
    set_weight_attrs(m.A_log, {"weight_loader": sharded_weight_loader(0)})
    set_weight_attrs(m.dt_bias, {"weight_loader": sharded_weight_loader(0)})
    m.norm = torch.nn.Module()
    m.norm.weight = torch.nn.Parameter(torch.zeros(DV))  # RMSNormGated(head_v_dim): default_weight_loader
    m.out_proj = lin.RowParallelLinear(VD, H, bias=False, input_is_parallel=True)
    return _load_gdn(m, t, default_weight_loader)


def _sglang_gpt_oss(fm, t: dict[str, torch.Tensor], p: EnginePlacement) -> dict[str, torch.Tensor]:
    """sglang 0.5.23's own FusedMoE.weight_loader_fused (-> _load_model_weight_or_group_weight_scale -> _load_w13 /
    _load_w2), bound to an experts module holding the attributes they read and the expert parameters (shapes as
    UnquantizedFusedMoEMethod.create_weights makes them). models/gpt_oss.py cannot be imported on CPU (it
    registers stubbed kernels as torch custom ops), so what its _load_normal_weights does before the loader is
    repeated here: make_expert_params_mapping_fused's names and shard ids, weights transposed (not biases),
    down_proj_bias zeroed off moe_tp rank 0."""
    per = INTER // p.moe_tp
    experts = torch.nn.Module()
    for attr, value in dict(moe_tp_size=p.moe_tp, moe_tp_rank=p.moe_tp_rank, use_padded_loading=False,
                            use_presharded_weights=False, use_triton_kernels=False, use_flashinfer_trtllm_moe=False,
                            moe_runner_config=types.SimpleNamespace(is_gated=True), weight_load_method=None,
                            quant_method=types.SimpleNamespace(), quant_config=None, scheme=None).items():
        setattr(experts, attr, value)
    for method in ("weight_loader_fused", "_load_model_weight_or_group_weight_scale", "_load_w13", "_load_w2"):
        setattr(experts, method, types.MethodType(getattr(fm.FusedMoE, method), experts))
    params = {n: torch.zeros(shape) for n, shape in (("w13_weight", (E, 2 * per, H)), ("w2_weight", (E, H, per)),
                                                      ("w13_weight_bias", (E, 2 * per)), ("w2_weight_bias", (E, H)))}
    mapping = fm.FusedMoE.make_expert_params_mapping_fused(
        ckpt_gate_up_proj_name="gate_up_proj", ckpt_down_proj_name="down_proj",
        ckpt_gate_up_proj_bias_name="gate_up_proj_bias", ckpt_down_proj_bias_name="down_proj_bias")
    for name, w in t.items():
        param_name, weight_name, shard_id = next(m for m in mapping if m[1] in name)
        name = name.replace(weight_name, param_name).rsplit(".", 1)[-1]
        if "bias" not in name:
            w = w.transpose(-2, -1)
        if "w2_weight_bias" in name and p.moe_tp_rank != 0:
            w = w.zero_()
        experts.weight_loader_fused(torch.nn.Parameter(params[name], requires_grad=False), w, name,
                                    shard_id=shard_id)
    return params


def _vllm_gpt_oss(t: dict[str, torch.Tensor], p: EnginePlacement) -> dict[str, torch.Tensor]:
    """vllm 0.33.0's own GptOssModel.load_weights (bf16 path: _load_weights_other) on a module holding just the
    expert parameters it fills (shapes as its FusedMoE creates them), the HF names mapped by the model's own
    hf_to_vllm_mapper and the "model." prefix dropped as AutoWeightsLoader does."""
    import vllm.model_executor.models.gpt_oss as go

    one = types.SimpleNamespace(world_size=1, rank_in_group=0)
    go.get_dp_group = go.get_pcp_group = lambda: one
    go.get_ep_group = lambda: types.SimpleNamespace(world_size=p.ep_size, rank_in_group=p.ep_rank)
    ep = p.ep_size > 1
    local, per = E // p.ep_size, INTER if ep else -(-INTER // p.tp_size)

    class Stand(torch.nn.Module):
        pass

    m = Stand()
    m.config = types.SimpleNamespace(num_local_experts=E, intermediate_size=INTER)
    m.parallel_config = types.SimpleNamespace(enable_expert_parallel=ep)
    m._load_weights_other = types.MethodType(go.GptOssModel._load_weights_other, m)
    m._try_load_streamed_expert = go.GptOssModel._try_load_streamed_expert
    experts = torch.nn.Module()
    for n, shape in (("w13_weight", (local, 2 * per, H)), ("w2_weight", (local, H, per)),
                     ("w13_bias", (local, 2 * per)), ("w2_bias", (local, H))):
        experts.register_parameter(n, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
    m.layers = torch.nn.ModuleList([torch.nn.Module()])
    m.layers[0].mlp = torch.nn.Module()
    m.layers[0].mlp.experts = experts
    weights = go.GptOssForCausalLM.hf_to_vllm_mapper.apply(iter(t.items()))
    loaded = go.GptOssModel.load_weights(m, ((n.removeprefix("model."), v) for n, v in weights))
    assert len(loaded) == 4, loaded
    return {n: v.detach().clone() for n, v in m.named_parameters()}


def _even_rows(rows: int, p: EnginePlacement) -> tuple[int, int, int]:
    n = rows // p.tp_size
    return (0, p.tp_rank * n, n)


def _stub_modules(top: tuple[str, ...]) -> None:
    """Permissive stub modules (harness.sglang_real's) for packages not installed here that vllm's
    quantization / vision imports name at import time; nothing of them runs in the loaders under test."""
    import importlib.abc
    import importlib.machinery

    from harness.sglang_real import _StubLoader

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] in top:
                return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
            return None

    sys.meta_path.insert(0, Finder())


def harness(engine: str, site: str, out: str) -> None:
    t0 = time.time()
    if engine == "sglang":
        from harness.sglang_real import install

        install(site)
        load = _sglang_engine()
        import sglang as mod
    else:
        from harness.vllm_real import install_gpu_stubs

        _stub_modules(("compressed_tensors", "torchvision"))  # imported by the gated DeltaNet / Qwen3.5 modules
        install_gpu_stubs()
        load = _vllm_engine()
        import vllm as mod
    results = {"version": mod.__version__, "file": mod.__file__, "import_s": round(time.time() - t0, 1)}
    for case in CASES:
        try:
            full = _hf_tensors(case)
            checked = 0
            if (engine, case) == ("vllm", "vocab_tp3"):  # both vllm's class and our rules refuse it
                p = EnginePlacement(engine, 0, 3)
                for attempt in ("engine", "rules"):
                    try:
                        if attempt == "engine":
                            load(case, full, p)
                        else:
                            engine_regions("lm_head.weight", (VOCAB, H), DIMS, p)
                    except (AssertionError, ValueError, EngineShardError):
                        checked += 1
                assert checked == 2, "vllm 0.33.0 refuses a padded vocab that does not divide over TP"
                results[case] = "ok: refused by vllm's VocabParallelEmbedding and by engine_regions"
                continue
            for tp in CASE_TPS.get(case, TPS):
                for p in placements(engine, tp, moe=case in ("fused_moe", "gpt_oss_experts")):
                    if p.ep_size > 1 and (engine, case) in NOT_DECLARED_EP:
                        continue
                    want = load(case, {n: v.clone() for n, v in full.items()}, p)
                    mt = CASE_MODEL_TYPE.get(case)
                    masked = {n: mask_to_engine(v, engine_regions(n, v.shape, DIMS, p, mt), debug=True)
                              for n, v in full.items()}
                    got = load(case, masked, p)
                    nan = load(case, {n: torch.full_like(v, float("nan")) for n, v in full.items()}, p)
                    for n in want:
                        assert not got[n].isnan().any(), f"{p}: {n} has NaN: a region misses what the engine reads"
                        assert torch.equal(got[n], want[n]), f"{p}: {n} differs from loading the full tensor"
                    mine = {n: engine_regions(n, v.shape, DIMS, p, mt) for n, v in full.items()}
                    if any(mine.values()):  # a rank with no region (vocab rows past the real ones) reads nothing
                        assert any(v.isnan().any() for v in nan.values()), f"{p}: the loader read nothing"
                    other = dataclasses.replace(p, tp_rank=(p.tp_rank + 1) % tp)
                    if any(mine.values()) and any(engine_regions(n, v.shape, DIMS, other, mt) != mine[n]
                                                  for n, v in full.items()):
                        # another rank's regions must not do: the check can fail
                        wrong = load(case, {n: mask_to_engine(v, engine_regions(n, v.shape, DIMS, other, mt), debug=True)
                                            for n, v in full.items()}, p)
                        assert any(v.isnan().any() for v in wrong.values()), f"{p}: rank {other.tp_rank}'s regions pass"
                    if tp > 1 and case.startswith("gdn_"):
                        # the [q; k; v] parts rule is needed: a plain contiguous column slice of them leaves NaN
                        col = {n: [(_even_rows(v.shape[0], p),)] if sharding_kind(n, mt)[0] == "linear_qkv_parts"
                               else engine_regions(n, v.shape, DIMS, p, mt) for n, v in full.items()}
                        wrong = load(case, {n: mask_to_engine(v, col[n], debug=True) for n, v in full.items()}, p)
                        assert any(v.isnan().any() for v in wrong.values()), f"{p}: a column slice of q/k/v passes"
                    checked += 1
            results[case] = f"ok {checked}"
        except BaseException:  # noqa: BLE001
            results[case] = traceback.format_exc()
    results["total_s"] = round(time.time() - t0, 1)
    Path(out).write_text(json.dumps(results, indent=1))


ENGINES = {"sglang": SGLANG, "vllm": VLLM}


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory) -> dict:
    """Both engines' harness subprocesses, started together (each spends most of its time importing its engine)."""
    from harness.wheels import unpacked_wheel

    tmp = tmp_path_factory.mktemp("engine_oracle")
    running = {}
    for engine, version in ENGINES.items():
        if engine == "sglang":
            site = unpacked_wheel("sglang", version, include=("sglang/*",))
            env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        else:
            site = unpacked_wheel("vllm", version, ("vllm/*.py", "vllm-*.dist-info/*"))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), VLLM_LOGGING_LEVEL="WARNING")
        out = tmp / f"{engine}.json"
        proc = subprocess.Popen([sys.executable, __file__, engine, str(site), str(out)], env=env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        running[engine] = (proc, out, site)
    yield running
    for proc, _, _ in running.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_real_engine_loaders(harnesses, engine):
    proc, out, site = harnesses[engine]
    log, _ = proc.communicate(timeout=900)
    assert out.exists(), f"the {engine} harness died (rc {proc.returncode}):\n{log[-6000:]}"
    res = json.loads(out.read_text())
    assert res["version"] == ENGINES[engine] and res["file"].startswith(str(site)), res  # the wheel's own code
    print({k: v for k, v in res.items() if k not in CASES})
    bad = {c: res.get(c) for c in CASES if not str(res.get(c)).startswith("ok")}
    assert not bad, "\n".join(f"{c}:\n{v}" for c, v in bad.items())


if __name__ == "__main__":
    harness(*sys.argv[1:4])
