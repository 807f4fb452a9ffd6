#!/usr/bin/env bash
# tests/run.sh — every CPU test suite, then one closing line "N passed, N failed".
#
# Called by `make test` (and `make test-gpu` with SHARDLM_TEST_GPU=1). Each suite
# appends "passed failed name" to a results file (the test main reads
# SHARDLM_TEST_RESULTS and SHARDLM_TEST_SUITE); a suite that crashes or times
# out without writing its line counts as one failure. Exit status: 0 only when
# nothing failed.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
PYTHON=${PYTHON:-/usr/bin/python3}
export PYTHON BUILD
results="$BUILD/test-results.txt"
: > "$results"
logs="$BUILD/test-logs"  # each suite's output, whose tail the summary repeats when the suite failed
rm -rf "$logs"
mkdir -p "$logs"
log_of() { echo "$logs/$(tr -c 'A-Za-z0-9._-' '_' <<< "$1")"; }

if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
cores=$(nproc 2>/dev/null || echo 2)
# OpenMP threads that spin while OpenBLAS or another rank needs the core make the
# CPU backend 10x slower on a shared 2-core box; passive waiting avoids that.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
MPIRUN_FLAGS="--oversubscribe --bind-to none -x SHARDLM_TEST_RESULTS -x SHARDLM_TEST_SUITE -x OMP_NUM_THREADS -x OMP_WAIT_POLICY"

# run_suite NAME TIMEOUT CMD...: a suite that dies without reporting is one failure.
run_suite() {
  local name=$1 limit=$2
  shift 2
  local before
  before=$(grep -c . "$results")
  echo "== $name"
  SHARDLM_TEST_RESULTS="$results" SHARDLM_TEST_SUITE="$name" timeout --kill-after=10 "$limit" "$@" 2>&1 |
    tee "$(log_of "$name")"
  local rc=${PIPESTATUS[0]}
  if [ "$(grep -c . "$results")" = "$before" ]; then
    local why=""
    [ $rc = 124 ] && why=", timed out"
    [ $rc -gt 128 ] && why=", killed by signal $((rc - 128))"
    echo "$name: no result (exit status $rc$why)" | tee -a "$(log_of "$name")" >&2
    echo "0 1 $name" >> "$results"
  fi
}

threads_for() { local t=$(( cores / $1 )); [ $t -lt 1 ] && t=1; echo $t; }

OMP_NUM_THREADS=$cores run_suite unit 900 "$BUILD/test_unit"
for np in 1 2 3 4; do
  OMP_NUM_THREADS=$(threads_for $np) run_suite "mpi-np$np" 900 \
    $MPIRUN $MPIRUN_FLAGS -np $np "$BUILD/test_mpi"
done
# MPMD: two trainers and one receiver in one job; the role tests check the split.
OMP_NUM_THREADS=1 run_suite "mpi-mpmd" 300 \
  $MPIRUN $MPIRUN_FLAGS -np 2 "$BUILD/test_mpi" --test-suite=runtime : -np 1 "$BUILD/test_mpi" --test-suite=runtime

# run_script SCRIPT TIMEOUT: a script test prints PASS/FAIL lines; one that
# fails without printing FAIL counts as one failure.
run_script() {
  local t=$1 limit=$2
  echo "== $t"
  local out rc p f
  out=$(timeout "$limit" bash "$t" 2>&1); rc=$?
  echo "$out"
  echo "$out" > "$(log_of "$t")"
  p=$(grep -c '^PASS' <<< "$out"); f=$(grep -c '^FAIL' <<< "$out")
  if [ $rc != 0 ] && [ "$f" = 0 ]; then f=1; fi
  echo "$p $f $t" >> "$results"
}

for t in tests/scripts/*.sh; do
  [ -e "$t" ] && run_script "$t" 600
done

# The FP8 emulation against cuda_fp8.h's own conversions (host code: no GPU needed,
# only nvcc; the device checks run under make test-gpu).
NVCC_BIN=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
if [ "${SHARDLM_TEST_GPU:-0}" != 1 ] && [ -x "$NVCC_BIN" ]; then
  echo "== tests/gpu/build_fp8.sh --host-only"
  out=$(NVCC=$NVCC_BIN BUILD_GPU="$BUILD/gpu-host" timeout 900 bash tests/gpu/build_fp8.sh --host-only 2>&1); rc=$?
  echo "$out" | grep -E ' PASS$| FAIL$|passed|error' | tail -20
  p=$(grep -cE ' PASS$' <<< "$out"); f=$(grep -cE ' FAIL$' <<< "$out")
  if [ $rc != 0 ] && [ "$f" = 0 ]; then f=1; fi
  echo "$p $f fp8-host" >> "$results"
fi

# GPU suites (make test-gpu): kernel-vs-CPU checks; each binary prints PASS/FAIL lines.
if [ "${SHARDLM_TEST_GPU:-0}" = 1 ]; then
  OMP_NUM_THREADS=$cores run_suite gpu 900 "$BUILD/test_gpu"
  for t in tests/gpu/build_and_run.sh tests/gpu/build_attention.sh tests/gpu/build_rl_loss.sh \
           tests/gpu/build_ring_attention.sh tests/gpu/build_fp8.sh tests/gpu/build_sdpa_fp8.sh; do
    echo "== $t"
    out=$(timeout 900 bash "$t" --no-timing 2>&1); rc=$?
    echo "$out" | tail -40
    p=$(grep -cE ' PASS$' <<< "$out"); f=$(grep -cE ' FAIL$|^FAIL' <<< "$out")
    if [ $rc != 0 ] && [ "$f" = 0 ]; then f=1; fi
    echo "$p $f $t" >> "$results"
  done
  # Sharded training at world 2 on the GPU and the NCCL watchdog; the offload pipeline.
  run_script tests/gpu/test_multirank.sh 900
  run_script tests/gpu/test_offload.sh 900
  run_script tests/gpu/test_async_ckpt.sh 600
  # The RL job on one GPU: the weights device to device into the GPU decoder.
  run_script tests/gpu/test_rl_gpu.sh 900
  # ... a busy sampler over both device communicators, kill -9 and resume, top-p / top-k on-policy.
  run_script tests/gpu/test_rl_gpu_faults.sh 900
  # Context parallelism: the ring in the trainer, ranks sharing the GPU (staged MPI).
  run_script tests/gpu/test_context_parallel.sh 900
  # Expert parallelism: a model of experts' rows over the ranks sharing the GPU (staged MPI).
  run_script tests/gpu/test_expert_parallel.sh 900
fi

passed=$(awk '{p+=$1} END {print p+0}' "$results")
failed=$(awk '{f+=$2} END {print f+0}' "$results")
if [ "$failed" != 0 ]; then
  # What each failing suite printed last, where a log that shows only the end of the run still has it.
  awk '$2 > 0 {print $3}' "$results" | while read -r name; do
    f=$(log_of "$name")
    [ -s "$f" ] || continue
    echo "--- $name: the failures and the last lines of its output"
    grep -E '^FAIL|ERROR:|FAILED|: no result' "$f" | head -20
    tail -25 "$f"
  done
  echo "failing suites:"; awk '$2 > 0 {print "  " $3 ": " $2 " failed"}' "$results"
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
