#!/usr/bin/env bash
# test_watchdog.sh — no wait lasts past comm.timeout_s:
#   a rank stuck in a background checkpoint write ends the job within the bound,
#     naming the rank and the write; the previous checkpoint stays `latest` and whole;
#   the same with SIGUSR1 pending exits 75 (requeue);
#   a rank stuck in a synchronous save, and rank 0 stuck in the final export,
#     end the job naming them;
#   a final export that takes longer than comm.timeout_s but keeps making
#     progress does not trip it: the other ranks wait in their barrier.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive SHARDLM_CKPT_FAULT="" SHARDLM_FAULT=""
if [ ! -x "$BIN" ]; then echo "FAIL watchdog: $BIN is not built"; exit 1; fi

T=$(mktemp -d /tmp/shardlm-watchdog-XXXXXX)
cleanup() { [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"; }
trap cleanup EXIT
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has, wait_for
# finish PID: wait for the job (killing its tree after 120 s: a hang is the failure
# this file is about); sets rc and took (seconds from start_s)
finish() {
  wait_for 120 bash -c "! kill -0 $1 2>/dev/null" || kill -9 $(tree_pids "$1") 2>/dev/null
  wait "$1"
  rc=$?
  took=$((SECONDS - start_s))
}
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x SHARDLM_CKPT_FAULT -x SHARDLM_FAULT)
sft() { echo inputs/tiny-sft.toml --set "run.dir=$1" --set log.interval=1 --set ckpt.interval=5 --set run.max_steps=20; }

# ---- a background write that stalls (rank 1, the save of step 10): the bound
# is 3 s; without the watchdog the job waits forever (finish kills it at 120 s)
D=$T/async
start_s=$SECONDS
SHARDLM_CKPT_FAULT=stall:10@1 "${MPI[@]}" -np 2 "$BIN" train $(sft "$D") --set ckpt.async=true --set comm.timeout_s=3 \
  > "$T/async.log" 2>&1 &
finish $!
check "async write stalled on rank 1: the job ends, exit 1 (got $rc after ${took} s)" test $rc = 1 -a $took -lt 100
check "... the message names rank 1 and the write" \
  has "$T/async.log" "error on rank 1 of 2 ($(hostname)): checkpoint: rank 1's background write of step 10 to $D/checkpoints/step_10.h5.tmp has made no progress for"
check "... the bound it kept" has "$T/async.log" "(comm.timeout_s = 3): stuck in I/O"
check "... latest still names step 5" test "$(cat "$D/checkpoints/latest" 2>/dev/null)" = step_5.h5
"$BIN" inspect "$D/checkpoints/step_5.h5" > "$T/inspect.log" 2>&1
check "... and step 5 is whole (inspect verifies every checksum: exit $?)" test $? = 0

# ---- the same with a stop signal pending: the job was ending anyway; exit 75
# lets the scheduler requeue it from step 5
D=$T/async-usr1
start_s=$SECONDS
SHARDLM_CKPT_FAULT=stall:10@1 "${MPI[@]}" -np 2 "$BIN" train $(sft "$D") --set ckpt.async=true --set comm.timeout_s=6 \
  > "$T/usr1.log" 2>&1 &
job=$!
wait_for 60 grep -qs "step     15/" "$T/usr1.log"  # the save of step 15 now waits for the stalled one
kill -USR1 $job
finish $job
check "async write stalled, SIGUSR1 pending: exit 75 (got $rc)" test $rc = 75
check "... the message says why 75" has "$T/usr1.log" "ending the job with exit 75 (a stop signal is pending"
check "... latest still names step 5" test "$(cat "$D/checkpoints/latest" 2>/dev/null)" = step_5.h5

# ---- a synchronous save that stalls on rank 1
D=$T/sync
start_s=$SECONDS
SHARDLM_CKPT_FAULT=stall:10@1 "${MPI[@]}" -np 2 "$BIN" train $(sft "$D") --set ckpt.async=false --set comm.timeout_s=3 \
  > "$T/sync.log" 2>&1 &
finish $!
check "sync save stalled on rank 1: exit 1 (got $rc after ${took} s)" test $rc = 1 -a $took -lt 100
check "... the message names rank 1 and the save" \
  has "$T/sync.log" "error on rank 1 of 2 ($(hostname)): checkpoint: saving step 10 to $D/checkpoints/step_10.h5.tmp has made no progress"
check "... latest still names step 5" test "$(cat "$D/checkpoints/latest" 2>/dev/null)" = step_5.h5

# ---- the final export: rank 0 stuck in it
D=$T/export-stall
start_s=$SECONDS
SHARDLM_FAULT=export_stall@0 "${MPI[@]}" -np 2 "$BIN" train $(sft "$D") --set run.export_dir="$D/hf" --set comm.timeout_s=3 \
  > "$T/export-stall.log" 2>&1 &
finish $!
check "export stalled on rank 0: exit 1 (got $rc after ${took} s)" test $rc = 1 -a $took -lt 100
check "... the message names rank 0 and the export" \
  has "$T/export-stall.log" "error on rank 0 of 2 ($(hostname)): export: writing $D/hf/model.safetensors has made no progress"
check "... no model.safetensors half-written under its real name" test ! -e "$D/hf/model.safetensors"
check "... the run's last checkpoint is latest" test "$(cat "$D/checkpoints/latest" 2>/dev/null)" = step_20.h5

# ---- the final export takes 6 s on rank 0 with comm.timeout_s = 2, progressing:
# rank 1 waits in its barrier past the bound (rank 0 answers "busy") and the run completes
D=$T/export-slow
start_s=$SECONDS
SHARDLM_FAULT=export_slow@0 "${MPI[@]}" -np 2 "$BIN" train $(sft "$D") --set run.export_dir="$D/hf" --set comm.timeout_s=2 \
  > "$T/export-slow.log" 2>&1 &
finish $!
check "export slower than comm.timeout_s but progressing: exit 0 (got $rc)" test $rc = 0
check "... exported" test -s "$D/hf/model.safetensors"
check "... no watchdog line" test -z "$(grep -E 'no progress|has not completed after' "$T/export-slow.log")"

exit $((failures > 0))
