"""The runnable examples under examples/ run as a user runs them (CI runs them, so they cannot rot)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_and_sync_example(tmp_path):
    """examples/train_and_sync.py under torchrun at TP 2 on CPU: Megatron-Core's DDP and gradient finalization,
    a few Adam steps, each step's weights streamed by HFExporter.buckets() into a transformers model on rank 0;
    the example itself checks that the weights moved and that the consumer's logits equal Megatron's (it exits 1
    otherwise: without finalize_model_grads the TP ranks' q/k-norm weights drift apart and it fails, 8e-2 off)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "examples", "train_and_sync.py"), "--steps", "2"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step 1: loss" in r.stdout and "47 HF tensors into the engine" in r.stdout, r.stdout
    assert "): PASS" in r.stdout.splitlines()[-1], r.stdout
    assert not [f for f in os.listdir(tmp_path) if f.startswith("mcore2hf-example-")]  # its checkpoint removed
