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
from mcore2hf.arch.registry import Architecture, register
from mcore2hf.model_specs import qwen3_vl as spec

from .common import (
    TINY_QWEN3_VL_VISION,
    TINY_VL_IDS,
    TINY_VL_MROPE,
    TINY_VL_TEXT,
    VLM_FP8_SOURCE,
    fp8_policy,
    hf_tower,
    language_model,
    llama_like,
    native_vision_tower,
)

#: the vision tower's HF tensors: the Megatron model may hold them (an embedded tower) or not (layout 3)
VISUAL = (r"model\.visual\..*",)

QWEN3_VL = Converter(
    model_type="qwen3_vl",
    spec=spec.SPEC,
    rules=language_model(llama_like()) + native_vision_tower() + hf_tower("vision_model", "model.visual"),
    not_held=VISUAL,
    fp8=fp8_policy(source=VLM_FP8_SOURCE, tower=("model.visual.",)),
)

TINY = dict(text_config=dict(TINY_VL_TEXT, rope_parameters=TINY_VL_MROPE), vision_config=TINY_QWEN3_VL_VISION,
            tie_word_embeddings=False, **TINY_VL_IDS)
VERIFIED = ('its own world (TP2 x PP2 x EP2, PP2 x VPP2 x EP2): the language model bit-identical, the tower '
            'completed from the multimodal checkpoint offline and live (once per sync or with the first), '
            'offline export and import, engine shards, the dry run, transformers loads every directory; '
            "logits (text tokens) = transformers' at both, demo, Megatron-Bridge 0.3.1's Qwen3VLModel with "
            "its HF tower (TP2 x PP2); its wrapper's torch_dist checkpoint exported offline, verified and "
            "imported (--vision-tower hf), the wrapper's dry run; the native Megatron tower (TP2 x PP2, "
            'TP2, PP2, TP1, PP2 x VPP2): bit-identical with the tower, transformers loads it, text + image '
            "logits = transformers', Bridge 0.6.2's own tower module, FP8, the dry run")
register(Architecture(QWEN3_VL, tiny=TINY, verified=VERIFIED))
