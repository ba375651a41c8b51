"""Plan once, run many: the plan is built with one metadata exchange and reused; the dry run is complete."""

import json

import worlds
from oracle import logit_problems

from mcore2hf.runtime.world import Layout, run_world, same_on_every_rank


def test_plan_reuse_dry_run_and_balance(qwen3_moe_ckpt):
    layout = Layout(tp=2, pp=2, ep=2, etp=1)
    per_rank = run_world(worlds.plan_suite, layout, str(qwen3_moe_ckpt), layout)
    # the model built without initialization and attributes, loaded by mcore2hf: the Megatron forward is right
    problems = logit_problems([{"qwen3_moe": r.pop("logits")} for r in per_rank], {"qwen3_moe": qwen3_moe_ckpt},
                              worlds.TOKENS, str(layout))
    assert not problems, problems
    r = same_on_every_rank(per_rank)
    assert r["buckets"] > 3
    assert r["pp_padding"] < 1.35, r  # bytes moved by the PP all-gather / bytes that must move


def test_cli_list_and_plan():
    out = worlds.cli_run("list", check=True)
    assert "qwen3_moe" in out.stdout
    out = worlds.cli_run("plan", "--hf-config", "tiny:qwen3_moe", "--tp", "2",
                         "--ep", "2", "--bucket-size", "64KiB", check=True)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in out.stdout
    assert "135 HF tensors" in out.stdout
    assert "at TP2 PP1 EP2 ETP2 (world size 4)" in out.stdout  # the ETP Megatron uses when none is given
    assert "extra memory per rank during an export" in out.stdout and "staging arena" in out.stdout


def test_cli_plan_json_with_te_names_and_filter():
    out = worlds.cli_run("plan", "--hf-config", "tiny:glm4_moe", "--pp", "2",
                         "--ep", "2", "--etp", "1", "--json", "--te-names", "--exclude", r"^model\.layers\.4\.", check=True)
    plan = json.loads(out.stdout)
    assert plan["layout"] == {"tp": 1, "pp": 2, "vpp": None, "ep": 2, "etp": 1, "world_size": 4}
    names = {t["name"]: t for t in plan["tensors"]}
    assert not [n for n in names if n.startswith("model.layers.4.")]  # MTP layer filtered out
    assert names["model.layers.1.input_layernorm.weight"]["megatron"].endswith("linear_qkv.layer_norm_weight")
    assert names["model.layers.2.mlp.experts.5.down_proj.weight"]["megatron"].endswith("linear_fc2.weight1")
    assert len(plan["memory"]) == 4 and all(m["arena_bytes"] > 0 and m["largest_bucket_bytes"] > 0
                                            for m in plan["memory"])
    assert plan["total_bytes"] == sum(t["bytes"] for t in plan["tensors"])


def _cli_plan(*args: str):
    return worlds.cli_run("plan", *args)


def test_cli_plan_of_a_hybrid_model():
    """`mcore2hf plan --model-class hybrid`: the hybrid model (megatron-core 0.16.1 MambaModel, 0.19 HybridModel)
    of DeepSeek-V3's MLA + MoE layers plans the same HF tensors, bytes and holders as the GPTModel of the config
    (each HF layer is two Megatron layers on the same stage); `--no-mtp` leaves out the MTP layer's tensors; on
    megatron-core < 0.19, whose MambaModel has no MTP depths, the hybrid model with the config's MTP layer is
    refused in one line naming the release."""
    from mcore2hf.model_specs.deepseek_v3 import megatron_at_least

    layout = ("--hf-config", "tiny:deepseek_v3", "--pp", "2", "--ep", "2", "--etp", "1", "--json")
    plans = {}
    for model_class in ("gpt", "hybrid"):
        out = _cli_plan(*layout, "--model-class", model_class, "--no-mtp")
        assert out.returncode == 0, out.stderr[-2000:]
        plans[model_class] = json.loads(out.stdout)
    gpt, hybrid = ({t["name"]: t for t in plans[mc]["tensors"]} for mc in ("gpt", "hybrid"))
    held_as = {n: t.pop("megatron") for n, t in hybrid.items()}
    assert hybrid == {n: {k: v for k, v in t.items() if k != "megatron"} for n, t in gpt.items()}
    assert plans["hybrid"]["memory"] == plans["gpt"]["memory"]
    # each HF tensor from the hybrid model's own parameter (its holder's local name): HF layer l is Megatron layers
    # 2l (mixer) and 2l + 1 (MLP), four of them per stage; the stack's final norm is `final_norm`
    assert held_as["model.layers.0.mlp.gate_proj.weight"] == "decoder.layers.1.mlp.linear_fc1.weight"
    assert held_as["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (
        "decoder.layers.2.self_attention.linear_kv_down_proj.weight")
    assert held_as["model.layers.3.mlp.experts.7.down_proj.weight"] == (
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight")
    assert held_as["model.norm.weight"] == "decoder.final_norm.weight"
    with_mtp = _cli_plan(*layout)
    assert with_mtp.returncode == 0, with_mtp.stderr[-2000:]
    mtp_names = set(t["name"] for t in json.loads(with_mtp.stdout)["tensors"]) - set(gpt)
    assert mtp_names and all(n.startswith("model.layers.4.") for n in mtp_names), sorted(mtp_names)[:5]
    hybrid_mtp = _cli_plan(*layout, "--model-class", "hybrid")
    if megatron_at_least(0, 19):
        assert hybrid_mtp.returncode == 0, hybrid_mtp.stderr[-2000:]
        assert set(t["name"] for t in json.loads(hybrid_mtp.stdout)["tensors"]) == set(gpt) | mtp_names
    else:
        lines = hybrid_mtp.stderr.strip().splitlines()
        assert hybrid_mtp.returncode == 1 and len(lines) == 1, hybrid_mtp.stderr[-2000:]
        assert "MTP layer(s) in a hybrid model need megatron-core >= 0.19" in lines[0] and "--no-mtp" in lines[0]


#: DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), without its quantization_config
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "tie_word_embeddings": False,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "torch_dtype": "bfloat16",
}


def test_dry_run_deepseek_v3_at_pp16_ep64(tmp_path, capsys):
    """`mcore2hf plan` of the real DeepSeek-V3 shapes at PP 16 x EP 64 (1,024 ranks) in one process: every HF
    tensor once, with the parameter count transformers' own model of the config has; each expert on the stage
    and EP rank that holds it; a memory line for every rank."""
    import re
    import time

    import torch
    import transformers

    from mcore2hf.plan.report import render

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    t0 = time.perf_counter()
    out = worlds.cli_run("plan", "--hf-config", str(tmp_path / "config.json"),
                         "--pp", "16", "--ep", "64", "--first-stage-layers", "3", "--last-stage-layers", "2",
                         "--json", check=True)
    wall = time.perf_counter() - t0
    report = json.loads(out.stdout)
    assert report["layout"] == {"tp": 1, "pp": 16, "vpp": None, "ep": 64, "etp": 1, "world_size": 1024}
    assert [m["rank"] for m in report["memory"]] == list(range(1024))
    assert all(m["total_bytes"] == m["arena_bytes"] + m["largest_bucket_bytes"] + m["next_bucket_bytes"] > 0
               for m in report["memory"])
    tensors = report["tensors"]
    names = [t["name"] for t in tensors]
    assert len(names) == len(set(names)) == report["num_tensors"]
    # 3 dense layers of 12 tensors, 58 MoE layers of 782 (256 x 3 experts, 3 shared-expert, gate weight and
    # e_score_correction_bias, 7 MLA, 2 norms), embed / norm / lm_head, the MTP layer (782 + enorm, hnorm, eh_proj,
    # shared_head.norm, and its copies of the embedding and the head)
    assert len(names) == 3 * 12 + 58 * 782 + 3 + 782 + 6 == 46183
    # the oracle: transformers' DeepseekV3 model of this config (no MTP layer) has the same parameter count
    # (transformers 5.24 keeps the router's e_score_correction_bias as a buffer)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**DEEPSEEK_V3))
    hf_params = sum(p.numel() for p in hf.parameters()) + \
        sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    main = sum(t["bytes"] // 2 for t in tensors if not t["name"].startswith("model.layers.61."))
    assert main == hf_params, (main, hf_params)
    # layers 0-2 on stage 0, then 4 per stage, 59-60 and the MTP layer on stage 15; expert E on EP rank E // 4
    for t in tensors:
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", t["name"])
        if m:
            layer, expert = int(m.group(1)), int(m.group(2))
            assert t["stages"] == [0 if layer < 3 else min(1 + (layer - 3) // 4, 15)], t
            assert t["ep"] == expert // 4 and t["shards"] == 1, t
    with capsys.disabled():
        print(f"\n{render(report, limit=0)}\n`mcore2hf plan` wall time {wall:.1f} s (CLI start included)")


def test_memory_per_rank_class_equals_each_ranks_own_programs():
    """transfer.builders.memory_estimates builds a program once per bucket and rank class; at 32 ranks (TP 2, PP 4 x EP 8: more
    classes than the layout worlds have) every rank's estimate equals the one its own Executor computes."""
    import worlds

    from mcore2hf.runtime.world import Layout

    got = worlds.in_fresh_process(worlds.memory_by_rank_class, "deepseek_v3", Layout(tp=2, pp=4, ep=8, etp=1),
                                  4096)
    assert got["buckets"] > 20
    for arenas in (1, 2):
        shared, own = got[arenas]
        assert len(own) == 32 and shared == own, (arenas, shared, own)
    assert got["classes"] == got[1][0]  # dry_run's own memory is the one-arena estimate


def test_members_issue_each_collective_at_the_same_point():
    """Every member of a group issues each of the export's collectives at the same point of the bucket loop (when
    the bucket starts, or when it completes), whatever it packs itself: NCCL matches a group's collectives in
    the order they are issued, and a consumer may run collectives between buckets (or iterate two exports in
    step). A stage whose member packs only local tensors used to issue it a bucket early, beside a member that
    waits for its EP all-gather first: on 4 H200s at PP2 x EP2, garbage experts in the last layer of each stage.
    Checked on every rank's programs (one-process dry run) at layouts with PP, VPP, EP, expert-TP != TP, uneven PP,
    and gpt-oss's stacked experts gathered in rounds."""
    cases = [("qwen3_moe", Layout(tp=2, pp=2, ep=2, etp=1)), ("qwen3_moe", Layout(pp=2, vpp=2, ep=2)),
             ("deepseek_v3", Layout(tp=2, pp=2)), ("gpt_oss", Layout(pp=2, ep=2)),
             ("deepseek_v3", Layout(pp=4, first_stage_layers=1, last_stage_layers=1))]
    got = worlds.in_fresh_process(worlds.collective_schedules, cases, [2048])
    for (model_type, layout), found in zip(cases, got):
        assert found["checked"] > 100 and not found["bad"], (model_type, str(layout), found["bad"][:3])
