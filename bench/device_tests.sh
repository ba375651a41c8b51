#!/usr/bin/env bash
# Run the test suite on a lent GPU machine (no registry there). The wheels it needs are carried in ignored dirs:
#   WHEEL_DIR...  megatron-core (0.16.1 or 0.19.2, cp312), einops, the mcore2hf wheel built from this checkout
#                 (`pip wheel --no-deps -w DIR .`), pytest/pluggy/iniconfig/psutil/accelerate/pytest-xdist/execnet,
#                 optionally transformers and its hub when the machine's transformers is older than the tests need,
#                 peft 0.21.2 for tests/test_lora.py (MCORE2HF_WHEEL_CACHE: unpacked wheels the tests take, e.g.
#                 megatron-bridge, when the machine has no package index).
#   bash bench/device_tests.sh .whl16 .whl-test -- -n 4 -k "not contract"
# The log goes to $OUT/tests.log. Tests import the installed wheel (python -P: the checkout's mcore2hf/ lacks the
# converters/ and model_specs/ that setuptools installs under it).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
dirs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do dirs+=("$1"); shift; done
shift || true
site=/tmp/site-tests
rm -rf "$site" "$site-hf"
hub='transformers-|huggingface_hub-|httpx2-|httpcore2-|truststore-'
wheels=$(for d in "${dirs[@]}"; do ls "$d"/*.whl; done)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" $(echo "$wheels" | grep -Ev "$hub") || exit 1
export PYTHONPATH=$site
if echo "$wheels" | grep -Eq "$hub"; then  # a newer transformers, used only if it imports with this machine's deps
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site-hf" $(echo "$wheels" | grep -E "$hub")
    PYTHONPATH=$site-hf:$site python3 -P -c "import transformers.models.auto" && export PYTHONPATH=$site-hf:$site \
        || echo "carried transformers does not import here: using the machine's"
fi
{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -P -c "import sys, torch, megatron.core, transformers, mcore2hf; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)"
    python3 -P -m pytest -q -p no:cacheprovider --durations=15 "$@"
} 2>&1 | tee "$OUT/tests.log"
exit "${PIPESTATUS[0]}"
