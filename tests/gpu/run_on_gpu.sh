#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one prepared run, for a machine with one CUDA GPU and PyTorch (no Ray and no
# package index needed). At most 8 3/4 minutes on one H100/H200: every stage has its own hard `timeout`, so a
# hang costs that stage only, and the stages that matter most come first.
#   0. versions (torch, CUDA, libnccl and its optional functions);
#   1. the step benchmark on the DEFAULT lane (collective, the lean hook): the five GPU rows of issue 30 against
#      DDP's faster configuration, with the A/A band and the verdicts -- the ratio comes back even if a lane fails;
#   2. tests/gpu/test_gpu_bucket_paths.py for the `inline` lane, then (3.) for the `thread` lane, each on its own;
#   4. the launch-latency micro-benchmark (1,000 small allreduces per way of launching, host us per call);
#   5. the step benchmark with `--hotpath inline`, then (6.) `--hotpath thread`, each on its own (two small rows);
#   7. with --with-tests: the rest of tests/gpu (the default lane; 23 passed on 2026-11-27), 100 s.
# Logs go to $OUT (default /tmp/elastic-ring-gpu), one per stage, and $OUT/summary.log lists each stage's exit
# status (124: its timeout ended it).
# Usage: bash tests/gpu/run_on_gpu.sh [--with-tests] [--with-reform]   (--with-reform adds benchmarks.nccl_reform, 150 s)
set -u -o pipefail
OUT=${OUT:-/tmp/elastic-ring-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
tests=0 reform=0
for arg in "$@"; do
    case "$arg" in
        --with-tests) tests=1 ;;
        --with-reform) reform=1 ;;
        *) echo "unknown argument $arg (use --with-tests, --with-reform)" >&2; exit 2 ;;
    esac
done
started=$(date +%s)
: > "$OUT/summary.log"
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=75)

# stage NAME SECONDS LOG COMMAND...: run COMMAND under `timeout SECONDS`, its output to the terminal and $OUT/LOG
stage() {
    local name=$1 seconds=$2 log=$3
    shift 3
    echo "=== $name (limit ${seconds} s; $(( $(date +%s) - started )) s since the start)"
    local t0=$(date +%s)
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    echo "$name: exit $rc after $(( $(date +%s) - t0 )) s ($log)" | tee -a "$OUT/summary.log"
}

stage "0. versions" 30 versions.log python3 - <<'PY'
import subprocess, sys, torch
from elastic_ring.backends.nccl import lib as nccl_lib
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
lib = nccl_lib.load()
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0))
print("libnccl", lib.version(), lib.path)
print({n: lib.has(n) for n in ("ncclCommShrink", "ncclCommRevoke", "ncclCommGetUniqueId", "ncclCommGrow")})
PY

stage "1. step benchmark, default lane (collective, lean hook): the five rows of issue 30" 160 step_default.log \
    python3 -m benchmarks.step --device cuda \
    --rows mlp4x1024@2 mlp4x1024@3 mlp10x2048@2 resnet18@2 mlp30x64@2 \
    --blocks 5 --steps 3 --max-warmup 30 --count-steps 2 --no-strict --timeout-s 60

for lane in inline thread; do
    stage "2/3. tests/gpu/test_gpu_bucket_paths.py, lane $lane" 85 "lane_${lane}_tests.log" \
        python3 -m pytest tests/gpu/test_gpu_bucket_paths.py -k "$lane" -v -s -p no:cacheprovider -o addopts="" \
        ${per_test[@]+"${per_test[@]}"}
done

stage "4. launch latency: 1,000 small allreduces per way of launching" 55 nccl_launch.log \
    python3 -m benchmarks.nccl_launch --calls 1000 --blocks 4 --numel 1024 --world 2 --timeout-s 15

for lane in inline thread; do
    stage "5/6. step benchmark, lane $lane beside the default" 55 "step_${lane}.log" \
        python3 -m benchmarks.step --device cuda --rows mlp4x1024@2 mlp30x64@2 \
        --blocks 3 --steps 3 --max-warmup 30 --count-steps 1 --no-strict --hotpath "$lane" --timeout-s 20
done

if [ "$tests" = 1 ]; then
    ignore=()
    python3 -c "import ray" 2>/dev/null || ignore=(--ignore=tests/gpu/test_gpu_trainer.py)
    stage "7. the rest of tests/gpu (the default lane)" 100 gpu_tests.log \
        python3 -m pytest tests/gpu --ignore=tests/gpu/test_gpu_bucket_paths.py -v -p no:cacheprovider \
        -o addopts="" ${per_test[@]+"${per_test[@]}"} ${ignore[@]+"${ignore[@]}"}
fi
if [ "$reform" = 1 ]; then
    stage "NCCL re-form by shrink and grow" 150 nccl_reform.log \
        python3 -m benchmarks.nccl_reform --world 3 --repeats 3
fi
echo "=== done ($(( $(date +%s) - started )) s)"
cat "$OUT/summary.log"
