#!/bin/sh
# tests/gpu/run.sh — the checks that need a GPU, for a machine lent for minutes: whatever happens
# (a check that crashes or hangs, a missing library, the run killed) it reports what it could do.
#
# It runs the binaries `make gpu-bin` built beforehand on a CPU machine (sm_90, portable host
# code, -lineinfo), which travel with the working tree in build/gpu-bin; only without them (or
# when they cannot load) does it build here, when nvcc is found.
#   0. the libraries: the system's libcublasLt and libnccl, else a Python environment's
#      (nvidia-* wheels under site-packages), added to LD_LIBRARY_PATH; NCCL is loaded by the
#      backend only when a communicator is made, so one GPU runs without it;
#   1. the GPUs (nvidia-smi), and what the binaries' CUDA runtime sees (test_cuda --probe; when
#      it sees none, or the binaries cannot load, they are built here once if nvcc is found);
#   2. then the steps, in order of value, each in its own process with its own timeout:
#      test_cuda's modes (ops, attention, steps, ...; a crash or hang of one loses nothing of
#      the others), GPT-2 124M throughput, the attention benchmark, the driver end to end, the
#      --offload parts' price (bench-offload: ms a step against the plan's copy time),
#      PyTorch's step on the same GPU, compute-sanitizer over the attention kernels and a step.
# One deadline for the whole run: RUN_SECONDS (default 540); a step gets at most its own limit
# and what is left, and is skipped with a line when under RUN_MIN_STEP (10) seconds are left.
# Everything lands in $OUT (else build/gpu) as it comes: STEP.txt per step (written line by line
# while it runs), run.log (all of it), summary.txt (a line per step as it ends, and a last line
# saying how the run ended, written also when run.sh is killed by TERM, INT or HUP).
# For tests (tests/gpu/dry_run.sh): GPU_BIN (the binaries' folder), RUN_STEP_LIMIT (a cap on
# every step's limit), RUN_MIN_STEP, RUN_PYTHON (python3), RUN_STEPS (only these steps, by
# name), RUN_NO_NCCL (behave as if no libnccl.so.2 were found).
set -u
cd "$(dirname "$0")/../.." || exit 1
ulimit -c 0 2>/dev/null # an aborted check writes no core file (seconds and disk of the deadline)
RUN_SECONDS=${RUN_SECONDS:-540}
step_cap=${RUN_STEP_LIMIT:-600}
min_step=${RUN_MIN_STEP:-10}
python=${RUN_PYTHON:-python3}
bin=${GPU_BIN:-build/gpu-bin}
logs=${OUT:-build/gpu}
mkdir -p "$logs" || exit 1
log=$logs/run.log
summary=$logs/summary.txt
started=$(date +%s)
deadline=$((started + RUN_SECONDS))
current=""   # the step running now, for the trap
child=""     # its timeout process (the leader of the step's process group)
step_started=$started
closed=""
: > "$log"
: > "$summary"

elapsed() { echo $(($(date +%s) - started)); }
say() { echo "$*"; echo "$*" >> "$log"; }
# result NAME TEXT: one line of the summary, as soon as it is known
result() {
    line=$(printf '%-16s %s' "$1" "$2")
    say "$line"
    echo "$line" >> "$summary"
}
count_lines() { grep -c "$1" "$2" 2>/dev/null || true; }

# outcome RC FILE: what a step's exit status and log say ("ok: 345 passed, 0 failed", "CRASHED
# (signal 6, ABRT): 12 ok, 0 FAIL lines before it ended", "TIMEOUT ...")
outcome() {
    case $1 in
    0) state="ok" ;;
    124) state="TIMEOUT (still running at its limit: killed)" ;;
    137) state="TIMEOUT (did not end on TERM: killed)" ;;
    *) if [ "$1" -gt 128 ]; then
           state="CRASHED (signal $(($1 - 128)), $(kill -l $(($1 - 128)) 2>/dev/null))"
       else state="exit $1"; fi ;;
    esac
    counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$2" | tail -1)
    oks=$(count_lines '^  ok' "$2")
    fails=$(count_lines '^  FAIL' "$2")
    if [ -n "$counts" ]; then echo "$state: $counts"
    elif [ "$1" -eq 0 ] && [ "$oks$fails" = 00 ]; then echo "$state"
    elif [ "$oks$fails" = 00 ]; then echo "$state: $(grep -v '^[[:space:]]*$' "$2" | tail -n 1 | cut -c1-160)"
    else echo "$state: $oks ok, $fails FAIL lines before it ended"; fi
}

# closing TEXT: the summary's last line (once)
closing() {
    [ -n "$closed" ] && return
    closed=1
    result "ended" "$1 after $(elapsed) s of $RUN_SECONDS ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
    echo
    echo "== summary ($logs/summary.txt)"
    cat "$summary"
}

# On a signal: the running step is killed (its whole process group) and named, with what its
# log holds so far; the summary ends saying so.
on_signal() {
    trap - INT TERM HUP
    if [ -n "$child" ]; then
        kill -s TERM -"$child" 2>/dev/null || kill -s TERM "$child" 2>/dev/null
        sleep 1
        kill -s KILL -"$child" 2>/dev/null
    fi
    if [ -n "$current" ]; then
        cat "$logs/$current.txt" >> "$log" 2>/dev/null
        result "$current" "KILLED with run.sh ($1) after $(($(date +%s) - step_started)) s: $(count_lines '^  ok' "$logs/$current.txt") ok, $(count_lines '^  FAIL' "$logs/$current.txt") FAIL lines so far"
    fi
    closing "killed by $1 during ${current:-no step}"
    exit 130
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap 'on_signal HUP' HUP
trap 'closing "run.sh stopped (exit $?)"' EXIT

# wanted NAME: whether RUN_STEPS (when set) names the step
wanted() { [ -z "${RUN_STEPS:-}" ] || case " $RUN_STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# step NAME LIMIT COMMAND...: COMMAND in its own process group (timeout's) for at most LIMIT s
# (or what is left), its output into $logs/NAME.txt as it comes; a summary line when it ends,
# with its FAIL lines. Returns COMMAND's status (1 when skipped for time, 0 when not in RUN_STEPS).
step() {
    name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    left=$((deadline - $(date +%s)))
    if [ "$left" -lt "$min_step" ]; then
        [ "$left" -lt 0 ] && left=0
        result "$name" "skipped: $left s left of $RUN_SECONDS"
        return 1
    fi
    [ "$limit" -gt "$step_cap" ] && limit=$step_cap
    [ "$limit" -gt "$left" ] && limit=$left
    say "== $name: $* (at most $limit s) [$(elapsed) s]"
    current=$name
    step_started=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$logs/$name.txt" 2>&1 &
    child=$!
    wait "$child"
    rc=$?
    child=""
    current=""
    cat "$logs/$name.txt" >> "$log"
    grep -v '^  ok' "$logs/$name.txt" | tail -n 40
    result "$name" "$(outcome "$rc" "$logs/$name.txt") in $(($(date +%s) - step_started)) s"
    grep '^  FAIL' "$logs/$name.txt" | head -n 30 >> "$summary"
    return "$rc"
}

# skip NAME WHY: a step not run, with the reason
skip() { wanted "$1" && result "$1" "skipped: $2"; }

# --- 0. libraries -------------------------------------------------------------------------------

# The folders a CUDA library may be in besides the loader's: CUDA's own, then every Python
# environment's nvidia-* wheels (site-packages/nvidia/*/lib, e.g. nvidia/nccl/lib, nvidia/cu13/lib).
library_dirs() {
    echo /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /opt/conda/lib
    sites=$(timeout 20 "$python" -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
    for sp in $sites /usr/lib/python3/dist-packages /usr/local/lib/python3*/dist-packages /opt/conda/lib/python3*/site-packages; do
        [ -d "$sp/nvidia" ] && ls -d "$sp"/nvidia/*/lib 2>/dev/null
    done
}

# find_library SONAME: "loader" when the loader finds it already, else the folder holding it
# (searched: library_dirs, then a bounded find), else nothing.
loader_cache() { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; }
find_library() {
    if loader_cache | grep -q "^[[:space:]]*$1 "; then echo loader; return; fi
    for d in $(echo "${LD_LIBRARY_PATH:-}" | tr ':' ' '); do
        [ -e "$d/$1" ] && { echo loader; return; }
    done
    for d in $(library_dirs); do
        [ -e "$d/$1" ] && { echo "$d"; return; }
    done
    found=$(timeout 20 find /usr /opt /root /home -name "$1" -print 2>/dev/null | head -n 1)
    [ -n "$found" ] && dirname "$found"
}

# use_library SONAME: found -> LD_LIBRARY_PATH (said), else returns 1
use_library() {
    where=$(find_library "$1")
    if [ -z "$where" ]; then say "  $1: not found (loader, CUDA, Python wheels, find)"; return 1; fi
    if [ "$where" = loader ]; then say "  $1: the loader's ($(loader_cache | grep "^[[:space:]]*$1 " | sed 's/.*=> //' | head -n 1))"
    else
        say "  $1: $where (added to LD_LIBRARY_PATH)"
        LD_LIBRARY_PATH=$where${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        export LD_LIBRARY_PATH
    fi
}

# missing_libraries BINARY: the sonames ldd cannot resolve
missing_libraries() { ldd "$1" 2>/dev/null | awk '/not found/ { print $1 }' | sort -u; }

# build_here WHY: make gpu-bin on this machine when it has nvcc (minutes of the deadline)
built_here=""
build_here() {
    if [ -n "$built_here" ]; then return 1; fi
    built_here=1
    if command -v nvcc > /dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
        say "$1: building them here (make gpu-bin)"
        step build 300 make -s -B -j2 gpu-bin
    else
        result binaries "$1, and no nvcc here to build them"
        return 1
    fi
}

# find_libraries: what the binaries need and the loader lacks, looked for and added; sets
# cannot_load to what is still missing
find_libraries() {
    for so in $(missing_libraries "$bin/test_cuda"; missing_libraries "$bin/train_cuda"); do
        use_library "$so"
    done
    cannot_load=$( (missing_libraries "$bin/test_cuda"; missing_libraries "$bin/train_cuda") | sort -u | tr '\n' ' ')
    [ -x "$bin/test_cuda" ] && [ -x "$bin/train_cuda" ] || cannot_load="(no binaries in $bin) $cannot_load"
}

say "== run.sh $(date -u '+%Y-%m-%d %H:%M:%S UTC'): RUN_SECONDS $RUN_SECONDS, binaries $bin, logs $logs"
if [ ! -x "$bin/test_cuda" ] || [ ! -x "$bin/train_cuda" ]; then
    build_here "no prepared binaries in $bin (make gpu-bin on the CPU machine)"
fi
say "== libraries [$(elapsed) s]"
find_libraries
if [ -n "$cannot_load" ] && build_here "the binaries cannot load (missing $cannot_load)"; then
    find_libraries
fi
nccl=yes
if [ -n "${RUN_NO_NCCL:-}" ]; then say "  libnccl.so.2: not looked for (RUN_NO_NCCL)"; nccl=no
else use_library libnccl.so.2 || nccl=no; fi
ldd "$bin/test_cuda" 2>&1 | grep -E 'cublas|nccl|cudart|gomp|not found|not a dynamic' >> "$logs/libraries.txt"
result libraries "cuBLASLt/runtime: ${cannot_load:+MISSING $cannot_load}${cannot_load:-found}; NCCL: $nccl${LD_LIBRARY_PATH:+; LD_LIBRARY_PATH=$LD_LIBRARY_PATH}"

# --- 1. the GPUs ------------------------------------------------------------------------------------

gpus=0
if step gpus 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv &&
    [ -s "$logs/gpus.txt" ]; then
    gpus=$(($(wc -l < "$logs/gpus.txt") - 1))
fi
[ "$gpus" -gt 0 ] || say "no GPU listed by nvidia-smi: the steps run anyway (they say what they find)"
# what the binaries' CUDA runtime sees: a driver older than it shows as no device
if [ -z "$cannot_load" ] && ! step probe 30 "$bin/test_cuda" --probe && [ "$gpus" -gt 0 ] &&
    build_here "test_cuda sees no GPU where nvidia-smi lists $gpus (a driver older than the binaries' CUDA?)"; then
    find_libraries
    step probe-again 30 "$bin/test_cuda" --probe
fi
if [ "$nccl" = no ] && [ "$gpus" -gt 1 ]; then
    say "no NCCL: the checks run on GPU 0 alone (CUDA_VISIBLE_DEVICES=0)"
    CUDA_VISIBLE_DEVICES=0
    export CUDA_VISIBLE_DEVICES
fi

# --- 2. the steps, in order of value ---------------------------------------------------------------

tc=$bin/test_cuda
if [ -n "$cannot_load" ]; then
    for s in ops attention long-context steps bench memory bench-attention train grads features combinations resume bench-offload devices; do
        skip "$s" "the binaries cannot load (missing $cannot_load)"
    done
else
    step ops 90 "$tc" ops
    step attention 90 "$tc" attention
    step long-context 300 "$tc" long-context
    step steps 120 "$tc" steps
    step bench 120 "$tc" bench
    step memory 90 "$tc" memory
    step bench-attention 60 "$tc" bench-attention
    step train 60 "$bin/train_cuda" --max-steps 200 --eval-every 100
    step grads 60 "$tc" grads
    step features 90 "$tc" features
    step combinations 120 "$tc" combinations
    step resume 90 "$tc" resume
    step bench-offload 60 "$tc" bench-offload
    if [ "$nccl" = yes ]; then step devices 90 "$tc" devices
    else skip devices "no libnccl.so.2 found"; fi
fi
if timeout 30 "$python" -c "import torch; assert torch.cuda.is_available()" > /dev/null 2>&1; then
    step torch 150 "$python" tests/gpu/torch_gpt2_step.py -b 16 -t 1024
else
    skip torch "no PyTorch with CUDA here ($python)"
fi
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$cannot_load" ]; then skip memcheck "the binaries cannot load"
elif [ -z "$sanitizer" ]; then skip memcheck "no compute-sanitizer"
else
    step memcheck 150 "$sanitizer" --tool memcheck --error-exitcode 99 "$tc" attention
    step racecheck 150 "$sanitizer" --tool racecheck --error-exitcode 99 "$tc" attention
    step memcheck-step 120 "$sanitizer" --tool memcheck --error-exitcode 99 \
        "$bin/train_cuda" -c test-llama -t 16 -b 2 -g 4 --max-steps 2 --eval-every 0
fi

# --- the table ---------------------------------------------------------------------------------------

ours=$(awk '$(NF-3) == 16 && $(NF-2) == 1024 { print $(NF-1) }' "$logs/bench.txt" 2>/dev/null | head -n 1)
for mode in eager compile; do
    theirs=$(awk -v m="$mode" '$2 == m { print $NF }' "$logs/torch.txt" 2>/dev/null)
    if [ -n "$ours" ] && [ -n "$theirs" ]; then
        result "torch $mode" "B 16: $theirs tokens/s, litgpt.c $ours: ratio $(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2f", a / b }')"
    fi
done
grep 'GPU memory in use' "$logs/memory.txt" 2>/dev/null >> "$summary"
grep '^cuda.runtime on' "$logs/long-context.txt" 2>/dev/null | sed 's/^/long-context  /' >> "$summary"
grep -E '^ +[0-9]+ ' "$logs/long-context.txt" 2>/dev/null | sed 's/^ */long-context  T /' >> "$summary"
grep -v '^GPT-2' "$logs/bench.txt" 2>/dev/null | sed 's/^/bench  /' >> "$summary"
grep 'val loss' "$logs/train.txt" 2>/dev/null | tail -n 1 | sed 's/^/train  /' >> "$summary"
closing "complete"
