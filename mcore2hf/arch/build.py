"""`build_model`: the Megatron model of any registered architecture, from its HF config."""

from __future__ import annotations

import importlib.util

import torch

from .hf_config import HFConfigLike, load_hf_config, text_config


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def build_model(hf_config: HFConfigLike, *, use_te: bool | None = None, make_vocab_size_divisible_by: int = 128,
                model_class: str = "gpt", vision_tower: str | None = None, **overrides) -> list[torch.nn.Module]:
    """Megatron GPTModel chunks (one per virtual-PP stage of this rank) for the HF model `hf_config`.

    `model_class="hybrid"`: megatron-core's HybridModel (0.19; MambaModel on 0.16-0.18) instead, whose stack
    holds each HF layer as two Megatron layers, attention then MLP/MoE (pattern "*-*E..." from the HF config;
    with PP on 0.19 one '|' segment per stage). It exports and loads like the GPTModel.

    Needs an initialized Megatron parallel state (parallel sizes are read from it). `hf_config`: whatever
    HFExporter accepts (PretrainedConfig, dict, config.json or an HF directory). `overrides`: TransformerConfig
    fields (e.g. params_dtype=torch.bfloat16, bf16=True, mtp_num_layers=None). The layer spec is the one the
    architecture needs: Transformer Engine's when it is installed (`use_te=None`), the local spec otherwise.
    The vocabulary is padded as Megatron pads it (a multiple of make_vocab_size_divisible_by x TP). On a torch
    without CUDA it first applies `arch.cpu_shims.apply_cpu_shims()` (megatron-core builds and runs on CPU only with
    them: e.g. MoE routers put their expert bias on `torch.cuda.current_device()`).

    `vision_tower="native"` (vision-language architectures that have one, e.g. qwen3_vl): each chunk wraps the
    language model with a vision tower built natively in Megatron (`vision_model`, on the first pipeline stage,
    tensor-parallel), as Megatron-Bridge 0.6.2's Qwen3VLModel holds it; without it, the language model only."""
    from megatron.core import parallel_state as ps

    from ..errors import ParallelStateError, UsageError
    from ..model_specs.common import padded_vocab_size
    from .registry import get_model_spec

    if not ps.model_parallel_is_initialized():
        raise ParallelStateError("build_model needs Megatron's parallel state: call "
                                 "megatron.core.parallel_state.initialize_model_parallel(...) first")
    if not torch.cuda.is_available():  # a CPU-only torch: megatron-core assumes CUDA in places (cpu_shims.py)
        from .cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    if model_class not in ("gpt", "hybrid"):
        raise UsageError(f"model_class must be 'gpt' or 'hybrid', got {model_class!r}")
    cfg = load_hf_config(hf_config)
    spec = get_model_spec(cfg.model_type)
    if use_te is None:
        use_te = transformer_engine_available()
    vocab = padded_vocab_size(text_config(cfg).vocab_size, ps.get_tensor_model_parallel_world_size(),
                              make_vocab_size_divisible_by)
    if vision_tower not in (None, "native") or (vision_tower and spec.native_vision_tower is None):
        raise UsageError(f"vision_tower={vision_tower!r}: expected None or 'native' (model types with a native "
                         f"Megatron vision tower), {cfg.model_type!r} has "
                         f"{'none' if spec.native_vision_tower is None else 'one'}")
    if model_class == "hybrid" and vision_tower:
        # NativeVLModel (model_specs/qwen3_vl_vision.py) runs the language model's decoder layers itself, adding
        # the deepstack features after the first HF layers; a hybrid stack numbers its layers otherwise
        raise UsageError("vision_tower='native' with model_class='hybrid': the native vision-language model runs a "
                         "GPTModel's decoder (deepstack features per decoder layer); build the hybrid language model "
                         "alone (vision_tower=None; the tower is completed from the checkpoint, base=)")
    if model_class == "hybrid":
        from ..model_specs.hybrid import build_hybrid_model

        chunks = build_hybrid_model(spec, cfg, vocab_size=vocab, use_te=use_te, **overrides)
    else:
        chunks = spec.build_model(cfg, vocab_size=vocab, use_te=use_te, **overrides)
    return spec.native_vision_tower(chunks, cfg) if vision_tower else chunks
