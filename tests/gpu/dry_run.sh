#!/bin/sh
# tests/gpu/dry_run.sh — tests/gpu/run.sh on this CPU machine, before it meets a GPU (make test
# runs it through tests/test.c). The GPU binaries are stand-ins, shell scripts that behave as a
# check may on a GPU: the `memory` mode is the real test_cuda built for the emulator
# (build/test_cuda_emulated); `attention` prints two results and aborts (SIGABRT, as
# lg_cuda_die does), `steps` prints one and hangs, `grads` fails a check; nvidia-smi and
# compute-sanitizer are stubs. Three runs:
#   1. every step with a 3 s cap each: the crash and the hang are recorded, what they printed
#      reaches $OUT, the steps after them still run, the hung step's processes are gone;
#   2. the run killed (TERM) during the hanging step: the summary names it and ends;
#   3. a 3 s deadline: the hang takes what is left and the next step is skipped with a line;
#      no NCCL: the multi-GPU step is skipped, the others run on GPU 0.
# Prints "  ok"/"  FAIL" lines and "N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
root=$(pwd)
dry=$root/build/gpu-dry
rm -rf "$dry"
mkdir -p "$dry/bin" "$dry/path"
passed=0
failed=0
check() { # CONDITION-STATUS TEXT
    if [ "$1" -eq 0 ]; then echo "  ok    $2"; passed=$((passed + 1))
    else echo "  FAIL  $2"; failed=$((failed + 1)); fi
}
has() { grep -q -e "$2" "$1" 2>/dev/null; } # FILE PATTERN

if [ ! -x build/test_cuda_emulated ]; then
    echo "  FAIL  build/test_cuda_emulated is missing (make build/test_cuda_emulated)"
    echo "0 passed, 1 failed"
    exit 1
fi

cat > "$dry/bin/test_cuda" <<EOF
#!/bin/sh
case "\$1" in
memory) exec env LG_EMU_DEVICES=1 LG_EMU_MEMORY=256M OMP_NUM_THREADS=1 "$root/build/test_cuda_emulated" memory ;;
attention) echo attention; echo "  ok    stand-in attention 1"; echo "  ok    stand-in attention 2"
    kill -s ABRT \$\$ ;;
steps) echo "training steps"; echo "  ok    stand-in step 1"; echo \$\$ > "$dry/hung.pid"
    sleep 300; echo "  ok    after the hang" ;;
grads) echo "  ok    stand-in grads 1"; echo "  FAIL  stand-in grads 2 (made to fail)"
    echo "1 passed, 1 failed"; exit 1 ;;
bench) echo "GPT-2 124M bf16-mixed            B      T     tokens/s      MFU"
    echo "stand-in GPU                    16   1024       400000    40.0%" ;;
--probe) echo "runtime: stand-in, 2 devices" ;;
*) echo "  ok    stand-in \$1"; echo "1 passed, 0 failed" ;;
esac
EOF
cat > "$dry/bin/train_cuda" <<'EOF'
#!/bin/sh
echo "step 200/200 | loss 1.70"
echo "step 200 | val loss 1.69"
EOF
cat > "$dry/path/nvidia-smi" <<'EOF'
#!/bin/sh
echo "name, driver_version, memory.total [MiB], memory.used [MiB]"
echo "Stand-in GPU, 0.0, 143771 MiB, 0 MiB"
echo "Stand-in GPU, 0.0, 143771 MiB, 0 MiB"
EOF
cat > "$dry/path/compute-sanitizer" <<'EOF'
#!/bin/sh
while [ $# -gt 0 ]; do case $1 in --tool|--error-exitcode) shift 2 ;; *) break ;; esac; done
exec "$@"
EOF
chmod +x "$dry/bin/"* "$dry/path/"*

# run N [VAR=VALUE...]: run.sh with the stand-ins, $OUT = $dry/outN, in the background; its pid in $pid
run() {
    n=$1
    shift
    mkdir -p "$dry/out$n"
    env PATH="$dry/path:$PATH" GPU_BIN="$dry/bin" OUT="$dry/out$n" RUN_PYTHON=false \
        RUN_MIN_STEP=1 "$@" sh tests/gpu/run.sh > "$dry/run$n.txt" 2>&1 &
    pid=$!
}
# gone PIDFILE: the process whose pid the file holds has ended
gone() { [ -s "$1" ] && ! kill -0 "$(cat "$1")" 2>/dev/null; }

# 1. every step, each capped at 3 s
run 1 RUN_SECONDS=60 RUN_STEP_LIMIT=3
wait "$pid"
code=$?
s=$dry/out1/summary.txt
check $code "run 1 ends with status 0 (got $code)"
has "$s" '^ended .*complete'
check $? "run 1: the summary reaches \$OUT and ends 'complete'"
has "$s" '^libraries .*NCCL: yes'
check $? "run 1: the libraries found (cuBLASLt, NCCL) are in the summary"
has "$s" '^gpus  *ok' && has "$s" '^probe  *ok' && has "$dry/out1/probe.txt" 'stand-in, 2 devices'
check $? "run 1: nvidia-smi's table (the stub) and test_cuda --probe recorded"
has "$s" '^ops  *ok: 1 passed, 0 failed'
check $? "run 1: a passing mode: its counts"
has "$s" '^attention  *CRASHED (signal 6, ABRT): 2 ok, 0 FAIL lines before it ended'
check $? "run 1: the aborted mode: CRASHED, signal 6, with the 2 results it printed"
has "$dry/out1/attention.txt" 'stand-in attention 2'
check $? "run 1: the crashed mode's output reached \$OUT/attention.txt"
has "$s" '^steps  *TIMEOUT (still running at its limit: killed): 1 ok'
check $? "run 1: the hung mode: TIMEOUT after its 3 s cap, with its 1 result"
gone "$dry/hung.pid"
check $? "run 1: the hung mode's processes are gone"
has "$s" '^grads  *exit 1: 1 passed, 1 failed' && has "$s" '^  FAIL  stand-in grads 2'
check $? "run 1: a failed check: the mode's counts and its FAIL line in the summary"
has "$s" '^memory  *ok: 5 passed, 0 failed' && has "$s" 'GPU memory in use'
check $? "run 1: the emulated test_cuda memory mode, after the crash and the hang: 5 passed (the plan, a refusal, cuBLASLt's out-of-memory line named and spelled, a stopped GPU's step)"
has "$s" '^bench  *ok' && has "$s" '^bench  stand-in GPU  *16  *1024  *400000' && has "$s" '^train  .*val loss 1.69'
check $? "run 1: the benchmark's table and the driver's last validation loss in the summary"
has "$s" '^torch  *skipped: no PyTorch' && has "$s" '^racecheck  *CRASHED' && has "$s" '^memcheck-step  *ok'
check $? "run 1: torch skipped with a line; the sanitizer steps ran (a stub: attention crashes again)"
l=$dry/out1/run.log
has "$l" 'stand-in attention 2' && has "$l" 'stand-in step 1' && ! has "$l" 'after the hang'
check $? "run 1: run.log holds every step's output (the hung step's line, nothing after its kill)"

# 2. killed during the hanging step
rm -f "$dry/hung.pid"
run 2 RUN_SECONDS=60 RUN_STEP_LIMIT=30 RUN_STEPS="ops steps bench"
for i in $(seq 50); do [ -s "$dry/hung.pid" ] && break; sleep 0.1; done
kill -s TERM "$pid"
wait "$pid"
code=$?
s=$dry/out2/summary.txt
check $((code != 130)) "run 2: killed by TERM during a step: status 130 (got $code)"
has "$s" '^ops  *ok: 1 passed' && has "$s" '^steps  *KILLED with run.sh (TERM) after [0-9]* s: 1 ok'
check $? "run 2: the summary keeps the earlier step and names the killed one with its 1 result"
has "$s" '^ended  *killed by TERM during steps' && ! has "$s" '^bench'
check $? "run 2: the summary ends saying it was killed; no later step ran"
sleep 0.5
gone "$dry/hung.pid"
check $? "run 2: the killed step's processes are gone"

# 3. a 3 s deadline, no NCCL, 2 GPUs listed
run 3 RUN_SECONDS=3 RUN_STEP_LIMIT=30 RUN_NO_NCCL=1 RUN_STEPS="gpus steps bench devices"
wait "$pid"
s=$dry/out3/summary.txt
has "$s" '^steps  *TIMEOUT' && has "$s" '^bench  *skipped: [0-9]* s left of 3'
check $? "run 3: the hang takes what is left of the deadline, the next step is skipped with a line"
has "$s" '^devices  *skipped: no libnccl.so.2' && has "$dry/out3/run.log" 'CUDA_VISIBLE_DEVICES=0' && has "$s" '^ended .*complete'
check $? "run 3: without NCCL the multi-GPU step is skipped and the rest run on GPU 0"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
