"""Layout invariance: the same HF weights, loaded into real megatron-core models at every parallel layout,
export bit-identical HF tensors (all-ranks and chosen-receiver modes, save_pretrained, TE names)."""

import pytest
import worlds

from mcore2hf.testing.world import Layout, run_world

LAYOUTS = [
    (Layout(), "float32"),
    (Layout(tp=2, ep=2, etp=1), "float32"),  # expert-TP != TP
    (Layout(tp=2, pp=2, ep=2, etp=1), "float32"),
    (Layout(pp=2, vpp=2, ep=2, etp=1), "float32"),  # virtual pipeline
    (Layout(tp=2, pp=2, ep=4, etp=1), "bfloat16"),  # 8 workers
    (Layout(pp=2, first_stage_layers=1), "float32"),  # uneven pipeline: 1 + 3 layers
    (Layout(ep=2, etp=2), "float32"),  # expert-TP > TP
]


@pytest.mark.parametrize("layout,dtype", LAYOUTS, ids=[f"{lay}-{dt}" for lay, dt in LAYOUTS])
def test_qwen3_moe_layout_invariance(layout, dtype, qwen3_moe_ckpt, qwen3_moe_ckpt_bf16, tmp_path):
    ckpt = qwen3_moe_ckpt_bf16 if dtype == "bfloat16" else qwen3_moe_ckpt
    results = run_world(worlds.layout_matrix, layout, str(ckpt), layout, dtype, str(tmp_path))
    assert len(results) == layout.size
    assert results[0]["buckets_4k"] > 1
