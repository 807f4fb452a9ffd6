#!/usr/bin/env bash
# test_rl_faults.sh — an RL job's inference rank busy or stopped: a stop signal
# while its reward program runs, a reward step longer than comm.timeout_s, a
# stopped rank on either side (each case's reproduction is in its comment).
#
# A stop signal while the reward program runs:
#   `mpirun -np 1 shardlm train copy-rl.toml : -np 1 shardlm generate copy-rl.toml`
#   with a reward program that takes a few seconds at rollout step 2; SIGUSR1 to
#   mpirun while it runs (Open MPI forwards it to each rank's process group, as
#   Slurm's --signal reaches every task). The program used to share the inference
#   rank's process group, died of the signal, and the job ended with exit 1, no
#   checkpoint and no requeue. A stop is a stop: the step is scored, the trainer
#   saves the step it stops at and the job exits 75.
# The model is the copy task's seeded one (no warm start: the reward does not
# matter here). The reward program's own limits are tests/unit/test_rl_faults.cpp's.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_faults  # BIN, PY, MPI, T, checks.sh
start=$(date +%s)

"$PY" tools/make_copy_task.py --out-dir "$T/task" > "$T/task.log" 2>&1 || { fail "make_copy_task.py"; cat "$T/task.log"; }

# The reward program: 1 for every completion; its third call (rollout step 2)
# says it has started, then takes 4 s, time for mpirun to forward the signal.
cat > "$T/reward.sh" <<EOF
n=\$(wc -l)
echo call >> "$T/calls"
if [ "\$(wc -l < "$T/calls")" -eq 3 ]; then touch "$T/started"; sleep 4; fi
i=0
while [ \$i -lt \$n ]; do echo 1; i=\$((i + 1)); done
EOF
model=(--set 'model.hf=""' --set 'model.arch="llama"' --set model.vocab_size=16 --set model.hidden_size=32
       --set model.intermediate_size=64 --set model.num_layers=2 --set model.num_heads=4 --set model.num_kv_heads=2
       --set model.max_position_embeddings=32 --set model.tie_word_embeddings=true)
ARGS=(inputs/copy-rl.toml "${model[@]}" --set "run.dir=$T/rl" --set "data.rollout_dir=$T/rl/rollouts"
      --set "rollout.prompts=$T/task/prompts.h5" --set run.max_steps=40 --set rollout.prompts_per_step=4
      --set rollout.n=2 --set 'rollout.reward="program"' --set "rollout.reward_program=\"sh $T/reward.sh\""
      --set rollout.reward_timeout_s=120 --set ckpt.interval=0)
"${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/rl.log" 2>&1 &
job=$!
wait_for 120 test -e "$T/started"
kill -USR1 "$job"
wait_for 120 bash -c "! kill -0 $job 2>/dev/null" || kill -9 $(tree_pids "$job") 2>/dev/null
wait "$job"
rc=$?
check "SIGUSR1 to mpirun while the reward program runs: exit 75, requeue (got $rc)" test $rc = 75
check "... the reward program was not a casualty: not killed, no reward error in the log" \
  bash -c "! grep -qF '(rollout.reward_program, rollout step' '$T/rl.log'"
stopped=$(sed -n 's/.*stopped by signal 10 after step \([0-9]*\).*/\1/p' "$T/rl.log")
check "... the trainer saved the step it stopped at (${stopped:-none})" \
  test -n "$stopped" -a -f "$T/rl/checkpoints/step_${stopped:-x}.h5"
check "... the step the program was scoring was published: rollout step 2 has its file" \
  test -f "$T/rl/rollouts/step_2.h5"
check "... the inference rank ended with the trainers' exit code" has "$T/rl.log" "the trainers ended (exit 75)"

# ---- Busy is not dead. Two trainers, one inference rank, data.max_async = 1,
# comm.timeout_s = 2 and a reward program that takes 7 s at rollout step 2.
# Reproduction: trainer rank 0 waited for the inference rank in an unwatched
# MPI_Bcast (the weight broadcast's header) while trainer rank 1 went on to its
# next all-gather, timed out after comm.timeout_s and ended the job blaming
# rank 0. Now rank 0 tells rank 1 it is busy waiting for the other side, asks
# the inference rank where it is (busy: scoring), and the job finishes.
cat > "$T/slow.sh" <<EOF
n=\$(wc -l)
echo call >> "$T/slow-calls"
if [ "\$(wc -l < "$T/slow-calls")" -eq 3 ]; then sleep 7; fi
i=0
while [ \$i -lt \$n ]; do echo 1; i=\$((i + 1)); done
EOF
busy=("${ARGS[@]}" --set "run.dir=$T/busy" --set "data.rollout_dir=$T/busy/rollouts" --set run.max_steps=6
      --set data.max_async=1 --set comm.timeout_s=2 --set "rollout.reward_program=\"sh $T/slow.sh\"")
timeout 300 "${MPI[@]}" -np 2 "$BIN" train "${busy[@]}" : -np 1 "$BIN" generate "${busy[@]}" > "$T/busy.log" 2>&1
rc=$?
check "a reward step of 7 s with comm.timeout_s = 2 and two trainers: the job finishes, exit 0 (got $rc)" test $rc = 0
check "... it trained every step" has "$T/busy.log" "step      6/6"

# ---- A stopped peer ends the job, named. comm.timeout_s = 2, rollout_timeout_s
# = 120; once step 3 is trained, SIGSTOP to one rank. Reproduction: with one
# trainer and one inference rank, either stopped, the job was still running at
# 90 s with comm.timeout_s = 10 (an unwatched MPI_Bcast on the inference side,
# rollout files polled for data.rollout_timeout_s on the trainer's); with two
# trainers the message blamed a trainer for the inference rank's stall.
# stalled NAME TRAINERS WHO [REWARD...]: the job with TRAINERS trainers, WHO
# (train|generate) stopped after step 3 (or, with a reward program, while it runs)
stalled() {
  local name=$1 trainers=$2 who=$3
  shift 3
  local reward=(--set 'rollout.reward="exact"')
  [ $# -gt 0 ] && reward=("$@")
  local a=("${ARGS[@]}" --set "run.dir=$T/$name" --set "data.rollout_dir=$T/$name/rollouts" --set run.max_steps=400
           --set comm.timeout_s=2 --set data.rollout_timeout_s=120 --set log.interval=1 "${reward[@]}")
  "${MPI[@]}" -np "$trainers" "$BIN" train "${a[@]}" : -np 1 "$BIN" generate "${a[@]}" > "$T/$name.log" 2>&1 &
  local job=$! t0 victim
  if [ $# -gt 0 ]; then wait_for 120 test -e "$T/$name-started"; else wait_for 120 grep -qs "step      3/" "$T/$name.log"; fi
  victim=$(pgrep -f -n "^$BIN $who .*run.dir=$T/$name " || true)
  t0=$(date +%s)
  [ -n "$victim" ] && kill -STOP "$victim"
  wait_for 60 bash -c "! kill -0 $job 2>/dev/null" || kill -9 $(tree_pids "$job") 2>/dev/null
  wait "$job"
  rc=$?
  [ -n "$victim" ] && kill -CONT "$victim" 2>/dev/null
  elapsed=$(( $(date +%s) - t0 ))
}
stalled stop-gen 1 generate
check "inference rank stopped (one trainer): the job ends, exit $rc, in ${elapsed} s (< 30)" \
  test $rc != 0 -a "$elapsed" -lt 30
check "... the message names the inference rank as stopped" \
  grep -qE "rank 1 on [^ ]+ \(inference rank 0\) (gave no answer|did not arrive).*stopped, dead, or stuck" "$T/stop-gen.log"
stalled stop-train 1 train
check "trainer stopped (one inference rank): the job ends, exit $rc, in ${elapsed} s (< 30)" \
  test $rc != 0 -a "$elapsed" -lt 30
check "... the message names trainer rank 0 as stopped" \
  grep -qE "rank 0 on [^ ]+ \(trainer rank 0\) (gave no answer|did not arrive).*stopped, dead, or stuck" "$T/stop-train.log"
stalled stop-gen2 2 generate
check "inference rank stopped (two trainers): the job ends, exit $rc, in ${elapsed} s (< 30)" \
  test $rc != 0 -a "$elapsed" -lt 30
check "... the message names the inference rank, not a trainer" \
  bash -c "grep -qE 'rank 2 on [^ ]+ \(inference rank 0\) (gave no answer|did not arrive)' '$T/stop-gen2.log' &&
           ! grep -qE 'rank [01] on [^ ]+ (\(trainer rank 0\) )?(gave no answer|did not arrive)' '$T/stop-gen2.log'"
check "... a trainer that lost sight of trainer rank 0 says where it was last: waiting for the other side" \
  bash -c "! grep -q 'error on rank 1 ' '$T/stop-gen2.log' || grep -q 'last heard busy in weight broadcast' '$T/stop-gen2.log'"
# Stopped while its reward program runs: the trainer is polling for the step's
# rollout file, outside any collective, and asks the inference rank itself.
cat > "$T/stuck.sh" <<EOF
n=\$(wc -l)
echo call >> "$T/stuck-calls"
if [ "\$(wc -l < "$T/stuck-calls")" -eq 3 ]; then touch "$T/stop-scoring-started"; sleep 20; fi
i=0
while [ \$i -lt \$n ]; do echo 1; i=\$((i + 1)); done
EOF
stalled stop-scoring 1 generate --set 'rollout.reward="program"' --set "rollout.reward_program=\"sh $T/stuck.sh\""
check "inference rank stopped while scoring: the job ends, exit $rc, in ${elapsed} s (< 30)" \
  test $rc != 0 -a "$elapsed" -lt 30
check "... the trainer waiting for the rollouts names it" \
  grep -qE "waiting for the rollouts of step 2 for .*rank 1 on [^ ]+ \(inference rank 0\) gave no answer" "$T/stop-scoring.log"

echo "test_rl_faults.sh: $(( $(date +%s) - start )) s"

exit $((failures > 0))
