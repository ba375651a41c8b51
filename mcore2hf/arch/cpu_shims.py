"""Shims that let real megatron-core models build and run forward on a CPU-only machine (gloo workers).

The one place for them (measured with megatron-core 0.16.1, torch 2.13 CPU); each is a no-op when CUDA exists:

1. `torch.cuda.current_device` -> "cpu": rotary embeddings and the MoE router (its expert_bias buffer) place
   tensors on the current CUDA device.
2. the tensor-parallel RNG tracker's `fork()` -> a null context: it saves and restores CUDA RNG state.
3. `moe_utils.te_general_gemm = None`: without Transformer Engine the router hits a NameError on it.
4. `torch.cuda.synchronize` -> no-op: dist_checkpointing's filesystem writer calls it.
6. `torch.Tensor.cuda` -> the tensor itself: with PP > 1, a tied embedding's (or MTP's) copy on the last stage
   is synchronized with `weight.data.cuda()` before an all-reduce.
5. MLA (DeepSeek): `megatron.core.extensions.transformer_engine` imports with MagicMocks for TE classes, and
   MLA does `isinstance(linear_proj, TELinear)`; give that module (and multi_latent_attention, which imported
   the name) a plain `TELinear` class and HAVE_TE=False.
7. the sliding-window causal mask (gpt-oss) is built with device="cuda": built on the CPU instead.
8. gated DeltaNet (Qwen3-Next, megatron-core 0.16.1 megatron/core/ssm/gated_delta_net.py) refuses to build without
   flash-linear-attention (HAVE_FLA) and calls fla's `l2norm` and `chunk_gated_delta_rule`: torch references
   instead (`l2norm` as fla computes it, megatron's own `torch_chunk_gated_delta_rule`, which it uses in
   deterministic mode); causal_conv1d is absent, so megatron runs its nn.Conv1d path. The `jit_fuser`
   (torch.compile) methods of GatedDeltaNet and Attention (the gated norm, the attention output gate) run eagerly.
   megatron-core 0.19.2 (ssm/gated_delta_net/{common,gdn}.py) also calls fla's causal_conv1d: a torch depthwise
   conv1d as its deterministic mode computes it.

9. DeepSeek sparse attention (megatron-core 0.16.1 transformer/experimental_attention_variant/dsa.py:41-46
   `rotate_activation`): the indexer's Hadamard rotation of q and k asserts bf16 and calls the CUDA kernel of
   fast_hadamard_transform. The same transform in torch (Sylvester's H / sqrt(n), any float dtype) instead; it
   is orthogonal, so the indexer's q.k scores are unchanged but for rounding (transformers 5.24 skips it for
   that reason, modeling_deepseek_v32.py `DeepseekV32Indexer.forward`).

10. torch.compile off (`torch._dynamo.config.disable`): megatron-core's `jit_fuser` functions (megatron/core/jit.py:
   torch.compile since torch 2.2: activations, norms, the router, gpt-oss' expert activation, ...) run as the plain
   functions they wrap. Compiling costs seconds in every new process (gpt-oss' first forward: 24 s compiled, 0.08 s
   eager) and fuses nothing worth it on a CPU. MCORE2HF_COMPILE=1 keeps torch.compile.
"""

from __future__ import annotations

import contextlib
import os

import torch

_applied = False


def apply_cpu_shims() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True
    if os.environ.get("MCORE2HF_COMPILE") != "1":
        from torch import _dynamo

        _dynamo.config.disable = True  # read when a compiled function is called: the original runs
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    # NVTX profiler ranges (Megatron-Bridge's Qwen3VLModel.forward marks its phases) do nothing on a CPU build
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()

    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None

    from megatron.core.fusions import fused_softmax

    def window_mask_cpu(sq, skv, window_size):
        # megatron/core/transformer/utils.py get_sliding_window_causal_mask (0.16.1), on the CPU
        mu = torch.triu(torch.ones(sq, skv, dtype=torch.bool), diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = window_mask_cpu
    # transformer/utils.py get_default_causal_mask (0.16.1), the mask a causal attention builds when given none
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    _gdn_without_fla()
    _dsa_without_hadamard_kernel()

    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception:  # noqa: BLE001 - absent in some releases: nothing to patch
        te_ext = None
    if te_ext is not None:
        class TELinear:  # noqa: D401 - a type nothing is an instance of
            """Stand-in so isinstance(x, TELinear) is False without Transformer Engine."""

        te_ext.TELinear = TELinear
        te_ext.HAVE_TE = False
        from megatron.core.transformer import multi_latent_attention as mla

        mla.TELinear = TELinear
        mla.HAVE_TE = False


def fla_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla.modules.l2norm's l2norm: x / sqrt(sum(x^2) + eps) over the last dim, in fp32, cast back."""
    if dim not in (-1, x.dim() - 1):
        raise NotImplementedError(f"fla's l2norm normalizes the last dim; asked for dim={dim}")
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def fla_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None, initial_state=None, output_final_state: bool = False,
                      cu_seqlens=None) -> tuple[torch.Tensor, None]:
    """fla.modules.convolution's causal_conv1d for the call megatron-core 0.19.2's GatedDeltaNet makes
    (ssm/gated_delta_net/gdn.py): x [b, s, d], depthwise weight [d, w], causal (left) padding, then the activation;
    the same arithmetic as that module's own deterministic-mode F.conv1d path."""
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError("causal_conv1d shim: no initial/final state, no packed sequences")
    seq, width = x.shape[1], weight.shape[-1]
    y = torch.nn.functional.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1,
                                   groups=x.shape[-1])[..., :seq]
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    elif activation is not None:
        raise NotImplementedError(f"causal_conv1d shim: activation {activation!r}")
    return y.transpose(1, 2), None


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fast_hadamard_transform's `hadamard_transform(x, scale)`: x @ H_n * scale over the last dim (n a power of
    two; H_n Sylvester's, entries +-1), as a butterfly in x's dtype."""
    n = x.shape[-1]
    if n & (n - 1):
        raise NotImplementedError(f"hadamard_transform shim: last dim {n} is not a power of two")
    y, h = x.reshape(-1, n), 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.cat([y[:, :, :1] + y[:, :, 1:], y[:, :, :1] - y[:, :, 1:]], dim=2).view(-1, n)
        h *= 2
    return (y * scale).view(x.shape)


def _dsa_without_hadamard_kernel() -> None:
    try:
        from megatron.core.transformer.experimental_attention_variant import dsa
    except ImportError:  # releases without DeepSeek sparse attention
        return
    if getattr(dsa, "hadamard_transform", None) is None and hasattr(dsa, "rotate_activation"):
        dsa.hadamard_transform = hadamard_transform
        dsa.rotate_activation = lambda x: hadamard_transform(x, scale=x.size(-1) ** -0.5)


def _eager(cls, name: str) -> None:
    fn = cls.__dict__.get(name)
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    if orig is not None:
        setattr(cls, name, orig)


def _gdn_without_fla() -> None:
    try:
        from megatron.core.ssm import gated_delta_net as gdn
    except ImportError:  # releases without gated DeltaNet
        return
    from megatron.core.transformer.attention import Attention

    if hasattr(gdn, "__path__"):  # 0.19: a package; the layer (gdn.py) imported the kernels from common.py
        from megatron.core.ssm.gated_delta_net import common
        from megatron.core.ssm.gated_delta_net import gdn as layer

        if not common.HAVE_FLA:
            common.HAVE_FLA = True
            common.l2norm = fla_l2norm
            layer.causal_conv1d = fla_causal_conv1d
            layer.chunk_gated_delta_rule = common.torch_chunk_gated_delta_rule
        for name in ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta"):
            _eager(common._GDNBase, name)
    else:  # 0.16.1: one module
        if not gdn.HAVE_FLA:
            gdn.HAVE_FLA = True
            gdn.l2norm = fla_l2norm
            gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
        _eager(gdn.GatedDeltaNet, "_apply_gated_norm")
    _eager(Attention, "_apply_output_gate")

