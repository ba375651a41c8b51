"""Registry of architectures: HF model_type -> converter table (+ its model spec)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

from .errors import UnsupportedArchitectureError

if TYPE_CHECKING:  # the converters import torch; `mcore2hf list` reads only the catalog below
    from .mapping import Converter

_CONVERTERS: dict[str, Converter] = {}
_loaded = False


def register(converter: Converter) -> Converter:
    for name in (converter.model_type, *converter.aliases):
        _CONVERTERS[name] = converter
    return converter


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        importlib.import_module("mcore2hf.converters")  # a failure here surfaces, and is retried next time
        _loaded = True


def list_architectures() -> list[str]:
    """Registered HF model_type names, e.g. ["qwen3_moe", ...]."""
    _load_builtin()
    return sorted(_CONVERTERS)


def get_converter(model_type: str) -> Converter:
    _load_builtin()
    try:
        return _CONVERTERS[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"no converter for HF model_type {model_type!r}; registered: {sorted(_CONVERTERS)}"
        ) from None


def canonical_model_type(model_type: str) -> str:
    """The registered model_type an alias stands for (e.g. kimi_k2 -> deepseek_v3); others unchanged."""
    _load_builtin()
    converter = _CONVERTERS.get(model_type)
    return converter.model_type if converter is not None else model_type


def formats_mapping(names) -> list[str]:
    """The registered formats (model_types, aliases left out) whose table maps every canonical Megatron name in
    `names`: which architecture a checkpoint holds, when it is not the one its HF config says."""
    _load_builtin()
    names = list(names)
    return sorted({c.model_type for c in _CONVERTERS.values() if all(c.maps(n) for n in names)})


def get_model_spec(model_type: str) -> ModuleType:
    return importlib.import_module(get_converter(model_type).spec)


#: What the test suite verifies per architecture (`mcore2hf list`; docs/architectures.md has the detail). The layout
#: worlds' counts are checked against tests/test_layout_matrix.py, so this table cannot drift from the suite.
_EVERY = "logits = transformers' at each, import loaded by Megatron, offline export, engine shards, demo"
VERIFIED: dict[str, str] = {
    **{mt: f"7 layout worlds (TP, PP, VPP, EP, expert-TP != TP, uneven PP, bf16); {_EVERY}"
       for mt in ("qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3", "qwen2", "llama", "minimax_m2")},
    "gpt_oss": f"6 layout worlds (all at expert-TP 1); {_EVERY}",
    **{mt: f"3 layout worlds (TP x PP x EP, PP x VPP, uneven PP: every parallel dimension); {_EVERY}"
       for mt in ("glm4_moe_lite", "deepseek_v2", "mixtral", "mistral", "olmoe", "deepseek_v32", "glm_moe_dsa")},
    "qwen3_next": "its own layout world (TP2 x PP2 x VPP2 x EP2, bf16); logits (and fp32 round-off) = transformers' "
                  "at TP1 and TP2 x EP2, import loaded by Megatron, offline export, engine shards, demo",
    **{mt: "its own worlds (TP2 x EP2, PP2, TP1 x DP2); logits (and fp32 round-off) = transformers' at each, "
           "completed from the multimodal checkpoint, offline export, engine shards, demo"
       for mt in ("qwen3_5", "qwen3_5_moe")},
    **{mt: "its own world (TP2 x PP2 x EP2, PP2 x VPP2 x EP2): the language model bit-identical, the tower completed "
           "from the multimodal checkpoint offline and live (once per sync or with the first), offline export and "
           "import, engine shards" + (" (its packed experts refused)" if mt == "qwen3_vl_moe" else "")
           + ", the dry run, transformers loads every directory; logits (text tokens) = transformers' at both, "
           "demo" + {"qwen3_vl": ", Megatron-Bridge 0.3.1's Qwen3VLModel with its HF tower (TP2 x PP2)",
                     "glm4v_moe": ", Megatron-Bridge 0.3.1's GLM45VModel with its HF tower (TP2 x PP2)",
                     "kimi_k25": ", Megatron-Bridge 0.6.2's KimiK25VLModel (rebuilt) with its tower (TP2 x PP2)",
                     }.get(mt, "") + ("; its wrapper's torch_dist checkpoint exported offline, verified and imported "
                                      "(--vision-tower hf), the wrapper's dry run" if mt != "qwen3_vl_moe" else "")
       for mt in ("qwen3_vl", "qwen3_vl_moe", "glm4v_moe", "kimi_k25")},
}

#: the vision tower built natively in Megatron (build_model(vision_tower="native"), Megatron-Bridge 0.6.2's layout;
#: tests/test_qwen3_vl_native.py, docs/architectures.md)
for _mt, _layouts in (("qwen3_vl", "TP2 x PP2, TP2, PP2, TP1, PP2 x VPP2"), ("qwen3_vl_moe", "TP2 x PP2"), ("qwen3_5", "TP2 x PP2"),
                      ("qwen3_5_moe", "TP2 x PP2")):
    VERIFIED[_mt] += (f"; the native Megatron tower ({_layouts}): bit-identical with the tower, transformers loads it, "
                      "text + image logits = transformers'" + (", Bridge 0.6.2's own tower module, FP8, the dry run"
                                                               if _mt == "qwen3_vl" else ""))


class Listed(NamedTuple):
    """What `mcore2hf list` shows of a registered model_type, without importing a converter (they import torch)."""

    hf_class: str  # the model class transformers registers for it (the checkpoints' `architectures`)
    fp8: bool  # its converter has an FP8 policy
    format_of: str | None = None  # an alias: the registered model_type whose format it is


#: every registered model_type (converters/*.py registers them: tests/test_cli.py checks this table against the
#: registry and transformers 5.24's auto mappings, so it cannot drift)
CATALOG: dict[str, Listed] = {
    "deepseek_v2": Listed("DeepseekV2ForCausalLM", True),
    "deepseek_v3": Listed("DeepseekV3ForCausalLM", True),
    "deepseek_v32": Listed("DeepseekV32ForCausalLM", True),
    "glm4_moe": Listed("Glm4MoeForCausalLM", True),
    "glm4_moe_lite": Listed("Glm4MoeLiteForCausalLM", True),
    "glm4v_moe": Listed("Glm4vMoeForConditionalGeneration", True),
    "glm_moe_dsa": Listed("GlmMoeDsaForCausalLM", True),
    "gpt_oss": Listed("GptOssForCausalLM", False),
    "kimi_k2": Listed("DeepseekV3ForCausalLM", True, "deepseek_v3"),
    "kimi_k25": Listed("Kimi_K25ForConditionalGeneration", True),
    "llama": Listed("LlamaForCausalLM", True),
    "minimax_m2": Listed("MiniMaxM2ForCausalLM", True),
    "mistral": Listed("MistralForCausalLM", True),
    "mixtral": Listed("MixtralForCausalLM", True),
    "olmoe": Listed("OlmoeForCausalLM", True),
    "qwen2": Listed("Qwen2ForCausalLM", True),
    "qwen3": Listed("Qwen3ForCausalLM", True),
    "qwen3_5": Listed("Qwen3_5ForConditionalGeneration", False),
    "qwen3_5_moe": Listed("Qwen3_5MoeForConditionalGeneration", False),
    "qwen3_moe": Listed("Qwen3MoeForCausalLM", True),
    "qwen3_next": Listed("Qwen3NextForCausalLM", False),
    "qwen3_vl": Listed("Qwen3VLForConditionalGeneration", True),
    "qwen3_vl_moe": Listed("Qwen3VLMoeForConditionalGeneration", False),
}


def verified(model_type: str) -> str:
    """What the test suite verifies for `model_type` (an alias: its format's)."""
    listed = CATALOG.get(model_type)
    return VERIFIED[(listed.format_of or model_type) if listed else canonical_model_type(model_type)]

