"""The Megatron side of logit parity: one forward of the whole model at any layout (TP, PP, virtual PP, EP,
expert-TP), the same logits returned on every rank."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

#: max |Megatron - transformers| fp32 logit difference per model family, measured (random tiny models with logits of
#: magnitude ~15, 2 x 16 tokens; the maxima over every layout world of the test suite, TP/PP/VPP/EP/expert-TP, fp32
#: and from bf16 sources: tests/oracle.py prints each). Tolerance: MARGIN x the family's maximum, tight enough that a
#: realistic bug moving logits by ~1e-4 fails (MLA's latent-norm eps 1e-6 -> 1e-5 moves them by 2-3e-4). Gated
#: DeltaNet models run the chunked delta-rule recurrence in fp32 in both forwards, in different summation orders:
#: ten times the round-off (model_specs/qwen3_next.py LOGIT_TOL has those measurements).
#: Maxima measured 2026-11-25 (commit after 4790167): dense 1.14e-5 (qwen3, TP2 x PP2 x EP2), MoE 2.15e-5 (glm4_moe,
#: TP2 x EP2), MLA 1.55e-5 (deepseek_v3, TP2 x PP2 x EP2), gpt-oss 6.7e-6, gated DeltaNet 9.8e-5 (qwen3_next, TP2 x EP2).
MEASURED_LOGIT_DIFF = {"dense": 1.2e-5, "moe": 2.2e-5, "mla": 1.6e-5, "gpt_oss": 7e-6, "gated_deltanet": 1.0e-4}
MARGIN = 3.0
FAMILY = {"qwen3": "dense", "qwen2": "dense", "llama": "dense", "mistral": "dense",
          "qwen3_moe": "moe", "glm4_moe": "moe", "mixtral": "moe", "olmoe": "moe", "minimax_m2": "moe",
          "deepseek_v3": "mla", "deepseek_v2": "mla", "glm4_moe_lite": "mla", "kimi_k2": "mla", "moonlight": "mla",
          "deepseek_v32": "mla", "glm_moe_dsa": "mla",
          "gpt_oss": "gpt_oss", "qwen3_next": "gated_deltanet", "qwen3_5": "gated_deltanet",
          "qwen3_5_moe": "gated_deltanet",
          # vision-language models: their language model's family (text tokens; docs/vlm.md)
          "qwen3_vl": "dense", "qwen3_vl_moe": "moe", "glm4v_moe": "moe", "kimi_k25": "mla"}


def logit_tolerance(model_type: str) -> float:
    """The fp32 logit tolerance of `model_type`'s family (MEASURED_LOGIT_DIFF x MARGIN)."""
    return MARGIN * MEASURED_LOGIT_DIFF[FAMILY[model_type]]


@contextlib.contextmanager
def _main_model_only(chunk):
    """The main model's logits only: Megatron's MTP head needs labels and returns a loss, not logits."""
    saved = getattr(chunk, "mtp_process", False), chunk.config.mtp_num_layers
    chunk.mtp_process, chunk.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        chunk.mtp_process, chunk.config.mtp_num_layers = saved


def megatron_logits(chunks, tokens: torch.Tensor, vocab_size: int, images: dict | None = None,
                    causal_mask: bool = True) -> torch.Tensor:
    """Forward of `tokens` [batch, seq] through every pipeline stage and virtual chunk in order (stage 0 chunk 0,
    stage 1 chunk 0, ..., stage 0 chunk 1, ...: Megatron's interleaved layer order), hidden states passed with
    point-to-point sends over the PP group; the vocab-parallel logits gathered over TP, trimmed to the HF vocab
    and broadcast from the last stage, so every rank returns the same fp32 [batch, seq, vocab] tensor.

    `images`: a vision-language model's image input (`pixel_values`, `image_grid_thw`), given to every chunk (the
    tower runs where it is, the rope positions need the grids on every stage); the chunks compute their own
    multimodal rope positions from the tokens. `causal_mask=False`: no mask is passed, the attention builds its
    causal one (fused_softmax.py, megatron-core 0.16.1: the default causal mask when none is given), for a model that
    reads a given mask otherwise (Megatron-Bridge 0.3.1's Qwen3VLModel collapses it to a padding mask for its rope
    positions, modelling_qwen3_vl/utils.py `get_rope_index`)."""
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1) if causal_mask else None  # True = masked
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group) if pp > 1 else [dist.get_rank()]
    logits, hidden = None, None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            chunk.eval()
            if pp > 1 and not (v == 0 and stage == 0):  # input from the previous stage (or the last, one chunk back)
                param = next(chunk.parameters())
                # a sequence-parallel model passes [s / TP, b, h] between stages (megatron-core 0.19's DSA models)
                rows = s // ps.get_tensor_model_parallel_world_size() if chunk.config.sequence_parallel else s
                hidden = torch.empty(rows, b, chunk.config.hidden_size, dtype=param.dtype)
                dist.recv(hidden, src=ranks[(stage - 1) % pp], group=group)
            if hidden is not None:
                chunk.set_input_tensor(hidden)
            with _main_model_only(chunk):
                out = chunk(tokens, pos, attention_mask=mask, **(images or {}))
            last = v == len(chunks) - 1 and stage == pp - 1
            if last:
                logits = out
            elif pp > 1:
                dist.send(out.contiguous(), dst=ranks[(stage + 1) % pp], group=group)
            else:
                hidden = out
    if stage == pp - 1:
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        logits = logits[..., :vocab_size].float().contiguous()
    else:
        logits = torch.empty(b, s, vocab_size)
    if pp > 1:
        dist.broadcast(logits, src=ranks[-1], group=group)
    return logits
