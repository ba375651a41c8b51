"""Loading HF configs from any of the forms users hold, and reading fields across transformers versions."""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .errors import ConfigMismatchError

HFConfigLike = PretrainedConfig | dict | str | os.PathLike

_MISSING = object()


def load_hf_config(hf_config: HFConfigLike) -> PretrainedConfig:
    """A PretrainedConfig from a config object, a dict (with model_type), config.json, or an HF directory."""
    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    if isinstance(hf_config, dict):
        d = dict(hf_config)
        model_type = d.pop("model_type", None)
        if not model_type:
            raise ConfigMismatchError("an HF config given as a dict needs a 'model_type' key")
        return AutoConfig.for_model(model_type, **d)
    path = os.fspath(hf_config)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} is a directory without config.json")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if os.path.isfile(path):
        with open(path) as f:
            return load_hf_config(json.load(f))
    raise FileNotFoundError(f"no HF config at {path}")


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
