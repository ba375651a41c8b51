"""The export plan: built once (one metadata all-gather), reused by every export.

It holds, identically on every rank:
* one `Source` per canonical Megatron tensor: who holds which shard, its full shape, its converter rule and op;
* the HF tensors each source becomes, with shapes and dtypes;
* byte-bounded buckets, filled round-robin over holder classes (PP stage, EP rank) so that every rank
  contributes about the same number of bytes to each bucket's collectives.

`ExportPlan.describe()` is the dry run: every HF tensor with shape, dtype, source Megatron tensor and bucket.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import regex
import torch
import torch.distributed as dist

from ..arch.mapping import Converter, ModelDims, Resolved
from ..arch.naming import LocalTensor, filter_outputs
from ..errors import LayoutError, ShapeMismatchError, UnknownParametersError
from ..layouts.geometry import align, nbytes
from ..layouts.stacked import Stacked
from ..parallel import ParallelContext
from ..quantize.fp8 import FP8Policy, FP8RowSlices, row_pieces
from ..quantize.scheme import QuantScheme, quantized_tensors


def natural_key(name: str) -> tuple:
    """Sort key that orders layer and expert indices numerically."""
    return tuple(int(t) if t.isdigit() else t for t in regex.split(r"(\d+)", name))


_MTP_SOURCE = regex.compile(r"(decoder|mtp)\.layers\.(\d+)\.")  # canonical names (naming.py)
_HF_LAYER = regex.compile(r"layers\.(\d+)\.")  # an HF name's decoder layer
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                               torch.int32, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
                               torch.float8_e5m2)}


@dataclass(frozen=True)
class RankRecord:
    """What one rank tells the others when the plan is built."""

    rank: int
    pp: int
    tp: int
    ep: int
    etp: int
    tensors: tuple[tuple, ...]  # (name, local_name, shape, dtype, is_expert, sharded, dim, stride)


@dataclass
class Source:
    """One canonical Megatron tensor, as the whole world holds it."""

    name: str
    resolved: Resolved
    dtype: torch.dtype
    shard_shape: tuple[int, ...]
    count: int  # TP (or expert-TP) shards; 1 when every holder has all of it
    full_shape: tuple[int, ...]
    is_expert: bool
    stages: tuple[int, ...]  # PP stages holding it (more than one for a tied embedding's copy)
    ep: int  # EP rank holding it, -1 for non-expert tensors
    holders: dict[int, tuple[int, ...]]  # shard index -> global ranks holding that shard
    hf_shapes: list[tuple[int, ...]]
    local_name: str = ""
    #: FP8 export: quantized where it is held, before any collective (travels as an FP8RowSlices byte blob)
    prequant: bool = False

    @property
    def stage(self) -> int:
        """The PP stage that contributes it to gathers."""
        return self.stages[0]

    @cached_property  # read per rank and bucket when many ranks' programs are built (the dry run)
    def shard_nbytes(self) -> int:
        return nbytes(self.shard_shape, self.dtype)

    @cached_property
    def stacked_nbytes(self) -> int:
        """Bytes of all shards laid out one after the other (each aligned)."""
        return self.count * align(self.shard_nbytes)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.resolved.hf_names + self.resolved.copies

    def out_shapes(self) -> list[tuple[int, ...]]:
        return self.hf_shapes + [self.hf_shapes[0]] * len(self.resolved.copies)

    @property
    def hf_nbytes(self) -> int:
        """Bytes of its HF outputs; for a stacked piece, of its items (its share of the shared outputs)."""
        total = 0
        op = self.resolved.op
        shapes = op.item_shapes(self.full_shape) if isinstance(op, Stacked) else self.out_shapes()
        for shape in shapes:
            total += align(nbytes(shape, self.dtype))
        return total


@dataclass(frozen=True)
class HFEntry:
    """One HF tensor in a bucket's flat output buffer (SGLang FlattenedTensorMetadata fields, in bytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    nbytes: int
    source: str


@dataclass
class BucketPlan:
    index: int
    sources: list[Source] = field(default_factory=list)
    entries: list[HFEntry] = field(default_factory=list)
    nbytes: int = 0
    #: a quantized export's output (fp8 weights + their float32 weight_scale_inv); `entries` is then what the
    #: gather builds before quantization
    out_entries: list[HFEntry] | None = None
    #: a stacked tensor larger than the budget: its pieces gathered in rounds of <= the budget (each round's
    #: staging reused by the next), all writing into the bucket's one output buffer; None: one round
    rounds: list[list[Source]] | None = None
    #: its last grouped all-gather (PP stages when PP > 1, else EP ranks) lands in the output buffer: member m's HF
    #: tensors, converted, are bytes [m * direct, (m + 1) * direct) of it (`direct_layout`); None: via staging
    direct: int | None = None

    @property
    def output(self) -> list[HFEntry]:
        return self.entries if self.out_entries is None else self.out_entries

    @property
    def out_nbytes(self) -> int:
        return sum(e.nbytes for e in self.output)


@dataclass
class ExportPlan:
    model_type: str
    sources: dict[str, Source]
    buckets: list[BucketPlan]
    bucket_bytes: int
    records: list[RankRecord]
    world_size: int
    quantize: QuantScheme | None = None  # the scheme of a quantized export (quantize/scheme.py)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.output) for b in self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for b in self.buckets for e in b.output)

    def hf_entries(self) -> list[HFEntry]:
        """The tensors the export delivers (after quantization, for a quantized plan)."""
        return [e for b in self.buckets for e in b.output]

    def quantized_names(self) -> list[str]:
        if self.quantize is None:
            return []
        return [e.name for e in self.hf_entries() if e.dtype == self.quantize.weight_dtype]

    def prequantized_names(self) -> list[str]:
        """Weights quantized where they are held, before the collectives."""
        if self.quantize is None:
            return []
        return [e.name for e in self.hf_entries()
                if e.dtype == self.quantize.weight_dtype and self.sources[e.source].prequant]

    def to_dict(self) -> dict:
        """The plan as plain data (the JSON of `mcore2hf plan --json`)."""
        tensors = []
        for b in self.buckets:
            for e in b.output:
                src = self.sources[e.source]
                tensors.append(dict(name=e.name, shape=list(e.shape), dtype=str(e.dtype).removeprefix("torch."),
                                    bytes=e.nbytes, bucket=b.index, source=src.name, megatron=src.local_name,
                                    op=type(src.resolved.op).__name__, shards=src.count, stages=list(src.stages),
                                    ep=src.ep))
        out = dict(model_type=self.model_type, world_size=self.world_size, bucket_bytes=self.bucket_bytes,
                   num_tensors=self.num_tensors, total_bytes=self.total_bytes,
                   buckets=[dict(index=b.index, bytes=b.out_nbytes, tensors=len(b.output)) for b in self.buckets],
                   tensors=tensors)
        if self.quantize:
            out["quantize"] = self.quantize.name
            out["quantize_block"] = list(self.quantize.block)
            out["quantized"] = self.quantized_names()
            out["quantized_on_shards"] = self.prequantized_names()
        return out

    def describe(self, limit: int | None = None) -> str:
        """The dry run: every HF tensor with shape, dtype, its Megatron source (and its shards) and bucket."""
        from .report import render

        return render(self.to_dict(), limit)

def rank_record(local: list[LocalTensor], ctx: ParallelContext) -> RankRecord:
    """What this rank contributes to the plan: its place and its local tensors' metadata (no data)."""
    return RankRecord(
        rank=ctx.rank, pp=ctx.pp.rank, tp=ctx.tp.rank, ep=ctx.ep.rank, etp=ctx.etp.rank,
        tensors=tuple((t.name, t.local_name, t.shape, str(t.dtype), t.is_expert, t.sharded, t.dim, t.stride)
                      for t in local),
    )


def gather_records(local: list[LocalTensor], ctx: ParallelContext) -> list[RankRecord]:
    """Every rank's record (one all_gather_object, at plan time only); the plan is a pure function of them."""
    mine = rank_record(local, ctx)
    if ctx.world_size == 1:
        return [mine]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, mine)
    return out


def shard_split(name: str, local_name: str, op, sharded: bool, dim, stride: int, group: int,
                is_expert: bool, shard_shape: tuple[int, ...] = ()) -> tuple[int, int | None]:
    """(shard count, dim): the layout op says how Megatron splits the tensor, the attributes are checked against it.

    The op is the authority because Megatron sets `tensor_model_parallel` / `partition_dim` only when it
    initializes weights (`perform_initialization=False` leaves them unset), while a module's class (column-,
    row-parallel, replicated) is fixed. Attributes that positively contradict the op are an error."""
    count, split_dim = op.split(tuple(shard_shape), group)
    if not op.check_attributes or group == 1:
        return count, split_dim
    if split_dim is None:
        if sharded:
            raise LayoutError(f"{local_name} ({name}) is split over {group} TP ranks along dim {dim}, "
                              f"but its mapping ({type(op).__name__}) expects a tensor replicated on every rank")
        return count, split_dim
    if sharded and dim is not None and dim != split_dim and not (is_expert and split_dim == 1 and dim == 0):
        # the exception: TE's expert linears (grouped or not) drop parallel_mode, so row-parallel expert
        # weights carry partition_dim=0 although Megatron splits them along dim 1
        raise LayoutError(f"{local_name} ({name}): partition_dim={dim}, but its mapping "
                          f"({type(op).__name__}) shards along dim {split_dim}")
    if stride not in op.strides:
        raise LayoutError(f"{local_name} ({name}): partition_stride={stride} is not supported by "
                          f"{type(op).__name__} (supported: {op.strides})")
    return count, split_dim


def build_sources(records: list[RankRecord], converter: Converter, dims: ModelDims,
                  tp_size: int, etp_size: int) -> dict[str, Source]:
    """The global source table, identical on every rank; raises with every unknown name at once."""
    seen: dict[str, list[tuple[RankRecord, tuple]]] = defaultdict(list)
    for rec in records:
        for t in rec.tensors:
            seen[t[0]].append((rec, t))
    names = sorted(seen, key=natural_key)
    resolved_all = {n: converter.resolve(n, dims) for n in names}
    unknown = [n for n in names if resolved_all[n] is None]
    if unknown:
        raise UnknownParametersError(converter.model_type, [f"{n}  (local name: {seen[n][0][1][1]})" for n in unknown])

    sources: dict[str, Source] = {}
    for name in names:
        holders_raw = seen[name]
        rec0, t0 = holders_raw[0]
        _, local_name, shape, dtype, is_expert, sharded, dim, stride = t0
        for rec, t in holders_raw[1:]:
            if (tuple(t[2]), t[3], t[5], t[6], t[7]) != (tuple(shape), dtype, sharded, dim, stride):
                raise ShapeMismatchError(
                    f"{name} differs between ranks: rank {rec0.rank} has shape {tuple(shape)} {dtype} "
                    f"(sharded={sharded}, dim={dim}), rank {rec.rank} has {tuple(t[2])} {t[3]} "
                    f"(sharded={t[5]}, dim={t[6]})")
        resolved = resolved_all[name]
        op = resolved.op
        group = etp_size if is_expert else tp_size
        try:
            count, split_dim = shard_split(name, local_name, op, sharded, dim, stride, group, is_expert, shape)
        except ShapeMismatchError as e:
            raise ShapeMismatchError(f"{local_name} ({name}): {e}") from None
        full = list(shape)
        if split_dim is not None:
            full[split_dim] *= count
        try:
            hf_shapes = op.hf_shapes(tuple(full))
        except ShapeMismatchError as e:
            raise ShapeMismatchError(f"{local_name} ({name}) -> {list(resolved.hf_names)}: {e}") from None
        holders: dict[int, list[int]] = defaultdict(list)
        for rec, _ in holders_raw:
            index = (rec.etp if is_expert else rec.tp) if count > 1 else 0
            holders[index].append(rec.rank)
        eps = sorted({rec.ep for rec, _ in holders_raw})
        if is_expert and len(eps) != 1:
            raise LayoutError(f"expert tensor {name} is held by several EP ranks {eps}: expert naming is inconsistent")
        sources[name] = Source(
            name=name, resolved=resolved, dtype=_DTYPES[dtype], shard_shape=tuple(shape), count=count,
            full_shape=tuple(full), is_expert=is_expert,
            stages=tuple(sorted({rec.pp for rec, _ in holders_raw})),
            ep=eps[0] if is_expert else -1,
            holders={k: tuple(sorted(v)) for k, v in holders.items()},
            hf_shapes=[tuple(s) for s in hf_shapes], local_name=local_name,
        )
    return sources


def split_copies(src: Source, bucket_bytes: int) -> list[Source]:
    """A tensor whose published copies (MTP's embedding / head) take it over the budget: each copy becomes a unit
    of its own, made again from the same shards, so no bucket holds a large tensor twice."""
    r = src.resolved
    if not r.copies or len(r.hf_names) != 1 or src.hf_nbytes <= bucket_bytes:
        return [src]
    units = [replace(src, resolved=replace(r, copies=()))]
    units += [replace(src, resolved=replace(r, hf_names=(name,), copies=())) for name in r.copies]
    return units


def filter_sources(sources: dict[str, Source], keep) -> dict[str, Source]:
    """The sources (and published copies) whose HF names `keep(name)` accepts. A layout op writes all its outputs
    together, so a filter that keeps some outputs of one Megatron tensor but not others is an error."""
    if keep is None:
        return sources
    kept = filter_outputs(keep, ((n, s.resolved.hf_names, s.resolved.copies) for n, s in sources.items()),
                          copies_alone=True)
    out = {}
    for n, s in sources.items():
        if n not in kept:
            continue
        r = s.resolved
        if keep(r.hf_names[0]):
            new = r if kept[n] == r.copies else replace(r, copies=kept[n])
        else:  # only copies kept (filter_outputs' copies_alone): the first is the output, made as split_copies does
            new = replace(r, hf_names=kept[n][:1], copies=kept[n][1:])
        out[n] = s if new is r else replace(s, resolved=new)
    return out


class MTPTensors(NamedTuple):
    """The HF tensors of a model's MTP layers (the weights of an engine's MTP draft)."""

    layer: frozenset[str]  # the MTP layers' own tensors
    copies: frozenset[str]  # the embedding / head copies the published checkpoints keep in them


def mtp_outputs(sources: dict[str, Source], num_layers: int) -> MTPTensors:
    """The HF tensors of the model's MTP layers among `sources`' outputs. Canonical MTP names are `mtp.layers.*` and, for the inner
    transformer layer, decoder layers from `num_layers` on (naming.mtp_inner)."""
    layer, copies = set(), set()
    for s in sources.values():
        m = _MTP_SOURCE.match(s.name)
        if m and (m[1] == "mtp" or int(m[2]) >= num_layers):
            layer.update(s.resolved.hf_names)
        copies.update(c for c in s.resolved.copies if (h := _HF_LAYER.search(c)) and int(h[1]) >= num_layers)
    return MTPTensors(frozenset(layer), frozenset(copies - layer))


def assign_buckets(sources: dict[str, Source], bucket_bytes: int) -> list[BucketPlan]:
    """Byte-bounded buckets; a tensor larger than the budget is a bucket alone.

    Sources are taken round-robin over holder classes (PP stage, EP rank), each time from the class with the
    fewest bytes in the current bucket, so every stage and EP rank contributes evenly to each collective."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    queues: dict[tuple[int, int], list[list[Source]]] = defaultdict(list)
    for unit in stacked_units(sources, bucket_bytes):  # already in natural order
        queues[(unit[0].stage, -1 if len(unit) > 1 else unit[0].ep)].append(unit)
    heads = dict.fromkeys(queues, 0)
    buckets: list[BucketPlan] = []
    current = BucketPlan(0)
    per_stage: dict[int, int] = defaultdict(int)  # what the PP all-gather pads to
    per_class: dict[tuple[int, int], int] = defaultdict(int)  # what the EP all-gather pads to
    remaining = sum(len(q) for q in queues.values())
    pp_size, ep_size = holder_sizes(sources)
    added: list[tuple] = []  # (class, unit, bytes) of the current bucket, in the order taken
    # the classes with units left, per stage (a world of 1,024 ranks has ~1,000 classes: no scan of all per unit)
    live: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for c in queues:
        live[c[0]].add(c)
    while remaining:
        stage = min(live, key=lambda st: (per_stage[st], st))
        cls = min(live[stage], key=lambda c: (per_class[c], c))
        unit = queues[cls][heads[cls]]
        size = sum(src.hf_nbytes for src in unit)
        if current.sources and current.nbytes + size > bucket_bytes:
            back = _even_out(added, ep_size) if pp_size == 1 and ep_size > 1 else []
            for k in back:  # back to their queues (each the last taken from its class), for the next bucket
                c, _, n = added[k]
                heads[c] -= 1
                live[c[0]].add(c)
                remaining += 1
                current.nbytes -= n
            drop = {id(s) for k in back for s in added[k][1]}
            current.sources = [s for s in current.sources if id(s) not in drop]
            buckets.append(current)
            current = BucketPlan(len(buckets))
            per_stage.clear()
            per_class.clear()
            added.clear()
            if back:
                continue  # the unit picked may no longer be its class's next
        added.append((cls, unit, size))
        heads[cls] += 1
        if heads[cls] == len(queues[cls]):
            live[stage].discard(cls)
            if not live[stage]:
                del live[stage]
        remaining -= 1
        current.sources.extend(unit)
        current.nbytes += size
        per_stage[stage] += size
        per_class[cls] += size
    if current.sources:
        buckets.append(current)
    for b in buckets:
        # the round-robin picked what goes in; the layout is natural order, so each EP rank's experts are
        # contiguous in staging and in the output alike, and their copies merge into batched ones
        b.sources.sort(key=lambda s: natural_key(s.name))
        outputs: dict[str, tuple] = {}  # the pieces of a stacked tensor share its entry
        for src in b.sources:
            for name, shape in zip(src.hf_names, src.out_shapes()):
                outputs.setdefault(name, (name, shape, src.dtype, src.name))
        b.entries, b.direct = direct_layout(list(outputs.values()), gather_members(b.sources, pp_size, ep_size))
        b.nbytes = sum(e.nbytes for e in b.entries)
        if b.nbytes > bucket_bytes and isinstance(b.sources[0].resolved.op, Stacked):
            b.rounds = gather_rounds(b.sources, bucket_bytes)
    return buckets


def holder_sizes(sources: dict[str, Source]) -> tuple[int, int]:
    """(PP stages, EP ranks) of the world, as the sources' holders show them."""
    return (1 + max((st for s in sources.values() for st in s.stages), default=0),
            1 + max((s.ep for s in sources.values()), default=0))


def gather_members(sources: list[Source], pp_size: int, ep_size: int) -> list[list[Source]] | None:
    """What each member of a bucket's last grouped all-gather contributes, grouped as `all_ranks_program` groups
    it: the PP stages when PP > 1, else the EP ranks' experts; None without such a gather."""
    if pp_size == 1 and ep_size == 1:
        return None
    members: list[list[Source]] = [[] for _ in range(pp_size if pp_size > 1 else ep_size)]
    for s in sources:  # one pass (EP 64, PP 16)
        if pp_size > 1:
            members[s.stage].append(s)
        elif s.is_expert:
            members[s.ep].append(s)
    return members


def direct_layout(tensors: list[tuple[str, tuple[int, ...], torch.dtype, str]],
                  members: list[list[Source]] | None) -> tuple[list[HFEntry], int | None]:
    """A bucket's entries (`pack_tight` tuples) and its `direct` slot: member m's HF tensors packed tight at
    [m * slot, (m + 1) * slot), the rest after them, when every member's come to the same bytes and every tensor
    stays aligned for its dtype; then the all-gather's output is the bucket's output (no copy after it).
    Otherwise (uneven members, a stacked tensor shared by several members) `pack_tight` of all, slot None."""
    if members and not any(isinstance(s.resolved.op, Stacked) for m in members for s in m):
        owner = {s.name: k for k, m in enumerate(members) for s in m}
        # a member's source writes its layout op's outputs; its published copies are duplicated after the gather
        writes = {s.name: set(s.resolved.hf_names) for m in members for s in m}
        own = [[t for t in tensors if owner.get(t[3]) == k and t[0] in writes[t[3]]] for k in range(len(members))]
        parts = [pack_tight(ts) for ts in own]
        slot = sum(e.nbytes for e in parts[0])
        placed = {t[0] for ts in own for t in ts}
        if slot and all(sum(e.nbytes for e in p) == slot for p in parts):
            entries = [replace(e, start=e.start + k * slot) for k, p in enumerate(parts) for e in p]
            entries += [replace(e, start=e.start + len(members) * slot)
                        for e in pack_tight([t for t in tensors if t[0] not in placed])]
            if all(e.start % e.dtype.itemsize == 0 for e in entries):
                return entries, slot
    return pack_tight(tensors), None


def _even_out(added: list[tuple], ep_size: int) -> list[int]:
    """Indices of the last expert units taken (fewer than EP ranks: the rotation over EP ranks is at most that far
    ahead) whose return to their queues leaves every EP rank the same expert bytes in the bucket, so its EP
    all-gather can land in the output (`direct_layout`); [] if none does (or it would empty the bucket)."""
    per = defaultdict(int)
    for (_, ep), _, n in added:
        if ep >= 0:
            per[ep] += n
    back: list[int] = []
    kept: set[int] = set()  # EP ranks with a later unit staying: an earlier one of theirs cannot go back
    for k in range(len(added) - 1, -1, -1):
        if len({per[m] for m in range(ep_size)}) == 1 or len(back) == ep_size - 1:
            break
        (_, ep), _, n = added[k]
        if ep >= 0 and per[ep] == max(per.values()) and ep not in kept:
            back.append(k)
            per[ep] -= n
        elif ep >= 0:
            kept.add(ep)
    even = len({per[m] for m in range(ep_size)}) == 1
    return back if even and len(back) < len(added) else []


def gather_rounds(pieces: list[Source], bucket_bytes: int) -> list[list[Source]] | None:
    """Rounds of <= `bucket_bytes` (at least one piece each) over the pieces of one stacked tensor, taken
    round-robin over EP ranks so every rank contributes to each round's all-gather alike."""
    by_ep: dict[int, list[Source]] = defaultdict(list)
    for s in pieces:
        by_ep[s.ep].append(s)
    order = [s for k in range(max(len(v) for v in by_ep.values()))
             for ep in sorted(by_ep) for s in by_ep[ep][k:k + 1]]
    rounds: list[list[Source]] = []
    size = 0
    for s in order:
        if not rounds or (size + s.hf_nbytes > bucket_bytes and rounds[-1]):
            rounds.append([])
            size = 0
        rounds[-1].append(s)
        size += s.hf_nbytes
    return rounds if len(rounds) > 1 else None


def stacked_units(sources: dict[str, Source], bucket_bytes: int) -> list[list[Source]]:
    """What buckets are filled with: one source (or a published copy of it, `split_copies`), or all the pieces of
    stacked HF tensors (a layer's experts -> gpt-oss's experts.gate_up_proj), which go into one bucket together so
    each piece writes its item of the one output in place; such a unit may exceed the budget, alone in its bucket."""
    units = []
    for unit in stack_units(list(sources.values()), lambda s: (s.resolved.op, s.resolved.hf_names, s.name)):
        units += [unit] if isinstance(unit[0].resolved.op, Stacked) else [[u] for u in split_copies(unit[0], bucket_bytes)]
    for unit in units:
        if len(unit) > 1 and len({(s.stage, s.dtype, s.shard_shape, s.count) for s in unit}) != 1:
            raise ShapeMismatchError(f"{list(unit[0].resolved.hf_names)}: its stacked pieces differ in shape, dtype "
                                     f"or stage ({sorted({(s.stage, str(s.dtype), s.shard_shape) for s in unit})})")
    return units


def stack_units(items: list, describe) -> list[list]:
    """`items` in units, in order of first appearance: the pieces of one stacked HF tensor together (wherever they
    appear), everything else alone. `describe(item)` -> (op, HF names, name). Raises unless every stack is whole."""
    units: list[list] = []
    stacks: dict[tuple[str, ...], list] = {}
    for item in items:
        op, names, _ = describe(item)
        if not isinstance(op, Stacked):
            units.append([item])
            continue
        unit = stacks.get(names)
        if unit is None:
            unit = stacks[names] = []
            units.append(unit)
        unit.append(item)
    for names, unit in stacks.items():
        op, _, first = describe(unit[0])
        found = sorted(describe(x)[0].index for x in unit)
        if found != list(range(op.count)):
            raise LayoutError(f"{list(names)} stack {op.count} Megatron tensors (one per expert), but there are "
                              f"items {found} (e.g. {first}): every expert of the layer is needed")
    return units


def pack_tight(tensors: list[tuple[str, tuple[int, ...], torch.dtype, str]]) -> list[HFEntry]:
    """Offsets of tensors packed back to back, larger element sizes first (stable otherwise).

    No padding: the flat buffer is byte for byte what SGLang's receivers allocate from names, dtypes and
    shapes (its flattened bucket concatenates tensors in request order). Sorting by element size keeps every
    tensor aligned for its dtype view, since each size is a multiple of its element size."""
    entries, offset = [], 0
    for name, shape, dtype, source in sorted(tensors, key=lambda t: -t[2].itemsize):
        n = nbytes(shape, dtype)
        entries.append(HFEntry(name, tuple(shape), dtype, offset, n, source))
        offset += n
    return entries


def prequantized_source(src: Source, policy: FP8Policy, scheme: QuantScheme, probes: dict) -> Source | None:
    """`src` quantized where it is held (each TP / expert-TP shard on its own), before the collectives, when that
    is bit-identical to quantizing its full HF tensors: a 2-D tensor whose HF outputs are all quantized and are
    made of runs of whole shard rows, or of whole shard columns (row-parallel), on 128 block boundaries (no
    128x128 block straddles a shard or an output; checked by running its layout op on labels). Its bytes cross
    every collective as fp8 + scales."""
    r = src.resolved
    if len(src.shard_shape) != 2 or r.copies or not src.dtype.is_floating_point:
        return None
    if not all(policy.quantized(n, shape) for n, shape in zip(r.hf_names, src.hf_shapes)):
        return None
    key = (id(r.op), src.shard_shape, src.count)
    if key not in probes:
        probes[key] = row_pieces(r.op, src.shard_shape, src.count)
    found = probes[key]
    if found is None:
        return None
    rows, cols = src.shard_shape
    op = FP8RowSlices(rows, cols, *found)
    names = tuple(x for n in r.hf_names for x in (n, scheme.scale_name(n)))
    blob = FP8RowSlices.blob_nbytes(rows, cols)
    return replace(src, resolved=replace(r, hf_names=names, op=op), dtype=torch.uint8, shard_shape=(blob,),
                   full_shape=(src.count * blob,), hf_shapes=op.hf_shapes(src.full_shape), prequant=True)


def quantized_plan(plan: ExportPlan, policy: FP8Policy, scheme: QuantScheme, on_shards: bool = True) -> ExportPlan:
    """The same plan (buckets, holders) delivering `scheme`'s format: the weights the architecture's policy
    quantizes become the scheme's weights followed by their scales, packed tight (larger element sizes first, so every
    entry stays aligned for its dtype). With `on_shards`, tensors that allow it are quantized where they are held,
    before the collectives (`prequantized_source`); the others are quantized after the gather, as full HF tensors
    (the bucket's `out_entries`; None when the gather already delivers everything quantized)."""
    probes: dict = {}
    sources = dict(plan.sources)
    pp_size, ep_size = holder_sizes(plan.sources)
    buckets = []
    for b in plan.buckets:
        srcs, gathered = [], []
        for s in b.sources:
            pre = prequantized_source(s, policy, scheme, probes) if on_shards and scheme.on_shards else None
            if pre is not None:
                s = sources[s.name] = pre
                gathered += [(n, shape, scheme.weight_dtype if i % 2 == 0 else scheme.scale_dtype, s.name)
                             for i, (n, shape) in enumerate(zip(s.hf_names, s.out_shapes()))]
            else:
                gathered += [(n, shape, s.dtype, s.name) for n, shape in zip(s.hf_names, s.out_shapes())]
            srcs.append(s)
        entries, direct = direct_layout(gathered, gather_members(srcs, pp_size, ep_size))
        final = quantized_tensors(gathered, policy, scheme)
        out = None if [t[:3] for t in final] == [t[:3] for t in gathered] else pack_tight(final)
        buckets.append(replace(b, sources=srcs, entries=entries, nbytes=sum(e.nbytes for e in entries),
                               out_entries=out, direct=direct))
    return replace(plan, sources=sources, buckets=buckets, quantize=scheme)
