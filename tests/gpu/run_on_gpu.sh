#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one run, for a machine with one CUDA GPU and PyTorch (no Ray needed):
# versions, tests/gpu (without the Ray trainer test), the NCCL shrink/grow benchmark, the step benchmark.
# Logs go to $OUT (default /tmp/elastic-ring-gpu). Usage: bash tests/gpu/run_on_gpu.sh [--no-step | step-benchmark args]
set -u
OUT=${OUT:-/tmp/elastic-ring-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 - <<'PY' 2>&1 | tee "$OUT/versions.log"
import torch
from elastic_ring.backends.nccl import lib as nccl_lib
lib = nccl_lib.load()
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("libnccl", lib.version(), lib.path)
print({n: lib.has(n) for n in ("ncclCommShrink", "ncclCommRevoke", "ncclCommGetUniqueId", "ncclCommGrow")})
PY
ray_test=()
python3 -c "import ray" 2>/dev/null || ray_test=(--ignore=tests/gpu/test_gpu_trainer.py)
timeout 240 python3 -m pytest tests/gpu -v -s -p no:cacheprovider -o addopts="" --timeout=240 "${ray_test[@]}" \
    2>&1 | tee "$OUT/gpu_tests.log"
timeout 150 python3 -m benchmarks.nccl_reform --world 3 --repeats 3 2>&1 | tee "$OUT/nccl_reform.log"
if [ "${1:-}" != "--no-step" ]; then
    timeout 200 python3 -m benchmarks.step --device cuda "$@" 2>&1 | tee "$OUT/step.log"
fi
