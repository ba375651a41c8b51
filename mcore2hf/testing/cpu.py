"""Shims that let real megatron-core models build and run forward on a CPU-only machine (gloo workers).

The one place for them (measured with megatron-core 0.16.1, torch 2.13 CPU); each is a no-op when CUDA exists:

1. `torch.cuda.current_device` -> "cpu": rotary embeddings and the MoE router (its expert_bias buffer) place
   tensors on the current CUDA device.
2. the tensor-parallel RNG tracker's `fork()` -> a null context: it saves and restores CUDA RNG state.
3. `moe_utils.te_general_gemm = None`: without Transformer Engine the router hits a NameError on it.
4. `torch.cuda.synchronize` -> no-op: dist_checkpointing's filesystem writer calls it.
5. MLA (DeepSeek): `megatron.core.extensions.transformer_engine` imports with MagicMocks for TE classes, and
   MLA does `isinstance(linear_proj, TELinear)`; give that module a plain `TELinear` class and HAVE_TE=False.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def apply_cpu_shims() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()

    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None

    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception:  # noqa: BLE001 - absent in some releases: nothing to patch
        te_ext = None
    if te_ext is not None:
        class TELinear:  # noqa: D401 - a type nothing is an instance of
            """Stand-in so isinstance(x, TELinear) is False without Transformer Engine."""

        te_ext.TELinear = TELinear
        te_ext.HAVE_TE = False
