#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one prepared run, for a machine with one CUDA GPU and PyTorch (no Ray and no
# package index needed), about 8 minutes at most on one H100/H200 (every step has a hard timeout):
#   1. versions (torch, CUDA, libnccl and its optional functions);
#   2. the launch-latency micro-benchmark (issue 30): 1,000 small allreduces per way of launching, host us per
#      call: today's path (collective), the bucket paths inline and thread, bare NCCL on the non-blocking
#      communicator and on a blocking child (ncclCommSplit), and torch's ProcessGroupNCCL;
#   3. pytest tests/gpu (the bucket paths of issue 30 first; without Ray, test_gpu_trainer.py is left out);
#   4. the step benchmark's GPU rows against the faster DDP, with the bucket paths inline and thread beside
#      today's default, the A/A band and the verdicts.
# Logs go to $OUT (default /tmp/elastic-ring-gpu).
# Usage: bash tests/gpu/run_on_gpu.sh [--no-step] [--with-reform]   (--with-reform adds benchmarks.nccl_reform, 150 s)
set -u
OUT=${OUT:-/tmp/elastic-ring-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step=1 reform=0
for arg in "$@"; do
    case "$arg" in
        --no-step) step=0 ;;
        --with-reform) reform=1 ;;
        *) echo "unknown argument $arg (use --no-step, --with-reform)" >&2; exit 2 ;;
    esac
done
started=$(date +%s)
stamp() { echo "=== $1 ($(( $(date +%s) - started )) s since the start)"; }

stamp "versions"
nvidia-smi -L
timeout -k 5 60 python3 - <<'PY' 2>&1 | tee "$OUT/versions.log"
import sys, torch
from elastic_ring.backends.nccl import lib as nccl_lib
lib = nccl_lib.load()
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0))
print("libnccl", lib.version(), lib.path)
print({n: lib.has(n) for n in ("ncclCommShrink", "ncclCommRevoke", "ncclCommGetUniqueId", "ncclCommGrow")})
PY

stamp "launch latency: 1,000 small allreduces per way of launching"
timeout -k 10 75 python3 -m benchmarks.nccl_launch --calls 1000 --blocks 4 --numel 1024 --world 2 \
    2>&1 | tee "$OUT/nccl_launch.log"

stamp "pytest tests/gpu"
ignore=()
python3 -c "import ray" 2>/dev/null || ignore=(--ignore=tests/gpu/test_gpu_trainer.py)
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=150)
timeout -k 10 240 python3 -m pytest tests/gpu/test_gpu_bucket_paths.py tests/gpu -v -s -p no:cacheprovider \
    -o addopts="" "${per_test[@]}" "${ignore[@]}" 2>&1 | tee "$OUT/gpu_tests.log"

if [ "$step" = 1 ]; then
    stamp "step benchmark: the GPU rows of issue 30"
    timeout -k 10 190 python3 -m benchmarks.step --device cuda \
        --rows mlp4x1024@2 mlp4x1024@3 mlp10x2048@2 resnet18@2 mlp30x64@2 \
        --blocks 5 --steps 3 --max-warmup 30 --count-steps 2 --no-strict --hotpath inline thread \
        2>&1 | tee "$OUT/step.log"
fi
if [ "$reform" = 1 ]; then
    stamp "NCCL re-form by shrink and grow"
    timeout -k 10 150 python3 -m benchmarks.nccl_reform --world 3 --repeats 3 2>&1 | tee "$OUT/nccl_reform.log"
fi
stamp "done"
