"""Qwen3-VL with its vision tower built natively in Megatron (issue 26, layout 1: Megatron-Bridge 0.6.2's
Qwen3VLModel / mbridge's qwen3_vl module tree, model_specs/qwen3_vl_vision.py), in one world of 4 ranks at TP2 x PP2,
TP2, PP2 and TP1 (data-parallel replicas beside): loading the HF checkpoint and every export mode are bit-exact
(tower included), transformers loads the exported directory with no missing, unexpected or mismatched key, and the
Megatron forward of text + two images (vision tower, mergers, multimodal rope, deepstack) equals transformers'.
Under Transformer Engine's names (runtime.te_naming) the tower's parameters are exactly names of Megatron-Bridge
0.6.2's own Qwen3-VL table (models/qwen_vl/qwen3_vl_bridge.py, read from the published wheel) and export the same.

The tiny tower: 2 heads of 20 (TP2 splits the heads; transformers' 2-D vision rope needs head_dim % 4 == 0, so
with an even head count the width is a multiple of 8 here, unlike every other dimension), ffn 30, 3 blocks,
deepstack after blocks 0 and 1, patches of 2 x 3 x 3 over a 5 x 5 position grid."""

import pytest
import torch
import worlds

from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VISION = dict(depth=3, hidden_size=40, intermediate_size=30, num_heads=2, out_hidden_size=44,
              num_position_embeddings=25, patch_size=3, temporal_patch_size=2, spatial_merge_size=2,
              deepstack_visual_indexes=[0, 1])
LAYOUTS = [Layout(tp=2, pp=2), Layout(tp=2), Layout(pp=2), Layout()]
#: two images (grids t x h x w in patches: 6 and 2 tokens after the 2 x 2 merge) between text
GRID = torch.tensor([[1, 4, 6], [1, 2, 4]])
IMAGE, START, END = 97, 99, 100
TOKENS = torch.tensor([[5, 7, START] + [IMAGE] * 6 + [END, 11, 12, START] + [IMAGE] * 2 + [END, 40, 41, 42]])
#: measured max |Megatron - transformers| fp32 logit difference over these layouts: see test_native_tower_...
TOL = 1e-4
#: Megatron-Bridge 0.6.2's Qwen3-VL table (its vision_model.* names are those of its TE-built native tower)
BRIDGE, BRIDGE_TABLE = "0.6.2", "megatron/bridge/models/qwen_vl/qwen3_vl_bridge.py"


def bridge_tower_patterns() -> list[str]:
    """The `vision_model.*` Megatron names of Bridge's Qwen3VLBridge.mapping_registry as regexes (`*` a layer
    index, `**` any rest, as its param_mapping matches them)."""
    import re

    from harness.wheels import unpacked_wheel

    text = (unpacked_wheel("megatron-bridge", BRIDGE, (BRIDGE_TABLE,)) / BRIDGE_TABLE).read_text()
    table = text[text.index("class Qwen3VLBridge"):text.index("class Qwen3VLMoEBridge")]
    names = sorted(set(re.findall(r'"(vision_model\.[^"]+)"', table)))
    assert len(names) > 20, names
    return [re.escape(n).replace(r"\*\*", ".+").replace(r"\*", r"\d+") for n in names]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tiny_config("qwen3_vl", vision_config=VISION), tmp_path_factory.mktemp("q3vl") / "ckpt")


def test_native_tower_exports_bit_exact_and_matches_transformers_forward(ckpt, tmp_path, capsys):
    from transformers import Qwen3VLForConditionalGeneration

    pixels = torch.randn(int(GRID.prod(-1).sum()), 3 * 2 * 3 * 3, generator=torch.Generator().manual_seed(1))
    images = {"pixel_values": pixels, "image_grid_thw": GRID}
    per_rank = run_world(worlds.in_layouts, LAYOUTS[0], LAYOUTS, worlds.native_vl_suite, ckpt, str(tmp_path),
                         TOKENS, images, timeout=600)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_image = hf(input_ids=TOKENS, pixel_values=pixels, image_grid_thw=GRID,
                       mm_token_type_ids=(TOKENS == IMAGE).int()).logits
        ref_text = hf(input_ids=worlds.TOKENS).logits
    worst = {}
    for layout in LAYOUTS:
        key = str(layout)
        res = [r[key] for r in per_rank]
        # the tower only on the first pipeline stage: one chunk per rank of stage 0, none elsewhere
        stage = [rank // (len(res) // layout.pp) for rank in range(len(res))]  # Megatron's order: PP outermost
        assert [r["towers"] for r in res] == [int(s == 0) for s in stage], (key, [r["towers"] for r in res])
        for r in res:
            worst[key] = max(worst.get(key, 0.0), (r["image"] - ref_image).abs().max().item(),
                             (r["text"] - ref_text).abs().max().item())
        _, info = Qwen3VLForConditionalGeneration.from_pretrained(res[0]["dir"], output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (key, info)
    # TE names (one TP rank of the first stage holds the whole tower's names): all in Bridge 0.6.2's table
    import re

    patterns = bridge_tower_patterns()
    names = per_rank[0][str(LAYOUTS[0])]["te_tower"]
    assert names and not [n for n in names if not any(re.fullmatch(p, n) for p in patterns)], names
    with capsys.disabled():
        print(f"\nqwen3_vl native tower: max |Megatron - transformers| logits per layout {worst}")
    assert max(worst.values()) < TOL, worst


def test_native_tower_block_and_deepstack_counts_are_checked_against_the_hf_vision_config():
    """The export's structure check (exporter.vision_tower_problems): blocks 0..depth-1 and one deepstack merger
    per deepstack_visual_indexes entry; a tower of another depth or without its mergers is named."""
    from mcore2hf.exporter import vision_tower_problems

    cfg = tiny_config("qwen3_vl", vision_config=VISION)
    block = "vision_model.decoder.layers.{}.self_attention.linear_qkv.weight"
    merger = "vision_model.decoder.deepstack_merger_list.{}.linear_fc1.weight"
    good = [block.format(i) for i in range(3)] + [merger.format(i) for i in range(2)]
    assert vision_tower_problems(good, cfg) == []
    assert vision_tower_problems(["model.x"], cfg) == []  # no native tower: nothing to check
    (depth,) = vision_tower_problems(good[1:], cfg)
    assert "depth 3" in depth and "[1, 2]" in depth, depth
    (deep,) = vision_tower_problems(good[:3], cfg)
    assert "has 2 (deepstack_visual_indexes)" in deep, deep
