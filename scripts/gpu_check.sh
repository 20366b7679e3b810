#!/usr/bin/env bash
# The GPU check: everything a lent GPU should run, in one call, under 8 minutes on one
# H100/H200, every result under one folder ($OUT if set, else ./gpu-check-<time>).
#
#   OUT=/tmp/gpu-check scripts/gpu_check.sh
#
# Steps (each with its own time limit; a failed step does not stop the next):
#   env          torch, CUDA, DeepSpeed versions, nvidia-smi
#   probes       scripts/gpu_probes.py: issue 41 findings 3 (latched error after a refused
#                registration), 4 (fork of a process with page-locked buffers), 7 (snapshot
#                still registered after the optimizer is gone); skipped without CUDA
#   tests_gpu    FLATZERO_TEST_GPU=1 pytest tests/gpu tests/device -k cuda, the
#                checkpoint GPU test
#   sanitizer    TORCH_CUDA_SANITIZER=1 over the offload and checkpoint GPU tests
#   bench_*      device-memory, init (device tier) and step benchmarks against DeepSpeed
#                where it is installed (the benchmarks skip it otherwise)
# Without CUDA every CUDA step writes "skipped: no CUDA" and the script exits 0 (CI runs it
# so: tests/test_gpu_check.py). summary.txt has one line per step: name, exit code, seconds.
# The whole script keeps within GPU_CHECK_SECONDS (default 480, under the 600 s a device
# call may run): each step's limit is cut to what is left, and a step with under 10 s left
# is skipped ("time spent"), so the summary and results always come back.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-$(date +%Y%m%d-%H%M%S)}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
DEADLINE=$(($(date +%s) + ${GPU_CHECK_SECONDS:-480}))
mkdir -p "$OUT"
: > "$OUT/summary.txt"
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    if [ $((DEADLINE - start)) -lt 10 ]; then
        skip "$name" "time spent"
        return
    fi
    [ "$limit" -le $((DEADLINE - start)) ] || limit=$((DEADLINE - start))
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - start))s" >> "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || failed=1
}

skip() {  # skip NAME REASON
    echo "skipped: $2" > "$OUT/$1.log"
    echo "$1 skipped ($2)" >> "$OUT/summary.txt"
}

step env 60 "$PY" -c '
import shutil, subprocess, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import deepspeed
    print("deepspeed", deepspeed.__version__)
except Exception as error:
    print("deepspeed: not importable:", type(error).__name__)
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
'
step probes 180 "$PY" scripts/gpu_probes.py "$OUT/probes"

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    export FLATZERO_TEST_GPU=1
    step tests_gpu 240 "$PY" -m pytest -q -x --junitxml="$OUT/tests_gpu.xml" \
        tests/gpu tests/test_checkpoint_gpu.py tests/device -k "cuda or gpu"
    step sanitizer 150 env TORCH_CUDA_SANITIZER=1 "$PY" -m pytest -q \
        --junitxml="$OUT/sanitizer.xml" tests/gpu/test_offload_gpu.py tests/test_checkpoint_gpu.py
    step bench_device_memory 60 "$PY" -m flatzero bench device-memory --device cuda \
        --model llama-0.4b --world-sizes 1 --json "$OUT/device_memory_cuda_llama-0.4b.json"
    step bench_init 90 "$PY" -m flatzero bench init --device cuda --params-on device \
        --world-sizes 1 --trials 2 --json "$OUT/init_gpu_device.json"
    step bench_step 90 "$PY" -m flatzero bench step --device cuda --world-sizes 1 \
        --steps 10 --json "$OUT/step_gpu.json"
else
    for name in tests_gpu sanitizer bench_device_memory bench_init bench_step; do
        skip "$name" "no CUDA"
    done
fi
cat "$OUT/summary.txt"
echo "results: $OUT"
exit "$failed"
