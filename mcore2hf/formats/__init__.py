"""On-disk formats, one module each: HF directories (`hf_dir`, the one reader; `safetensors`, the streaming
writer), Megatron checkpoints (`torch_dist`, megatron-core's distributed format read and written; `legacy`,
Megatron-LM's per-rank `torch` files, read; `checkpoint_keys`, the key scheme both ways) and output directories
(`paths`). A Megatron checkpoint is opened here, whatever its format (`open_checkpoint`; an HF directory too, read
as the Megatron tensors the import writes from it, `hf_as_megatron`), and several are read as one
(`CombinedReader`). Imports the plan and transfer layers (buckets) and below; the format modules are imported when
a checkpoint is opened."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from ..errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from .checkpoint_keys import CkptSource

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's: the iteration a checkpoint directory's readers load


class CheckpointReader(Protocol):
    """What every Megatron checkpoint reader gives (`torch_dist.DistCheckpointReader`, `legacy.LegacyCheckpointReader`):
    the model tensors as canonical `CkptSource`s (checkpoint_keys) and their bytes, key by key."""

    path: str
    tensors: dict

    def sources(self, num_layers: int, tied: bool, hybrid=None) -> tuple[list, list[str]]: ...

    def read(self, key: str, lead: tuple[int, ...] = ()): ...

    def tp_of(self, source) -> int: ...

    def check_files(self, keys) -> None: ...

    def checkpoint_bytes(self) -> int: ...


def _readers():
    """(format, recognizes(iteration directory), reader class), in the order they are tried."""
    from .legacy import LegacyCheckpointReader, is_legacy_dir
    from .torch_dist import DistCheckpointReader

    return (("torch_dist", lambda d: os.path.isfile(os.path.join(d, ".metadata")), DistCheckpointReader),
            ("legacy torch", is_legacy_dir, LegacyCheckpointReader))


def resolve_iteration_dir(ckpt_dir: str | os.PathLike, iteration: int | None = None) -> str:
    """The iter_NNNNNNN directory to read: `iteration`, else the tracker file's, else ckpt_dir itself when it is
    an iteration directory of a known format."""
    root = os.fspath(ckpt_dir)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root} is not a directory")
    if iteration is not None:
        path = os.path.join(root, f"iter_{iteration:07d}")
        if not os.path.isdir(path):
            have = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
            raise CheckpointError(f"iteration {iteration} not found in {root} (expected {path}); present: {have}")
        return path
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            raise CheckpointError(f"{tracker} names iteration {text!r}, but {path} does not exist")
        return path
    if any(recognizes(root) for _, recognizes, _ in _readers()):
        return root
    raise CheckpointError(f"{root} is not a Megatron checkpoint: no {TRACKER}, no iter_* directory given, no "
                          ".metadata, no mp_rank_*/model_optim_rng.pt")


def is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    """A checkpoint directory (with its tracker file) or an iteration directory of a known format."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, TRACKER)) or any(recognizes(path) for _, recognizes, _ in _readers())


def open_checkpoint(ckpt_dir: str | os.PathLike, iteration: int | None = None, *,
                    hf_config=None) -> CheckpointReader:
    """The reader of a Megatron checkpoint (`resolve_iteration_dir`), whatever its format: torch_dist (.metadata)
    or Megatron-LM's legacy torch (mp_rank_*). Readers give `sources(num_layers, tied, hybrid)` (canonical
    `CkptSource`s), `read(key, lead)`, `tp_of`, `check_files` and `checkpoint_bytes` (`CheckpointReader`).
    With `hf_config` (a PretrainedConfig) a path that is no Megatron checkpoint opens as an HF directory of that
    model, read as the Megatron tensors the import would write from it (`hf_as_megatron.HFBaseReader`: the base
    weights of an adapter-only checkpoint)."""
    if hf_config is not None and not is_megatron_checkpoint(ckpt_dir):
        from .hf_as_megatron import HFBaseReader

        return HFBaseReader(ckpt_dir, hf_config)
    it_dir = resolve_iteration_dir(ckpt_dir, iteration)
    for _, recognizes, reader in _readers():
        if recognizes(it_dir):
            return reader(it_dir)
    raise CheckpointError(f"{it_dir} is not a Megatron checkpoint of a known format (torch_dist .metadata, legacy "
                          "mp_rank_*/model_optim_rng.pt)")


class CombinedReader:
    """Several checkpoints read as one (`CheckpointReader`): an adapter-only checkpoint and the base weights it
    was trained on (a Megatron checkpoint's reader, or an HF directory's, `open_checkpoint(..., hf_config=...)`).
    Their sources together; each key read from the reader holding it (no key may be in two)."""

    def __init__(self, readers: list[CheckpointReader]):
        self.readers, self.path = readers, readers[0].path
        self.tensors: dict = {}
        self._owner: dict[str, CheckpointReader] = {}
        for r in readers:
            twice = sorted(set(r.tensors) & set(self.tensors))
            if twice:
                raise CheckpointError(f"{r.path} and {self._owner[twice[0]].path} both hold {twice[:3]}: not an "
                                      "adapter-only checkpoint and its base")
            self.tensors.update(r.tensors)
            self._owner.update(dict.fromkeys(r.tensors, r))

    def sources(self, num_layers: int, tied: bool, hybrid=None) -> tuple[list[CkptSource], list[str]]:
        found, ignored = [], []
        for r in self.readers:
            s, i = r.sources(num_layers, tied, hybrid)
            found += s
            ignored += i
        return found, ignored

    def read(self, key: str, lead: tuple[int, ...] = ()) -> torch.Tensor:
        return self._owner[key].read(key, lead)

    def check_files(self, keys) -> None:
        keys = set(keys)
        for r in self.readers:
            r.check_files({k for k in keys if self._owner.get(k) is r})

    def tp_of(self, source: CkptSource) -> int:
        return self._owner[source.key].tp_of(source)

    def checkpoint_bytes(self) -> int:
        return sum(r.checkpoint_bytes() for r in self.readers)
