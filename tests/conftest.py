import os

import pytest

from mcore2hf.testing.tiny import make_hf_checkpoint, tiny_config

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def qwen3_moe_ckpt(tmp_path_factory):
    """A tiny random Qwen3-MoE HF checkpoint (fp32), written by transformers."""
    return make_hf_checkpoint(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe") / "hf")


@pytest.fixture(scope="session")
def qwen3_moe_ckpt_bf16(tmp_path_factory):
    return make_hf_checkpoint(tiny_config("qwen3_moe"), tmp_path_factory.mktemp("qwen3_moe_bf16") / "hf",
                              seed=1, dtype=__import__("torch").bfloat16)
