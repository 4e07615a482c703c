#!/usr/bin/env bash
# GPU check for a machine with CUDA, run from a source checkout (no install needed):
#   bash tools/gpu_check.sh            (LOGS=DIR keeps each stage's whole output there)
# Two phases, each stage printed as it finishes (a timeout still reports what ran), about 5 minutes in
# all on one H200. First, side by side (they compile on the host's cores): the Triton kernels against
# the references on CUDA; the gpu tests (reduce-overhead with cudagraph_or_error, zero cudagraph skips,
# replay == eager tokens, pool and KV equal after N steps, bf16); the demo on the shipped checkpoint,
# compiled on CUDA, plain and with MTP drafting (a verify and a draft graph beside decode); the shipped
# checkpoint's logprobs, eager and compiled, against a reference recorded on CPU (tools/device_parity.py).
# Then, alone, the timings: per-bucket replay latency and tokens/s for tiny and small, and the kernels'
# achieved bandwidth (and the prefill attention's rate) against the device's copy bandwidth and matrix
# rate. A missing msgspec travels as a wheel (see the README's GPU section).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=1 NVTX_DISABLE=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inkling-inductor}"
export INKLING_CACHE_DIR="${INKLING_CACHE_DIR:-/tmp/inkling-cache}"
LOGS="${LOGS:-$(mktemp -d)}"
mkdir -p "$LOGS"
echo "logs: $LOGS"
# pytest-xdist, where it is installed, spreads the kernel tests' Triton compiles over four workers.
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
failed=0

run_stage() {  # run_stage NAME SECONDS COMMAND... : the stage's output goes to $LOGS/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$rc $((SECONDS - start))" >"$LOGS/$name.rc"
}

report() {  # report NAME: its log's tail and its verdict
    local name=$1 rc secs
    read -r rc secs <"$LOGS/$name.rc"
    echo "== $name"
    tail -n "${TAIL:-25}" "$LOGS/$name.log"
    echo "== $name: $([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)") in $secs s"
    [ "$rc" = 0 ] || failed=1
}

python3 -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, 'on', torch.cuda.get_device_name())" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader

# Phase 1, side by side.
# (test_ops' "CUDA" cases hand the Triton launchers CPU tensors: they are for the interpreter only.)
run_stage kernels 160 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_triton_kernels.py \
    -k "not compiles_for_the_h200" &
run_stage gpu-tests 160 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py &
run_stage demo 160 python3 -m inkling_compiled.cli demo --device cuda &
run_stage demo-mtp 160 python3 -m inkling_compiled.cli demo --device cuda --speculative mtp &
run_stage device-parity 160 python3 tools/device_parity.py --check tools/device_parity_ref.json --device cuda &
wait
report kernels
report gpu-tests
TAIL=14 report demo
TAIL=16 report demo-mtp
TAIL=12 report device-parity

# Phase 2, alone: timings.
run_stage replay 120 python3 tools/step_latency.py --device cuda --dtype bfloat16
TAIL=40 report replay
run_stage kernel-bandwidth 40 python3 tools/bench_kernels.py --device cuda --dtype bfloat16
TAIL=40 report kernel-bandwidth
exit $failed
