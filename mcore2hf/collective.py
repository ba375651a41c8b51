"""Failing together: a check that one rank makes (a writer's output directory, an engine's answer) must fail every
rank, or the others hang in the next collective. `agree` is the one way mcore2hf does it."""

from __future__ import annotations

import torch.distributed as dist

from .errors import Mcore2HFError


def agree(error: str | None, raise_as: type[Exception] = Mcore2HFError, prefix: str = "", group=None) -> None:
    """Collective over `group` (default: the world): every rank raises `raise_as(prefix + "rank r: <error>; ...")`,
    naming each rank that found an error, if any rank's `error` is not None. Without a world of several ranks, this
    rank's own error only."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        ranks, errors = [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0], [error]
    else:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(errors))
    failed = [f"rank {r}: {e}" for r, e in zip(ranks, errors) if e]
    if failed:
        raise raise_as(prefix + "; ".join(failed))
