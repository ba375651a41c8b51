import os

import pytest
import torch

from mcore2hf.testing.tiny import make_hf_checkpoint, tiny_config

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARCHS = ["qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3", "qwen2", "llama", "minimax_m2", "olmoe"]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """A tiny random HF checkpoint (fp32) per architecture, written by transformers (+ MTP tensors)."""
    root = tmp_path_factory.mktemp("ckpts")
    return {mt: make_hf_checkpoint(tiny_config(mt), root / mt) for mt in ARCHS}


@pytest.fixture(scope="session")
def ckpts_bf16(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpts_bf16")
    return {mt: make_hf_checkpoint(tiny_config(mt), root / mt, seed=1, dtype=torch.bfloat16) for mt in ARCHS}


@pytest.fixture(scope="session")
def qwen3_moe_ckpt(ckpts) -> str:
    return ckpts["qwen3_moe"]
