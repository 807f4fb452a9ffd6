#!/usr/bin/env bash
# test_signals.sh — stop signals (SIGUSR1, as Slurm's --signal=USR1@T sends)
# where test_runs.sh and test_checkpoint_faults.sh do not reach:
#   an RL MPMD job (a trainer and a receiver, signalled through mpirun): exit 75,
#     a checkpoint, a resume that goes on;
#   a signal during setup (before the first step): exit 75, run.lock released,
#     a rerun starts;
#   a signal on the final step: the run completes, exit 0;
#   a signal while MPI starts up: exit 75 as during setup.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
PY=${PYTHON:-/usr/bin/python3}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive SHARDLM_CKPT_FAULT=""
if [ ! -x "$BIN" ]; then echo "FAIL signals: $BIN is not built"; exit 1; fi

T=$(mktemp -d /tmp/shardlm-signals-XXXXXX)
cleanup() { [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"; }
trap cleanup EXIT
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has, wait_for
# finish PID: wait for the job (killing its tree after 120 s: a hang is a failure); sets rc
finish() {
  wait_for 120 bash -c "! kill -0 $1 2>/dev/null" || kill -9 $(tree_pids "$1") 2>/dev/null
  wait "$1"
  rc=$?
}
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY)

# ---- an RL MPMD job: trainer + receiver, SIGUSR1 to mpirun mid-run
R=$T/rl
"$PY" tools/make_rollouts.py inputs/data/tiny.h5 --out "$R/rollouts" --steps 400 > "$T/rollouts.log" 2>&1
rl=(inputs/tiny-rl.toml --set "run.dir=$R" --set "data.rollout_dir=$R/rollouts" --set log.interval=1
    --set broadcast.interval=2 --set ckpt.interval=0)
"${MPI[@]}" -np 1 "$BIN" train "${rl[@]}" --set run.max_steps=400 : -np 1 "$BIN" receive "${rl[@]}" \
  > "$T/rl.log" 2>&1 &
job=$!
wait_for 120 grep -qs "step      3/" "$T/rl.log"
kill -USR1 "$job"
finish "$job"
check "RL MPMD, SIGUSR1 to mpirun: exit 75, requeue (got $rc)" test $rc = 75
stopped=$(sed -n 's/.*stopped by signal [0-9]* after step \([0-9]*\).*/\1/p' "$T/rl.log")
check "... the trainer saved the step it stopped at (${stopped:-none})" \
  test -n "$stopped" -a -f "$R/checkpoints/step_${stopped:-x}.h5"
check "... the receiver ended with the trainers' decision" \
  has "$T/rl.log" "receive[0]: the trainers ended with exit 75 (stopped by a signal: requeue and resume)"
"${MPI[@]}" -np 1 "$BIN" train "${rl[@]}" --set run.max_steps=$((${stopped:-0} + 2)) : -np 1 "$BIN" receive "${rl[@]}" \
  > "$T/rl2.log" 2>&1 &
finish $!
check "... the requeued job resumes at that step and finishes: exit 0 (got $rc)" \
  test $rc = 0 -a -n "$(grep "resumed from $R/checkpoints/step_${stopped:-x}.h5 at step ${stopped:-x}" "$T/rl2.log")"

# ---- a signal during setup: after the banner (the deck is read), while the run
# dir is locked and the session is built (a bigger model makes that take a while)
P=$T/setup
big=(--set model.hidden_size=1024 --set model.intermediate_size=4096 --set model.num_layers=12 --set model.num_heads=8
     --set model.num_kv_heads=8)
"$BIN" train inputs/tiny-sft.toml --set "run.dir=$P" "${big[@]}" --set run.max_steps=3 --set sched.warmup=1 > "$T/setup.log" 2>&1 &
job=$!
wait_for 120 grep -qs "^deck .* | run dir " "$T/setup.log"
kill -USR1 "$job"
finish "$job"
check "SIGUSR1 during setup: exit 75, requeue (got $rc)" test $rc = 75
check "... says so: nothing trained, nothing to save" \
  has "$T/setup.log" "stopped by signal 10 during setup, before the first step: exit 75 (requeue; nothing to save)"
check "... no step ran" bash -c "! grep -q 'step      1/' '$T/setup.log'"
check "... run.lock is released" test ! -e "$P/run.lock"
timeout 300 "$BIN" train inputs/tiny-sft.toml --set "run.dir=$P" --set run.max_steps=2 --set sched.warmup=1 > "$T/setup2.log" 2>&1
check "... the requeued run starts at once and finishes: exit 0 (got $?)" has "$T/setup2.log" "done: outputs in $P"

# ---- a signal at the first instant, while MPI starts up (a task Slurm or mpirun
# signals as it starts). Reproduction: the signal lands before the handlers are
# installed and the default action kills the rank (exit 138). The moment is
# found without a clock: the first of (the SIGUSR1 handler installed, a second
# thread, which MPI's start-up makes) seen in /proc; one thread at start with
# OpenBLAS and OpenMP held to one (neither makes threads before main).
E=$T/early
OPENBLAS_NUM_THREADS=1 "${MPI[@]}" -x OPENBLAS_NUM_THREADS -np 1 "$BIN" train inputs/tiny-sft.toml \
  --set "run.dir=$E" --set run.max_steps=3 --set sched.warmup=1 > "$T/early.log" 2>&1 &
job=$!
rank=""
for _ in $(seq 1 20000); do
  rank=$(pgrep -f -n "^$BIN train inputs/tiny-sft.toml --set run.dir=$E" || true)
  if [ -n "$rank" ] && [ -r "/proc/$rank/status" ]; then
    caught=$(awk '/^SigCgt/ {print $2}' "/proc/$rank/status" 2>/dev/null)
    threads=$(awk '/^Threads/ {print $2}' "/proc/$rank/status" 2>/dev/null)
    if [ -n "$caught" ] && { [ $((0x$caught & 0x200)) != 0 ] || [ "${threads:-1}" -gt 1 ]; }; then break; fi
  fi
  rank=""
done
[ -n "$rank" ] && kill -USR1 "$rank"
finish "$job"
check "SIGUSR1 during MPI's start-up: exit 75, requeue (got $rc)" test -n "$rank" -a $rc = 75
check "... says so: nothing trained, nothing to save" \
  has "$T/early.log" "stopped by signal 10 during setup, before the first step: exit 75 (requeue; nothing to save)"

exit $((failures > 0))
