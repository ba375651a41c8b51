"""Qwen3-VL (HF `qwen3_vl`: Qwen3VLForConditionalGeneration, Qwen3-VL-2B ... 32B): the language model is Qwen3
(q/k norms, GQA, no biases) under `model.language_model.`, `lm_head.weight` at the top, the vision tower under
`model.visual.` (patch_embed, pos_embed, blocks, merger, deepstack_merger_list), as transformers 5.24 names them
(models/qwen3_vl/modeling_qwen3_vl.py: Qwen3VLModel.visual / .language_model; no conversion_mapping entry).

The tower, by Megatron-side layout (docs/vlm.md):
* a native Megatron tower (Megatron-Bridge 0.6.2's Qwen3VLModel, mbridge's qwen3_vl: megatron-core ViT layers at
  `vision_model`, tensor-parallel, on the first stage): `native_vision_tower` (converters/common.py), before the
  pass-through, whose `vision_model.*` names it shares only where both mean the same tensor (the merger linears,
  split natively and whole when embedded, decide from the shard: layouts.WholeOrSplit);
* an HF tower inside the Megatron model (Megatron-Bridge 0.3.1's Qwen3VLModel: transformers' Qwen3VLVisionModel
  at `vision_model`, replicated on the first stage): passed through under `model.visual.` (`hf_tower`);
* no tower (a text-only trainer, or miles' frozen tower): `model.visual.*` is declared not held, so loading skips
  it, `save_pretrained(base=...)` completes it and a live sync sends it from the checkpoint (`tower_from`)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import VLM_FP8_SOURCE, fp8_policy, hf_tower, language_model, llama_like, native_vision_tower

#: the vision tower's HF tensors: the Megatron model may hold them (an embedded tower) or not (layout 3)
VISUAL = (r"model\.visual\..*",)

QWEN3_VL = register(Converter(
    model_type="qwen3_vl",
    spec="mcore2hf.model_specs.qwen3_vl",
    rules=language_model(llama_like()) + native_vision_tower() + hf_tower("vision_model", "model.visual"),
    not_held=VISUAL,
    fp8=fp8_policy(source=VLM_FP8_SOURCE, tower=("model.visual.",)),
))
