"""The one route rule of every point-to-point export (chosen receivers and engine-sharded alike): a receiver that
holds an element copies it locally; otherwise it comes from the least loaded of its holders (bytes sent so far,
ties to the lowest rank), so senders are balanced. A leaf module: the plan (engine routes) and the program
builders (receivers) both use it, so the two cannot drift apart."""

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
