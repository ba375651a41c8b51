"""The README's main job: `mcore2hf demo` runs end to end and reports every check passed, for every registered
architecture at its default layout and at a pipeline-parallel one, leaving nothing behind but --out."""

import os
import subprocess
import sys

import pytest
from conftest import FORMAT_MATES, VLM_ARCHS

from mcore2hf import get_converter, list_architectures
from mcore2hf.demo import DEMO_LAYOUT, format_report, run_demo
from mcore2hf.runtime.world import Layout


def test_demo_end_to_end(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    os.makedirs(env["TMPDIR"])
    out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "demo", "--out", str(tmp_path / "exported")],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RESULT: all checks passed" in out.stdout
    assert "bit-identical to the source         PASS on 4/4 ranks" in out.stdout
    assert (tmp_path / "exported" / "model.safetensors.index.json").is_file()
    assert not [f for f in os.listdir(env["TMPDIR"]) if f.startswith("mcore2hf")], os.listdir(env["TMPDIR"])


# an alias runs its format's; every vision-language model too (`mcore2hf demo --model-type` of each: a second
# or so each in the warm pool), at the default layout only (test_vlm.py runs their other layouts)
MODEL_TYPES = sorted({get_converter(mt).model_type for mt in list_architectures()})
CASES = [(mt, DEMO_LAYOUT) for mt in MODEL_TYPES] + [(mt, Layout(pp=2, ep=2, etp=1)) for mt in MODEL_TYPES
                                                     if mt not in FORMAT_MATES and mt not in VLM_ARCHS]  # conftest


@pytest.mark.parametrize("model_type,layout", CASES, ids=[f"{mt}-{'default' if lay == DEMO_LAYOUT else 'pp2'}"
                                                          for mt, lay in CASES])
def test_demo_passes_for_every_architecture(model_type, layout):
    report, ok = format_report(run_demo(model_type, layout))
    assert ok, report
