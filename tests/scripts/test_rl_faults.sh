#!/usr/bin/env bash
# test_rl_faults.sh — a stop signal to an RL job while its reward program runs.
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
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
PY=${PYTHON:-/usr/bin/python3}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
if [ ! -x "$BIN" ]; then echo "FAIL rl_faults: $BIN is not built"; exit 1; fi

T=$(mktemp -d /tmp/shardlm-rl-faults-XXXXXX)
cleanup() { [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"; }
trap cleanup EXIT
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has, wait_for, tree_pids
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY)
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
echo "test_rl_faults.sh: $(( $(date +%s) - start )) s"

exit $((failures > 0))
