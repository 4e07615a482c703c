#!/usr/bin/env bash
# GPU check for a machine with CUDA, run from a source checkout (no install needed):
#   bash tools/gpu_check.sh
# Stages, each printed as it finishes (a timeout still reports what ran), about 5 minutes in all on one
# H200: the Triton kernels against the references on CUDA; the gpu tests (reduce-overhead with
# cudagraph_or_error, zero cudagraph skips, replay == eager tokens, pool and KV equal after N steps,
# bf16); per-bucket replay latency and tokens/s for tiny and small; the kernels' achieved bandwidth
# against the device's copy bandwidth. A missing msgspec travels as a wheel (see the README).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=1 NVTX_DISABLE=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inkling-inductor}"
export INKLING_CACHE_DIR="${INKLING_CACHE_DIR:-/tmp/inkling-cache}"
failed=0
stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name"
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - start)) s"
    [ $rc = 0 ] || failed=1
}
stage "device" 60 python3 -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, 'on', torch.cuda.get_device_name())"
stage "kernels vs references (CUDA)" 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_ops.py -k "CUDA or triton or moe or paged or ring or top_k"
stage "gpu tests" 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
stage "replay latency and tokens/s" 120 python3 tools/step_latency.py --device cuda --dtype bfloat16
stage "kernel bandwidth" 60 python3 tools/bench_kernels.py --device cuda --dtype bfloat16
exit $failed
