#!/usr/bin/env bash
# Run benchmarks on a lent GPU machine (no registry there): install the carried wheels (.whl/: megatron-core,
# mbridge, einops and an mcore2hf wheel built from this checkout; .whl-ipc/: bench/gpu_ipc.py's engine deps), then run
# each argument as a command, logging everything to $OUT/bench.log.
#   bash bench/on_device.sh "python3 bench/gpu_senders.py" "python3 bench/export_speed.py --layout ep2 --mbridge"
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_NCCL_ENABLE_MONITORING=0  # no heartbeat noise when an engine outlives the trainer's store
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# .whl-ipc/*.whl: what bench/gpu_ipc.py's engines import beyond the image (its --pack writes them)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .whl-ipc/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site
cd /tmp  # import mcore2hf from the installed wheel, not the checkout's unmapped converters/ and model_specs/
REPO=$OLDPWD
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -5
    python3 -c "import torch, megatron.core, transformers, mcore2hf; print('torch', torch.__version__, \
'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee -a "$OUT/bench.log"
status=0
for cmd in "$@"; do
    echo "=== $cmd" | tee -a "$OUT/bench.log"
    (cd "$REPO" && PYTHONPATH=/tmp/site:$REPO/tests bash -c "$cmd") 2>&1 | grep -v -i "warn" | tee -a "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    echo "=== exit $rc" | tee -a "$OUT/bench.log"
    [ "$rc" = 0 ] || status=1
done
exit $status
