"""Oracles that are not mcore2hf: transformers' forward (against the Megatron forward of the weights mcore2hf
loaded at a layout, worlds.forward_oracle, fp32 logits) and DeepGEMM's block-FP8 quantizer."""

from __future__ import annotations

import functools
import importlib.util

import torch
from harness.wheels import unpacked_wheel

from mcore2hf.arch.hf_config import load_hf_config
from mcore2hf.runtime.forward import FAMILY, logit_tolerance

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
        tol = logit_tolerance(mt if mt in FAMILY else load_hf_config(ckpts[mt]).model_type)  # a config variant
        print(f"{what} {mt}: max |megatron - transformers| = {diff:.2e} over {len(per_rank)} rank(s) "
              f"(tolerance {tol:.1e})")
        if not diff <= tol:
            problems.append(f"{what} {mt}: max |megatron - transformers| logit difference {diff:.3e} > {tol:.1e}")
    return problems


#: Gated-DeltaNet models (fp32 chunked recurrences in both forwards): Megatron's RMS distance to transformers' fp64
#: forward may be at most this multiple of transformers' own fp32 RMS distance to it. RMS over every logit, not the
#: max: the max of one roundoff sample moves with the CPU's kernels (transformers' fp32 max distance here: 1.24e-4
#: with 1 thread or eager experts, 9.6e-5 with 2 threads and grouped experts; its RMS 1.40-1.50e-5 either way).
#: Measured ratios (Megatron / transformers fp32, RMS; 2026-11-25): Qwen3-Next 1.04 (TP1), 1.11 (TP2 x EP2); Qwen3.5
#: 0.93-0.98, Qwen3.5-MoE 0.84-1.27 (TP2 x EP2, PP2, TP1 x DP2).
ROUNDOFF_FACTOR = 2.0


def roundoff_problems(megatron: torch.Tensor, path, tokens: torch.Tensor, what: str) -> list[str]:
    """Megatron's logits no further (RMS) from transformers' fp64 forward of `path` than ROUNDOFF_FACTOR x
    transformers' own fp32 forward is: the same function up to fp32 roundoff."""
    hf32, hf64 = hf_logits(path, tokens, torch.float32), hf_logits(path, tokens, torch.float64)

    def rms(x: torch.Tensor) -> float:
        return x.double().pow(2).mean().sqrt().item()

    ours, theirs = rms(megatron.double() - hf64), rms(hf32 - hf64)
    print(f"{what}: RMS distance to transformers fp64: megatron {ours:.3e}, transformers fp32 {theirs:.3e} (ratio "
          f"{ours / theirs:.2f}, at most {ROUNDOFF_FACTOR}); max: megatron {(megatron.double() - hf64).abs().max():.2e}, "
          f"transformers fp32 {(hf32 - hf64).abs().max():.2e}")
    return [] if ours <= ROUNDOFF_FACTOR * theirs else [f"{what}: Megatron's RMS distance to transformers' fp64 "
                                                        f"forward {ours:.3e} > {ROUNDOFF_FACTOR} x transformers' "
                                                        f"fp32 one {theirs:.3e}"]
