"""Vision-language models with their vision tower built natively in Megatron (issue 26, layout 1: Megatron-Bridge
0.6.2's Qwen3VLModel and Qwen3.5-VL model / mbridge's qwen3_vl module tree, model_specs/qwen3_vl_vision.py), in one
world of 4 ranks: Qwen3-VL at TP2 x PP2, TP2, PP2, TP1 (data-parallel replicas beside) and PP2 x VPP2 (the tower in
the first virtual chunk; the forward with images needs the deepstack layers there: text only), Qwen3-VL-MoE (packed
experts; deepstack after blocks 0 and 2), Qwen3.5 and Qwen3.5-MoE (gated-DeltaNet language models, a tower without
deepstack mergers) at TP2 x PP2. Loading the HF checkpoint and
every export mode are bit-exact (tower included), the tower is held on the first pipeline stage only, transformers
loads the exported directory with no missing, unexpected or mismatched key, and the Megatron forward of text + two
images (vision tower, mergers, multimodal rope, deepstack) and of text alone equals transformers'. Under
Transformer Engine's names (runtime.te_naming) the tower's parameters are exactly names of Megatron-Bridge 0.6.2's
own Qwen3-VL table (models/qwen_vl/qwen3_vl_bridge.py, read from the published wheel) and export the same; and
Bridge 0.6.2's own tower module (harness.bridge_vision), put in place of mcore2hf's at TP2 x PP2, has the same
parameter names, shapes and TP attributes on every rank and loads and exports the checkpoint bit for bit; the
one-process dry run (`mcore2hf plan --vision-tower native`) is the live plan.

Offline (layout 1): Megatron's torch_dist checkpoint of the native-tower model (dist_checkpointing of its
sharded_state_dict, whose tower part equals Bridge 0.6.2's key for key) exports offline bit for bit, `verify` finds
it identical, and `mcore2hf import --vision-tower native` writes exactly its keys and loads back at TP2 x PP2, TP2
and PP2. Layout 2's image forward: Megatron-Bridge 0.3.1's own Qwen3VLModel (transformers' tower embedded, loaded by
mcore2hf) on text + images equals transformers' at TP2 x PP2 and TP1.

The tiny towers: 2 heads of 20 (TP2 splits the heads; transformers' 2-D vision rope needs head_dim % 4 == 0, so
with an even head count the width is a multiple of 8 here, unlike the other tower dimensions), ffn 30, patches of
2 x 3 x 3 over a 5 x 5 position grid; Qwen3-VL's 3 blocks with deepstack after blocks 0 and 1, Qwen3.5's 2."""

import os
import re

import pytest
import torch
import worlds
from harness.bridge_vision import BRIDGE_VISION_FILES, BRIDGE_VISION_VERSION, bridge_vision_root
from harness.bridge_vlm import bridge_vlm_root
from vlm_checks import check_wrapper_checkpoint

from mcore2hf.runtime.forward import MARGIN, logit_tolerance
from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOWER = dict(hidden_size=40, intermediate_size=30, num_heads=2, num_position_embeddings=25, patch_size=3,
             temporal_patch_size=2, spatial_merge_size=2)
IDS = dict(image_token_id=95, video_token_id=96, vision_start_token_id=97, vision_end_token_id=98)
CONFIGS = {
    "qwen3_vl": dict(vision_config=dict(TOWER, depth=3, out_hidden_size=44, deepstack_visual_indexes=[0, 1]), **IDS),
    "qwen3_vl_moe": dict(vision_config=dict(TOWER, depth=3, out_hidden_size=44, deepstack_visual_indexes=[0, 2]),
                         **IDS),
    "qwen3_5": dict(vision_config=dict(TOWER, depth=2, out_hidden_size=64), **IDS),
    "qwen3_5_moe": dict(vision_config=dict(TOWER, depth=2, out_hidden_size=64), **IDS),
}
LAYOUTS = [Layout(tp=2, pp=2), Layout(tp=2), Layout(pp=2), Layout(), Layout(pp=2, vpp=2)]
#: two images (grids t x h x w in patches: 6 and 2 tokens after the 2 x 2 merge) between text
GRID = torch.tensor([[1, 4, 6], [1, 2, 4]])
IMAGE, START, END = 95, 97, 98
TOKENS = torch.tensor([[5, 7, START] + [IMAGE] * 6 + [END, 11, 12, START] + [IMAGE] * 2 + [END, 40, 41, 42]])
#: fp32 logit tolerance (max |Megatron - transformers|, logits ~12-16): for Qwen3-VL and its MoE form MARGIN x the
#: measured maximum over every layout, text and image, Bridge 0.3.1's forward included (1.1e-5; 2026-11-28:
#: qwen3_vl 8.6e-6, qwen3_vl_moe 9.1e-6, Bridge 6.3e-6); for Qwen3.5 text the gated-DeltaNet family's
#: (runtime.forward: the chunked delta rule sums in another order; measured 4.3-7.9e-5 here), with images MARGIN x
#: the measured 5.3e-4 (a single text or image position after the second image, TP1, seed 1 pixels; at TP2 x PP2
#: 1.1e-4 and 3.1e-4, and 3.2e-4 and 6.5e-4 on 2026-11-28: 2.4x):
#: the same forward in float64 shrinks it 7x (6.1e-5; parts of both stacks stay fp32), while the other positions
#: stay ~1e-5, so it is round-off the recurrence amplifies, not a misplaced tensor (that moves logits by ~1)
TOL = {"qwen3_vl": MARGIN * 1.1e-5, "qwen3_vl_moe": MARGIN * 1.1e-5, "qwen3_5": logit_tolerance("qwen3_5"),
       "qwen3_5_moe": logit_tolerance("qwen3_5_moe")}
TOL_IMAGE_GDN = MARGIN * 5.3e-4
#: engine-sharded export refused at engine TP 4: Qwen3-VL's tower's 2 heads (or its ffn of 30) do not divide, as
#: the engines refuse; Qwen3.5's 2 linear key heads already; Qwen3-VL-MoE: its packed experts (worlds.ENGINE_REFUSALS)
ENGINE_REFUSALS = {"qwen3_vl": (lambda engine, tp, ep: tp > 2, r"model\.visual\.[\w.]+: expected (?:tp_size 4 "
                                r"dividing the 2 vision heads|dim 0 \(30\) divisible by 4 engine ranks)"),
                   **{mt: (lambda engine, tp, ep: tp > 2, r"linear_attn\.\w+(?:\.weight)?: expected tp_size 4 "
                           r"dividing the 2 linear key heads") for mt in ("qwen3_5", "qwen3_5_moe")}}
#: Megatron-Bridge 0.6.2's Qwen3-VL table (its vision_model.* names are those of its TE-built native tower)
BRIDGE_TABLE = "megatron/bridge/models/qwen_vl/qwen3_vl_bridge.py"


def bridge_tower_patterns() -> list[str]:
    """The `vision_model.*` Megatron names of Bridge's Qwen3VLBridge.mapping_registry as regexes (`*` a layer
    index, `**` any rest, as its param_mapping matches them)."""
    from harness.wheels import unpacked_wheel

    text = (unpacked_wheel("megatron-bridge", BRIDGE_VISION_VERSION, BRIDGE_VISION_FILES) / BRIDGE_TABLE).read_text()
    table = text[text.index("class Qwen3VLBridge"):text.index("class Qwen3VLMoEBridge")]
    names = sorted(set(re.findall(r'"(vision_model\.[^"]+)"', table)))
    assert len(names) > 20, names
    return [re.escape(n).replace(r"\*\*", ".+").replace(r"\*", r"\d+") for n in names]


@pytest.fixture(scope="module")
def vl_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_vl")
    return {mt: make_hf_checkpoint(tiny_config(mt, **kw), root / mt) for mt, kw in CONFIGS.items()}


def test_native_tower_exports_bit_exact_and_matches_transformers_forward(vl_ckpts, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    pixels = torch.randn(int(GRID.prod(-1).sum()), 3 * 2 * 3 * 3, generator=torch.Generator().manual_seed(1))
    images = {"pixel_values": pixels, "image_grid_thw": GRID}
    per_rank = run_world(worlds.in_layouts, LAYOUTS[0], LAYOUTS, worlds.native_vl_archs, vl_ckpts, "qwen3_vl",
                         str(tmp_path), TOKENS, images, LAYOUTS[0], bridge_vision_root(), bridge_vlm_root(),
                         timeout=900)
    # Megatron-Bridge 0.6.2's own tower: mcore2hf's names, shapes and TP attributes on every rank, exports the same,
    # and Megatron saves the same of both (checkpoint keys, global shapes, offsets, replicas, `_extra_state` objects)
    assert [r[str(LAYOUTS[0])]["bridge"]["compared"] for r in per_rank] == [57, 57, 0, 0], per_rank
    assert [r[str(LAYOUTS[0])]["bridge"]["keys"] for r in per_rank] == [75, 75, 0, 0], per_rank
    # layout 1 offline: Megatron's torch_dist checkpoint of the native-tower model, and the import loaded back
    full = read_hf_checkpoint(vl_ckpts["qwen3_vl"])
    for layout in (LAYOUTS[0], Layout(tp=2), Layout(pp=2)):  # TP2 x PP2, TP2, PP2 (the tower on stage 0)
        assert [r[str(layout)]["dist"]["tensors"] for r in per_rank] == [len(full)] * 4, layout
    base = per_rank[0][str(LAYOUTS[0])]["dist"]["base"]
    check_wrapper_checkpoint(base, vl_ckpts["qwen3_vl"], str(tmp_path / "offline_native"),
                             os.path.join(os.path.dirname(base), "import", "qwen3_vl"))
    patterns = bridge_tower_patterns()
    worst: dict[str, float] = {}
    engines = 0
    for mt, ckpt in vl_ckpts.items():
        hf = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
        with torch.no_grad():
            ref_image = hf(input_ids=TOKENS, pixel_values=pixels, image_grid_thw=GRID,
                           mm_token_type_ids=(TOKENS == IMAGE).int()).logits
            ref_text = hf(input_ids=worlds.TOKENS).logits
            if mt == "qwen3_vl":  # the image moves the logits far more than the tolerance: the check can fail
                blank = hf(input_ids=TOKENS, pixel_values=torch.zeros_like(pixels), image_grid_thw=GRID,
                           mm_token_type_ids=(TOKENS == IMAGE).int()).logits
                assert (blank - ref_image).abs().max() > 100 * TOL[mt]
                # layout 2: Megatron-Bridge 0.3.1's own Qwen3VLModel (transformers' tower embedded) on text +
                # images, at TP2 x PP2 and TP1, loaded by mcore2hf from the checkpoint
                for layout in (LAYOUTS[0], Layout()):
                    worst[f"bridge-0.3.1 {layout} image"] = max(
                        (r[str(layout)]["bridge_image"] - ref_image).abs().max().item() for r in per_rank)
        for layout in LAYOUTS:
            key = str(layout)
            if mt not in per_rank[0][key]:
                continue
            res = [r[key][mt] for r in per_rank]
            # the tower only on the first pipeline stage: one chunk per rank of stage 0, none elsewhere
            # (with a virtual pipeline, in the first chunk only: one tower per rank still)
            stage = [rank // (len(res) // layout.pp) for rank in range(len(res))]  # Megatron's order: PP outermost
            assert [r["towers"] for r in res] == [int(s == 0) for s in stage], (mt, key, [r["towers"] for r in res])
            for what, ref in (("image", ref_image), ("text", ref_text)):
                if res[0][what] is not None:  # (no image forward at PP2 x VPP2: deepstack needs 2 layers there)
                    worst[f"{mt} {key} {what}"] = max((r[what] - ref).abs().max().item() for r in res)
            # engine-sharded export, the tower as both engines shard it (at TP2 x PP2, the layout of the whole world)
            if res[0]["engine"] is not None:
                engines += 1
                problems = worlds.engine_problems(mt, [r["engine"] for r in res], layout, ENGINE_REFUSALS)
                assert not problems, "\n".join(problems)
            _, info = AutoModelForImageTextToText.from_pretrained(res[0]["dir"], output_loading_info=True)
            assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (mt, key, info)
            # TE names (a TP rank of the first stage holds every tower name): each is a name of Bridge 0.6.2's table
            names = res[0]["te_tower"]
            assert names and not [n for n in names if not any(re.fullmatch(p, n) for p in patterns)], (mt, names)
    assert engines == len(CONFIGS), engines  # every architecture at TP2 x PP2
    # `mcore2hf plan --vision-tower native`: the one-process dry run is the plan the live ranks built (records,
    # describe() text, every rank's memory estimate)
    text, records, memory = worlds.in_fresh_process(worlds.native_dry_run, vl_ckpts["qwen3_vl"], LAYOUTS[0], 4096)
    live = [r[str(LAYOUTS[0])]["qwen3_vl"]["plan_4k"] for r in per_rank]
    assert records == live[0][1] and text == live[0][0], "dry run != live plan"
    assert memory == [p[2] for p in live], (memory, [p[2] for p in live])
    with capsys.disabled():
        print(f"\nnative vision tower: max |Megatron - transformers| fp32 logits {worst}")
    assert len(worst) == 2 * (len(LAYOUTS) + len(CONFIGS) - 1) - 1 + 2, sorted(worst)
    bad = {k: v for k, v in worst.items() if v >= (TOL_IMAGE_GDN if k.endswith("image") and k.startswith("qwen3_5")
                                                   else TOL.get(k.split()[0], TOL["qwen3_vl"]))}
    assert not bad, bad


def test_native_tower_block_and_deepstack_counts_are_checked_against_the_hf_vision_config():
    """The export's structure check (plan.checks.vision_tower_problems): blocks 0..depth-1 and one deepstack merger
    per deepstack_visual_indexes entry; a tower of another depth or without its mergers is named."""
    from mcore2hf.plan.checks import vision_tower_problems

    cfg = tiny_config("qwen3_vl", **CONFIGS["qwen3_vl"])
    block = "vision_model.decoder.layers.{}.self_attention.linear_qkv.weight"
    merger = "vision_model.decoder.deepstack_merger_list.{}.linear_fc1.weight"
    good = [block.format(i) for i in range(3)] + [merger.format(i) for i in range(2)]
    assert vision_tower_problems(good, cfg) == []
    assert vision_tower_problems(["model.x"], cfg) == []  # no native tower: nothing to check
    (depth,) = vision_tower_problems(good[1:], cfg)
    assert "depth 3" in depth and "[1, 2]" in depth, depth
    (deep,) = vision_tower_problems(good[:3], cfg)
    assert "has 2 (deepstack_visual_indexes)" in deep, deep
