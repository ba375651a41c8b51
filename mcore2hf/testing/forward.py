"""The Megatron side of logit parity: a forward on every rank of a PP=1 model."""

from __future__ import annotations

import torch
import torch.distributed as dist


def megatron_logits(chunks, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Forward of a PP=1 model on every rank; vocab-parallel logits gathered over TP, trimmed to the HF vocab."""
    from megatron.core import parallel_state as ps

    model = chunks[0].eval()
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True = masked
    # the main model's logits only: Megatron's MTP head needs labels and returns a loss, not logits
    saved = getattr(model, "mtp_process", False), model.config.mtp_num_layers
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        with torch.no_grad():
            logits = model(tokens, pos, attention_mask=mask)
    finally:
        model.mtp_process, model.config.mtp_num_layers = saved
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab_size].float()
