"""Structure guards that .ci/run runs (and tests/test_guards.py): imports point one way.

1. No import cycle between mcore2hf's modules (converters/ and model_specs/ included, under the names they install
   as), counting imports at any depth, function-level ones too: a lazy import that hides a cycle still is one.
2. No module imports another module's private names (`from .x import _y`, `x._y` on an imported module) or reads
   a private attribute (`obj._y`) that only another of our modules defines.
3. Imports follow the layer order (`LAYERS`, lowest first): a module imports only modules of its own layer or of
   lower ones, at any depth; the entry points (one layer) do not import one another, so the facade `exporter.py`
   is no library of the others, and the layers listed in `APART` do not import each other at all.

    python tests/guards.py      # prints each violation; exit 1 if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"mcore2hf": ROOT / "mcore2hf", "mcore2hf.converters": ROOT / "converters",
                "mcore2hf.model_specs": ROOT / "model_specs"}


#: the layers, lowest first: (name, module prefixes). A module belongs to the layer of its longest matching prefix.
#: Architecture tables -> plan -> transfer -> formats and senders; the entry points and front ends on top.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("mcore2hf.errors", "mcore2hf.sizes", "mcore2hf.dtypes", "mcore2hf.parallel", "mcore2hf.collective")),
    ("layouts", ("mcore2hf.layouts",)),
    ("quantize", ("mcore2hf.quantize",)),
    ("arch", ("mcore2hf.arch", "mcore2hf.converters", "mcore2hf.model_specs")),
    ("plan", ("mcore2hf.plan",)),
    ("transfer", ("mcore2hf.transfer",)),
    ("formats", ("mcore2hf.formats",)),
    ("senders", ("mcore2hf.senders",)),
    ("runtime", ("mcore2hf.runtime",)),
    ("entry", ("mcore2hf.exporter", "mcore2hf.loader", "mcore2hf.offline", "mcore2hf.importer", "mcore2hf.dry_run")),
    ("front", ("mcore2hf", "mcore2hf.cli", "mcore2hf.demo", "mcore2hf.verify")),
]
ENTRY = "entry"
#: layers that never import each other although the order would allow one way: the entry points drive senders
#: only through `senders.sync(exporter, sender)`, which is handed the exporter (no import either way)
APART = {("entry", "senders")}


def layer_of(module: str) -> int:
    """The index in LAYERS of `module`'s layer (its longest matching prefix); a module no prefix covers is an
    error, so a new top-level module must be placed in a layer."""
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, index = p, i
    if index is None or (best == "mcore2hf" and module != "mcore2hf"):
        raise KeyError(f"{module}: in no layer of tests/guards.py LAYERS")
    return index


def layer_problems(graph: dict[str, set[str]], mods: dict[str, Path]) -> list[str]:
    """Imports against the layer order, and entry points importing one another."""
    problems = []
    for m, deps in sorted(graph.items()):
        try:
            mine = layer_of(m)
        except KeyError as e:
            problems.append(str(e))
            continue
        for d in sorted(deps):
            theirs = layer_of(d)
            pair = (LAYERS[mine][0], LAYERS[theirs][0])
            if (theirs > mine or (theirs == mine and pair[0] == ENTRY and d != m) or pair in APART
                    or pair[::-1] in APART):
                problems.append(f"{mods[m].relative_to(ROOT)}: {LAYERS[mine][0]} module {m} imports {d} "
                                f"({LAYERS[theirs][0]})")
    return problems


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGE_DIRS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "mcore2hf" and parts and parts[0] in ("converters", "model_specs"):
                continue
            out[name] = path
    return out


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ours `name` refers to (itself, or the package/module holding it), else None."""
    while name:
        if name in mods:
            return name
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return None


def analyse(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private_defs: dict[str, set[str]] = {}  # _attr -> modules defining it (self._x = ..., def _x, class attrs)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                private_defs.setdefault(node.name, set()).add(m)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
                private_defs.setdefault(node.attr, set()).add(m)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id.startswith("_"):
                        private_defs.setdefault(t.id, set()).add(m)
    problems = []
    for m, tree in trees.items():
        is_pkg = mods[m].name == "__init__.py"
        imported_modules: dict[str, str] = {}  # local name -> our module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(m, is_pkg, node.level, node.module)
                for alias in node.names:
                    full = _known(f"{base}.{alias.name}", mods)
                    target = full or _known(base, mods)
                    if target and target != m:
                        graph[m].add(target)
                        if full == f"{base}.{alias.name}":
                            imported_modules[alias.asname or alias.name] = full
                        elif alias.name.startswith("_") and not alias.name.startswith("__"):
                            problems.append(f"{mods[m].relative_to(ROOT)}:{node.lineno}: imports private name "
                                            f"{alias.name} of {target}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = _known(alias.name, mods)
                    if target and target != m:
                        graph[m].add(target)
                        imported_modules[alias.asname or alias.name] = target
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls"):
                continue
            if owner in imported_modules:
                problems.append(f"{mods[m].relative_to(ROOT)}:{node.lineno}: reads private name {node.attr} of "
                                f"{imported_modules[owner]}")
            elif node.attr in private_defs and m not in private_defs[node.attr]:
                problems.append(f"{mods[m].relative_to(ROOT)}:{node.lineno}: reads private attribute {node.attr} "
                                f"that only {sorted(private_defs[node.attr])} define")
    return graph, problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its submodules is no cycle: drop edges from a package to its own
    submodules (and from them to it through the package)."""
    out = {}
    for m, deps in graph.items():
        out[m] = {d for d in deps if not d.startswith(m + ".")}
    return out


def violations() -> list[str]:
    mods = modules()
    graph, problems = analyse(mods)
    for comp in cycles(_package_edges(graph)):
        problems.append("import cycle: " + " <-> ".join(comp))
    return problems + layer_problems(graph, mods)


if __name__ == "__main__":
    found = violations()
    for p in found:
        print(p)
    print(f"guards: {len(found)} violation(s)")
    sys.exit(1 if found else 0)
