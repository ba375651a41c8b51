import os

import pytest
import torch

from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# subprocesses of the tests (engine harnesses, the TE spec oracle) import tests/harness too
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join([_TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and p != _TESTS])

ARCHS = ["qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3", "qwen2", "llama", "glm4_moe_lite", "deepseek_v2", "mixtral",
         "mistral", "gpt_oss", "minimax_m2", "olmoe", "deepseek_v32", "glm_moe_dsa"]
#: family members whose checkpoint format, converter rules and spec code another architecture above already runs
#: everywhere (glm4_moe_lite, deepseek_v2 ~ deepseek_v3; mistral ~ llama/qwen2; mixtral, olmoe ~ minimax_m2's names
#: and full-width norm; deepseek_v32, glm_moe_dsa ~ deepseek_v3 plus the sparse-attention indexer, whose tensors
#: are replicated over TP, so the worlds with PP stage boundaries and TP 2 cover them; their own config values
#: differ). To keep CI within its budget they run in the worlds that
#: cover every parallel dimension (TP2 x PP2 x EP2 with expert-TP != TP, PP2 x VPP2, uneven PP), in parity at both
#: layouts, the default-layout demo, import and one FP8 world; the others run everywhere.
FORMAT_MATES = {"glm4_moe_lite", "deepseek_v2", "mistral", "mixtral", "olmoe", "deepseek_v32", "glm_moe_dsa"}
#: vision-language models (tests/test_vlm.py runs their language models and towers in its own world; the demo runs
#: them at its default layout only: their rules are the text families' above under another prefix)
VLM_ARCHS = ["qwen3_vl", "qwen3_vl_moe", "glm4v_moe", "kimi_k25"]
#: architectures whose megatron-core TE spec the `te_specs` fixture derives (ARCHS and the gated-DeltaNet ones)
TE_SPEC_ARCHS = ARCHS + ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
#: MCORE2HF_ARCHS=qwen3,deepseek_v3: the architecture checkpoints (fixtures ckpts, ckpts_bf16) hold only these, so
#: the layout-matrix and FP8 worlds run for them alone (tests/test_mutations.py; day-to-day work on one model)
ONLY = [mt for mt in os.environ.get("MCORE2HF_ARCHS", "").split(",") if mt]
WORLD_ARCHS = [mt for mt in ARCHS if not ONLY or mt in ONLY]


#: `pytest -m quick` (day-to-day work, ~3 minutes on 2 cores): every pure test, and one world per job (live export
#: at one layout for every architecture, offline export, import, legacy, FP8, engine shards, the senders against
#: SGLang's code, the CLI and the demo). Per test file: "*" (all of it) or the test-name prefixes that are quick.
QUICK = {
    "test_code_rules.py": "*", "test_layouts.py": "*", "test_stacked.py": "*", "test_quantize.py": "*",
    "test_plan_tiling.py": "*", "test_mtp_names.py": "*", "test_senders.py": "*", "test_hf_dir.py": "*",
    "test_checkpoint_keys.py": "*",
    "test_engine_plan.py": ("test_pieces_", "test_clip_"),
    "test_engine_shards.py": ("test_placement", "test_unknown", "test_kv_", "test_vocab", "test_padded", "test_expert",
                              "test_mask", "test_engine_slices", "test_stacked", "test_shared", "test_linear",
                              "test_qwen3_5", "test_every_architecture"),
    "test_te_spec.py": ("test_bridge_",), "test_hybrid.py": ("test_hybrid_layout_",),
    "test_qwen3_5.py": ("test_column_parts",), "test_qwen3_next.py": ("test_what_megatron_cannot",),
    "test_vllm_contract.py": ("test_verified_version", "test_packed_chunk", "test_fp8_bucket"),
    "test_layout_matrix.py": ("test_layout_invariance_all_architectures[tp2-pp2-ep2-etp1-w4-float32]",
                              "test_mcore2hf_list"),
    "test_offline.py": ("test_offline_export_equals_live_export[tp2-pp2-ep2-etp1-w4]", "test_verify_hf_directory"),
    "test_import.py": ("test_megatron_loads_the_import_and_exports_the_source_bit_for_bit[tp2-pp1-ep2-etp1-w2",),
    "test_legacy.py": ("test_legacy_export_equals_live_export[tp2-pp1-ep2-etp2-w4]", "test_disallowed"),
    "test_fp8.py": ("test_every_architecture_has", "test_fp8_output_loads_in_transformers_and_logits_follow_megatron[fp8]"),
    "test_errors.py": ("test_no_parallel_state", "test_unknown_architecture", "test_config_forms"),
    "test_outputs.py": "*", "test_cli.py": ("test_bad_config",), "test_demo.py": ("test_demo_end_to_end",),
    "test_sglang_contract.py": ("test_our_allowlist",),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the day-to-day subset (conftest.QUICK)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu: the lead's GPU suite), skipped without")


def pytest_collection_modifyitems(config, items):
    for item in items:
        spec = QUICK.get(os.path.basename(str(item.fspath)))
        if spec == "*" or (spec and item.name.startswith(spec)):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session", autouse=True)
def world_pool():
    """Gloo worlds live for the whole session (one start per world size; each call still gets fresh process
    groups and parallel state): starting workers is most of a small world's time."""
    from mcore2hf.runtime.world import close_pool, use_pool

    use_pool(int(os.environ.get("MCORE2HF_WORLD_PROCS", "15")), preload=("worlds", "oracle"))
    yield
    close_pool()


def only_full(ckpts: dict) -> dict:
    """The architectures that run in every world (see FORMAT_MATES)."""
    return {mt: p for mt, p in ckpts.items() if mt not in FORMAT_MATES}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """A tiny random HF checkpoint (fp32) per architecture, written by transformers (+ MTP tensors)."""
    root = tmp_path_factory.mktemp("ckpts")
    return {mt: make_hf_checkpoint(tiny_config(mt), root / mt) for mt in WORLD_ARCHS}


@pytest.fixture(scope="session")
def te_specs() -> dict[str, dict]:
    """megatron-core's own Transformer Engine spec tree per architecture (ARCHS and the gated-DeltaNet ones), the
    oracle for te_naming's names (harness.te_spec; one subprocess for all)."""
    import json

    from harness.te_spec import te_spec_trees

    given = os.environ.get("MCORE2HF_TE_SPECS")  # a file of them from an earlier run (tests/test_mutations.py)
    if given:
        with open(given) as f:
            return json.load(f)
    return te_spec_trees({mt: tiny_config(mt).to_dict() for mt in TE_SPEC_ARCHS})


@pytest.fixture(scope="session")
def ckpts_bf16(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts_bf16")
    return {mt: make_hf_checkpoint(tiny_config(mt), root / mt, seed=1, dtype=torch.bfloat16) for mt in WORLD_ARCHS}


@pytest.fixture(scope="session")
def qwen3_moe_ckpt(ckpts) -> str:
    return ckpts["qwen3_moe"]


@pytest.fixture(scope="session")
def variant_ckpts(tmp_path_factory) -> dict[str, str]:
    """Family members (TINY_VARIANTS: Kimi-K2, Moonlight): the checkpoint transformers writes, with config.json
    replaced by the published form (Kimi-K2: model_type kimi_k2 and an auto_map to remote code). The remote code
    files exist and fail when imported: nothing may run them."""
    import json

    from mcore2hf.runtime.tiny import TINY_VARIANTS

    root = tmp_path_factory.mktemp("variants")
    out = {}
    for name, raw in TINY_VARIANTS.items():
        if ONLY and tiny_config(name).model_type not in ONLY:  # MCORE2HF_ARCHS: their architecture's alone
            continue
        path = make_hf_checkpoint(tiny_config(name), root / name)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**raw, "torch_dtype": "float32"}, f, indent=2)
        for module in ("configuration_deepseek.py", "modeling_deepseek.py"):
            with open(os.path.join(path, module), "w") as f:
                f.write("raise RuntimeError('remote code was executed')\n")
        out[name] = path
    return out
