"""Offline export: a Megatron distributed checkpoint (torch_dist) -> an HF directory, on a CPU, in bounded memory.

No torch.distributed, no model, no GPU: the checkpoint's `.metadata` says where every chunk of every tensor is
(a byte range of a `.distcp` file holding one uncompressed `torch.save`d chunk), so each tensor is assembled from
exactly the bytes it needs (a layer of a stacked-layers chunk is one contiguous read) and written out bucket by
bucket through the streaming safetensors writer. Peak memory is about one bucket plus the tensor being
converted, whatever the model size; every byte read is covered by the chunk's CRC32.

Checkpoint keys are global already (layer and expert indices), in Megatron's sharded-state-dict names, which
`mcore2hf.checkpoint_keys` maps to the canonical names the converter tables use (the same scheme the import writes).

Megatron-LM's legacy `torch` format (`iter_N/mp_rank_*/model_optim_rng.pt`, per-rank local shards) is read by
`mcore2hf.legacy` into the same sources, whose reads are then the TP shards the layout ops take.
"""

from __future__ import annotations

import io
import os
import pickle
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import import_module

import torch

from .buckets import Bucket
from .checkpoint_keys import PARTS, CkptSource, canonical_parts
from .dtypes import parse_dtype
from .errors import (
    CheckpointError,
    ConfigMismatchError,
    Problem,
    ShapeMismatchError,
    UnknownParametersError,
    UsageError,
    option,
    problem_list,
)
from .exporter import structure_problems
from .hf_config import HFConfigLike, config_source, hf_tensor_shapes, shape_problems
from .layouts import full_shape_of_shard
from .layouts_stacked import Stacked
from .lora import (
    A_SUFFIX,
    ADAPTER,
    B_SUFFIX,
    LoraInfo,
    adapter_shapes,
    check_mode,
    is_adapter,
    lora_converter,
    merged_whole,
    peft_config,
)
from .naming import (
    HYBRID_FINAL_NORM,
    HybridLayout,
    checkpoint_hybrid_layout,
    filter_outputs,
)
from .plan import align, pack_tight, stack_units
from .quantize import get_scheme, quantize_flat, quantized_tensors
from .registry import get_converter
from .senders.safetensors import SafetensorsWriter, TensorInfo, check_target
from .sizes import parse_size, peak_rss

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")



def resolve_iteration_dir(ckpt_dir: str | os.PathLike, iteration: int | None = None) -> str:
    """The iter_NNNNNNN directory to read: `iteration`, else latest_checkpointed_iteration.txt, else ckpt_dir."""
    root = os.fspath(ckpt_dir)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root} is not a directory")
    if iteration is not None:
        path = os.path.join(root, f"iter_{iteration:07d}")
        if not os.path.isdir(path):
            have = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
            raise CheckpointError(f"iteration {iteration} not found in {root} (expected {path}); present: {have}")
        return path
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            raise CheckpointError(f"{tracker} names iteration {text!r}, but {path} does not exist")
        return path
    from .legacy import is_legacy_dir

    if os.path.isfile(os.path.join(root, ".metadata")) or is_legacy_dir(root):
        return root
    raise CheckpointError(f"{root} is not a Megatron checkpoint: no latest_checkpointed_iteration.txt, "
                          "no iter_* directory given, no .metadata, no mp_rank_*/model_optim_rng.pt")


class DistCheckpointReader:
    """Reads tensors (or slices of them) of a torch_dist checkpoint directory chunk by chunk."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        self.path = path
        meta_json = os.path.join(path, "metadata.json")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(f"{path} is not a torch_dist checkpoint: no .metadata file")
        if os.path.isfile(meta_json):
            import json

            with open(meta_json) as f:
                backend = json.load(f).get("sharded_backend")
            if backend not in (None, "torch_dist"):
                raise CheckpointError(f"{path}: sharded backend {backend!r} is not supported (only torch_dist)")
        try:
            self.meta = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}/.metadata cannot be read ({type(e).__name__}: {e})") from None
        self._index = MetadataIndex
        self.tensors = {k: v for k, v in self.meta.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self._sizes: dict[str, int] = {}
        self._verified: set[tuple[str, int]] = set()
        self.bytes_read = 0

    def check_files(self, keys) -> None:
        """Every chunk of `keys` lies inside its file: a truncated checkpoint fails before anything is written."""
        for key in keys:
            for chunk in self.tensors[key].chunks:
                self._locate(key, chunk)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def sources(self, num_layers: int, tied: bool, hybrid: HybridLayout | None = None
                ) -> tuple[list[CkptSource], list[str]]:
        return checkpoint_sources(self, num_layers, hybrid)  # a tied output layer is not saved apart from the embedding

    def tp_of(self, source: CkptSource) -> int:
        """TP of the checkpoint's chunking of this tensor along dim 0 (vocab-parallel tensors)."""
        return len({c.offsets[0] for c in self.tensors[source.key].chunks})

    def checkpoint_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in os.listdir(self.path) if f.endswith(".distcp"))

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def _locate(self, key: str, chunk) -> tuple[str, int, int]:
        info = self.meta.storage_data.get(self._index(key, chunk.offsets))
        if info is None:
            raise CheckpointError(f"{self.path}: no storage entry for a chunk of {key} at offset {list(chunk.offsets)}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{key}: transformed (e.g. compressed) chunks are not supported")
        file = os.path.join(self.path, info.relative_path)
        size = self._sizes.get(file)
        if size is None:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file} is missing (it holds a chunk of {key})")
            size = self._sizes[file] = os.path.getsize(file)
        if info.offset + info.length > size:
            raise CheckpointError(f"{file} is truncated: a chunk of {key} needs bytes [{info.offset}, "
                                  f"{info.offset + info.length}), the file has {size}")
        return file, info.offset, info.length

    def _chunk_part(self, key: str, chunk, sub: tuple[int, ...]) -> torch.Tensor:
        """chunk[sub], reading only its bytes: each chunk is an uncompressed torch.save zip at a byte range of a
        .distcp file, so its tensor layout comes from data.pkl and the sub-tensor from one contiguous read."""
        file, start, length = self._locate(key, chunk)
        where = f"{file} (chunk of {key} at bytes [{start}, {start + length}))"
        with open(file, "rb") as f:
            window = _Window(f, start, length)
            try:
                layout = _chunk_layout(window)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{where} is corrupt: {type(e).__name__}: {e}") from None
            if layout is None:  # unusual serialization: load the chunk whole (torch verifies it)
                window.seek(0)
                try:
                    return torch.load(io.BytesIO(window.read(length)), map_location="cpu", weights_only=True)[sub]
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(f"{where} is corrupt: {type(e).__name__}: {e}") from None
            dtype, storage_offset, size, stride, data_off, data_len, crc = layout
            if tuple(size) != tuple(chunk.sizes):
                raise CheckpointError(f"{where} is corrupt: tensor shape {list(size)}, metadata says {list(chunk.sizes)}")
            rest, rest_stride = size[len(sub):], stride[len(sub):]
            if tuple(rest_stride) != _contiguous_strides(rest):
                window.seek(0)
                return torch.load(io.BytesIO(window.read(length)), map_location="cpu", weights_only=True)[sub]
            first = storage_offset + sum(i * st for i, st in zip(sub, stride))
            count = 1
            for d in rest:
                count *= d
            item = dtype.itemsize
            window.seek(data_off + first * item)
            raw = window.read(count * item)
            if len(raw) != count * item:
                raise CheckpointError(f"{where} is truncated: its data ends early")
            whole = first == 0 and count * item == data_len
            if whole and zlib.crc32(raw) != crc:
                raise CheckpointError(f"{where} is corrupt: CRC32 mismatch")
            if not whole and (file, start) not in self._verified:
                _verify_crc(window, data_off, data_len, crc, where)
                self._verified.add((file, start))
        self.bytes_read += len(raw)
        return torch.frombuffer(bytearray(raw), dtype=dtype).view(rest) if count else torch.empty(rest, dtype=dtype)

    def read(self, key: str, lead: tuple[int, ...] = ()) -> torch.Tensor:
        """The tensor `key`, or its sub-tensor key[lead] (indices into its leading dims: stacked layers,
        stacked experts), assembled from the parts of the chunks that hold it."""
        md = self.tensors[key]
        shape = list(md.size)
        k = len(lead)
        out = torch.empty(shape[k:], dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            off, size = chunk.offsets, chunk.sizes
            if any(not off[d] <= lead[d] < off[d] + size[d] for d in range(k)):
                continue
            src = self._chunk_part(key, chunk, tuple(lead[d] - off[d] for d in range(k)))
            out[tuple(slice(o, o + n) for o, n in zip(off[k:], size[k:]))].copy_(src)
            covered += src.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.path}: the chunks of {key}{list(lead)} cover {covered} of {out.numel()} elements")
        return out


class _Window(io.RawIOBase):
    """A read-only view of bytes [start, start + length) of an open file (zipfile reads the chunk through it)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        data = self.f.read(max(n, 0))
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(list(shape)):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a torch.save data.pkl for one tensor's layout without touching its storage."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"unexpected {module}.{name}")

    def persistent_load(self, pid):
        return pid


def _chunk_layout(window: _Window):
    """(dtype, storage_offset, size, stride, data offset, data length, crc) of the chunk, or None if unusual."""
    zf = zipfile.ZipFile(window)
    pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
    obj = _LayoutUnpickler(io.BytesIO(zf.read(pkl))).load()
    if not (isinstance(obj, tuple) and obj and obj[0] == "tensor"):
        return None
    _, storage, offset, size, stride = obj
    if not (isinstance(storage, tuple) and storage[0] == "storage"):
        return None
    dtype = getattr(storage[1], "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    info = zf.getinfo(pkl[: -len("data.pkl")] + f"data/{storage[2]}")
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    window.seek(info.header_offset)
    header = window.read(30)
    data_off = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return dtype, offset, size, stride, data_off, info.file_size, info.CRC


def _verify_crc(window: _Window, start: int, length: int, crc: int, where: str) -> None:
    """CRC32 of a chunk's whole data, streamed (a partial read cannot check it otherwise)."""
    window.seek(start)
    value, left = 0, length
    while left:
        block = window.read(min(left, 64 * 2**20))
        if not block:
            raise CheckpointError(f"{where} is truncated: its data ends early")
        value = zlib.crc32(block, value)
        left -= len(block)
    if value != crc:
        raise CheckpointError(f"{where} is corrupt: CRC32 mismatch")


def checkpoint_sources(reader: DistCheckpointReader, num_layers: int,
                       hybrid: HybridLayout | None = None) -> tuple[list[CkptSource], list[str]]:
    """Canonical sources of every model tensor of the checkpoint (its keys read by `checkpoint_keys`); also the
    keys that are not model weights. `hybrid`: a hybrid model's checkpoint (naming.checkpoint_hybrid_layout)."""
    found, ignored = canonical_parts(reader.tensors, reader.shape, num_layers, hybrid)
    sources = []
    for name, parts in found.items():
        order = [parts[p] for p in PARTS if p in parts]  # gate (_w) before up (_v); GDN: Megatron's order
        key, lead = order[0]
        shape = list(reader.shape(key))[len(lead):]
        for k, ld in order[1:]:
            shape[0] += reader.shape(k)[len(ld)]
        sources.append(CkptSource(name, key, [list(order)], tuple(shape), reader.dtype(key)))
    return sources, ignored


@dataclass
class ExportReport:
    out_dir: str
    tensors: int
    bytes_written: int
    checkpoint_bytes: int
    ignored_keys: int
    seconds: float
    peak_rss_bytes: int
    notes: list[str] = field(default_factory=list)


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, hf_config: HFConfigLike | None, *,
                      iteration: int | None = None, dtype: torch.dtype | str | None = None,
                      max_shard_size: int | str = "5GB", bucket_bytes: int | str = "1GiB",
                      overwrite: bool = False, progress: bool = True, name_filter=None,
                      make_vocab_size_divisible_by: int = 128, quantize: str | None = None,
                      base: str | os.PathLike | None = None, lora: str | None = None,
                      lora_alpha: float | None = None) -> ExportReport:
    """Write an HF directory from a Megatron torch_dist checkpoint (no GPU, no torch.distributed).

    `dtype` casts floating tensors (tensors HF keeps in fp32, like e_score_correction_bias, stay fp32).
    Every tensor's shape is checked against the model transformers builds from `hf_config`, and the vocab rows
    dropped as padding must be exactly Megatron's padding (`make_vocab_size_divisible_by` x the checkpoint's
    TP); all problems are reported at once, before anything is written. `name_filter(hf_name) -> bool` selects
    tensors. `quantize="fp8"` / `"fp8-ue8m0"` writes a block-FP8 checkpoint (see `mcore2hf.quantize`): each
    bucket is quantized after it is read, so memory stays about one bucket plus its quantized copy. `base` (an HF
    directory) completes the output with the base tensors the checkpoint does not produce (`SafetensorsWriter`).
    A checkpoint of a Megatron-Bridge LoRA model: `lora="adapter"` writes a PEFT adapter directory,
    `lora="merged"` the HF directory of W + lora_alpha/r B A, `lora="base"` the base weights (docs/lora.md). An
    adapter-only checkpoint (Megatron-Bridge's PEFT training saves its adapters alone) takes its base weights for
    "merged" / "base" from `base`: the base model's HF directory (which also completes the output) or Megatron
    checkpoint."""
    t0 = time.perf_counter()
    if hf_config is None:  # Megatron's args cannot say which HF architecture this is (mcore2hf.legacy)
        from .legacy import missing_hf_config

        raise UsageError(missing_hf_config(resolve_iteration_dir(ckpt_dir, iteration)))
    budget = parse_size(bucket_bytes, "bucket_bytes")  # every argument is checked before anything is created
    parse_size(max_shard_size, "max_shard_size")
    cast = parse_dtype(dtype)
    scheme = get_scheme(quantize)
    out_dir = os.path.abspath(os.fspath(out_dir))
    source = config_source(hf_config)
    converter = get_converter(source.config.model_type)
    policy = None
    if scheme is not None:
        policy = converter.fp8
        if policy is None:
            raise ValueError(f"FP8 export is not supported for model_type {source.config.model_type!r}: its "
                             "converter has no fp8 policy")
    inputs = [ckpt_dir] + ([source.directory] if source.directory else []) + ([base] if base is not None else [])
    check_target(out_dir, overwrite, inputs)
    it_dir = resolve_iteration_dir(ckpt_dir, iteration)
    check_target(out_dir, overwrite, [it_dir])  # e.g. a symlinked iter_* directory elsewhere
    if lora == "adapter" and (quantize is not None or base is not None):
        raise UsageError(f"a LoRA adapter export is neither quantized nor completed from a base: drop "
                         f"{option('quantize', None)} / {option('base', None)}")
    reader, sources, ignored = prepare_sources(it_dir, source.config, make_vocab_size_divisible_by, name_filter,
                                               lora, lora_alpha, base_weights=base)
    if base is not None and is_megatron_checkpoint(base):
        base = None  # it gave the base weights (an adapter-only checkpoint's); only an HF directory completes

    def out_dtype(s: CkptSource) -> torch.dtype:
        return cast if cast is not None and s.dtype.is_floating_point and not s.keep_dtype else s.dtype

    tensors = list({name: (name, shape, out_dtype(s)) for s in sources for name, shape in s.hf}.values())
    quantization = None
    if scheme is not None:
        quantization = policy.config(scheme, [(name, shape) for name, shape, _ in tensors])
        tensors = quantized_tensors(tensors, policy)
    infos = [TensorInfo(name, shape, dt) for name, shape, dt in tensors]
    if lora == "adapter":  # r from the factors' shapes (checked equal), alpha as given
        r = next(shape[0] for name, shape, _ in tensors if ".lora_A." in name)
        num_layers = import_module(converter.spec).dims(source.config).num_layers
        config = peft_config(LoraInfo(r, float(lora_alpha), ()), [t.name for t in infos], num_layers,
                             source.directory)
        writer = SafetensorsWriter(out_dir, infos, None, overwrite=overwrite, inputs=inputs + [it_dir],
                                   adapter_config=config)
    else:
        writer = SafetensorsWriter(out_dir, infos, source, max_shard_size=max_shard_size, overwrite=overwrite,
                                   extra_files=source.companion_files, inputs=inputs + [it_dir],
                                   quantization=quantization, base=base, not_held=converter.not_held_by_model)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(t.nbytes for t in infos), unit="B", unit_scale=True, desc="export",
                   disable=None)  # a bar only on a terminal
    written = 0
    try:
        for index, group in enumerate(_groups(sources, budget, out_dtype)):
            bucket = _convert(reader, group, out_dtype, index)
            if scheme is not None:
                entries = pack_tight(quantized_tensors([(e.name, e.shape, e.dtype, e.source) for e in bucket.entries],
                                                       policy))
                bucket = Bucket(index, quantize_flat(bucket.flat, bucket.entries, entries, scheme), entries)
            writer.send(bucket)
            n = sum(e.nbytes for e in bucket.entries)
            del bucket  # one output buffer at a time
            written += n
            if bar is not None:
                bar.update(n)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return ExportReport(out_dir, len(infos), written, reader.checkpoint_bytes(),
                        len(ignored), time.perf_counter() - t0, peak_rss(), writer.notes)


def open_checkpoint(it_dir: str):
    """The reader for what the iteration directory holds: torch_dist (.metadata) or legacy (mp_rank_*)."""
    from .legacy import LegacyCheckpointReader, is_legacy_dir

    if not os.path.isfile(os.path.join(it_dir, ".metadata")) and is_legacy_dir(it_dir):
        return LegacyCheckpointReader(it_dir)
    return DistCheckpointReader(it_dir)


def prepare_sources(it_dir: str, cfg, make_vocab_size_divisible_by: int = 128, name_filter=None,
                    lora: str | None = None, lora_alpha: float | None = None,
                    base_weights: str | os.PathLike | None = None
                    ) -> tuple[DistCheckpointReader, list[CkptSource], list[str]]:
    """The checkpoint's model tensors, resolved to HF names and shapes and checked against the HF config (every
    problem at once); also the keys that are not model weights. A checkpoint of a Megatron-Bridge LoRA model:
    `lora` says what is exported, as for HFExporter (docs/lora.md); the checkpoint does not hold alpha, so
    "adapter" and "merged" need `lora_alpha`. An adapter-only checkpoint (what Megatron-Bridge's PEFT training
    saves: its adapters, no base weights) exports as "adapter" alone, or as "merged" / "base" with
    `base_weights`: the base model's HF directory or Megatron checkpoint, read with it (CombinedReader)."""
    converter = get_converter(cfg.model_type)
    spec = import_module(converter.spec)
    dims = spec.dims(cfg)
    reader = open_checkpoint(it_dir)
    sources, ignored = _checkpoint_sources(reader, spec, cfg, dims)
    adapter_only = bool(sources) and all(is_adapter(s.name) for s in sources)
    if base_weights is not None and not adapter_only and is_megatron_checkpoint(base_weights):
        raise UsageError(f"{option('base', base_weights)}: a Megatron checkpoint gives the base weights of an "
                         f"adapter-only checkpoint, and {it_dir} holds its own base weights (pass an HF directory "
                         "to complete the output from)")
    if adapter_only and lora in ("merged", "base"):
        if base_weights is None:
            raise UsageError(f"{it_dir} holds LoRA adapters only (Megatron-Bridge's PEFT checkpoints save no base "
                             f"weights): {option('lora', lora)} needs {option('base', None)}, the base model's HF "
                             "directory or Megatron checkpoint")
        reader = CombinedReader([reader, _base_reader(base_weights, cfg, converter, dims)])
        sources, ignored = _checkpoint_sources(reader, spec, cfg, dims)
    reader.check_files({key for s in sources for shard in s.reads for key, _ in shard})
    if not sources:
        raise CheckpointError(f"{it_dir} holds no model weights (keys: {sorted(reader.tensors)[:5]}...)")
    adapters = [s for s in sources if is_adapter(s.name)]
    sources = [s for s in sources if not is_adapter(s.name)]
    check_mode(lora, bool(adapters), adapters[0].key if adapters else None)
    if lora in ("adapter", "merged") and lora_alpha is None:
        raise UsageError(f"{option('lora', lora)}: a checkpoint does not hold LoRA's alpha; pass "
                         f"{option('lora_alpha', None)}, the alpha of Megatron-Bridge's LoRA(dim=..., alpha=...) the "
                         "model was trained with")
    if not sources:  # adapters only, exported alone: checked against the config's model (its MTP layers too)
        sources = _adapter_sources(adapters, converter, dims, cfg, dims.num_mtp_layers, it_dir)
        return reader, (_filtered(sources, name_filter) if name_filter is not None else sources), ignored

    unknown = [s for s in sources if not converter.maps(s.name)]
    if unknown:  # before any count: a checkpoint of another architecture is that, not a wrong number of layers
        raise UnknownParametersError(converter.model_type, [s.name if s.name == s.key else f"{s.name} (checkpoint "
                                                            f"key {s.key})" for s in unknown],
                                     first=_architecture_mismatch([s.name for s in sources], cfg.model_type))
    ckpt_mtp = len({s.name.split(".")[2] for s in sources if s.name.startswith("mtp.layers.")})
    if ckpt_mtp > dims.num_mtp_layers:
        raise ConfigMismatchError(f"the checkpoint has {ckpt_mtp} MTP layer(s), the HF config has "
                                  f"num_nextn_predict_layers={dims.num_mtp_layers}")
    dims = replace(dims, num_mtp_layers=ckpt_mtp)

    for s in sources:
        r = converter.resolve(s.name, dims)
        s.op, s.n_out, s.keep_dtype = r.op, r.op.n_out, r.rule.keep_dtype
        count, dim = r.op.split(s.shape, len(s.reads))  # as the live plan splits a rank's shard (plan._shard_split)
        s.reads, s.shape = s.reads[:count], full_shape_of_shard(s.shape, dim, count)
    problems = vocab_padding_problems([(s.key, s.shape[0], reader.tp_of(s)) for s in sources if s.name in VOCAB_KEYS],
                                      dims.vocab_size, make_vocab_size_divisible_by)
    for s in sources:
        r = converter.resolve(s.name, dims)
        try:
            shapes = r.op.hf_shapes(s.shape)
        except ShapeMismatchError as e:
            problems.append(Problem(f"{s.key} -> {list(r.hf_names)}", str(e)))
            continue
        s.hf = list(zip(r.hf_names + r.copies, shapes + [shapes[0]] * len(r.copies)))
    structural = structure_problems({s.name: s for s in sources}, spec, cfg, dims)
    if not problems:  # every tensor against the model transformers builds from this config (a tower held: all of it)
        produced = {name: shape for s in sources for name, shape in s.hf}
        problems = shape_problems(produced, hf_tensor_shapes(cfg, ckpt_mtp, converter.not_held_except(produced)))
    if structural or problems:
        error = ConfigMismatchError if structural else ShapeMismatchError
        raise error(f"the HF config ({cfg.model_type}) disagrees with the checkpoint {it_dir}:\n  "
                    + problem_list(structural + problems))
    if lora in ("adapter", "merged"):
        resolved = _adapter_sources(adapters, converter, dims, cfg, ckpt_mtp, it_dir)
        if lora == "adapter":
            sources = resolved
        else:
            _attach_merges(sources, adapters, lora_alpha)
    if name_filter is not None:
        sources = _filtered(sources, name_filter)
    return reader, sources, ignored


def _checkpoint_sources(reader, spec, cfg, dims) -> tuple[list[CkptSource], list[str]]:
    hybrid = None
    if HYBRID_FINAL_NORM in reader.tensors:  # a hybrid model's: its pattern from the HF config
        from .model_specs.common import hybrid_pattern

        hybrid = checkpoint_hybrid_layout(reader.tensors, hybrid_pattern(spec, cfg))
    return reader.sources(dims.num_layers, bool(getattr(cfg, "tie_word_embeddings", False)), hybrid)


def is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    """A Megatron checkpoint directory (its root or an iteration): torch_dist or legacy torch."""
    from .legacy import is_legacy_dir

    path = os.fspath(path)
    return os.path.isdir(path) and (any(os.path.exists(os.path.join(path, f)) for f in
                                        ("latest_checkpointed_iteration.txt", ".metadata")) or is_legacy_dir(path))


def _base_reader(base: str | os.PathLike, cfg, converter, dims):
    """The base weights of an adapter-only checkpoint: a Megatron checkpoint (its latest iteration) or an HF
    directory (importer.HFBaseReader: its tensors as the import would write them)."""
    if is_megatron_checkpoint(base):
        return open_checkpoint(resolve_iteration_dir(base))
    from .importer import HFBaseReader

    return HFBaseReader(base, cfg, converter, dims)


class CombinedReader:
    """Several checkpoints read as one: an adapter-only checkpoint and the base weights it was trained on (a
    Megatron checkpoint's reader, or importer.HFBaseReader). Their sources together; each key read from the
    reader holding it (no key may be in two)."""

    def __init__(self, readers: list):
        self.readers, self.path = readers, readers[0].path
        self.tensors, self._owner = {}, {}
        for r in readers:
            twice = sorted(set(r.tensors) & set(self.tensors))
            if twice:
                raise CheckpointError(f"{r.path} and {self._owner[twice[0]].path} both hold {twice[:3]}: not an "
                                      "adapter-only checkpoint and its base")
            self.tensors.update(r.tensors)
            self._owner.update(dict.fromkeys(r.tensors, r))

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers)

    def sources(self, num_layers: int, tied: bool, hybrid=None) -> tuple[list[CkptSource], list[str]]:
        found, ignored = [], []
        for r in self.readers:
            s, i = r.sources(num_layers, tied, hybrid)
            found += s
            ignored += i
        return found, ignored

    def read(self, key: str, lead: tuple[int, ...] = ()) -> torch.Tensor:
        return self._owner[key].read(key, lead)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._owner[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._owner[key].dtype(key)

    def check_files(self, keys) -> None:
        keys = set(keys)
        for r in self.readers:
            r.check_files({k for k in keys if self._owner.get(k) is r})

    def tp_of(self, source: CkptSource) -> int:
        return self._owner[source.key].tp_of(source)

    def checkpoint_bytes(self) -> int:
        return sum(r.checkpoint_bytes() for r in self.readers)


def _architecture_mismatch(names: list[str], model_type: str) -> str:
    """The architectures whose tables map every tensor of a checkpoint that `model_type`'s does not (the start of
    the error), or "" where none does (tensors no table knows)."""
    from .registry import formats_mapping

    fits = formats_mapping(names)
    if not fits:
        return ""
    return (f"the checkpoint holds another architecture than the HF config's model_type {model_type!r}: every "
            f"tensor of it maps as {', '.join(fits)}; pass that model's HF config (--hf-config). ")


def _adapter_sources(adapters: list[CkptSource], converter, dims, cfg, ckpt_mtp: int, it_dir: str) -> list[CkptSource]:
    """The adapter factors resolved through the derived LoRA table, their shapes checked against the base weights."""
    derived = lora_converter(converter)
    problems = []
    for s in adapters:
        r = derived.resolve(s.name, dims)
        if r is None:
            base = converter.resolve(s.name.split(ADAPTER)[0] + ".weight", dims)
            how = f"-> {list(base.hf_names)} with {type(base.op).__name__}" if base else "(no rule)"
            problems.append(f"{s.key}: a LoRA adapter on a module whose base weight {how} has no HF/PEFT adapter form")
            continue
        s.op, s.n_out = r.op, r.op.n_out
        count, dim = r.op.split(s.shape, len(s.reads))
        s.reads, s.shape = s.reads[:count], full_shape_of_shard(s.shape, dim, count)
        shapes = r.op.hf_shapes(s.shape)
        s.hf = list(zip(r.hf_names + r.copies, shapes + [shapes[0]] * len(r.copies)))
    if not problems:
        _, problems = adapter_shapes({n: shape for s in adapters for n, shape in s.hf},
                                     hf_tensor_shapes(cfg, ckpt_mtp, converter.not_held_by_model))
    if problems:
        raise ShapeMismatchError(f"the LoRA adapters of {it_dir}:\n  " + "\n  ".join(problems))
    return adapters


def _attach_merges(sources: list[CkptSource], adapters: list[CkptSource], alpha: float) -> None:
    """lora="merged": each adapted base weight gets its (A, B) sources and alpha / r."""
    split = sorted({s.name.split(ADAPTER)[0] for s in adapters if ".adapter.adapter_" in s.name})
    if split:
        raise UsageError(f"{option('lora', 'merged')} offline: canonical LoRA (adapter.adapter_q/k/v, "
                         f"adapter_gate/up) is not merged from checkpoints yet ({split[:3]}); export "
                         f"{option('lora', 'adapter')}, or merge live")
    by_name = {s.name: s for s in adapters}
    for s in sources:
        module = s.name.removesuffix(".weight")
        a, b = by_name.get(module + A_SUFFIX), by_name.get(module + B_SUFFIX)
        if a is None and b is None:
            continue
        if a is None or b is None or len(s.reads) != 1:
            raise CheckpointError(f"{s.key}: LoRA merge needs the whole base weight and both factors "
                                  f"(A {'found' if a else 'missing'}, B {'found' if b else 'missing'})")
        s.merge = (a, b, alpha / a.shape[0])


def _read_whole(reader, s: CkptSource) -> torch.Tensor:
    parts = [reader.read(key, lead) for key, lead in s.reads[0]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def checkpoint_tensors(ckpt_dir: str | os.PathLike, hf_config: HFConfigLike, *, iteration: int | None = None,
                       bucket_bytes: int | str = "1GiB", make_vocab_size_divisible_by: int = 128):
    """(HF name, tensor) pairs of a torch_dist checkpoint, converted bucket by bucket (bounded memory), as
    `export_checkpoint` would write them; the tensors of a bucket are views valid until the next one."""
    budget = parse_size(bucket_bytes, "bucket_bytes")
    it_dir = resolve_iteration_dir(ckpt_dir, iteration)
    reader, sources, _ = prepare_sources(it_dir, config_source(hf_config).config, make_vocab_size_divisible_by)

    def same(s: CkptSource) -> torch.dtype:
        return s.dtype

    for index, group in enumerate(_groups(sources, budget, same)):
        yield from _convert(reader, group, same, index)


def vocab_padding_problems(vocab: list[tuple[str, int, int]], vocab_size: int, divisible_by: int) -> list[str]:
    """Rows beyond `vocab_size` may only be Megatron's padding: up to the next multiple of divisible_by x TP, TP
    read from the checkpoint's own sharding of the vocab-parallel tensor (`vocab`: (key, rows, TP) each). A larger
    surplus means the HF config's vocab_size is too small, and dropping those rows would silently lose real
    vocabulary."""
    problems = []
    for key, rows, tp in vocab:
        m = divisible_by * tp
        padded = (vocab_size + m - 1) // m * m
        if rows not in (vocab_size, padded):
            problems.append(f"{key} has {rows} rows (TP {tp} in the checkpoint); HF vocab_size {vocab_size} padded "
                            f"to a multiple of make_vocab_size_divisible_by {divisible_by} x TP {tp} gives {padded}: "
                            "the HF config's vocab_size does not match the checkpoint (or pass the divisor used "
                            "in training)")
    return problems


def _filtered(sources: list[CkptSource], keep) -> list[CkptSource]:
    kept = filter_outputs(keep, ((s.name, [n for n, _ in s.hf[:s.n_out]], [n for n, _ in s.hf[s.n_out:]])
                                 for s in sources))
    return [replace(s, hf=s.hf[:s.n_out] + [h for h in s.hf[s.n_out:] if h[0] in kept[s.name]])
            for s in sources if s.name in kept]


def _groups(sources: Sequence[CkptSource], budget: int, out_dtype):
    """Byte-bounded groups of sources, in checkpoint order (a source over the budget is a group alone; the pieces
    of a stacked HF tensor, e.g. gpt-oss's experts.gate_up_proj, go into one group, which may exceed it)."""
    group, size = [], 0
    for unit in stack_units(list(sources), lambda s: (s.op, tuple(n for n, _ in s.hf[:s.n_out]), s.key)):
        n = sum(align(_nbytes(shape[1:] if isinstance(s.op, Stacked) else shape, out_dtype(s)))
                for s in unit for _, shape in s.hf)
        if group and size + n > budget:
            yield group
            group, size = [], 0
        group += unit
        size += n
    if group:
        yield group


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _convert(reader: DistCheckpointReader, group: list[CkptSource], out_dtype, index: int) -> Bucket:
    # the pieces of a stacked tensor share its entry, each writing its item
    entries = pack_tight(list({name: (name, shape, out_dtype(s), s.name) for s in group for name, shape in s.hf}.values()))
    flat = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
    views = {e.name: flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape) for e in entries}
    for s in group:
        shards = []
        for shard in s.reads:
            parts = [reader.read(key, lead) for key, lead in shard]
            shards.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
        if s.merge is not None:  # W + alpha/r B A on the whole Megatron tensor (B's rows are laid out as W's)
            a, b, scale = s.merge
            w = shards[0]
            shards = [merged_whole(w, _read_whole(reader, b), _read_whole(reader, a), scale)]
        outs = [views[name] for name, _ in s.hf]
        s.op.to_hf(shards, outs[:s.n_out])  # copy_ casts when a dtype was asked for
        for out in outs[s.n_out:]:
            out.copy_(outs[0])
    return Bucket(index, flat, entries)
