"""Streaming writer of an HF checkpoint directory: sharded *.safetensors, the index and config.json.

All names, shapes and dtypes are known from the plan before the first byte arrives, so every file's header is
written up front and each tensor is written at its final offset as its bucket arrives: memory stays at one
bucket (no shard is assembled in RAM), and tensors may arrive in any order. Files go to a temporary
directory beside the target, which replaces the target only when everything was written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..buckets import Bucket
from ..errors import Mcore2HFError, ShapeMismatchError
from ..hf_config import ConfigSource, output_config
from ..lora import ADAPTER_CONFIG, ADAPTER_FILE
from ..sizes import parse_size

log = logging.getLogger("mcore2hf")
_MARKER = ".mcore2hf-writer"  # in our temporary directories: host and pid of the writing process
HF_DIR_MARKS = ("config.json", "model.safetensors.index.json", "model.safetensors", ADAPTER_CONFIG)

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


_COPY_CHUNK = 64 * 2**20  # base tensors are copied in chunks of this many bytes: memory stays bounded
_TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class BaseTensor:
    """A tensor of a base checkpoint, located by byte range in its file (read straight from the header)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    path: str
    offset: int  # absolute byte offset in `path`
    nbytes: int


def read_base(base_dir: str | os.PathLike) -> dict[str, BaseTensor]:
    """Every tensor of an HF directory (sharded with model.safetensors.index.json, or model.safetensors), from
    the safetensors headers only (the format: 8-byte little-endian header length, JSON header, data; safetensors
    0.8 `safetensors/src/tensor.rs`): nothing is loaded."""
    root = os.fspath(base_dir)
    if not os.path.isdir(root):
        raise Mcore2HFError(f"base checkpoint {root} is not a directory")
    index = os.path.join(root, "model.safetensors.index.json")
    weight_map = None  # the index is authoritative: a name in two files is read from the file it names
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(root, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise Mcore2HFError(f"base checkpoint {root} has neither model.safetensors.index.json nor model.safetensors")
    out: dict[str, BaseTensor] = {}
    for fname in files:
        path = os.path.join(root, fname)
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise Mcore2HFError(f"base checkpoint file {path} is not a readable safetensors file: {e}") from e
        for name, h in header.items():
            if name == "__metadata__" or (weight_map is not None and weight_map.get(name) != fname):
                continue
            if h["dtype"] not in _TORCH_DTYPES:
                raise Mcore2HFError(f"base tensor {name} in {path} has dtype {h['dtype']}, expected one of "
                                    f"{sorted(_TORCH_DTYPES)}")
            begin, end = h["data_offsets"]
            out[name] = BaseTensor(name, tuple(h["shape"]), _TORCH_DTYPES[h["dtype"]], path, 8 + n + begin,
                                   end - begin)
    return out


def base_completion(produced: Sequence[TensorInfo], base: dict[str, BaseTensor],
                    not_held: Callable[[str], bool]) -> list[BaseTensor]:
    """The base tensors the export does not produce, each one the converter declares not held by the Megatron
    model (`not_held`: a text model's vision tower). A produced name wins over the base's (it is the trained
    value, also in another dtype); a produced tensor whose shape differs from the base's is an error, since then
    the base is not a checkpoint of this model; so is any other base tensor the export lacks (filtered out,
    an FP8 base's scales, a model that should hold it): it would silently stand in for a trained one."""
    names = {t.name: t for t in produced}
    bad = [f"{n}: the model gives {list(names[n].shape)}, the base has {list(b.shape)}"
           for n, b in base.items() if n in names and tuple(names[n].shape) != tuple(b.shape)]
    if bad:
        raise ShapeMismatchError(f"{len(bad)} tensor(s) of the base checkpoint conflict with the model's:\n  "
                                 + "\n  ".join(bad[:50]))
    missing = [n for n in base if n not in names and not not_held(n)]
    if missing:
        raise Mcore2HFError(f"the base checkpoint holds {len(missing)} tensor(s) the export does not produce and "
                            f"the converter does not declare as not held by the Megatron model (expected only "
                            f"such tensors, e.g. a text model's vision tower): {sorted(missing)[:8]}")
    return [b for n, b in base.items() if n not in names]


def _overlap(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)


def check_target(out_dir: str | os.PathLike, overwrite: bool, inputs: Sequence[str | os.PathLike] = ()) -> None:
    """Refuse an output that would destroy anything of the user's, before anything is touched: one that is,
    contains or lies inside an input (symlinks resolved), a file, a non-empty directory without `overwrite`,
    and with `overwrite` a directory that is not an HF directory (no config.json or safetensors index)."""
    out = os.fspath(out_dir)
    for inp in inputs:
        if inp is not None and _overlap(out, os.fspath(inp)):
            raise Mcore2HFError(f"output directory {out} overlaps the input {os.fspath(inp)} "
                                f"({os.path.realpath(out)} vs {os.path.realpath(inp)}): choose another output")
    if os.path.isfile(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise Mcore2HFError(f"output path {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise Mcore2HFError(f"output directory {out} exists and is not empty (pass overwrite=True / --overwrite)")
        if not any(os.path.isfile(os.path.join(out, f)) for f in HF_DIR_MARKS):
            raise Mcore2HFError(f"output directory {out} is not empty and not an HF directory (none of "
                                f"{', '.join(HF_DIR_MARKS)}): refusing to replace it, even with overwrite")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_temp_dirs(out_dir: str) -> list[str]:
    """Remove temporary directories an earlier writer of `out_dir` left when it was killed: only ours (marked),
    only from this host, only when their process is gone."""
    parent, base = os.path.dirname(out_dir), os.path.basename(out_dir)
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        if not name.startswith(f".{base}.tmp-") or not os.path.isfile(os.path.join(path, _MARKER)):
            continue
        try:
            with open(os.path.join(path, _MARKER)) as f:
                host, pid = f.read().split()
            if host != socket.gethostname():
                continue
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d stale temporary director%s of killed exports: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


def _with_base_files(extra_files: Sequence[str], base: str | os.PathLike, hf_config) -> list[str]:
    """The export's companion files, plus the base's of other names (the export's win: they come with the config
    the model was built from). The base's config.json must have the export config's model_type."""
    from ..hf_config import COMPANION_FILES

    root = os.fspath(base)
    base_config = os.path.join(root, "config.json")
    if hf_config is not None and os.path.isfile(base_config):
        with open(base_config) as f:
            base_type = json.load(f).get("model_type")
        if isinstance(hf_config, ConfigSource):  # the type as the user's file spells it (aliases included)
            ours = (hf_config.raw or {}).get("model_type") or hf_config.config.model_type
        else:
            ours = getattr(hf_config, "model_type", None)
        if base_type != ours:
            raise Mcore2HFError(f"base checkpoint {root} is a {base_type!r} checkpoint, the export is {ours!r}")
    if os.path.isfile(base_config):
        with open(base_config) as f:
            if json.load(f).get("quantization_config") is not None:  # its weights are not this export's dtype
                raise Mcore2HFError(f"base checkpoint {root} is quantized (config.json has a quantization_config):"
                                    " complete the output from an unquantized checkpoint")
    have = {os.path.basename(p) for p in extra_files}
    return [*extra_files, *(os.path.join(root, f) for f in COMPANION_FILES
                            if f not in have and os.path.isfile(os.path.join(root, f)))]


class SafetensorsWriter:
    """Sender that writes an HF directory. `finish()` moves it into place; `abort()` removes every trace.

    `hf_config` is a `ConfigSource` (config.json written as the user's file has it), a `PretrainedConfig`
    (written as transformers writes it) or None (no config.json). `inputs` are paths the output must not overlap.
    The directory gets the permissions the umask allows, as any directory the user creates.

    `base` (an HF directory) completes the output: every base tensor the export does not produce, which must be
    one the converter declares not held (`not_held`: a vision tower the Megatron model lacks), is copied byte for byte, in bounded chunks, into the output's shards and
    index, and the base's companion files (tokenizer, preprocessor, chat template...) are copied where the
    export brings none of that name. config.json stays the export's (the config the model was checked
    against), which must have the base's model_type."""

    def __init__(self, out_dir: str | os.PathLike, tensors: Sequence[TensorInfo], hf_config=None, *,
                 max_shard_size: int | str = "5GB", overwrite: bool = False, extra_files: Sequence[str] = (),
                 inputs: Sequence[str | os.PathLike] = (), quantization: dict | None = None,
                 base: str | os.PathLike | None = None, not_held: Callable[[str], bool] = lambda name: False,
                 adapter_config: dict | None = None):
        limit = parse_size(max_shard_size, "max_shard_size")  # before anything is created
        #: a PEFT adapter directory (peft 0.21.2 PeftModel.save_pretrained's layout: adapter_config.json and one
        #: adapter_model.safetensors, no index; PeftModel.from_pretrained reads exactly these two)
        self.adapter_config = adapter_config
        if adapter_config is not None and (base is not None or quantization is not None or hf_config is not None):
            raise Mcore2HFError("a PEFT adapter directory has no config.json, base completion or quantization")
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        self.base: list[BaseTensor] = []
        if base is not None:
            if quantization is not None:  # the base's tensors would be missing from modules_to_not_convert
                raise Mcore2HFError("a quantized export cannot be completed from a base checkpoint: export "
                                    "without quantize, or without base")
            inputs = [*inputs, base]
            extra_files = _with_base_files(extra_files, base, hf_config)  # first: is it this model's checkpoint
            self.base = base_completion(tensors, read_base(base), not_held)
        check_target(self.out_dir, overwrite, inputs)
        parent = os.path.dirname(self.out_dir)
        os.makedirs(parent, exist_ok=True)
        remove_stale_temp_dirs(self.out_dir)
        self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out_dir)}.tmp-", dir=parent)
        self.overwrite = overwrite
        self.config = ConfigSource(hf_config) if hf_config is not None and not isinstance(hf_config, ConfigSource) \
            else hf_config
        self.quantization = quantization
        self.extra_files = list(extra_files)
        self.notes: list[str] = []
        self._handles: dict[str, object] = {}
        self._written: set[str] = set()
        try:
            os.chmod(self.tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700: a server of another user could not read it
            with open(os.path.join(self.tmp, _MARKER), "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}\n")
            self._plan_files(list(tensors), limit, [TensorInfo(b.name, b.shape, b.dtype) for b in self.base])
            for fname, infos in self.files.items():
                self._write_header(fname, infos)
        except BaseException:
            self.abort()
            raise

    def _plan_files(self, tensors: list[TensorInfo], limit: int, base: Sequence[TensorInfo] = ()) -> None:
        groups: list[list[TensorInfo]] = [[]]
        size = 0
        for t in [*tensors, *base]:  # base tensors after the model's: the config's dtype is the model's
            if groups[-1] and size + t.nbytes > limit:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += t.nbytes
        if self.adapter_config is not None:
            groups = [[t for g in groups for t in g]]
        n = len(groups)
        self.files: dict[str, list[TensorInfo]] = {}
        self.location: dict[str, tuple[str, int, int]] = {}  # name -> (file, absolute offset, nbytes)
        self.total_size = 0
        for i, infos in enumerate(groups):
            self.files[f"model-{i + 1:05d}-of-{n:05d}.safetensors"] = infos
        if self.adapter_config is not None:
            self.files = {ADAPTER_FILE: groups[0]}
        # the model's dtype is that of most bytes; in a quantized export, that of the unquantized tensors (published
        # FP8 checkpoints say bfloat16): fp8 weights and their scales do not count
        counted = [t for t in tensors if self.quantization is None
                   or (t.dtype != torch.float8_e4m3fn and not t.name.endswith("_scale_inv"))] or tensors
        self.dtype = max(((sum(t.nbytes for t in counted if t.dtype == d), d) for d in {t.dtype for t in counted}),
                         default=(0, torch.float32), key=lambda x: x[0])[1]

    def _write_header(self, fname: str, infos: list[TensorInfo]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        off = 0
        for t in infos:
            header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [off, off + t.nbytes]}
            off += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        data_start = 8 + len(raw)
        path = os.path.join(self.tmp, fname)
        f = open(path, "wb")  # noqa: SIM115 - kept open for the streamed writes
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(data_start + off)
        self._handles[fname] = f
        for t in infos:
            start = header[t.name]["data_offsets"][0]
            self.location[t.name] = (fname, data_start + start, t.nbytes)
        self.total_size += off

    def send(self, bucket: Bucket) -> None:
        if not len(bucket):
            return
        flat = bucket.flat
        host = flat if flat.device.type == "cpu" else flat.to("cpu")  # one device-to-host copy per bucket
        data = host.numpy()
        for e in bucket.entries:
            if e.name not in self.location:
                raise Mcore2HFError(f"bucket tensor {e.name} is not in the planned checkpoint")
            fname, offset, nbytes = self.location[e.name]
            if nbytes != e.nbytes:
                raise Mcore2HFError(f"{e.name}: planned {nbytes} bytes, bucket has {e.nbytes}")
            f = self._handles[fname]
            f.seek(offset)
            f.write(memoryview(data[e.start:e.start + e.nbytes]))
            self._written.add(e.name)

    def _copy_base(self) -> None:
        """Each base tensor's bytes, copied in chunks of at most _COPY_CHUNK: one chunk in memory at a time."""
        sources: dict[str, object] = {}
        try:
            for b in self.base:
                fname, offset, nbytes = self.location[b.name]
                src = sources.get(b.path)
                if src is None:
                    src = sources[b.path] = open(b.path, "rb")  # noqa: SIM115 - closed below
                dst = self._handles[fname]
                src.seek(b.offset)
                dst.seek(offset)
                left = nbytes
                while left:
                    chunk = src.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise Mcore2HFError(f"base tensor {b.name}: {b.path} ends {left} bytes early")
                    dst.write(chunk)
                    left -= len(chunk)
                self._written.add(b.name)
        finally:
            for f in sources.values():
                f.close()

    def finish(self) -> str:
        if self.base:
            try:
                self._copy_base()
            except BaseException:
                self.abort()
                raise
        missing = [n for n in self.location if n not in self._written]
        if missing:
            self.abort()
            raise Mcore2HFError(f"{len(missing)} planned tensor(s) were never written, e.g. {missing[:5]}")
        try:
            for f in self._handles.values():
                f.close()
            weight_map = {name: loc[0] for name, loc in sorted(self.location.items())}
            if self.adapter_config is not None:
                with open(os.path.join(self.tmp, ADAPTER_CONFIG), "w") as f:
                    json.dump(self.adapter_config, f, indent=2)
            else:
                with open(os.path.join(self.tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {"total_size": self.total_size}, "weight_map": weight_map}, f, indent=2)
            if self.config is not None:
                self._write_config()
            for path in self.extra_files:
                shutil.copy2(path, os.path.join(self.tmp, os.path.basename(path)))
            self._move_into_place()
        except BaseException:
            self.abort()
            raise
        return self.out_dir

    def _write_config(self) -> None:
        text, notes = output_config(self.config, self.dtype, self.quantization)
        with open(os.path.join(self.tmp, "config.json"), "w") as f:
            f.write(text)
        for note in notes:
            log.warning("%s: %s", self.out_dir, note)
        self.notes += notes

    def _move_into_place(self) -> None:
        os.remove(os.path.join(self.tmp, _MARKER))
        check_target(self.out_dir, self.overwrite)  # nothing appeared there meanwhile that we would replace
        old = None
        if os.path.exists(self.out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out_dir)}.old-", dir=os.path.dirname(self.out_dir))
            os.rmdir(old)
            os.rename(self.out_dir, old)
        os.rename(self.tmp, self.out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        for f in self._handles.values():
            with contextlib.suppress(OSError):
                f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
