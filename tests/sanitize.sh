#!/usr/bin/env bash
# tests/sanitize.sh — the ASan + UBSan build's checks (`make test-sanitize`):
# the unit suite (the fuzz cases included) and tiny training runs at -np 1 and
# -np 2 on the sanitizer build. Any sanitizer report fails its check: UBSan is
# built with -fno-sanitize-recover, ASan aborts on its first error. Ends with
# "N passed, N failed" like tests/run.sh; exit status 0 only when nothing failed.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-sanitize}
MPIRUN=${MPIRUN:-mpirun}
export BUILD MPIRUN
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
# Open MPI and HDF5 keep allocations until exit: leak reports would be theirs, not ours.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
passed=0 failed=0
scratch=$(mktemp -d "${TMPDIR:-/tmp}/shardlm-sanitize.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

# check NAME STATUS OUTPUT-FILE: passes when the command succeeded and printed no sanitizer report.
check() {
  local name=$1 status=$2 out=$3
  if [ "$status" = 0 ] && ! grep -qE 'runtime error:|ERROR: AddressSanitizer|ERROR: LeakSanitizer' "$out"; then
    echo "PASS $name"; passed=$((passed + 1))
  else
    echo "FAIL $name (exit status $status)"; grep -E -A12 'runtime error:|ERROR: AddressSanitizer' "$out" | head -40
    tail -20 "$out"; failed=$((failed + 1))
  fi
}

# The unit suite must run to its end with no sanitizer report; its own pass/fail
# counts are make test's business (printed here for the record).
timeout 2400 "$BUILD/test_unit" > "$scratch/unit.txt" 2>&1
counts=$(grep -o 'tests (1 rank): [0-9]* passed, [0-9]* failed' "$scratch/unit.txt")
check "unit suite under ASan+UBSan ran to its end, no report (${counts:-no summary line})" "$([ -n "$counts" ] && echo 0 || echo 1)" \
  "$scratch/unit.txt"
for np in 1 2; do
  timeout 900 $MPIRUN --oversubscribe --bind-to none -x ASAN_OPTIONS -x UBSAN_OPTIONS -x OMP_NUM_THREADS \
    -x OMP_WAIT_POLICY -np $np "$BUILD/shardlm" train inputs/tiny-sft.toml --set run.max_steps=6 \
    --set sched.warmup=2 --set run.dir="$scratch/np$np" > "$scratch/np$np.txt" 2>&1
  check "tiny-sft at -np $np under ASan+UBSan" $? "$scratch/np$np.txt"
done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
