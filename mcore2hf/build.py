"""`build_model`: the Megatron model of any registered architecture, from its HF config."""

from __future__ import annotations

import importlib.util

import torch

from .hf_config import HFConfigLike, load_hf_config, text_config


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def build_model(hf_config: HFConfigLike, *, use_te: bool | None = None, make_vocab_size_divisible_by: int = 128,
                **overrides) -> list[torch.nn.Module]:
    """Megatron GPTModel chunks (one per virtual-PP stage of this rank) for the HF model `hf_config`.

    Needs an initialized Megatron parallel state (parallel sizes are read from it). `hf_config`: whatever
    HFExporter accepts (PretrainedConfig, dict, config.json or an HF directory). `overrides`: TransformerConfig
    fields (e.g. params_dtype=torch.bfloat16, bf16=True, mtp_num_layers=None). The layer spec is the one the
    architecture needs: Transformer Engine's when it is installed (`use_te=None`), the local spec otherwise.
    The vocabulary is padded as Megatron pads it (a multiple of make_vocab_size_divisible_by x TP)."""
    from megatron.core import parallel_state as ps

    from .errors import ParallelStateError
    from .model_specs.common import padded_vocab_size
    from .registry import get_model_spec

    if not ps.model_parallel_is_initialized():
        raise ParallelStateError("build_model needs Megatron's parallel state: call "
                                 "megatron.core.parallel_state.initialize_model_parallel(...) first")
    cfg = load_hf_config(hf_config)
    spec = get_model_spec(cfg.model_type)
    if use_te is None:
        use_te = transformer_engine_available()
    vocab = padded_vocab_size(text_config(cfg).vocab_size, ps.get_tensor_model_parallel_world_size(), make_vocab_size_divisible_by)
    return spec.build_model(cfg, vocab_size=vocab, use_te=use_te, **overrides)
