"""The README's main job: `mcore2hf demo` runs end to end and reports every check passed."""

import subprocess
import sys


def test_demo_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mcore2hf.cli", "demo", "--out", str(tmp_path / "exported")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RESULT: all checks passed" in out.stdout
    assert "bit-identical to the source         PASS on 4/4 ranks" in out.stdout
    assert (tmp_path / "exported" / "model.safetensors.index.json").is_file()
