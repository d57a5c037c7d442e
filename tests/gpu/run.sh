#!/bin/sh
# tests/gpu/run.sh — the checks that need a GPU, in one run of under eight minutes. It runs the
# binaries `make gpu-bin` built beforehand on a CPU machine (sm_90, portable host code), which
# travel with the working tree in build/gpu-bin; only without them does it build here.
#   0. the driver and the libraries: nvidia-smi, ldd of both binaries;
#   1. every CUDA op (cuBLASLt too) against the CPU backend, each storage type;
#   2. a training step of each family and precision, CUDA against CPU; -d 1 against -d N;
#   3. the plan against the memory cudaMemGetInfo reports (test-llama, Llama-3.2-1B), and a plan
#      too large refused before allocating;
#   4. GPT-2 124M bf16-mixed at T 1024, B 16..64: tokens/s and MFU;
#   5. the same step in PyTorch on the same GPU (eager, torch.compile), side by side;
#   6. the driver end to end on the built-in task.
# Logs go to build/gpu/ (and $OUT when set); a table ends it.
set -u
cd "$(dirname "$0")/../.."
logs=build/gpu
bin=build/gpu-bin
mkdir -p "$logs"
started=$(date +%s)
elapsed() { echo $(( $(date +%s) - started )); }

echo "== driver and libraries"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee "$logs/gpus.txt"
nvidia-smi -L > /dev/null 2>&1 || { echo "run.sh: no GPU (nvidia-smi failed)"; exit 2; }
if [ ! -x "$bin/test_cuda" ] || [ ! -x "$bin/train_cuda" ]; then
    echo "run.sh: no prepared binaries in $bin (make gpu-bin on the CPU machine): building here"
    make -s gpu-bin > "$logs/build.txt" 2>&1 || { cat "$logs/build.txt"; echo "run.sh: build failed"; exit 1; }
fi
missing=$(ldd "$bin/test_cuda" "$bin/train_cuda" 2>&1 | grep 'not found' | sort -u)
ldd "$bin/test_cuda" | grep -E 'cublas|nccl|cudart|gomp' | tee "$logs/libraries.txt"
if [ -n "$missing" ]; then echo "run.sh: missing libraries:"; echo "$missing"; exit 2; fi

echo "== checks (ops, steps, devices, memory) [$(elapsed) s]"
timeout 210 "$bin/test_cuda" > "$logs/test_cuda.txt" 2>&1
echo "exit $?" >> "$logs/test_cuda.txt"
grep -v '^  ok' "$logs/test_cuda.txt"

echo "== litgpt.c benchmark [$(elapsed) s]"
timeout 100 "$bin/test_cuda" --bench 2>&1 | tee "$logs/bench.txt"
timeout 60 "$bin/test_cuda" --bench-attention 2>&1 | tee "$logs/bench_attention.txt"

echo "== PyTorch, the same step [$(elapsed) s]"
if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    timeout 120 python3 tests/gpu/torch_gpt2_step.py -b 16 -t 1024 2>&1 | tee "$logs/torch.txt"
else
    echo "no PyTorch with CUDA here" | tee "$logs/torch.txt"
fi

echo "== the driver: the built-in task on GPU 0, 200 steps [$(elapsed) s]"
timeout 40 "$bin/train_cuda" --max-steps 200 --eval-every 100 2>&1 | tail -8 | tee "$logs/train.txt"

echo
echo "== summary ($(date -u +%Y-%m-%d), $(sed -n 2p "$logs/gpus.txt" | cut -d, -f1), $(elapsed) s)"
printf '%-36s %s\n' "checks" "$(grep 'passed,' "$logs/test_cuda.txt" | tail -1) ($(tail -1 "$logs/test_cuda.txt"))"
grep '^  FAIL' "$logs/test_cuda.txt"
printf '%-36s %s\n' "plan vs cudaMemGetInfo" ""
grep 'GPU memory in use' "$logs/test_cuda.txt"
ours=$(awk '$(NF-3) == 16 && $(NF-2) == 1024 { print $(NF-1) }' "$logs/bench.txt" | head -1)
grep -v '^GPT-2' "$logs/bench.txt" | sed 's/^/litgpt.c  /'
for mode in eager compile; do
    theirs=$(awk -v m="$mode" '$2 == m { print $NF }' "$logs/torch.txt")
    if [ -n "$ours" ] && [ -n "$theirs" ]; then
        printf '%-36s %s tokens/s, litgpt.c %s: ratio %s\n' "PyTorch $mode B 16" "$theirs" "$ours" \
            "$(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2f", a / b }')"
    fi
done
printf '%-36s %s\n' "driver, final val loss" "$(grep 'val loss' "$logs/train.txt" | tail -1)"
if [ -n "${OUT:-}" ]; then cp "$logs"/*.txt "$OUT"/; fi
