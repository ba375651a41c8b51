"""The code's own rules, in the suite so that README's test command (and so .ci/run) enforces them: ruff clean,
imports one way (tests/guards.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from guards import violations

ROOT = Path(__file__).resolve().parent.parent

# What the reorganisation (issue 23) still has to remove; a violation not listed here fails, and so does an entry
# that no longer occurs (shrink the list as they go).
KNOWN: set[str] = set()


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: tests/requirements.txt lists it")
    out = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_imports_point_one_way():
    found = {re.sub(r":\d+:", ":", v) for v in violations()}  # line numbers move; the file and name stay
    new = sorted(found - KNOWN)
    gone = sorted(KNOWN - found)
    assert not new, "new structure violations:\n" + "\n".join(new)
    assert not gone, "fixed, remove from KNOWN:\n" + "\n".join(gone)


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages (converters/ and model_specs/ install under mcore2hf): a package directory
    left out is missing from the wheel while an editable install still finds it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("mcore2hf", *p.parent.relative_to(ROOT / "mcore2hf").parts)) for p in
             (ROOT / "mcore2hf").rglob("__init__.py")} | {"mcore2hf.converters", "mcore2hf.model_specs"}
    assert found == listed, (sorted(found - listed), sorted(listed - found))



def test_imports_follow_the_layer_order():
    """The layer order of tests/guards.py LAYERS (architecture tables -> plan -> transfer -> formats and senders,
    entry points and front ends on top) holds for every import of the package (pure AST, no model built), and the
    check itself finds an import against it: a plan module importing the transfer layer, an entry point importing
    the facade, the facade importing a sender."""
    from guards import analyse, layer_problems, modules

    mods = modules()
    graph, _ = analyse(mods)
    assert not layer_problems(graph, mods)
    planted = {"mcore2hf.plan.export": {"mcore2hf.transfer.buckets"}, "mcore2hf.loader": {"mcore2hf.exporter"},
               "mcore2hf.exporter": {"mcore2hf.senders.sync"}}
    found = layer_problems({**graph, **{m: graph[m] | extra for m, extra in planted.items()}}, mods)
    assert [p.split(": ", 1)[1] for p in found] == [
        "entry module mcore2hf.exporter imports mcore2hf.senders.sync (senders)",
        "entry module mcore2hf.loader imports mcore2hf.exporter (entry)",
        "plan module mcore2hf.plan.export imports mcore2hf.transfer.buckets (transfer)"], found


def test_every_mcore2hf_import_resolves():
    """Every `from mcore2hf.x import y` in the package, tests, bench and examples names a module or attribute that
    exists: a module moved (issue 39) leaves no import behind that only fails when its test or benchmark runs (a
    harness worker, a GPU script)."""
    import ast
    import importlib

    broken = []
    for path in sorted(p for d in ("mcore2hf", "tests", "bench", "examples") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [(a.name, None) for a in node.names if a.name.startswith("mcore2hf")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mcore2hf"):
                found = [(node.module, a.name) for a in node.names if a.name != "*"]
            else:
                continue
            for module, name in found:
                where = f"{path.relative_to(ROOT)}:{node.lineno}: {module}{'' if name is None else '.' + name}"
                try:
                    mod = importlib.import_module(module)
                    if name is not None and not hasattr(mod, name):
                        importlib.import_module(f"{module}.{name}")
                except ImportError:
                    broken.append(where)
    assert not broken, "imports that do not resolve:\n" + "\n".join(broken)
