"""Per-architecture config handling that needs no Megatron world: aliases (Kimi-K2), family members' fields,
what a Megatron config cannot express (clear errors), and build_model's preconditions."""

import json
import os

import pytest
from transformers import DeepseekV3Config

from mcore2hf import ParallelStateError, build_model, get_converter, list_architectures
from mcore2hf.arch.hf_config import load_hf_config
from mcore2hf.arch.registry import get_model_spec
from mcore2hf.errors import ConfigMismatchError
from mcore2hf.runtime.tiny import TINY_VARIANTS, tiny_config


def test_kimi_k2_loads_as_deepseek_v3_without_running_its_remote_code(variant_ckpts):
    path = variant_ckpts["kimi_k2"]  # its configuration_deepseek.py raises if imported
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "kimi_k2" and "AutoConfig" in raw["auto_map"]
    for form in (path, os.path.join(path, "config.json"), raw):
        cfg = load_hf_config(form)
        assert type(cfg) is DeepseekV3Config and cfg.model_type == "deepseek_v3"
        assert cfg.n_group == 1 and cfg.routed_scaling_factor == 2.827
        assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 64.0
    assert "kimi_k2" in list_architectures()
    assert get_converter("kimi_k2") is get_converter("deepseek_v3")


def test_moonlight_has_no_q_lora_and_eps_1e5():
    cfg = tiny_config("moonlight")
    assert cfg.model_type == "deepseek_v3" and cfg.q_lora_rank is None and cfg.rms_norm_eps == 1e-5
    assert set(TINY_VARIANTS) == {"kimi_k2", "moonlight"}


def test_glm4_moe_lite_moe_layers_follow_mlp_layer_types():
    cfg = tiny_config("glm4_moe_lite", mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    spec = get_model_spec("glm4_moe_lite")
    assert [spec.is_moe_layer(cfg, i) for i in range(4)] == [False, True, False, True]


def test_what_megatron_cannot_express_is_refused_with_the_field_named():
    with pytest.raises(ConfigMismatchError, match="sliding_window=4096"):
        get_model_spec("mistral").transformer_config(tiny_config("mistral", sliding_window=4096))
    with pytest.raises(ConfigMismatchError, match="sliding_window=4096"):
        get_model_spec("mixtral").transformer_config(tiny_config("mixtral", sliding_window=4096))
    with pytest.raises(ConfigMismatchError, match="topk_method='group_limited_greedy'"):
        get_model_spec("deepseek_v2").transformer_config(
            tiny_config("deepseek_v2", topk_method="group_limited_greedy", n_group=2, topk_group=1))
    with pytest.raises(ConfigMismatchError, match="norm_topk_prob=True"):
        get_model_spec("deepseek_v2").transformer_config(tiny_config("deepseek_v2", norm_topk_prob=True))
    with pytest.raises(ConfigMismatchError, match="attention_bias=True"):
        get_model_spec("glm4_moe_lite").transformer_config(tiny_config("glm4_moe_lite", attention_bias=True))


def test_build_model_needs_the_parallel_state():
    with pytest.raises(ParallelStateError, match="initialize_model_parallel"):
        build_model(tiny_config("mixtral"))
