"""Offline export of Megatron-LM legacy checkpoints (`--ckpt-format torch`), written in real megatron-core gloo
worlds the way Megatron-LM writes them, equals the live export bit for bit; a file naming a disallowed global is
refused before anything in it runs."""

import argparse
import os
import random
import shutil

import pytest
import torch
import torch.distributed as dist
import worlds
from oracle import logit_problems
from worlds import TOKENS

from mcore2hf.errors import UsageError
from mcore2hf.formats.legacy import LegacyFormatError
from mcore2hf.offline import export_checkpoint
from mcore2hf.runtime.tiny import read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world, same_on_every_rank

ARCHS = ["llama", "qwen3_moe"]  # dense (GLU fc1, QKV, tied embedding) and MoE
LAYOUTS = [
    Layout(tp=2, pp=2, vpp=2, ep=2, etp=1),  # mp_rank_XX_YYY_ZZZ, model0/model1, experts whole (expert-TP 1)
    Layout(tp=2, ep=2),  # mp_rank_XX_ZZZ (one suffix: EP), experts TP-sharded (expert-TP = TP)
]
WORLD_ARCHS = {str(LAYOUTS[0]): ARCHS, str(LAYOUTS[1]): ["qwen3_moe"]}  # the second world is about experts (CI time)


def checkpoint_name(root: str, iteration: int, tp: int, pp: int, ep: int, pp_size: int, ep_size: int) -> str:
    """NVIDIA/Megatron-LM megatron/training/checkpointing.py get_checkpoint_name (commit d98e8a64)."""
    path = os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{tp:02d}")
    if pp_size > 1:
        path += f"_{pp:03d}"
    if ep_size > 1:
        path += f"_{ep:03d}"
    return os.path.join(path, "model_optim_rng.pt")


def save_legacy(ckpt: str, layout: Layout, root: str, iteration: int = 9) -> dict:
    """Megatron-LM's save_checkpoint with ckpt_format 'torch': the ranks with data-parallel rank 0 or
    expert-data-parallel rank 0 each torch.save generate_state_dict's dict (args, checkpoint_version, iteration,
    model / model0.., optimizer, opt_param_scheduler, rng_state as get_rng_state builds it). Also the live export."""
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnBackend
    from worlds import build, forward_oracle

    from mcore2hf import HFExporter, load_hf_weights

    cfg, chunks = build(ckpt, layout)
    load_hf_weights(chunks, ckpt)
    logits = forward_oracle(ckpt, layout, chunks)  # what the legacy files hold is right (the transformers oracle)
    base = os.path.join(root, cfg.model_type)
    HFExporter(chunks, cfg).save_pretrained(os.path.join(base, "live"))

    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:  # Adam state from a zero-gradient step: the weights do not move
        p.grad = torch.zeros_like(p)
    opt.step()
    args = argparse.Namespace(  # fields of megatron/training/arguments.py, with their types as validate_args sets them
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        num_experts=getattr(cfg, "num_experts", None), padded_vocab_size=cfg.vocab_size,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp, params_dtype=torch.float32,
        main_grads_dtype=torch.float32, attention_backend=AttnBackend.auto, ckpt_format="torch",
        swiglu=True, normalization="RMSNorm", untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        data_path=["/data/x_text_document"], seed=1234, iteration=iteration)
    rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                  "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                  "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    if len(chunks) == 1:
        state["model"] = chunks[0].state_dict_for_save_checkpoint()
    else:
        for i, c in enumerate(chunks):
            state[f"model{i}"] = c.state_dict_for_save_checkpoint()
    state.update(optimizer={"optimizer": opt.state_dict(), "fp32_from_fp16_params": []},
                 opt_param_scheduler={"max_lr": 1e-3, "num_steps": iteration}, rng_state=rng_state,
                 num_floating_point_operations_so_far=0)
    ckpt_dir = os.path.join(base, "ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        name = checkpoint_name(ckpt_dir, iteration, ps.get_tensor_model_parallel_rank(),
                               ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                               layout.pp, layout.ep)
        os.makedirs(os.path.dirname(name), exist_ok=True)
        torch.save(state, name)
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return {"base": base, "logits": logits}


def for_archs(ckpts: dict, layout: Layout, root: str) -> dict:
    return {mt: save_legacy(path, layout, root) for mt, path in ckpts.items()}


@pytest.fixture(scope="module")
def saved(ckpts, tmp_path_factory):
    out = {}
    for layout in LAYOUTS:
        root = tmp_path_factory.mktemp(f"legacy-{layout}")
        source = {mt: ckpts[mt] for mt in WORLD_ARCHS[str(layout)]}
        per_rank = run_world(for_archs, layout, source, layout, str(root))
        problems = logit_problems([{mt: r.pop("logits") for mt, r in res.items()} for res in per_rank], source,
                                  TOKENS, str(layout))
        res = same_on_every_rank(per_rank)
        assert not problems, "\n".join(problems)
        out[str(layout)] = {mt: r["base"] for mt, r in res.items()}
    return out


def assert_same(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {bad[:5]}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_legacy_export_equals_live_export(layout, saved, ckpts, tmp_path):
    for mt, base in saved[str(layout)].items():
        files = sorted(os.listdir(os.path.join(base, "ckpt", "iter_0000009")))
        if layout.pp > 1:  # written by the ranks Megatron-LM picks: every (tp, pp) and (pp, ep) at least once
            assert files == ["mp_rank_00_000_000", "mp_rank_00_001_000", "mp_rank_01_000_001", "mp_rank_01_001_001"]
        else:
            assert files == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
        out = tmp_path / mt
        report = export_checkpoint(os.path.join(base, "ckpt"), out, ckpts[mt], progress=False)
        assert report.ignored_keys > 0  # the local linears' _extra_state (None); llama: the tied output copy
        live = read_hf_checkpoint(os.path.join(base, "live"))
        assert_same(read_hf_checkpoint(out), live, f"{mt} {layout}")
        assert_same(live, read_hf_checkpoint(ckpts[mt]), f"{mt} {layout} live vs source")


def test_verify_reads_legacy(saved, ckpts):
    from mcore2hf.verify import compare

    root = os.path.join(saved[str(LAYOUTS[0])]["qwen3_moe"], "ckpt")
    for path in (root, os.path.join(root, "iter_0000009")):  # the checkpoint root or one iteration's directory
        result = compare(ckpts["qwen3_moe"], path)
        assert result.identical and not result.missing and not result.unexpected, path


def test_missing_rank_files_are_named_as_one_pattern(saved, ckpts, tmp_path):
    """A checkpoint copied without some rank directories: the layout check names what is missing, grouped."""
    layout = next(lay for lay in LAYOUTS if lay.pp > 1)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(saved[str(layout)]["qwen3_moe"], "ckpt"), ckpt)
    shutil.rmtree(ckpt / "iter_0000009" / "mp_rank_01_001_001")
    with pytest.raises(LegacyFormatError, match=r"iter_0000009:\n  PP stage 1, EP rank 1: no mp_rank_\* file; the same "
                                                r"for TP rank 1, PP stage 1 \(2 in all\)$"):
        export_checkpoint(ckpt, tmp_path / "out", ckpts["qwen3_moe"], progress=False)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_globals_registered_by_others_are_not_used(saved):
    """Importing megatron.core adds the real numpy _reconstruct to torch's process-wide allow-list; whichever entry
    of a name comes last wins there, so a load must see ALLOWED's entries only, and leave the others registered."""
    from mcore2hf.formats.legacy import FILE, load_restricted

    def bomb(*args):
        raise AssertionError("a global registered by someone else was called")

    others = [(lambda *a, i=i: bomb(i), name) for i in range(16)  # many, so that ours would rarely come last
              for name in ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")]
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(others)
    try:
        it_dir = os.path.join(saved[str(LAYOUTS[1])]["qwen3_moe"], "ckpt", "iter_0000009")
        state = load_restricted(os.path.join(it_dir, "mp_rank_00_000", FILE))
        assert "model" in state and "rng_state" in state
        assert set(others) <= set(torch.serialization.get_safe_globals())
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_disallowed_global_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "executed"
    it = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00"
    it.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1), "checkpoint_version": 3.0,
                "model": {"embedding.word_embeddings.weight": torch.zeros(100, 64)}, "rng_state": [_Evil(str(marker))]},
               it / "model_optim_rng.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(LegacyFormatError, match=r"does not allow: \['posix.system'\]"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out", tiny_config("llama"), progress=False)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_without_hf_config_the_error_says_what_the_args_lack(saved, tmp_path):
    base = saved[str(LAYOUTS[1])]["qwen3_moe"]
    with pytest.raises(UsageError, match="cannot infer an HF config .*missing: model_type") as e:
        export_checkpoint(os.path.join(base, "ckpt"), tmp_path / "out", None, progress=False)
    assert "vocab_size (args hold only padded_vocab_size=100;" in str(e.value)
    assert "'num_hidden_layers': 4" in str(e.value) and "Pass --hf-config" in str(e.value)
    assert not (tmp_path / "out").exists()
    r = worlds.cli_run("export", os.path.join(base, "ckpt"), str(tmp_path / "o"))
    assert r.returncode != 0 and "missing: model_type" in r.stderr and not (tmp_path / "o").exists(), r.stderr


def test_without_hf_config_torch_dist_common_pt_args_or_none(tmp_path):
    it = tmp_path / "ckpt" / "iter_0000003"
    it.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    (it / ".metadata").write_bytes(b"")
    with pytest.raises(UsageError, match="stores no training args: pass --hf-config"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out", None, progress=False)
    torch.save({"args": argparse.Namespace(num_layers=2, hidden_size=32, padded_vocab_size=128)}, it / "common.pt")
    with pytest.raises(UsageError, match=r"missing: model_type .*padded_vocab_size=128.*'num_hidden_layers': 2"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out", None, progress=False)
    assert not (tmp_path / "out").exists()


def test_hybrid_model_legacy_checkpoint_is_refused(tmp_path):
    it = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00"
    it.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1), "checkpoint_version": 3.0,
                "model": {"embedding.word_embeddings.weight": torch.zeros(100, 64),
                          "decoder.final_norm.weight": torch.ones(64)}}, it / "model_optim_rng.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(LegacyFormatError, match="hybrid model's legacy checkpoint"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out", tiny_config("llama"), progress=False)
    assert not (tmp_path / "out").exists()
