"""Exceptions. Each names the parameter or setting involved and what was expected and found."""

from __future__ import annotations


class Mcore2HFError(Exception):
    """Base class of every error this library raises on purpose."""


class UnknownParametersError(Mcore2HFError):
    """Megatron parameters that no rule of the converter maps, all listed at once."""

    def __init__(self, model_type: str, names: list[str]):
        self.names = sorted(names)
        shown = "\n  ".join(self.names)
        super().__init__(
            f"{len(self.names)} Megatron parameter(s) have no mapping in the {model_type!r} converter:\n  {shown}"
        )


class MissingWeightsError(Mcore2HFError):
    """HF tensors that loading needs but the source does not have, all listed at once."""

    def __init__(self, names: list[str], source: str):
        self.names = sorted(names)
        shown = "\n  ".join(self.names)
        super().__init__(f"{len(self.names)} HF tensor(s) missing from {source}:\n  {shown}")


class ConfigMismatchError(Mcore2HFError):
    """The HF config disagrees with the Megatron model (heads, groups, experts, vocab, layers...)."""


class ShapeMismatchError(Mcore2HFError):
    """A tensor's shape differs from what the config and the layout imply."""


class LayoutError(Mcore2HFError):
    """A parameter is sharded in a way this library does not convert (e.g. an unexpected stride)."""


class ParallelStateError(Mcore2HFError):
    """Megatron's parallel state is not initialized, or disagrees with the model."""


class UnsupportedArchitectureError(Mcore2HFError):
    """No converter is registered for the HF model_type."""


class UsageError(Mcore2HFError):
    """An argument or option that cannot work (e.g. a layout the model does not divide into)."""


class LegacyFormatError(LayoutError):
    """A legacy checkpoint this library cannot read: a disallowed global, missing ranks, an unknown layout."""


class OutputError(Mcore2HFError):
    """An output directory or file cannot be written without destroying something of the user's, or writing it
    failed (a full disk...): the message names the path, and what was left as it was."""


class ImportTargetError(OutputError):
    """The output checkpoint directory cannot be written without destroying something."""


class CheckpointError(Mcore2HFError):
    """Not a Megatron checkpoint, a missing iteration, or a truncated / corrupt file."""


class EngineShardError(Mcore2HFError):
    """An HF tensor or engine placement the engine sharding rules do not cover (or cannot be right)."""


class EngineError(Mcore2HFError):
    """An inference engine answered an error, timed out, or disappeared during a weight update."""


class UnsupportedEngine(EngineError):
    """The engine's release or configuration cannot take our updates (found before any byte moves)."""


class HTTPStatusError(EngineError):
    """An engine's HTTP route answered an error status (`status`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class WorldError(RuntimeError):
    """A rank of a gloo worker world (mcore2hf.runtime.world) failed, died or hung: not a user error."""
