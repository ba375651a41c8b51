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
    """`mcore2hf demo` as the README runs it: every check passes, nothing is left behind but --out, and it talks
    as it goes (a line as each stage ends, the workers' start one per rank, the world's from its rank 0), not
    silence until the report: each line arrives while the demo still runs."""
    import time

    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    os.makedirs(env["TMPDIR"])
    proc = subprocess.Popen([sys.executable, "-m", "mcore2hf.cli", "demo", "--out", str(tmp_path / "exported")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    arrived = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]  # each line as it is printed
    err = proc.stderr.read()
    assert proc.wait(timeout=900) == 0, "\n".join(line for _, line in arrived) + err
    out = "\n".join(line for _, line in arrived)
    assert "RESULT: all checks passed" in out
    assert "bit-identical to the source         PASS on 4/4 ranks" in out
    stages = ["a line as each stage ends", "transformers wrote a random tiny qwen3_moe checkpoint",
              "starting 4 gloo worker processes", "torch imported (1/4)", "megatron-core imported (4/4)",
              "parallel state initialized (4/4)",
              "built on every rank and loaded", "bit-identical to the source: PASS on 4/4 ranks",
              "save_pretrained wrote the HF directory", "world done", "from_pretrained: PASS; logits",
              "RESULT: all checks passed"]
    at = [next(i for i, (_, line) in enumerate(arrived) if stage in line) for stage in stages]
    assert at == sorted(at), list(zip(stages, at))
    end = arrived[at[-1]][0]
    assert end - arrived[at[3]][0] > 1.0, "the workers' start was not shown while the demo ran"
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
