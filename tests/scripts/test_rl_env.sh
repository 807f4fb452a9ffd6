#!/usr/bin/env bash
# test_rl_env.sh — episodes of several turns against an environment program
# (env.program, rollout.reward = "env"; docs/rl.md "Environments"), on the copy
# task with 1 trainer and 1 inference rank: tests/scripts/lib/copy_env.py shows
# one more digit after the policy's first turn and rewards a second turn that
# copies it.
#   the job ends (exit 0); every rollout sample is turn, observation, turn: the
#     observation's ids are in the file with no loss on them, the turns' ids
#     carry it; each sample's reward is the environment's rule recomputed from
#     the file's tokens; rollouts.jsonl logs turns_mean and observation_tokens_mean;
#   an environment that crashes, hangs past env.timeout_s, answers with other
#     than JSON or for another episode ends the job (exit 1) with one message
#     naming the program, the episode and what went wrong;
#   check refuses rollout.reward = "env" without env.program.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_env  # BIN, PY, MPI, T, checks.sh
start=$(date +%s)
copy_task_warm_start --set run.max_steps=20 --set 'run.export_dtype="bf16"'
ENV="$PY tests/scripts/lib/copy_env.py"
rl() {  # rl RUN_DIR ENV_ARGS EXTRA...: ARGS = the deck of a run in RUN_DIR
  local dir=$1 fault=$2
  shift 2
  ARGS=(inputs/copy-rl.toml --set "model.hf=$T/sft/export" --set "run.dir=$dir" --set "data.rollout_dir=$dir/rollouts"
        --set "rollout.prompts=$T/task/prompts.h5" --set run.max_steps=3 --set log.interval=1
        --set data.seq_len=16 --set rollout.max_new_tokens=8 --set 'rollout.reward="env"'
        --set "env.program=\"$ENV $fault\"" --set rollout.max_turns=3 "$@")
}
job() { timeout 180 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}"; }

rl "$T/ok" ""
job > "$T/ok.log" 2>&1
check "3 steps against the environment: exit $? (0)" test $? = 0
check "... each sample turn, observation, turn: no loss on the observation, rewards the environment's rule" \
  "$PY" - "$T/ok" <<'EOF'
import json, sys, h5py, numpy as np
d = sys.argv[1]
EOS, SEP = 12, 11
two_turns = right = 0
for step in range(3):
    with h5py.File(f"{d}/rollouts/step_{step}.h5") as f:
        tok, mask, off, rew = f["tokens"][()], f["loss_mask"][()], f["offsets"][()], f["rewards"][()]
    for s in range(len(off) - 1):
        t, m = list(tok[off[s]:off[s + 1]]), list(mask[off[s]:off[s + 1]])
        first = m.index(1)  # the completion starts where the loss does
        c, cm = t[first:], m[first:]
        if EOS in c[:-1]:  # a first turn that stopped: then the observation, then the second turn
            e = c.index(EOS)
            obs = c[e + 1:e + 3]
            want = (c[0] + 1) % 10
            assert obs == [want, SEP], (step, s, c)
            assert cm[:e + 1] == [1] * (e + 1) and cm[e + 1:e + 3] == [0, 0] and all(cm[e + 3:]), (step, s, c, cm)
            expect = 1.0 if len(c) > e + 3 and c[e + 3] == want and c[-1] == EOS else 0.0
            assert rew[s] == expect, (step, s, c, rew[s], expect)
            two_turns += 1
            right += expect == 1.0
        else:
            assert rew[s] == 0.0 and all(cm), (step, s, c, rew[s])
assert two_turns > 0, two_turns
rows = [json.loads(l) for l in open(f"{d}/rollouts.jsonl")]
assert all(r["turns_mean"] >= 1 and r["observation_tokens_mean"] > 0 for r in rows), rows[0]
print(f"{two_turns} episodes of two turns, {right} rewarded; turns_mean {[r['turns_mean'] for r in rows]}")
EOF
for fault in crash:"exited with status 3 without answering" hang:"no answer within env.timeout_s = 2 s" \
             badjson:"the answer is not JSON: 'not json'" wrongepisode:"the answer is for episode "; do
  name=${fault%%:*} text=${fault#*:}
  rl "$T/$name" "$name" --set env.timeout_s=2 --set data.rollout_timeout_s=60
  job > "$T/$name.log" 2>&1
  check "an environment that fails ($name): exit $? (1)" test $? = 1
  check "... one message naming the program, the episode and what went wrong" \
    bash -c "grep -q \"environment program '$ENV $name' (env.program), episode [0-9-]*\\.[0-9]* (prompt [0-9]*, sample [0-9]*), turn 1: .*$text\" '$T/$name.log'"
done
"$BIN" check inputs/copy-rl.toml --set 'rollout.reward="env"' > "$T/noenv.log" 2>&1
check "check refuses rollout.reward = \"env\" without env.program" \
  bash -c "grep -q 'rollout.reward = \"env\" needs env.program' '$T/noenv.log'"
"$BIN" check inputs/copy-rl.toml --set 'rollout.reward="env"' --set 'env.program="cat"' \
  --set "eval.prompts=\"$T/task/prompts.h5\"" > "$T/eval.log" 2>&1
check "check refuses eval.prompts beside rollout.reward = \"env\" (the evaluation has no episodes)" \
  bash -c "grep -q 'eval.prompts with rollout.reward = \"env\"' '$T/eval.log'"
echo "test_rl_env: $(( $(date +%s) - start )) s"
exit $((failures > 0))
