"""Checks shared by the vision-language tests (tests/test_vlm.py, tests/test_qwen3_vl_native.py), run in the test
process on what their worlds wrote."""

from __future__ import annotations

import os

import torch

from mcore2hf.runtime.tiny import read_hf_checkpoint


def check_wrapper_checkpoint(base: str, hf_dir: str, out: str, imported: str,
                             tower: tuple[str, str] = ("vision_model.", "model.visual.")) -> None:
    """A vision-language wrapper's torch_dist checkpoint (Megatron-Bridge's Qwen3VLModel, its tower native or
    embedded: keys under `language_model.` / `vision_model.`; GLM45VModel's and KimiK25VLModel's under `visual.` /
    `vision_tower.`: `tower` is (a tower key prefix, its HF prefix)), saved by Megatron under base/ckpt beside the live
    export base/live (worlds.save_dist_checkpoint): the offline export is the HF checkpoint `hf_dir` and the live
    export bit for bit, and transformers' class loads it with nothing missing, unexpected or mismatched;
    `mcore2hf verify` finds checkpoint and HF directory identical, nothing missing; `mcore2hf import
    --vision-tower` wrote (under `imported`) exactly the keys and `_extra_state` objects Megatron saved (that
    Megatron loads the import: the worlds)."""
    from transformers import AutoModelForImageTextToText

    from mcore2hf.formats import open_checkpoint
    from mcore2hf.offline import export_checkpoint
    from mcore2hf.verify import compare

    ckpt = os.path.join(base, "ckpt")
    want, live = read_hf_checkpoint(hf_dir), read_hf_checkpoint(os.path.join(base, "live"))
    export_checkpoint(ckpt, out, hf_dir, progress=False)
    got = read_hf_checkpoint(out)
    assert set(got) == set(want) == set(live), sorted(set(want) ^ set(got))[:4]
    assert all(torch.equal(got[n], want[n]) and torch.equal(live[n], want[n]) for n in want), base
    assert any(n.startswith(tower[1]) for n in got)
    _, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    r = compare(hf_dir, ckpt)
    assert r.identical and r.compared == len(want), (r.rows[:3], r.missing[:3], r.unexpected[:3])
    saved = {k for k in open_checkpoint(ckpt).meta.state_dict_metadata
             if not k.startswith("optimizer.")}
    written = set(open_checkpoint(imported).meta.state_dict_metadata)
    assert written == saved, sorted(written ^ saved)[:6]
    assert any(k.startswith(tower[0]) for k in saved) and any(k.startswith("language_model.") for k in saved)
