"""Exceptions. Each names the parameter or setting involved and what was expected and found; lists of problems
found at once are grouped by cause and bounded (`problem_list`)."""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterable
from dataclasses import dataclass

SHOWN = 4  # names (or name patterns) shown per group of problems of one cause
GROUPS = 8  # groups (causes) shown; the rest are counted
_CAUSE_CHARS = 300  # a cause (an exception's text) is cut here
_ITEM_CHARS = 160
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class Problem:
    """One problem of a list reported at once: `item` (a tensor, a key) has `cause`, found in `file` if any.
    Problems of the same cause and file are shown as one group."""

    item: str
    cause: str
    file: str = ""


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _span(values: list[str]) -> str:
    if len(values) == 1:
        return values[0]
    ints = [int(v) for v in values]
    if all(str(i) == v for i, v in zip(ints, values)) and ints == list(range(ints[0], ints[0] + len(ints))):
        return f"{{{ints[0]}-{ints[-1]}}}"
    return "{" + ",".join(values) + "}"


def compact_names(names: Iterable[str]) -> list[str]:
    """Names that differ only in their numbers, as one pattern when they are exactly its combinations
    (`model.layers.{0-3}.mlp.experts.{0-7}.up_proj.weight` for 32 names); others as they are. In natural order."""
    groups: dict[str, list[tuple[str, ...]]] = {}
    for name in sorted(set(names), key=lambda n: (_NUMBER.sub("#", n), [int(x) for x in _NUMBER.findall(n)])):
        groups.setdefault(_NUMBER.sub("#", name), []).append(tuple(_NUMBER.findall(name)))
    out = []
    for template, numbers in groups.items():
        parts = template.split("#")
        columns = [sorted(set(c), key=int) for c in zip(*numbers)] if numbers[0] else []
        combinations = 1
        for c in columns:
            combinations *= len(c)
        rows = [list(n) for n in numbers] if combinations != len(numbers) else [[_span(c) for c in columns]]
        for row in rows:
            out.append("".join(p + (row[i] if i < len(row) else "") for i, p in enumerate(parts)))
    return out


def problem_list(problems: Iterable[Problem | str], shown: int = SHOWN, groups: int = GROUPS) -> str:
    """The problems as lines (joined by newline and two spaces, after a message's colon), grouped by cause and
    file in the order first met: `<item>: <cause> (in <file>)`, then, when others share it, `; the same for
    <item>, ... and N more` (items that differ only in numbers as one pattern, `compact_names`; at most `shown`).
    A plain string is its own group (repeats counted). At most `groups` lines, then one that counts the rest:
    one cause for 124 tensors is one bounded line."""
    order: dict[tuple[str, str | None], list[str]] = {}
    for p in problems:
        key = (p.cause, p.file) if isinstance(p, Problem) else (p, None)
        order.setdefault(key, []).append(p.item if isinstance(p, Problem) else "")
    lines = []
    for (cause, file), items in list(order.items())[:groups]:
        if file is None:  # a plain string
            lines.append(_cut(cause, _CAUSE_CHARS * 2) + (f" ({len(items)} times)" if len(items) > 1 else ""))
            continue
        names = compact_names(items)
        where = f" (in {file})" if file else ""
        line = f"{_cut(names[0], _ITEM_CHARS)}: {_cut(cause, _CAUSE_CHARS)}{where}"
        if len(names) > 1:
            line += "; the same for " + ", ".join(_cut(n, _ITEM_CHARS) for n in names[1:shown])
            if len(names) > shown:
                line += f" and {len(names) - shown} more"
        if len(items) > 1:
            line += f" ({len(items)} in all)"
        lines.append(line)
    hidden = list(order.values())[groups:]
    if hidden:
        n = sum(map(len, hidden))
        lines.append(f"... and {n} more" if n == len(hidden) else f"... and {n} more of {len(hidden)} other causes")
    return "\n  ".join(lines)


#: how an error names an option the user passes: "python" (`overwrite=True`) or "cli" (`--overwrite`); the command
#: line sets "cli" for the command it runs (cli.main), so its one-line errors name its own flags
SPELLING: contextvars.ContextVar[str] = contextvars.ContextVar("mcore2hf_option_spelling", default="python")
#: keyword arguments whose command-line flag is not their name with dashes
_FLAGS = {"max_shard_size": "--shard-size", "bucket_bytes": "--bucket-size"}


def option(name: str, value: object = True) -> str:
    """Option `name` as the user writes it: `--name value` (`--name` for True, `value` None: the flag alone) on
    the command line, `name=value` (`value` None: the name alone) in Python."""
    if SPELLING.get() == "cli":
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        return flag if value is True or value is None else f"{flag} {value}"
    return name if value is None else f"{name}={value!r}"


class Mcore2HFError(Exception):
    """Base class of every error this library raises on purpose."""


class UnknownParametersError(Mcore2HFError):
    """Megatron parameters that no rule of the converter maps, all found at once (`names`), the first few shown;
    `first`: what to say before them (e.g. which architecture they are)."""

    def __init__(self, model_type: str, names: list[str], first: str = ""):
        self.names = sorted(names)
        shown = problem_list(self.names, groups=2 * GROUPS)
        super().__init__(
            f"{first}{len(self.names)} Megatron parameter(s) have no mapping in the {model_type!r} converter:\n  {shown}"
        )


class MissingWeightsError(Mcore2HFError):
    """HF tensors that loading needs but the source does not have, all found at once (`names`), the first few
    shown."""

    def __init__(self, names: list[str], source: str):
        self.names = sorted(names)
        shown = problem_list(self.names, groups=2 * GROUPS)
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
    """The output checkpoint directory cannot be written without destroying something, or writing it failed."""


class HFDirectoryError(Mcore2HFError):
    """An HF directory that is not one, or is inconsistent or damaged: a missing or truncated file, an unreadable
    header, an index that disagrees with the files. `path` is the file (or directory) at fault, always named in
    the message; `problems` lists every one found when there were several."""

    def __init__(self, path: str, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.path = path
        self.problems = problems or [message]


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
