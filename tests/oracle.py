"""Oracles that are not mcore2hf: transformers' forward (against the Megatron forward of the weights mcore2hf
loaded at a layout, worlds.forward_oracle, fp32 logits) and DeepGEMM's block-FP8 quantizer."""

from __future__ import annotations

import functools
import importlib.util

import torch

from mcore2hf.hf_config import load_hf_config
from mcore2hf.testing.forward import logit_tolerance
from mcore2hf.testing.wheels import unpacked_wheel

#: deep_gemm/utils/math.py as published on PyPI in sgl-deep-gemm 0.2.5 (SGLang's DeepGEMM build; the file is
#: identical to deepseek-ai/DeepGEMM at 54e22612409371d6364144b69086735beb54e98b), loaded from the wheel
DEEP_GEMM = ("sgl-deep-gemm", "0.2.5")


@functools.cache
def deepgemm():
    """DeepGEMM's reference math module (per_block_cast_to_fp8 and friends)."""
    root = unpacked_wheel(*DEEP_GEMM, ("deep_gemm/utils/math.py",))
    spec = importlib.util.spec_from_file_location("deepgemm_math", root / "deep_gemm" / "utils" / "math.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fp8_reference(t: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A full HF weight quantized by DeepGEMM: (float8_e4m3fn weight, float32 weight_scale_inv)."""
    return deepgemm().per_block_cast_to_fp8(t, use_ue8m0=ue8m0)

@functools.lru_cache(maxsize=64)
def _logits(path: str, tokens_key: tuple, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    tokens = torch.tensor(tokens_key)
    # the config as mcore2hf reads it: Kimi-K2's kimi_k2 (unknown to transformers) is a DeepseekV3Config; a
    # multimodal checkpoint (Qwen3.5) loads whole, its text forward is the one compared; experts_implementation:
    # transformers' grouped_mm has no fp64 kernel
    config = load_hf_config(path)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model, info = auto.from_pretrained(path, config=config, dtype=dtype, output_loading_info=True,
                                       experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.double()


def hf_logits(path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' forward of the checkpoint at `path` (cached per path and tokens; float64 logits): its weights
    are upcast to `dtype` as loaded, so a bf16 source gives the fp32 forward of exactly its values."""
    return _logits(str(path), tuple(map(tuple, tokens.tolist())), dtype)


def logit_problems(per_rank: list[dict[str, torch.Tensor]], ckpts: dict[str, str], tokens: torch.Tensor,
                   what: str) -> list[str]:
    """Every rank's Megatron logits ({model: logits} per rank) against transformers' forward of ckpts[model]; one
    line per model over its family's tolerance, and the largest difference over the ranks printed. (Ranks need not
    agree bit for bit: data-parallel replicas whose expert groups span them reduce in different orders.)"""
    problems = []
    for mt in per_rank[0]:
        ref = hf_logits(ckpts[mt], tokens)
        diff = max((rank[mt].double() - ref).abs().max().item() for rank in per_rank)
        tol = logit_tolerance(mt)
        print(f"{what} {mt}: max |megatron - transformers| = {diff:.2e} over {len(per_rank)} rank(s) "
              f"(tolerance {tol:.1e})")
        if not diff <= tol:
            problems.append(f"{what} {mt}: max |megatron - transformers| logit difference {diff:.3e} > {tol:.1e}")
    return problems
