"""Output directories and files: the one way mcore2hf writes what the user asked for (an HF directory, a Megatron
iteration directory, the checkpoint tracker file) without losing anything of the user's.

* A target that does not exist is written in a hidden sibling, `<parent>/.<name>.mcore2hf-tmp-<pid>-<random>/`,
  renamed into place when complete (atomic).
* An existing target directory (empty, or with overwrite one of the output's kind) is never renamed, replaced or
  re-created: it may be a mount point (renaming it gives EBUSY) or sit in a directory the user cannot write
  (EACCES), and its inode, mode, setgid bit, group and ACLs are the user's. The files are written in a hidden
  directory inside it, `<target>/.mcore2hf-tmp-<pid>-<random>/`, then moved in with rename(2) (same file system).
  The files that say a directory is complete (`OutputKind.last`: the safetensors index and config.json; the
  torch_dist `.metadata`) are removed first and moved in last, so a reader never finds a complete-looking mix of
  old and new. The files a previous output of that kind wrote (`OutputKind.owned`) are replaced or removed; every
  other file is the user's and is kept (and named in a note).
* Each staging directory holds a marker file that the writing process keeps locked (flock; the kernel releases the
  lock when the process dies, also on SIGKILL). A staging directory whose marker is no longer locked was left by a
  killed run: the next run on that target removes it and says so in one line (the `mcore2hf.paths` logger, which
  the CLI prints on stderr); one still locked belongs to a running process and is an error that names it.
* Directories and files are created with the mode the umask gives (and in a setgid directory its group), as
  `mkdir` and `open` create them.
* An OSError while writing (a full disk, a file size limit, a permission) becomes an `OutputError` in one line
  that names the target; the staging directory is removed, so the target is as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import OutputError, option

log = logging.getLogger("mcore2hf.paths")
#: set by a front end's SIGINT handler (mcore2hf.cli): an interrupt that code swallowed on its way (a
#: KeyboardInterrupt raised inside a __del__ is only printed) still keeps the output from being committed
interrupt_requested = threading.Event()
TMP_TAG = ".mcore2hf-tmp-"  # in the names of our staging directories and files: <prefix>.mcore2hf-tmp-<pid>-<hex>
MARKER = ".mcore2hf-staging"  # in each staging directory: "<host> <pid>", flock-ed by the writing process


@dataclass(frozen=True)
class OutputKind:
    """What an output directory holds. `owned(dir)`: the names of the files an earlier output of this kind wrote
    there (replaced or removed by an overwrite; any other file is the user's and kept). `last`: the files that
    say the directory is complete, removed before and moved in after every other file, in this order."""

    what: str
    owned: Callable[[str], set[str]]
    last: tuple[str, ...] = ()
    error: type[OutputError] = OutputError


def overlaps(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether one path is, contains or lies inside the other (symlinks resolved)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)


def is_temp(name: str) -> bool:
    """Whether a directory entry is named as our staging directories and files are."""
    return name.startswith(".") and TMP_TAG in name


def user_entries(directory: str) -> list[str]:
    """The entries of a directory, without our staging directories and files."""
    return sorted(n for n in os.listdir(directory) if not is_temp(n))


def check_output_dir(target: str | os.PathLike, overwrite: bool, kind: OutputKind,
                     inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Refuse, before anything is written, an output that would destroy anything of the user's: one that is,
    contains or lies inside an input, a file, a non-empty directory without `overwrite`, and with `overwrite` a
    directory holding nothing of `kind`. Staging directories killed runs left for it are removed first."""
    out = os.path.abspath(os.fspath(target))
    for inp in inputs:
        if inp is not None and overlaps(out, inp):
            raise kind.error(f"output directory {out} overlaps the input {os.fspath(inp)} ({os.path.realpath(out)} "
                             f"vs {os.path.realpath(inp)}): choose another output")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise kind.error(f"output path {out} exists and is not a directory")
    remove_stale(out, kind)
    _check_entries(out, overwrite, kind)


def _check_entries(out: str, overwrite: bool, kind: OutputKind) -> None:
    if not os.path.isdir(out) or not user_entries(out):
        return
    if not overwrite:
        raise kind.error(f"output directory {out} exists and is not empty (pass {option('overwrite')})")
    if not kind.owned(out):
        raise kind.error(f"output directory {out} is not empty and not {kind.what}: refusing to write into it, "
                         "even with overwrite")


def _pid_of(name: str) -> int | None:
    try:
        return int(name.rsplit(TMP_TAG, 1)[1].split("-")[0])
    except (IndexError, ValueError):
        return None


def _holder(path: str) -> str | None:
    """Who holds the staging entry `path`: None when nobody (its writer was killed), else a description. Raises
    FileNotFoundError for a directory without our marker (not ours, or one being created right now)."""
    lock = os.path.join(path, MARKER) if os.path.isdir(path) and not os.path.islink(path) else path
    fd = os.open(lock, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"process {_pid_of(os.path.basename(path))}"
        except OSError:  # no locks on this file system: the pid, on this host
            try:
                with open(lock) as f:
                    host, pid = f.read().split()
                if host == socket.gethostname():
                    os.kill(int(pid), 0)
                return f"process {pid} on {host}"
            except ProcessLookupError:
                return None
            except (OSError, ValueError):
                return "an unknown process"
        return None
    finally:
        os.close(fd)  # closing releases the lock taken above


def _abandoned(path: str) -> bool:
    """A staging directory of ours killed between its mkdir and its marker: named with our tag and a pid that is
    not running here, holding nothing but the unfinished marker, and older than a minute (a run on another host
    sharing this file system creates its marker within microseconds)."""
    pid = _pid_of(os.path.basename(path))
    if pid is None or not os.path.isdir(path) or os.path.islink(path):
        return False
    if set(_listdir(path)) - {MARKER + ".new"}:
        return False
    try:
        if time.time() - os.stat(path).st_mtime < 60:
            return False
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True
    except OSError:
        return False


def remove_stale(target: str | os.PathLike, kind: OutputKind | None = None) -> list[str]:
    """Remove the staging directories and files that runs writing `target` left when they were killed (ours:
    named so and marked; no longer locked). One still held by a running process is an error that names it."""
    out = os.path.abspath(os.fspath(target))
    parent, base = os.path.dirname(out), os.path.basename(out)
    found = [os.path.join(parent, n) for n in _listdir(parent) if n.startswith(f".{base}{TMP_TAG}")]
    if os.path.isdir(out):
        found += [os.path.join(out, n) for n in _listdir(out) if n.startswith(TMP_TAG)]
    removed = []
    error = kind.error if kind is not None else OutputError
    for path in found:
        try:
            holder = _holder(path)
        except FileNotFoundError:
            if not _abandoned(path):
                continue  # no marker: not ours, or being created this instant
            holder = None
        if holder is not None:
            raise error(f"{path} is in use by {holder}, which is writing {out}: wait for it to finish, or remove "
                        f"{path} if that process is not an mcore2hf run")
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError as e:
            raise error(f"cannot remove {path}, left by an earlier run on {out} that was killed: {e}") from e
        log.warning("removed %s, left by an earlier run that was killed", path)
        removed.append(path)
    return removed


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _new_name(directory: str, prefix: str) -> str:
    return os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(4)}")


class Staging:
    """Where an output directory is written before it is moved into place (see the module docstring): `path`,
    then `commit()` or `abort()`. `failure(e)` turns an OSError met while writing into the one-line error."""

    def __init__(self, target: str | os.PathLike, kind: OutputKind, overwrite: bool = False):
        self.target = os.path.abspath(os.fspath(target))
        self.kind, self.overwrite = kind, overwrite
        self.in_place = os.path.isdir(self.target)
        self.kept: list[str] = []
        self._fd: int | None = None
        where = self.target if self.in_place else os.path.dirname(self.target)
        prefix = TMP_TAG if self.in_place else f".{os.path.basename(self.target)}{TMP_TAG}"
        try:
            os.makedirs(where, exist_ok=True)
            while True:
                self.path = _new_name(where, prefix)
                try:
                    os.mkdir(self.path, 0o777)  # the umask applies; a setgid parent passes its group on
                    break
                except FileExistsError:
                    continue
        except OSError as e:
            raise kind.error(f"cannot write {self.target}: cannot create a directory in {where}: {e}") from e
        try:
            new = os.path.join(self.path, MARKER + ".new")
            self._fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with contextlib.suppress(OSError):  # no locks here: the marker's pid and host stand in
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            os.rename(new, os.path.join(self.path, MARKER))  # locked before it has the name other runs look for
        except OSError as e:
            self.abort()
            raise self.failure(e) from e

    def failure(self, e: OSError) -> OutputError:
        """The error for an OSError met while writing: it names the target, and says nothing of it was kept."""
        kept = f"{self.target} is as it was" if self.in_place else f"{self.target} was not created"
        return self.kind.error(f"cannot write {self.target}: {e}; nothing of this run was kept ({kept})")

    def commit(self) -> list[str]:
        """Move the written files into place; returns the user's files found in the target and kept there."""
        if interrupt_requested.is_set():
            self.abort()
            raise KeyboardInterrupt
        try:
            if self.in_place:
                self._move_in()
            else:
                self._rename_in()
        finally:
            self.abort()  # whatever is left of the staging directory
        return self.kept

    def _unlock(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.path, MARKER))
            os.close(self._fd)
            self._fd = None

    def _rename_in(self) -> None:
        if os.path.lexists(self.target) and (not os.path.isdir(self.target) or os.listdir(self.target)):
            raise self.kind.error(f"{self.target} appeared while it was being written: nothing of this run was kept")
        self._unlock()
        try:
            os.rename(self.path, self.target)  # over an empty directory that appeared meanwhile, too (rename(2))
        except OSError as e:
            raise self.failure(e) from e

    def _move_in(self) -> None:
        _check_entries(self.target, self.overwrite, self.kind)  # nothing appeared meanwhile that would be lost
        names = sorted(n for n in os.listdir(self.path) if n not in (MARKER, MARKER + ".new"))
        for n in names:
            dst = os.path.join(self.target, n)
            if os.path.isdir(dst) and not os.path.islink(dst):
                raise self.kind.error(f"{dst} is a directory, where this output writes a file: nothing of this "
                                      f"run was kept ({self.target} is as it was)")
        owned = self.kind.owned(self.target) if self.overwrite else set()
        existing = set(user_entries(self.target))
        replaced = owned | (existing & set(names))
        self.kept = sorted(existing - replaced)
        last = list(self.kind.last)
        moved = 0
        try:
            for n in last:  # first, the files that say the directory is complete
                if n in replaced:
                    os.remove(os.path.join(self.target, n))
            for n in names:
                if n not in last:
                    os.replace(os.path.join(self.path, n), os.path.join(self.target, n))
                    moved += 1
            for n in sorted(replaced - set(names) - set(last)):  # an earlier output's files this one does not have
                os.remove(os.path.join(self.target, n))
            for n in last:
                if n in names:
                    os.replace(os.path.join(self.path, n), os.path.join(self.target, n))
        except OSError as e:
            if not moved and not (replaced & set(last)):
                raise self.failure(e) from e
            raise self.kind.error(f"moving the written files into {self.target} failed: {e}; it now holds an "
                                  f"incomplete output (none of {', '.join(last)}): write it again") from e

    def abort(self) -> None:
        """Remove the staging directory and everything in it (idempotent)."""
        self._unlock()
        shutil.rmtree(self.path, ignore_errors=True)


def replace_file(path: str | os.PathLike, data: bytes, kind: OutputKind | None = None) -> None:
    """Write a small file whole, in place of any earlier one (rename(2) over it): a reader sees the old or the
    new content. Its staging file is named and locked as staging directories are, so a killed run's is removed."""
    path = os.path.abspath(os.fspath(path))
    error = kind.error if kind is not None else OutputError
    tmp = _new_name(os.path.dirname(path), f".{os.path.basename(path)}{TMP_TAG}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise error(f"cannot write {path}: {e}") from e
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, data)
        os.fsync(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise error(f"cannot write {path}: {e}; it is as it was") from e
    finally:
        os.close(fd)
