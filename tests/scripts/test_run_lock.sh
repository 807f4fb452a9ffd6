#!/usr/bin/env bash
# test_run_lock.sh — run.lock held by one run only.
#   A run whose run.lock is rewritten mid-run by another holder (as a run on
#   another host taking it over does) stops at the end of that step, with a
#   message naming the new holder and exit 73, saves no checkpoint and writes no
#   end row in that directory, and leaves the other holder's lock in place.
#   Two trainer ranks: the stop is agreed, rank 1 leaves with rank 0.
# (The other cases, a fresh lock with this Slurm step's ids refused and a stale
# one taken, token-checked removal, are unit tests: tests/unit/test_runs.cpp.)
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive SHARDLM_CKPT_FAULT=""
# A heartbeat every 200 ms instead of 15 s: the lost lock is noticed within a step or two.
export SHARDLM_RUN_LOCK_HEARTBEAT_MS=200
if [ ! -x "$BIN" ]; then echo "FAIL run_lock: $BIN is not built"; exit 1; fi

T=$(mktemp -d /tmp/shardlm-lock-XXXXXX)
cleanup() { [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"; }
trap cleanup EXIT
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has, wait_for
logged() { grep -qF "\"step\": $2," "$1/metrics.jsonl" 2>/dev/null; }

A=$T/a
$MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x SHARDLM_RUN_LOCK_HEARTBEAT_MS \
  -np 2 "$BIN" train inputs/tiny-sft.toml --set "run.dir=$A" --set log.interval=1 --set run.max_steps=3000 \
  --set ckpt.interval=5 > "$T/a.log" 2>&1 &
job=$!
check "the run logs steps" wait_for 240 logged "$A" 3
check "... and holds run.lock with its token" grep -q "^token=$(hostname):" "$A/run.lock"
# Another holder rewrites the file in place, as a run on another host taking a
# lock it found stale does (ftruncate + write on the same inode).
thief='host=node-thief-9
pid=9999
started=2026-12-01 12:00:00 UTC
run_name=thief
deck=thief.toml
token=node-thief-9:9999:1:00000000000000ff
'
printf '%s' "$thief" > "$A/run.lock"
wait_for 60 bash -c "! kill -0 $job 2>/dev/null" || kill -9 $(tree_pids "$job") 2>/dev/null
wait "$job"
rc=$?
check "a run whose run.lock was taken stops: exit 73 (got $rc)" test $rc = 73
check "... with a message naming the new holder" \
  has "$T/a.log" "was taken by another run: $A/run.lock now names pid 9999 on host node-thief-9, started 2026-12-01 12:00:00 UTC (run 'thief', deck thief.toml)"
check "... said once (by trainer rank 0)" test "$(grep -c 'was taken by another run' "$T/a.log")" = 1
stopped=$(sed -n 's/.*Stopped after step \([0-9]*\) without a checkpoint.*/\1/p' "$T/a.log")
logged_last=$(grep -o '"step": [0-9]*,' "$A/metrics.jsonl" | tail -1 | tr -dc 0-9)
check "... after the step it was at (step ${stopped:-?}, the last logged ${logged_last:-?})" \
  test -n "$stopped" -a "${stopped:-x}" = "${logged_last:-y}"
check "... within a few steps of the rewrite (stopped at ${stopped:-?} of 3000)" test "${stopped:-3000}" -lt 2000
check "... the other holder's lock is left as that holder wrote it" test "$(cat "$A/run.lock")" = "${thief%$'\n'}"
check "... no checkpoint saved at that step" test ! -e "$A/checkpoints/step_${stopped:-x}.h5"
check "... no end row written in that directory" bash -c "! grep -q '\"event\": \"end\"' '$A/metrics.jsonl'"
check "... not a signal stop: no 'stopped by signal', no exit 75" bash -c "! grep -q 'stopped by signal' '$T/a.log'"

exit $((failures > 0))
