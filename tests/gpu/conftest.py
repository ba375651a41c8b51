"""The GPU suite (`pytest -m gpu tests/gpu`): the paths users run on GPUs (NCCL, the replay pool, CUDA graphs, the
Triton FP8 kernel, CUDA IPC into the engines' own receive code), on real megatron-core models in NCCL worlds of one
process per GPU. Skipped where torch sees no CUDA device (the CPU CI collects and skips it). bench/gpu_suite.sh runs
it on a lent GPU machine."""

import faulthandler
import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # gpu_jobs, imported by the NCCL workers too (spawn copies sys.path)
os.environ["PYTHONPATH"] = os.pathsep.join([_HERE, os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.dirname(str(item.fspath)) == _HERE:
            item.add_marker(pytest.mark.gpu)
            if not GPUS:
                item.add_marker(pytest.mark.skip(reason="GPU suite: no CUDA device here"))


@pytest.fixture(scope="session", autouse=True)
def hang_guard():
    """A stuck NCCL world must not eat the machine's lease: the whole session's stacks are dumped and it exits
    (each world's job has its own timeout too)."""
    if GPUS:
        faulthandler.dump_traceback_later(int(os.environ.get("MCORE2HF_GPU_SUITE_TIMEOUT", "900")), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
