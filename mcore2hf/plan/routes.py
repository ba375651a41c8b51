"""The one route rule of every point-to-point export (chosen receivers and engine-sharded alike): a receiver that
holds an element copies it locally; otherwise it comes from the least loaded of its holders (bytes sent so far,
ties to the lowest rank), so senders are balanced. Part of the planning layer (routing decisions are the
planner's): the chosen-receivers routes (`receiver_routes`, turned into a P2P round by `transfer.builders`) and the
engine-shard planner (`engine_plan`) both use it, so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Iterable


class LeastLoaded:
    """Bytes sent per rank so far, over one plan (every bucket): `sender` picks and charges."""

    def __init__(self) -> None:
        self.load: dict[int, int] = {}

    def sender(self, holders: Iterable[int], nbytes: int) -> int:
        """The least loaded holder (lowest rank on ties), charged `nbytes` (what it will send)."""
        p = min(holders, key=lambda r: (self.load.get(r, 0), r))
        self.load[p] = self.load.get(p, 0) + nbytes
        return p

    def route(self, holders: Iterable[int], receiver: int, nbytes: int) -> int:
        """Who sends one piece to `receiver`: itself when it holds it (nothing charged), else `sender`."""
        holders = tuple(holders)
        return receiver if receiver in holders else self.sender(holders, nbytes)


def receiver_routes(sources: Iterable, receivers: tuple[int, ...]) -> dict[tuple[int, int], list[tuple]]:
    """One bucket's point-to-point routes to chosen receivers (global, the same on every rank): (sender, receiver)
    -> [(source, shard index)], in source order. A receiver holding a shard routes nothing for it; each other
    shard comes from one holder for every receiver in need, the least loaded (bytes sent so far in this bucket)."""
    loads = LeastLoaded()
    routes: dict[tuple[int, int], list[tuple]] = {}
    for s in sources:
        for i in range(s.count):
            need = [r for r in receivers if r not in s.holders[i]]
            if not need:
                continue
            sender = loads.sender(s.holders[i], s.shard_nbytes * len(need))  # one sender for every receiver in need
            for r in need:
                routes.setdefault((sender, r), []).append((s, i))
    return routes
