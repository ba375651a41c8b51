"""Functions that run inside gloo worker processes (spawned by mcore2hf.testing.world.run_world)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from mcore2hf.model_specs.common import padded_vocab_size

from mcore2hf import HFExporter, load_hf_weights
from mcore2hf.hf_config import load_hf_config
from mcore2hf.registry import get_model_spec
from mcore2hf.testing.te_naming import te_names_of, to_te_names
from mcore2hf.testing.tiny import read_hf_checkpoint
from mcore2hf.testing.world import Layout


def build(ckpt: str, layout: Layout, dtype: torch.dtype = torch.float32):
    cfg = load_hf_config(ckpt)
    spec = get_model_spec(cfg.model_type)
    overrides = dict(layout.config_overrides())
    if dtype != torch.float32:
        overrides.update(params_dtype=dtype, bf16=dtype == torch.bfloat16)
    chunks = spec.build_model(cfg, vocab_size=padded_vocab_size(cfg.vocab_size, layout.tp), **overrides)
    if dtype != torch.float32:
        chunks = [c.to(dtype) for c in chunks]  # what Megatron's Float16Module does in training
    return cfg, chunks


def assert_same(got: dict, ref: dict, what: str) -> None:
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    assert not missing and not extra, f"{what}: missing {missing[:5]}, extra {extra[:5]}"
    diff = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k].cpu(), ref[k])]
    assert not diff, f"{what}: {len(diff)} tensors differ, e.g. {diff[:5]}"


def zero_(chunks) -> None:
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.zero_()
            for n, b in c.named_buffers():
                if n.endswith("expert_bias"):
                    b.zero_()


def layout_matrix(ckpt: str, layout: Layout, dtype_name: str, out_root: str) -> dict:
    """Load the same HF weights at `layout`, export every way, and require bit-identical HF tensors."""
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    cfg, chunks = build(ckpt, layout, dtype)
    load_hf_weights(chunks, ckpt)
    ref = read_hf_checkpoint(ckpt)
    ex = HFExporter(chunks, cfg)

    assert_same(ex.state_dict(), ref, f"{layout} all ranks")
    small = {n: t.clone() for b in ex.buckets(bucket_bytes=4096) for n, t in b}
    assert_same(small, ref, f"{layout} 4 KiB buckets")
    plan = ex.plan(4096)
    for b in plan.buckets:  # byte bound: only a single oversized tensor may exceed the budget
        assert b.nbytes <= 4096 or len(b.sources) == 1, (b.index, b.nbytes)

    got0 = ex.state_dict(receivers=0)
    if rank == 0:
        assert_same(got0, ref, f"{layout} receivers=[0]")
    else:
        assert not got0
    last = dist.get_world_size() - 1
    got = ex.state_dict(receivers=[0, last])
    if rank in (0, last):
        assert_same(got, ref, f"{layout} receivers=[0, {last}]")
    else:
        assert not got

    out = os.path.join(out_root, str(layout))
    ex.save_pretrained(out, max_shard_size=20_000)
    if rank == 0:
        assert_same(read_hf_checkpoint(out), ref, f"{layout} save_pretrained")
        assert os.path.isfile(os.path.join(out, "config.json"))
        assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1  # sharded

    # the same model under Transformer Engine's names and attributes, reloaded from scratch
    to_te_names(chunks)
    names = te_names_of(chunks)
    assert any("linear_qkv.layer_norm_weight" in n for n in names), names[:10]
    if cfg.model_type == "qwen3_moe":
        assert any(".mlp.experts.linear_fc1.weight" in n for n in names), names[:10]
    zero_(chunks)
    load_hf_weights(chunks, ckpt)
    assert_same(HFExporter(chunks, cfg).state_dict(), ref, f"{layout} TE names")
    return {"tensors": len(ref), "buckets_4k": len(plan.buckets), "rank": rank}
