"""Streaming writer of an HF checkpoint directory: sharded *.safetensors, the index and config.json.

All names, shapes and dtypes are known from the plan before the first byte arrives, so every file's header is
written up front and each tensor is written at its final offset as its bucket arrives: memory stays at one
bucket (no shard is assembled in RAM), and tensors may arrive in any order. The directory is staged and moved
into place as `mcore2hf.formats.paths` does it for every output: the index and config.json last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..arch.hf_config import ConfigSource, output_config
from ..arch.lora import ADAPTER_CONFIG, ADAPTER_FILE
from ..errors import Mcore2HFError, Problem, ShapeMismatchError, problem_list
from ..layouts.geometry import nbytes
from ..sizes import parse_size
from ..transfer.buckets import Bucket
from .hf_dir import SAFETENSORS_DTYPES, HFDirectory, StoredTensor
from .paths import OutputKind, Staging, check_output_dir

log = logging.getLogger("mcore2hf")
#: the files of an HF checkpoint an earlier export (ours or another tool's) wrote: replaced by an overwrite
_HF_FILES = re.compile(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json|"
                       + re.escape(ADAPTER_FILE) + "|" + re.escape(ADAPTER_CONFIG))  # a PEFT adapter's two files


def hf_files(directory: str) -> set[str]:
    """The names of an HF checkpoint's own files in `directory`: config.json, the index, model.safetensors,
    model-NNNNN-of-NNNNN.safetensors and every *.safetensors file the index maps a tensor to. The rest (a README, the
    tokenizer of another export, notes) is not the checkpoint's."""
    names = {n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n))}
    owned = {n for n in names if _HF_FILES.fullmatch(n)}
    if "model.safetensors.index.json" in owned:
        try:
            with open(os.path.join(directory, "model.safetensors.index.json")) as f:
                mapped = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            mapped = set()  # a damaged index: its shards are still model-*.safetensors above
        owned |= {n for n in mapped if isinstance(n, str) and n.endswith(".safetensors") and n in names}
    return owned


HF_OUTPUT = OutputKind("an HF directory (no config.json, model.safetensors, model-*.safetensors, safetensors index "
                       f"or PEFT {ADAPTER_CONFIG})", hf_files,
                       last=("model.safetensors", "model.safetensors.index.json", "config.json", ADAPTER_CONFIG))

_COPY_CHUNK = 64 * 2**20  # base tensors are copied in chunks of this many bytes: memory stays bounded


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


BaseTensor = StoredTensor  # a base checkpoint's tensor, located by byte range in its file (hf_dir)


def read_base(base_dir: str | os.PathLike) -> dict[str, BaseTensor]:
    """Every tensor of an HF directory, from its validated headers only (hf_dir.HFDirectory): nothing is loaded."""
    with HFDirectory(base_dir, role="base checkpoint") as d:
        return dict(d.tensors)


def base_completion(produced: Sequence[TensorInfo], base: dict[str, BaseTensor],
                    not_held: Callable[[str], bool]) -> list[BaseTensor]:
    """The base tensors the export does not produce, each one the converter declares not held by the Megatron
    model (`not_held`: a text model's vision tower). A produced name wins over the base's (it is the trained
    value, also in another dtype); a produced tensor whose shape differs from the base's is an error, since then
    the base is not a checkpoint of this model; so is any other base tensor the export lacks (filtered out,
    an FP8 base's scales, a model that should hold it): it would silently stand in for a trained one."""
    names = {t.name: t for t in produced}
    bad = [Problem(n, f"the model gives {list(names[n].shape)}, the base has {list(b.shape)}")
           for n, b in base.items() if n in names and tuple(names[n].shape) != tuple(b.shape)]
    if bad:
        raise ShapeMismatchError(f"{len(bad)} tensor(s) of the base checkpoint conflict with the model's:\n  "
                                 + problem_list(bad))
    missing = [n for n in base if n not in names and not not_held(n)]
    if missing:
        raise Mcore2HFError(f"the base checkpoint holds {len(missing)} tensor(s) the export does not produce and "
                            f"the converter does not declare as not held by the Megatron model (expected only "
                            f"such tensors, e.g. a text model's vision tower): {sorted(missing)[:8]}")
    return [b for n, b in base.items() if n not in names]


def check_target(out_dir: str | os.PathLike, overwrite: bool, inputs: Sequence[str | os.PathLike] = ()) -> None:
    """Refuse an HF output that would destroy anything of the user's, before anything is touched
    (`paths.check_output_dir`): one that is, contains or lies inside an input (symlinks resolved), a file, a
    non-empty directory without `overwrite`, and with `overwrite` a directory without an HF checkpoint's files."""
    check_output_dir(out_dir, overwrite, HF_OUTPUT, inputs)


def check_base(base: str | os.PathLike, hf_config) -> None:
    """A base checkpoint completes an export only if its config.json (when it has one) has the export config's
    model_type and no quantization_config (its tensors are copied as stored, in the export's dtype)."""
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


def _with_base_files(extra_files: Sequence[str], base: str | os.PathLike, hf_config) -> list[str]:
    """The export's companion files, plus the base's of other names (the export's win: they come with the config
    the model was built from). The base must be one for this export (`check_base`)."""
    from ..arch.hf_config import COMPANION_FILES

    check_base(base, hf_config)
    root = os.fspath(base)
    have = {os.path.basename(p) for p in extra_files}
    return [*extra_files, *(os.path.join(root, f) for f in COMPANION_FILES
                            if f not in have and os.path.isfile(os.path.join(root, f)))]


class SafetensorsWriter:
    """Sender that writes an HF directory. `finish()` moves it into place; `abort()` removes every trace.

    `hf_config` is a `ConfigSource` (config.json written as the user's file has it), a `PretrainedConfig`
    (written as transformers writes it) or None (no config.json). `inputs` are paths the output must not overlap.
    The output is staged and moved into place by `mcore2hf.formats.paths` (an existing directory is written into, never
    replaced; with `overwrite` only an earlier checkpoint's files are replaced, the user's other files are kept
    and named in `notes`). New files and directories get the permissions the umask allows.

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
        self.stage = Staging(self.out_dir, HF_OUTPUT, overwrite)
        self.tmp = self.stage.path
        self.config = ConfigSource(hf_config) if hf_config is not None and not isinstance(hf_config, ConfigSource) \
            else hf_config
        self.quantization = quantization
        self.extra_files = list(extra_files)
        self.notes: list[str] = []
        self._handles: dict[str, object] = {}
        self._written: set[str] = set()
        try:
            self._plan_files(list(tensors), limit, [TensorInfo(b.name, b.shape, b.dtype) for b in self.base])
            for fname, infos in self.files.items():
                self._write_header(fname, infos)
        except OSError as e:  # a full disk, a file size limit: named in one line, nothing left
            self.abort()
            raise self.stage.failure(e) from e
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
            try:
                f.seek(offset)
                f.write(memoryview(data[e.start:e.start + e.nbytes]))
            except OSError as err:  # a full disk: named in one line, nothing left
                self.abort()
                raise self.stage.failure(err) from err
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

    @contextlib.contextmanager
    def _aborting(self):
        """Whatever fails inside leaves nothing behind: the staging directory is removed (an OSError named as the
        stage's failure)."""
        try:
            yield
        except OSError as e:
            self.abort()
            raise self.stage.failure(e) from e
        except BaseException:
            self.abort()
            raise

    def finish(self) -> str:
        if self.base:
            with self._aborting():
                self._copy_base()
        missing = [n for n in self.location if n not in self._written]
        if missing:
            self.abort()
            raise Mcore2HFError(f"{len(missing)} planned tensor(s) were never written, e.g. {missing[:5]}")
        with self._aborting():
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
            for path in self.extra_files:  # content only: the mode is the umask's, as for every file written
                shutil.copyfile(path, os.path.join(self.tmp, os.path.basename(path)))
        kept = self.stage.commit()
        if kept:
            note = (f"kept {len(kept)} file(s) of {self.out_dir} that are not the checkpoint's: "
                    f"{', '.join(kept[:5])}{' ...' if len(kept) > 5 else ''}")
            log.warning(note)
            self.notes.append(note)
        return self.out_dir

    def _write_config(self) -> None:
        text, notes = output_config(self.config, self.dtype, self.quantization)
        with open(os.path.join(self.tmp, "config.json"), "w") as f:
            f.write(text)
        for note in notes:
            log.warning("%s: %s", self.out_dir, note)
        self.notes += notes

    def abort(self) -> None:
        for f in self._handles.values():
            with contextlib.suppress(OSError):
                f.close()
        self.stage.abort()
