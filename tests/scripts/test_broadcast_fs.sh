#!/usr/bin/env bash
# test_broadcast_fs.sh — the filesystem weight broadcast never
# removes a step directory a receiver has not finished reading.
#   a slow receiver (SHARDLM_FAULT=receive_slow) beside a fast one, a broadcast
#     every step, broadcast.keep = 2: every receiver reads every step, the job
#     exits 0, the trainer is held back so that at most keep + 1 directories
#     exist at any time, and keep are left at the end;
#   a receiver stuck longer than comm.timeout_s on its first step: the trainer
#     says its directories are kept and trains on, the receiver still reads every
#     step, and once it has caught up retention takes the count back to keep.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
PY=${PYTHON:-/usr/bin/python3}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive SHARDLM_CKPT_FAULT=""
if [ ! -x "$BIN" ]; then echo "FAIL broadcast_fs: $BIN is not built"; exit 1; fi

T=$(mktemp -d /tmp/shardlm-bcast-XXXXXX)
cleanup() { [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"; }
trap cleanup EXIT
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has, wait_for
# run_job LOG BCAST_DIR COUNTS CMD...: runs the MPMD job, sampling the number of
# step directories every 20 ms into COUNTS; kills it after 240 s (a hang); sets rc.
run_job() {
  local log=$1 dir=$2 counts=$3 job
  shift 3
  "$@" > "$log" 2>&1 &
  job=$!
  : > "$counts"
  local i
  for ((i = 0; i < 12000; i++)); do
    kill -0 "$job" 2>/dev/null || break
    (shopt -s nullglob; d=("$dir"/step_*); echo ${#d[@]}) >> "$counts"
    sleep 0.02
  done
  kill -0 "$job" 2>/dev/null && kill -9 $(tree_pids "$job") 2>/dev/null
  wait "$job"
  rc=$?
}
# steps_read LOG N: the steps receiver N reported, in order, on one line.
steps_read() { sed -n "s/^receive\[$2\]: step \([0-9]*\): .*checksums ok$/\1/p" "$1" | tr '\n' ' '; }
left() { (cd "$1" && ls -d step_* 2>/dev/null | sort -t_ -k2 -n | tr '\n' ' '); }

"$PY" tools/make_rollouts.py inputs/data/tiny.h5 --out "$T/rollouts" --steps 40 > "$T/rollouts.log" 2>&1
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x SHARDLM_FAULT
     -x SHARDLM_RECEIVE_SLOW_MS -x SHARDLM_RECEIVE_SLOW_STEPS)
deck() {  # deck RUN_DIR BCAST_DIR
  echo inputs/tiny-rl.toml --set "run.dir=$1" --set "data.rollout_dir=$T/rollouts" --set log.interval=1 \
    --set ckpt.interval=0 --set 'broadcast.backend="filesystem"' --set "broadcast.dir=$2" \
    --set broadcast.interval=1 --set broadcast.keep=2
}

# ---- one trainer, two receivers; the second (world rank 2) takes 1.5 s more per step:
# far slower than a tiny step even on a loaded machine (at 300 ms, CI's busy 2 cores
# once kept the trainer from ever getting ahead), so the trainer must wait for it
A=$T/a
read -ra rl <<< "$(deck "$A/run" "$A/bc")"
SHARDLM_FAULT=receive_slow@2 SHARDLM_RECEIVE_SLOW_MS=1500 SHARDLM_RECEIVE_SLOW_STEPS="" \
  run_job "$T/a.log" "$A/bc" "$T/a.counts" \
  "${MPI[@]}" -np 1 "$BIN" train "${rl[@]}" --set run.max_steps=12 : -np 2 "$BIN" receive "${rl[@]}"
all="1 2 3 4 5 6 7 8 9 10 11 12 "
check "a slow receiver beside a fast one, a broadcast every step: exit 0 (got $rc)" test $rc = 0
check "... no 'checksum' or missing-file error" bash -c "! grep -qE 'shardlm: error|checksum mismatch|has no checksum' '$T/a.log'"
check "... the slow receiver read every step in order ($(steps_read "$T/a.log" 1))" test "$(steps_read "$T/a.log" 1)" = "$all"
check "... the fast one too ($(steps_read "$T/a.log" 0))" test "$(steps_read "$T/a.log" 0)" = "$all"
most=$(sort -n "$T/a.counts" | tail -1)
check "... the trainer ran ahead and was held back: at most keep + 1 = 3 step directories at any time (most seen: ${most:-?})" \
  test "${most:-0}" = 3
check "... it waited within comm.timeout_s: no 'directories are kept' line" bash -c "! grep -q 'directories are kept' '$T/a.log'"
check "... keep = 2 directories left at the end, the newest ($(left "$A/bc"))" test "$(left "$A/bc")" = "step_11 step_12 "

# ---- a receiver stuck 6 s on its first step, comm.timeout_s = 3: kept, then caught up
B=$T/b
read -ra rl <<< "$(deck "$B/run" "$B/bc")"
SHARDLM_FAULT=receive_slow@1 SHARDLM_RECEIVE_SLOW_MS=6000 SHARDLM_RECEIVE_SLOW_STEPS=1 \
  run_job "$T/b.log" "$B/bc" "$T/b.counts" \
  "${MPI[@]}" -np 1 "$BIN" train "${rl[@]}" --set run.max_steps=30 --set comm.timeout_s=3 \
  : -np 1 "$BIN" receive "${rl[@]}"
check "a receiver stuck past comm.timeout_s: the job still exits 0 (got $rc)" test $rc = 0
kept=$(grep -m1 'directories are kept' "$T/b.log")
check "... the trainer says whose directories it keeps and why" \
  grep -qE "^broadcast: step [0-9]+: the receiver at world rank 1 \(.*\) has not finished reading any step yet, more than broadcast.keep = 2 step directories behind; it did not catch up within comm.timeout_s = 3 s: its directories are kept" <<< "$kept"
b_all=$(seq -s ' ' 1 30)" "
check "... the receiver still read every step, in order" test "$(steps_read "$T/b.log" 0)" = "$b_all"
most=$(sort -n "$T/b.counts" | tail -1)
check "... directories piled up while it was stuck (most seen: ${most:-?} > 3)" test "${most:-0}" -gt 3
check "... the trainer says when it has caught up" \
  grep -qE "^broadcast: step [0-9]+: the receivers have caught up \([0-9]+ step directories, broadcast.keep = 2\): retention and waiting resume" "$T/b.log"
check "... and retention takes the count back to keep = 2 ($(left "$B/bc"))" test "$(left "$B/bc")" = "step_29 step_30 "

exit $((failures > 0))
