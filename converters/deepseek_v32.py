"""DeepSeek-V3.2 (HF `deepseek_v32`): DeepSeek-V3's table (multi-latent attention, dense first layers, shared
experts, expert bias, MTP layers with the embedding and head copies) plus DeepSeek sparse attention's indexer."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import dsa_indexer, fp8_policy
from .deepseek_v3 import DEEPSEEK_V3

DEEPSEEK_V32 = register(Converter(
    model_type="deepseek_v32",
    spec="mcore2hf.model_specs.deepseek_v32",
    rules=DEEPSEEK_V3.rules + dsa_indexer(),
    fp8=fp8_policy(mtp=True, list_not_converted=False, dsa_indexer=True,
                   source="DeepSeek-V3.2 FP8 checkpoints"),
))
