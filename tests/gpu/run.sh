#!/bin/sh
# tests/gpu/run.sh — the checks that need GPUs, in one run of under six minutes:
#   1. every CUDA op against the CPU backend, each storage type, outputs poisoned first;
#   2. a training step of each family and precision, CUDA against CPU;
#   3. -d 1 against -d N when N GPUs are visible;
#   4. the plan against the memory cudaMemGetInfo reports, a small and a 1B-class model;
#   5. GPT-2 124M bf16-mixed throughput and MFU at T 1024, B 16..64;
#   then the driver end to end. Logs go to build/gpu/ (and $OUT when set); a table ends it.
set -u
cd "$(dirname "$0")/../.."
logs=build/gpu
mkdir -p "$logs"
started=$(date +%s)
nvidia-smi -L | tee "$logs/gpus.txt" || { echo "run.sh: no GPU (nvidia-smi failed)"; exit 2; }

echo "== build"
if ! make -s -j2 build/train_cuda build/test_cuda > "$logs/build.txt" 2>&1; then
    cat "$logs/build.txt"; echo "run.sh: the CUDA build failed"; exit 1
fi

echo "== checks (ops, steps, devices, memory)"
timeout 200 ./build/test_cuda 2>&1 | tee "$logs/test_cuda.txt"
echo "== benchmark"
timeout 90 ./build/test_cuda --bench 2>&1 | tee "$logs/bench.txt"
echo "== the driver: the built-in task on GPU 0, 200 steps"
timeout 40 ./build/train_cuda --max-steps 200 --eval-every 100 2>&1 | tail -8 | tee "$logs/train.txt"

echo
echo "== summary ($(date -u +%Y-%m-%d), $(head -1 "$logs/gpus.txt" | cut -d'(' -f1), $(( $(date +%s) - started )) s)"
printf '%-34s %s\n' "checks" "$(tail -1 "$logs/test_cuda.txt")"
grep -c '^  FAIL' "$logs/test_cuda.txt" | sed 's/^/failed checks: /'
grep '^  FAIL' "$logs/test_cuda.txt"
cat "$logs/bench.txt"
printf '%-34s %s\n' "driver, final val loss" "$(grep 'val loss' "$logs/train.txt" | tail -1)"
if [ -n "${OUT:-}" ]; then cp "$logs"/*.txt "$OUT"/; fi
