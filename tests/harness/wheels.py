"""Published wheels of the systems we talk to (SGLang, vLLM), unpacked without their dependencies, so tests run
the engines' own receive code on CPU. Several versions can sit side by side: each is its own directory, put on
`sys.path` of a subprocess (never of the test process, where two versions would collide)."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MCORE2HF_WHEEL_CACHE", Path.home() / ".cache" / "mcore2hf" / "wheels"))


def unpacked_wheel(package: str, version: str, include: tuple[str, ...] = ("*",)) -> Path:
    """The directory holding `package==version`'s published wheel unpacked (files matching `include` globs),
    downloaded once from the package index with `pip download --no-deps` and cached."""
    tag = "all" if include == ("*",) else hashlib.sha1("\0".join(include).encode()).hexdigest()[:8]
    dest = cache_root() / f"{package}-{version}-{tag}"
    if (dest / ".complete").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
               f"{package}=={version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:  # e.g. a wheel tagged for another Python: ask for the GPU machines' 3.12
            r = subprocess.run(cmd[:5] + ["--python-version", "3.12"] + cmd[5:], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            raise RuntimeError(f"pip download {package}=={version} failed: {r.stderr.strip()[-800:]}")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as z:
            for member in z.namelist():
                if any(fnmatch.fnmatch(member, g) for g in include):
                    z.extract(member, partial)
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)
        (dest / ".complete").write_text(wheels[0].name + "\n")
    return dest


def bare_package(name: str, path: str) -> None:
    """Register package `name` at `path` without running its `__init__` (which imports all of a wheel we need a
    part of); its parent must be in sys.modules already."""
    import types

    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [path]
        sys.modules[name] = pkg
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, pkg)
