"""Mutation proof: bugs planted in a copy of the package, each of which the suite's relevant tests must catch.

Each mutation is applied to a copy of mcore2hf (converters/ and model_specs/ placed where they install) that a
subprocess imports first (PYTHONPATH; the spawned gloo workers inherit it); its target tests must then fail
(pytest exit 1: a test failed, not a collection or import error). A control run of every target without a
mutation must pass first, so a target that fails for another reason cannot count as a catch. Several planted bugs
are symmetric (made alike in loading and exporting), which no round trip sees: the transformers forward of each
layout world (tests/oracle.py) must. A bug the suite misses is a missing test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # path in the repository
    edits: tuple[tuple[str, str], ...]  # (exact text, replacement): each text must occur exactly once
    targets: tuple[str, ...]  # pytest node ids / files (relative to tests/) that must each fail
    archs: str = ""  # MCORE2HF_ARCHS for the world targets (conftest.ONLY)


WORLD_TP1 = "test_layout_matrix.py::test_layout_invariance_all_architectures[tp1-pp1-ep1-etp1-w1-float32]"
WORLD_EP2 = "test_layout_matrix.py::test_layout_invariance_all_architectures[tp2-pp1-ep2-etp1-w2-float32]"
WORLD_FP8 = "test_fp8.py::test_fp8_export_bit_identical_to_reference_all_architectures[tp1-pp2-vpp2-ep2-etp1-w4]"

MUTATIONS = [
    Mutation("qkv-order", "mcore2hf/layouts/ops.py", (  # k and v swapped inside QKV, in export and load alike
        ("spans = [(0, hpg * d), (hpg * d, d), ((hpg + 1) * d, d)]",
         "spans = [(0, hpg * d), ((hpg + 1) * d, d), (hpg * d, d)]"),
        ("parts = [q.reshape(gl, hpg * d, *rest), k.reshape(gl, d, *rest), v.reshape(gl, d, *rest)]",
         "parts = [q.reshape(gl, hpg * d, *rest), v.reshape(gl, d, *rest), k.reshape(gl, d, *rest)]")),
        ("test_layouts.py", WORLD_TP1), "qwen3"),
    Mutation("expert-rank-order", "mcore2hf/arch/naming.py", (  # EP ranks' experts numbered in reverse
        ("canon = canonical_name(name[len(inner):], lm, ctx.ep.rank, num_local,",
         "canon = canonical_name(name[len(inner):], lm, ctx.ep.size - 1 - ctx.ep.rank, num_local,"),),
        (WORLD_EP2,), "qwen3_moe"),
    Mutation("vocab-padding-rows", "mcore2hf/layouts/ops.py", (  # padding rows put first, and read as vocabulary
        ("return torch.cat([real, pad], dim=0)", "return torch.cat([pad, real], dim=0)"),
        ("out.append(StridedCopy(0, (keep * rest,), (1,), (1,), dst_offset=i * rows * rest, src_shards=i))",
         "out.append(StridedCopy(0, (keep * rest,), (1,), (1,), dst_offset=i * rows * rest, src_shards=i, "
         "src_offset=(rows - keep) * rest))")),
        ("test_layouts.py", WORLD_TP1), "qwen3"),
    Mutation("fp8-scale-divisor", "mcore2hf/quantize/fp8.py", (
        ("FP8_MAX = 448.0", "FP8_MAX = 440.0"),),
        ("test_quantize.py", WORLD_FP8), "qwen3_moe"),
    Mutation("glu-half-order", "mcore2hf/layouts/ops.py", (  # gate and up swapped in fc1, in export and load alike
        ("return [StridedCopy(j, (count, block), (block, 1), (S, 1), src_offset=j * block) for j in (0, 1)]",
         "return [StridedCopy(j, (count, block), (block, 1), (S, 1), src_offset=(1 - j) * block) for j in (0, 1)]"),
        ("return torch.cat([take_range(h, 0, index * n, (index + 1) * n) for h in hf], dim=0)",
         "return torch.cat([take_range(h, 0, index * n, (index + 1) * n) for h in hf[::-1]], dim=0)")),
        ("test_layouts.py", WORLD_TP1), "qwen3"),
    Mutation("mla-latent-norm-eps", "model_specs/deepseek_v3.py", (
        ("MLA_LATENT_NORM_EPS = 1e-6", "MLA_LATENT_NORM_EPS = 1e-5"),),
        (WORLD_TP1,), "deepseek_v3"),
]


def _package_copy(dest: Path, mutation: Mutation | None, te_specs_file: Path) -> Path:
    """The package as installed (converters/, model_specs/ inside mcore2hf/), with `mutation` applied."""
    shutil.copy(te_specs_file, dest / "te_specs.json")
    pkg = dest / "mcore2hf"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "mcore2hf", pkg, ignore=ignore)
    shutil.copytree(ROOT / "converters", pkg / "converters", ignore=ignore)
    shutil.copytree(ROOT / "model_specs", pkg / "model_specs", ignore=ignore)
    if mutation is not None:
        rel = Path(mutation.file)
        target = pkg / rel.relative_to("mcore2hf") if rel.parts[0] == "mcore2hf" else pkg / rel
        text = target.read_text()
        for old, new in mutation.edits:
            assert text.count(old) == 1, f"{mutation.name}: {old!r} occurs {text.count(old)} times in {rel}"
            text = text.replace(old, new)
        target.write_text(text)
    return dest


def _run(root: Path, targets: tuple[str, ...], archs: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(TESTS)]), "MCORE2HF_ARCHS": archs,
           "PYTHONDONTWRITEBYTECODE": "1", "MCORE2HF_TE_SPECS": str(root / "te_specs.json")}
    # the copy must be what is imported (not the installed package): checked before the tests run
    probe = "import mcore2hf, mcore2hf.converters, sys; sys.exit(not mcore2hf.__file__.startswith(sys.argv[1]))"
    assert subprocess.run([sys.executable, "-c", probe, str(root)], env=env, cwd=TESTS).returncode == 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(TESTS), *targets]
    return subprocess.run(cmd, env=env, cwd=TESTS, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def te_specs_file(te_specs, tmp_path_factory) -> Path:
    """The session's TE spec trees (a subprocess of ~20 s), handed to every run below."""
    path = tmp_path_factory.mktemp("te") / "te_specs.json"
    path.write_text(json.dumps(te_specs))
    return path


@pytest.fixture(scope="module")
def control(tmp_path_factory, te_specs_file):
    """Every target, unmutated, from a copy of the package, per architecture selection: must pass."""
    root = _package_copy(tmp_path_factory.mktemp("control"), None, te_specs_file)
    runs = {}
    for archs in sorted({m.archs for m in MUTATIONS}):
        targets = tuple(sorted({t for m in MUTATIONS if m.archs == archs for t in m.targets}))
        r = _run(root, targets, archs)
        assert r.returncode == 0, f"control run ({archs}) failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
        runs[archs] = targets
    return runs


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_planted_bug_is_caught(mutation, control, te_specs_file, tmp_path):
    root = _package_copy(tmp_path, mutation, te_specs_file)
    r = _run(root, mutation.targets, mutation.archs)
    failed = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("FAILED ")]
    missed = [t for t in mutation.targets if not any(f == t or f.startswith(t + "::") for f in failed)]
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    assert r.returncode == 1 and not missed, (f"{mutation.name}: not caught by {missed} (exit {r.returncode}, "
                                              f"{tail}):\n{r.stdout[-3000:]}\n{r.stderr[-1500:]}")
    print(f"{mutation.name}: caught by {', '.join(mutation.targets)}: {tail}")
