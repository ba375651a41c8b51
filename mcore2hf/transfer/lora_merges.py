"""LoRA merges on the executor core (lora="merged"): a bucket's merged weights W + (alpha/r) B A, computed when the
bucket starts into a merge arena (its slots then read like parameters), batched per group of like weights (a
layer's experts: one product per term), precomputed at compile time like the core's other copies."""

from __future__ import annotations

import torch

from ..arch.lora import Merge, merge_weights
from ..layouts.geometry import align
from .sources import Arena, Pack, Sources


class LoRAMerges:
    """The merge arenas (one per staging arena index) and the compile / run of a bucket's merges."""

    def __init__(self, sources: Sources, device: torch.device):
        self.sources, self.device = sources, device
        self.arenas: list[Arena | None] = []

    def names(self, names) -> list[str]:
        """Of the local tensors a bucket reads, the LoRA-merged weights the core merges batched (2-D, contiguous,
        from Parameters; any other is read through its getter, merged on its own)."""
        out = []
        for n in dict.fromkeys(names):
            lt = self.sources.local.get(n)
            m = lt.merge if lt is not None else None
            if m is not None and len(m.base.shape) == 2 and m.base.param is not None and \
                    m.base.param.is_contiguous() and all(t.a.is_contiguous() and t.b.is_contiguous() for t in m.terms):
                out.append(n)
        return out

    def layout(self, names: list[str]) -> tuple[list[tuple], int]:
        """A bucket's merges in its merge arena: per group of like merges (`Merge.signature`), in order of first
        appearance, (names, byte offset of their weights back to back, per term the byte offsets of B and A
        stacked over the group's weights); and the bytes needed."""
        groups: dict[tuple, list[str]] = {}
        for n in names:
            groups.setdefault(self.sources.local[n].merge.signature(), []).append(n)
        out, off = [], 0
        for members in groups.values():
            m: Merge = self.sources.local[members[0]].merge
            k, dt = len(members), m.compute_dtype()
            w_off = off
            off = align(off + k * m.base.dtype.itemsize * m.base.shape[0] * m.base.shape[1])
            terms = []
            for t in m.terms:
                b_off = off
                off = align(off + k * t.b.numel() * dt.itemsize)
                terms.append((b_off, off))
                off = align(off + k * t.groups * t.a.numel() * dt.itemsize)
            out.append((members, w_off, terms))
        return out, off

    def make_arenas(self, buckets: list[tuple[int, list[str]]]) -> None:
        """One merge arena per staging arena index, sized for the largest of its buckets' merges ((arena index,
        merged names) per bucket); none without merges."""
        sizes: dict[int, int] = {}
        for a, names in buckets:
            sizes[a] = max(sizes.get(a, 0), self.layout(names)[1] if names else 0)
        self.arenas = [Arena(sizes.get(a, 0), self.device) if sizes.get(a) else None
                             for a in range(max(sizes, default=-1) + 1)]

    def compile(self, names: list[str], a: int, bases: dict) -> tuple[Pack | None, list[tuple]]:
        """A bucket's merges (`names`, from `names()`) into merge arena `a`: one pack of the base weights and
        factors (views of the Parameters, watched in the bucket's `bases`), then per group of like merges one
        batched product per term (`lora.merge_weights`). The merged weights are read from their slots
        (`Sources.merged`). Returns (the pack, the products) for `run`."""
        if not names:
            return None, []
        arena = self.arenas[a]
        pack, merges = Pack(), []

        def watched(key: str, t: torch.Tensor) -> torch.Tensor:
            d = t.detach()
            bases[key] = (t, d.data_ptr())
            return d

        def factor(key: str, t: torch.Tensor, item) -> torch.Tensor:
            """A factor's pack source: watched, or (an item of a larger parameter, whose .data training may swap)
            read through its getter at each run."""
            if item is None:
                return watched(key, t)
            pack.dynamic.append((len(pack.srcs), item.name, (tuple(t.shape), t.stride(), 0)))
            return t.detach()  # replaced at each run

        for members, w_off, term_offs in self.layout(names)[0]:
            m0: Merge = self.sources.local[members[0]].merge
            out, cols = m0.base.shape
            k, dt = len(members), m0.compute_dtype()
            w = arena.view(w_off, m0.base.dtype, (k, out, cols))
            stacks = []
            for j, (t0, (b_off, a_off)) in enumerate(zip(m0.terms, term_offs)):
                b = arena.view(b_off, dt, (k * t0.groups, t0.rows, t0.b.shape[1]))
                a_ = arena.view(a_off, dt, (k * t0.groups, *t0.a.shape))
                stacks.append((t0, b, a_))
                for i, n in enumerate(members):
                    t = self.sources.local[n].merge.terms[j]
                    pack.dsts.append(b[i * t.groups:(i + 1) * t.groups].view(t.b.shape))
                    pack.srcs.append(factor(f"{n}#B{j}", t.b, t.b_item))
                    for g in range(t.groups):  # A once per group (canonical q / k / v: the shard's query groups)
                        pack.dsts.append(a_[i * t.groups + g])
                        pack.srcs.append(factor(f"{n}#A{j}", t.a, t.a_item))
            for i, n in enumerate(members):
                pack.dsts.append(w[i])
                pack.srcs.append(watched(n, self.sources.local[n].merge.base.param))
                self.sources.merged[n] = w[i]
            merges.append((w, stacks, m0.scale))
        return pack, merges

    def run(self, pack: Pack, merges: list[tuple], cache: dict) -> None:
        """A bucket's merged weights into their slots: the pack, then the batched products."""
        self.sources.copy_pack(pack, cache)
        for w, stacks, scale in merges:
            merge_weights(w, stacks, scale)
