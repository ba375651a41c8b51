"""Loading HF configs from any of the forms users hold, and reading fields across transformers versions."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .errors import ConfigMismatchError, Problem

HFConfigLike = PretrainedConfig | dict | str | os.PathLike

_MISSING = object()


def load_hf_config(hf_config: HFConfigLike) -> PretrainedConfig:
    """A PretrainedConfig from a config object, a dict (with model_type), config.json, or an HF directory.

    A config that cannot be one of the registered architectures is refused here, naming the file: malformed JSON,
    no `model_type`, a model_type no converter is registered for (the registered ones listed, not transformers'),
    or `architectures` naming another model than `model_type` does."""
    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if isinstance(hf_config, dict):
        return _from_dict(hf_config, "the HF config dict")
    path = os.fspath(hf_config)
    if os.path.isdir(path):
        config_json = os.path.join(path, "config.json")
        if not os.path.isfile(config_json):
            raise ConfigMismatchError(f"{path} is a directory without config.json (expected an HF directory)")
        cfg = _from_dict(_read_json(config_json), config_json)
        cfg.name_or_path = path  # as from_pretrained records it: exports write this directory's config.json
        return cfg
    if os.path.isfile(path):
        return _from_dict(_read_json(path), path)
    raise FileNotFoundError(f"no HF config at {path} (expected config.json or an HF directory)")


def _from_dict(raw: dict, where: str) -> PretrainedConfig:
    """The config of `raw` (an alias's auto_map, i.e. remote code, is never imported: it loads as its target)."""
    from .registry import get_converter, list_architectures

    if not isinstance(raw, dict):
        raise ConfigMismatchError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    d = dict(raw)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ConfigMismatchError(f"{where}: no 'model_type' (expected one of {', '.join(list_architectures())})")
    if model_type not in list_architectures():
        raise ConfigMismatchError(f"{where}: model_type {model_type!r} has no converter (registered: "
                                  f"{', '.join(list_architectures())})")
    conv = get_converter(model_type)
    known = architecture_classes(conv.model_type)
    wrong = [a for a in d.get("architectures") or [] if known and a not in known]
    if wrong:
        raise ConfigMismatchError(f"{where}: architectures {wrong} disagree with model_type {model_type!r} "
                                  f"(transformers' classes for it: {', '.join(sorted(known))})")
    try:
        return AutoConfig.for_model(conv.model_type, **d)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigMismatchError(f"{where}: transformers refuses this {model_type} config: {e}") from None


def architecture_classes(model_type: str) -> set[str]:
    """The model classes transformers registers for `model_type` (its auto mappings), which a config's
    `architectures` may name; empty if transformers registers none."""
    from transformers.models.auto import modeling_auto

    out: set[str] = set()
    for attr in dir(modeling_auto):
        mapping = getattr(modeling_auto, attr)
        if attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict) and model_type in mapping:
            value = mapping[model_type]
            out.update(value if isinstance(value, (list, tuple)) else [value])
    return {n for n in out if not n.endswith("Config")}


def _canonical(model_type: str) -> str:
    """Aliases of registered architectures (Kimi-K2's `kimi_k2` is a DeepSeek-V3 config) load as their target."""
    from .registry import canonical_model_type

    return canonical_model_type(model_type)


def text_config(cfg: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: a multimodal config's nested `text_config` (Qwen3.5: transformers 5.23
    Qwen3_5Config / Qwen3_5MoeConfig), else the config itself. The Megatron model is built from it."""
    sub = getattr(cfg, "text_config", None)
    return sub if isinstance(sub, PretrainedConfig) else cfg


def get(cfg: PretrainedConfig, *names: str, default: Any = _MISSING) -> Any:
    """The first of `names` that the config has (field names moved between transformers versions)."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise ConfigMismatchError(f"{type(cfg).__name__} has none of the fields {names}")
    return default


def rope_parameters(cfg: PretrainedConfig) -> dict:
    """Rope settings: transformers 5 keeps them in `rope_parameters`, 4.x as attributes."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if "rope_theta" not in params and getattr(cfg, "rope_theta", None) is not None:
        params["rope_theta"] = cfg.rope_theta
    if "partial_rotary_factor" not in params and getattr(cfg, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = cfg.partial_rotary_factor
    return params


def rope_theta(cfg: PretrainedConfig) -> float:
    return float(rope_parameters(cfg).get("rope_theta", 10000.0))


def partial_rotary_factor(cfg: PretrainedConfig) -> float:
    return float(rope_parameters(cfg).get("partial_rotary_factor", 1.0))


# Files an HF directory carries besides weights and config.json; exports copy them from the source directory.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja", "chat_template.json",
                   "added_tokens.json", "preprocessor_config.json")


@dataclass(frozen=True)
class ConfigSource:
    """An HF config as the user holds it: the parsed config, the config.json dict exactly as written (key names
    and order; None when only an object was given), and the directory it came from (companion files)."""

    config: PretrainedConfig
    raw: dict | None = None
    directory: str | None = None

    @property
    def companion_files(self) -> list[str]:
        if self.directory is None:
            return []
        return [os.path.join(self.directory, f) for f in COMPANION_FILES
                if os.path.isfile(os.path.join(self.directory, f))]


def config_source(hf_config: HFConfigLike) -> ConfigSource:
    """Load `hf_config` and keep the file it came from, so exports write the user's config.json as given
    (transformers re-serializes renamed fields: e.g. Qwen3-MoE's num_experts, rope_theta, torch_dtype)."""
    cfg = load_hf_config(hf_config)
    if isinstance(hf_config, dict):
        return ConfigSource(cfg, dict(hf_config))
    if isinstance(hf_config, PretrainedConfig):
        # an object loaded from a directory and not changed since: that directory's file is the user's config
        path = getattr(hf_config, "_name_or_path", "") or ""
        if os.path.isfile(os.path.join(path, "config.json")):
            try:
                same = load_hf_config(path).to_dict() == hf_config.to_dict()
            except Exception:  # noqa: BLE001 - unreadable: write the object as transformers would
                same = False
            if same:
                return ConfigSource(cfg, _read_json(os.path.join(path, "config.json")), path)
        return ConfigSource(cfg)
    path = os.fspath(hf_config)
    if os.path.isdir(path):
        return ConfigSource(cfg, _read_json(os.path.join(path, "config.json")), path)
    return ConfigSource(cfg, _read_json(path))


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigMismatchError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def output_config(source: ConfigSource, dtype, quantization: dict | None = None) -> tuple[str, list[str]]:
    """config.json text for an exported directory, and notes on what changed.

    Only what the export changes is changed: the dtype value (under the key the input uses: `torch_dtype` or
    `dtype`) and `quantization_config` (set when the export is quantized, dropped otherwise: the weights are
    not quantized any more)."""
    notes = []
    dtype_name = str(dtype).removeprefix("torch.")
    if source.raw is not None:
        out = dict(source.raw)
        for key in ("torch_dtype", "dtype"):
            if key in out and out[key] != dtype_name:
                out[key] = dtype_name
        had_q = out.pop("quantization_config", None) if quantization is None else None
        if quantization is not None:
            out["quantization_config"] = quantization
        text = json.dumps(out, indent=2) + "\n"
    else:
        import copy

        cfg = copy.deepcopy(source.config)
        if hasattr(cfg, "dtype"):
            cfg.dtype = dtype_name
        else:
            cfg.torch_dtype = dtype_name
        had_q = getattr(cfg, "quantization_config", None) if quantization is None else None
        if had_q is not None:
            del cfg.quantization_config
        if quantization is not None:
            cfg.quantization_config = quantization
        text = cfg.to_json_string(use_diff=False)
    if had_q:
        method = had_q.get("quant_method", "?") if isinstance(had_q, dict) else type(had_q).__name__
        notes.append(f"dropped the source config's quantization_config (quant_method={method}): the exported "
                     "weights are not quantized")
    return text, notes


#: where the published checkpoints' layout differs from what transformers 5.24 saves (`revert_weight_conversion`
#: gives the latter; both load): per model_type, (regex, action) with action "transpose" (dims 1 and 2 swapped) or
#: a replacement name. Qwen3-VL-MoE's packed experts are published as [E, hidden, 2 * ffn] / [E, ffn, hidden]
#: (conversion_mapping.py "qwen3_vl_moe" transposes them on load, with check_dims, not back on save); Kimi-K2.5's
#: language model layers as `language_model.model.layers` (its "blocks" -> "layers" rename, meant for the vision
#: tower, is reverted on the language model's names too when saving) and its projector norm under `mm_projector.`
PUBLISHED_LAYOUT: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen3_vl_moe": ((r"\.mlp\.experts\.(gate_up_proj|down_proj)$", "transpose"),),
    "kimi_k25": ((r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                 (r"^model\.mm_projector\.", "mm_projector.")),
}


def published_layout(model_type: str, name: str, value):
    """(name, value) as the published checkpoints of `model_type` store a tensor transformers saves as (name,
    value); `value` is a tensor or a shape tuple."""
    import re

    for pattern, action in PUBLISHED_LAYOUT.get(model_type, ()):
        if re.search(pattern, name):
            if action != "transpose":
                name = re.sub(pattern, action, name)
            elif isinstance(value, tuple):
                value = (value[0], value[2], value[1], *value[3:])
            else:
                value = value.transpose(1, 2).contiguous()
    return name, value


def as_published(reader, cfg: PretrainedConfig):
    """`reader` (hf_dir.open_tensors) seen in the published layout: a checkpoint transformers itself saved (its
    names and packed-expert layout, PUBLISHED_LAYOUT) reads as the published one, as transformers reads both
    (conversion_mapping.py: "qwen3_vl_moe" transposes on load only where the stored shape is not the model's,
    `Transpose(1, 2, check_dims=True)`; "kimi_k25" renames either form). A transposed tensor is told by its shape
    against the published one; a square one (hidden == 2 x ffn) reads as published. Unchanged where nothing
    differs."""
    import re

    import torch

    from .hf_dir import PublishedView

    rules = PUBLISHED_LAYOUT.get(cfg.model_type, ())
    names = reader.names()
    if not any(re.search(p, n) for p, _ in rules for n in names):
        return reader
    want = hf_tensor_shapes(cfg) if any(a == "transpose" for _, a in rules) else {}
    stored: dict[str, tuple[str, bool]] = {}
    for n in names:
        x = reader.slice(n)
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x.get_shape())
        published, pshape = published_layout(cfg.model_type, n, shape)
        transposed = pshape != shape and want.get(published) == pshape and want.get(published) != shape
        stored[published] = (n, transposed)
    return PublishedView(reader, stored)


def hf_tensor_shapes(cfg: PretrainedConfig, num_mtp_layers: int = 0,
                     not_held: Callable[[str], bool] | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of `cfg` holds, with its shape, as transformers itself defines it: the model
    built on the meta device (no memory), in checkpoint format (`revert_weight_conversion` undoes transformers
    5's in-memory fusions, e.g. of experts). MTP layers, which transformers does not build, are the last decoder
    layer's tensors (and a DSA indexer, see below) plus DeepSeek-V3's published MTP extras. A multimodal config (Qwen3.5) is built as its
    published class (AutoModelForImageTextToText); `not_held` drops the tensors a converter declares the
    Megatron model never holds (its vision tower). Names and shapes are the published checkpoints' (PUBLISHED_LAYOUT)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(cfg, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    sd = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x keeps checkpoint format in memory
        pass
    else:
        sd = revert_weight_conversion(model, sd)
    shapes = dict(published_layout(cfg.model_type, k, tuple(v.shape)) for k, v in sd.items())
    if not_held is not None:
        shapes = {k: v for k, v in shapes.items() if not not_held(k)}
    if getattr(cfg, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # tied: checkpoints hold the embedding only
    n, h = text_config(cfg).num_hidden_layers, text_config(cfg).hidden_size
    last = f"model.layers.{n - 1}."
    embed = shapes.get("model.embed_tokens.weight")
    for m in range(num_mtp_layers):
        layer = f"model.layers.{n + m}."
        shapes.update({layer + k[len(last):]: v for k, v in list(shapes.items()) if k.startswith(last)})
        # DeepSeek sparse attention with IndexShare (GLM-5.2): the MTP layer computes its own top-k, so it holds the
        # indexer even where the last decoder layer is "shared" (megatron-core 0.19.2 multi_token_prediction.py:
        # 1036-1043 numbers its layer 1, which dsa.py is_dsa_skip_topk_layer never skips); layer 0 always has one
        shapes.update({layer + k[len("model.layers.0."):]: v for k, v in list(shapes.items())
                       if k.startswith("model.layers.0.self_attn.indexer.")})
        shapes.update({f"{layer}enorm.weight": (h,), f"{layer}hnorm.weight": (h,), f"{layer}eh_proj.weight": (h, 2 * h),
                       f"{layer}shared_head.norm.weight": (h,), f"{layer}embed_tokens.weight": embed,
                       f"{layer}shared_head.head.weight": shapes.get("lm_head.weight", embed)})
    return shapes


def shape_problems(produced: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[Problem | str]:
    """Every difference between the tensors an export produces and those transformers expects (for
    `errors.problem_list`: one cause for many tensors is one line)."""
    problems: list[Problem | str] = [
        Problem(k, f"HF config implies shape {list(expected[k])}, the checkpoint gives {list(v)}")
        for k, v in produced.items() if k in expected and tuple(expected[k]) != tuple(v)]
    extra = sorted(set(produced) - set(expected))
    missing = sorted(set(expected) - set(produced))
    if extra:
        problems.append(f"{len(extra)} tensor(s) the HF config has no place for, e.g. {extra[:4]}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) the HF config needs and the checkpoint lacks, e.g. {missing[:4]}")
    return problems
