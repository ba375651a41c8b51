"""On-disk formats, one module each: HF directories (`hf_dir`, the one reader; `safetensors`, the streaming
writer), Megatron checkpoints (`torch_dist`, megatron-core's distributed format read and written; `legacy`,
Megatron-LM's per-rank `torch` files, read; `checkpoint_keys`, the key scheme both ways) and output directories
(`paths`). A Megatron checkpoint is opened here, whatever its format (`open_checkpoint`). Imports the plan and
transfer layers (buckets) and below; the format modules are imported when a checkpoint is opened."""

from __future__ import annotations

import os
from typing import Protocol

from ..errors import CheckpointError

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


def open_checkpoint(ckpt_dir: str | os.PathLike, iteration: int | None = None) -> CheckpointReader:
    """The reader of a Megatron checkpoint (`resolve_iteration_dir`), whatever its format: torch_dist (.metadata)
    or Megatron-LM's legacy torch (mp_rank_*). Readers give `sources(num_layers, tied, hybrid)` (canonical
    `CkptSource`s), `read(key, lead)`, `tp_of`, `check_files` and `checkpoint_bytes` (`CheckpointReader`)."""
    it_dir = resolve_iteration_dir(ckpt_dir, iteration)
    for _, recognizes, reader in _readers():
        if recognizes(it_dir):
            return reader(it_dir)
    raise CheckpointError(f"{it_dir} is not a Megatron checkpoint of a known format (torch_dist .metadata, legacy "
                          "mp_rank_*/model_optim_rng.pt)")
