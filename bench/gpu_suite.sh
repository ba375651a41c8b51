#!/usr/bin/env bash
# The GPU suite (tests/gpu, pytest marker `gpu`) on a lent GPU machine: 4 GPUs run all of it in <= 8 minutes, 1 or 2
# GPUs what fits. Carry .whl/ (megatron-core 0.19.2 cp312, einops, the mcore2hf wheel of this checkout:
# `rm -f .whl/mcore2hf-*; pip wheel --no-deps -w .whl .`) and .whl-ipc/ (`python bench/gpu_ipc.py --pack .whl-ipc`:
# the engines' receive code and its small dependencies). Extra arguments go to pytest; the log is $OUT/tests.log.
#   bash bench/gpu_suite.sh            # everything
#   bash bench/gpu_suite.sh -k matrix  # the layout matrix only
set -uo pipefail
cd "$(dirname "$0")/.."
export MCORE2HF_WHEEL_CACHE=${MCORE2HF_WHEEL_CACHE:-$PWD/.whl-ipc/cache}  # --pack put DeepGEMM's FP8 oracle there
exec bash bench/device_tests.sh .whl .whl-ipc -- tests/gpu -rA "$@"
