"""Mutation proof: bugs planted in a copy of the package, each of which a named test must catch with a named
assertion (the oracle meant to catch it), not with just any failure.

Each mutation is applied to a copy of mcore2hf (converters/ and model_specs/ placed where they install) that a
pytest subprocess imports first (PYTHONPATH; the gloo workers, forked from a forkserver started there, inherit
it); every test it names must then fail, and its failure report (junit XML) must match the regex given with it.
A target that fails for another reason (a broken copy, an error in a fixture) is therefore no catch: this check
fails instead. (The targets pass unmutated in the suite itself.) Most planted bugs are symmetric, made alike in
loading and exporting, which no round trip sees: the transformers forward of the layout worlds (tests/oracle.py)
must, and three of them show only at a layout with PP, virtual PP or expert-TP > 1; MTP's two norms swapped only
an MTP forward sees (the engines' draft classes against megatron-core's MTP layer, tests/test_mtp_drafts.py). A
bug the suite misses is a missing test.

A mutation waiting for its oracle is kept in PENDING with its edits, which must still apply (so the row cannot
rot); once the oracle exists, the row moves to MUTATIONS with its `catches`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
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
    #: (pytest node id relative to tests/, regex its failure report must match): the oracles that must catch it
    catches: tuple[tuple[str, str], ...]
    archs: str = ""  # MCORE2HF_ARCHS for the world targets (conftest.ONLY)


def world(layout: str) -> str:
    return f"test_layout_matrix.py::test_layout_invariance_all_architectures[{layout}]"


#: oracle.logit_problems: the Megatron forward at the world's layout against transformers' forward of the source
FORWARD = r"max \|megatron - transformers\| logit difference"
#: tests/test_layouts.py roundtrip(): an op's HF tensors against an independent reference of Megatron's layout
TO_HF = r"assert torch\.equal\(a, b\)"
#: tests/test_quantize.py: our block-FP8 quantizer's bytes against DeepGEMM's per_block_cast_to_fp8
FP8_REFERENCE = r"assert _same_bits\(q, rq\) and _same_bits\(s, rs\)"
#: tests/test_mtp_drafts.py: an engine's own MTP draft forward on the exported weights against megatron-core's layer
MTP_FORWARD = r"(sglang|vllm) \w+ hidden: \S+ > \S+"

# the layer number of a decoder layer computed from the stage instead of read from Megatron's own layer_number
_STAGE_NUMBER = (
    ("canon = canonical_name(name[len(inner):], lm, ctx.ep.rank, num_local, num_layers, hybrid)",
     "canon = canonical_name(name[len(inner):], lm, ctx.ep.rank, num_local, num_layers, hybrid, (vp, len(chunks), "
     "ctx.pp))"),
    ("num_layers: int, hybrid: HybridLayout | None = None) -> str:",
     "num_layers: int, hybrid: HybridLayout | None = None, where=None) -> str:"))
_NUMBER = "number = getattr(chunk, kind).layers[idx].layer_number - 1"


def _numbered(offset: str) -> tuple[str, str]:
    return _NUMBER, (f"{_NUMBER} if kind != 'decoder' or where is None else "
                     f"idx + ({offset}) * len(chunk.decoder.layers)")


MUTATIONS = [
    Mutation("qkv-order", "mcore2hf/layouts/ops.py", (  # k and v swapped inside QKV, in export and load alike
        ("spans = [(0, hpg * d), (hpg * d, d), ((hpg + 1) * d, d)]",
         "spans = [(0, hpg * d), ((hpg + 1) * d, d), (hpg * d, d)]"),
        ("parts = [q.reshape(gl, hpg * d, *rest), k.reshape(gl, d, *rest), v.reshape(gl, d, *rest)]",
         "parts = [q.reshape(gl, hpg * d, *rest), v.reshape(gl, d, *rest), k.reshape(gl, d, *rest)]")),
        (("test_layouts.py::test_qkv_weight_heads_groups_d4_h16[8-2-1]", TO_HF),)),
    Mutation("expert-rank-order", "mcore2hf/arch/naming.py", (  # EP ranks' experts numbered in reverse
        ("canon = canonical_name(name[len(inner):], lm, ctx.ep.rank, num_local,",
         "canon = canonical_name(name[len(inner):], lm, ctx.ep.size - 1 - ctx.ep.rank, num_local,"),),
        ((world("tp2-pp1-ep2-etp1-w2-float32-sp"), FORWARD),), "qwen3_moe"),
    Mutation("vocab-padding-rows", "mcore2hf/layouts/ops.py", (  # padding rows put first, and read as vocabulary
        ("return torch.cat([real, pad], dim=0)", "return torch.cat([pad, real], dim=0)"),
        ("out.append(StridedCopy(0, (keep * rest,), (1,), (1,), dst_offset=i * rows * rest, src_shards=i))",
         "out.append(StridedCopy(0, (keep * rest,), (1,), (1,), dst_offset=i * rows * rest, src_shards=i, "
         "src_offset=(rows - keep) * rest))")),
        (("test_layouts.py::test_vocab_rows_V100_padded128_h8[1]", TO_HF),)),
    Mutation("fp8-scale-divisor", "mcore2hf/quantize/fp8.py", (
        ("FP8_MAX = 448.0", "FP8_MAX = 440.0"),),
        (("test_quantize.py::test_bit_identical_to_deepgemm_per_block_cast_to_fp8[fp32-scales-torch.float32-300x200]",
          FP8_REFERENCE),)),
    Mutation("glu-half-order", "mcore2hf/layouts/ops.py", (  # gate and up swapped in fc1, in export and load alike
        ("return [StridedCopy(j, (count, block), (block, 1), (S, 1), src_offset=j * block) for j in (0, 1)]",
         "return [StridedCopy(j, (count, block), (block, 1), (S, 1), src_offset=(1 - j) * block) for j in (0, 1)]"),
        ("return torch.cat([take_range(h, 0, index * n, (index + 1) * n) for h in hf], dim=0)",
         "return torch.cat([take_range(h, 0, index * n, (index + 1) * n) for h in hf[::-1]], dim=0)")),
        (("test_layouts.py::test_gated_column_glu_gate16_up16_h8[1]", TO_HF),)),
    Mutation("mla-latent-norm-eps", "model_specs/deepseek_v3.py", (  # a config value: only a forward sees it
        ("MLA_LATENT_NORM_EPS = 1e-6", "MLA_LATENT_NORM_EPS = 1e-5"),),
        ((world("tp1-pp1-ep1-etp1-w1-float32"), FORWARD),), "deepseek_v3"),
    # symmetric layout bugs that need PP, virtual PP or expert-TP > 1 to show (every other world passes them)
    Mutation("pp-stage-order", "mcore2hf/arch/naming.py",  # pipeline stages' layers numbered in reverse stage order
             (*_STAGE_NUMBER, _numbered("where[2].size - 1 - where[2].rank")),
             ((world("tp2-pp2-ep2-etp1-w4-float32"), FORWARD),), "qwen3"),
    Mutation("vpp-chunk-order", "mcore2hf/arch/naming.py",  # virtual chunks numbered stage-major (pp * vpp + v)
             (*_STAGE_NUMBER, _numbered("where[2].rank * where[1] + where[0]")),
             ((world("tp1-pp2-vpp2-ep2-etp1-w4-float32"), FORWARD),), "qwen3"),
    Mutation("glu-tp-unaware", "mcore2hf/layouts/ops.py", (  # 2 shards of fc1 read as [gate; up], not as [g0; u0], [g1; u1]
        ("return [StridedCopy(j, (count, block), (block, 1), (S, 1), src_offset=j * block) for j in (0, 1)]",
         "return [StridedCopy(j, (count, block), (block, 1), (S, 1), src_offset=j * block) for j in (0, 1)] "
         "if count != 2 else [StridedCopy(j, (count, block), (block, 1), (block, 1), src_shards=j) for j in (0, 1)]"),
        ("return torch.cat([take_range(h, 0, index * n, (index + 1) * n) for h in hf], dim=0)",
         "return torch.cat([take_range(h, 0, index * n, (index + 1) * n) for h in hf], dim=0) if count != 2 else "
         "materialized(hf[index])")),
        # qwen3_moe has no dense MLP: only its experts' fc1 is split, and only expert-TP 2 splits it
        ((world("tp1-pp1-ep2-etp2-w4-float32"), FORWARD),
         ("test_layouts.py::test_gated_column_glu_gate16_up16_h8[2]", TO_HF)), "qwen3_moe"),
    # MTP's two input norms swapped in load and export alike: names and every round trip pass; the engines' own
    # draft classes' MTP forward on the exported weights against megatron-core's MultiTokenPredictionLayer does not
    Mutation("mtp-norm-swap", "converters/common.py", (
        ('Rule(f"{m}.enorm.weight", f"{h}.enorm.weight")', 'Rule(f"{m}.enorm.weight", f"{h}.hnorm.weight")'),
        ('Rule(f"{m}.hnorm.weight", f"{h}.hnorm.weight")', 'Rule(f"{m}.hnorm.weight", f"{h}.enorm.weight")')),
        tuple((f"test_mtp_drafts.py::test_mtp_forward_equals_megatron[{mt}-{engine}]", MTP_FORWARD)
              for mt in ("deepseek_v3", "glm4_moe") for engine in ("sglang", "vllm"))),
]

#: mutations whose oracle does not exist yet (catches empty): their edits are checked to apply
PENDING: list[Mutation] = []


def _apply(text: str, mutation: Mutation) -> str:
    for old, new in mutation.edits:
        assert text.count(old) == 1, f"{mutation.name}: {old!r} occurs {text.count(old)} times in {mutation.file}"
        text = text.replace(old, new)
    return text


def _package_copy(dest: Path, mutation: Mutation, te_specs_file: Path) -> Path:
    """The package as installed (converters/, model_specs/ inside mcore2hf/), with `mutation` applied."""
    shutil.copy(te_specs_file, dest / "te_specs.json")
    pkg = dest / "mcore2hf"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "mcore2hf", pkg, ignore=ignore)
    shutil.copytree(ROOT / "converters", pkg / "converters", ignore=ignore)
    shutil.copytree(ROOT / "model_specs", pkg / "model_specs", ignore=ignore)
    rel = Path(mutation.file)
    target = pkg / rel.relative_to("mcore2hf") if rel.parts[0] == "mcore2hf" else pkg / rel
    target.write_text(_apply(target.read_text(), mutation))
    return dest


def _failures(report: Path) -> dict[str, str]:
    """node id -> failure text (message and report) of every failed test in a junit XML report (not errors)."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is not None:
            node = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
            out[node] = (failure.get("message") or "") + "\n" + (failure.text or "")
    return out


def _run(root: Path, mutation: Mutation) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(TESTS)]), "MCORE2HF_ARCHS": mutation.archs,
           "PYTHONDONTWRITEBYTECODE": "1", "MCORE2HF_TE_SPECS": str(root / "te_specs.json")}
    # the copy must be what is imported (not the installed package): checked before the tests run
    probe = "import mcore2hf, mcore2hf.converters, sys; sys.exit(not mcore2hf.__file__.startswith(sys.argv[1]))"
    assert subprocess.run([sys.executable, "-c", probe, str(root)], env=env, cwd=TESTS).returncode == 0
    report = root / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(TESTS),
           f"--junitxml={report}", *(node for node, _ in mutation.catches)]
    r = subprocess.run(cmd, env=env, cwd=TESTS, capture_output=True, text=True, timeout=1200)
    return r, _failures(report) if report.exists() else {}


@pytest.fixture(scope="module")
def te_specs_file(te_specs, tmp_path_factory) -> Path:
    """The session's TE spec trees (a subprocess of ~20 s), handed to every run below."""
    path = tmp_path_factory.mktemp("te") / "te_specs.json"
    path.write_text(json.dumps(te_specs))
    return path


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_planted_bug_is_caught_by_its_oracle(mutation, te_specs_file, tmp_path):
    r, failed = _run(_package_copy(tmp_path, mutation, te_specs_file), mutation)
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    missed = [(node, pattern) for node, pattern in mutation.catches
              if node not in failed or not re.search(pattern, failed[node])]
    assert r.returncode == 1 and not missed, (
        f"{mutation.name}: not caught as intended by {missed} (exit {r.returncode}, {tail}); failures: "
        + "; ".join(f"{n}: {t[:600]}" for n, t in failed.items()) + f"\n{r.stdout[-2000:]}\n{r.stderr[-1500:]}")
    print(f"{mutation.name}: caught by {', '.join(n for n, _ in mutation.catches)}: {tail}")


def test_pending_mutations_still_apply():
    """A pending mutation's edits apply to today's code (so its row is ready when its oracle lands); a target
    that does not exist fails its mutation's run (pytest exits 4: no catch)."""
    assert all(m.catches for m in MUTATIONS) and not any(m.catches for m in PENDING)
    for m in PENDING:
        _apply((ROOT / m.file).read_text(), m)
