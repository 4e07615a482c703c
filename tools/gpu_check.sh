#!/usr/bin/env bash
# GPU check for a machine with CUDA, run from a source checkout (no install needed):
#   bash tools/gpu_check.sh
# Runs the gpu-marked tests (reduce-overhead capture with zero cudagraph skips, replay == eager tokens,
# pool/KV contents equal after N steps), then prints per-bucket replay latency and decode tokens/s.
# Budget: under 8 minutes on one H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 NVTX_DISABLE=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/inkling-inductor}"
export INKLING_CACHE_DIR="${INKLING_CACHE_DIR:-/tmp/inkling-cache}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
timeout 200 python3 tools/step_latency.py --device cuda --dtype bfloat16
