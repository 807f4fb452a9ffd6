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
#     than JSON, for another episode or with metrics that are not named
#     numbers ends the job (exit 1) with one message naming the program, the
#     episode and what went wrong;
#   check refuses rollout.reward = "env" without env.program;
#   the evaluation (eval.prompts) plays each prompt as episodes of its own
#     ("eval.P.S", marked eval, handed the prompt file's metadata) and logs
#     the episode metrics;
#   an environment that exits mid-run leaves the trainers' checkpoint, and the
#     same job with a sound environment resumes from it;
#   the guessing game (tools/make_guess_task.py, tools/envs/guess.py) from its
#     SFT warm start: the reward rises over 30 RL steps, the environment's
#     metrics (env_*) and the episode ends logged.
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
             badjson:"the answer is not JSON: 'not json'" wrongepisode:"the answer is for episode " \
             badmetrics:"metric 'tool calls' is not a finite number named by letters, digits and '_'"; do
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
# --- the evaluation plays episodes too (eval.prompts with the environment)
# (its prompt file with a 'metadata' entry each, which the environment must be handed)
"$PY" - "$T/task/prompts.h5" "$T/task/eval-prompts.h5" <<'PYEOF'
import json, shutil, sys, h5py, numpy as np
shutil.copy(sys.argv[1], sys.argv[2])
with h5py.File(sys.argv[2], "a") as f:
    P = len(f["offsets"]) - 1
    f.create_dataset("metadata", data=np.asarray([json.dumps({"p": p}) for p in range(P)], dtype=object),
                     dtype=h5py.string_dtype("utf-8"))
PYEOF
rl "$T/eval" "" --set "eval.prompts=$T/task/eval-prompts.h5" --set eval.interval=2 --set eval.samples=2 --set eval.batch=64
COPY_ENV_LOG=$T/eval-env.jsonl timeout 180 "${MPI[@]}" -x COPY_ENV_LOG -np 1 "$BIN" train "${ARGS[@]}" : \
  -np 1 "$BIN" generate "${ARGS[@]}" > "$T/eval.log" 2>&1
check "3 steps with an evaluation of episodes every 2 policy steps: exit $? (0)" test $? = 0
check "... each eval prompt played as episodes 'eval.P.S' (greedy, 2 samples), marked eval, apart from the rollouts', handed its metadata; the rows carry the episode metrics" \
  "$PY" - "$T/eval" "$T/eval-env.jsonl" "$T/task/prompts.h5" <<'PYEOF'
import json, sys, h5py
d, log, prompts = sys.argv[1:4]
with h5py.File(prompts) as f:
    P = len(f["offsets"]) - 1
rows = [json.loads(l) for l in open(f"{d}/eval.jsonl")]
assert [r["eval_policy_step"] for r in rows] == [0, 2, 3], rows  # the start, interval 2, the end
msgs = [json.loads(l) for l in open(log)]
ev = [m for m in msgs if m["eval"]]
assert all(m["episode"].startswith(f"eval.{m['prompt']}.") for m in ev), ev[:3]
assert all(m["metadata"] == {"p": m["prompt"]} for m in ev), ev[:3]  # the file's metadata, as JSON
assert all(m["metadata"] is None for m in msgs if not m["eval"])      # the rollouts' file has none
assert not any(m["episode"].startswith("eval.") for m in msgs if not m["eval"])
first = {m["episode"] for m in ev if m["turn"] == 1}
assert first == {f"eval.{p}.{s}" for p in range(P) for s in range(2)}, len(first)
assert any(m["turn"] == 2 for m in ev)
for r in rows:
    assert 0 <= r["eval_accuracy"] <= 1 and r["eval_turns_mean"] >= 1, r
    assert abs(r["eval_episode_end_env"] + r["eval_episode_end_max_turns"] + r["eval_episode_end_length"] - 1) < 1e-9, r
print(f"{len(rows)} evaluations, accuracy {[r['eval_accuracy'] for r in rows]}, turns {[r['eval_turns_mean'] for r in rows]}")
PYEOF

# --- an environment that fails mid-run leaves the trainers' checkpoint; the job resumes from it
rl "$T/mid" "crash-after:1200" --set run.max_steps=5 --set ckpt.interval=1
job > "$T/mid.log" 2>&1
check "an environment that exits mid-run ends the job: exit $? (1)" test $? = 1
check "... naming the program and the episode" \
  bash -c "grep -q \"environment program '$ENV crash-after:1200' (env.program), episode .*exited with status 3\" '$T/mid.log'"
check "... and the trainers left a checkpoint" bash -c "ls '$T/mid/checkpoints/'step_*.h5"
rl "$T/mid" "" --set run.max_steps=5 --set ckpt.interval=1
job > "$T/mid-resume.log" 2>&1
check "the same job with a sound environment resumes from it and finishes: exit $? (0)" test $? = 0
check "... from the checkpoint" grep -qE "checkpoint: resumed from .*/step_[1-9]\.h5" "$T/mid-resume.log"
check "... and every step up to 5 has a rollout file" test -f "$T/mid/rollouts/step_4.h5"

# --- the guessing game (tools/make_guess_task.py, tools/envs/guess.py): the reward rises
"$PY" tools/make_guess_task.py --out-dir "$T/guess-task" > /dev/null
timeout 300 "$BIN" train inputs/guess-sft.toml --set "data.path=$T/guess-task/sft.h5" --set "run.dir=$T/guess-sft" \
  --set "run.export_dir=$T/guess-sft/export" > "$T/guess-sft.log" 2>&1
check "the game's SFT warm start: exit $? (0)" test $? = 0
ARGS=(inputs/guess-rl.toml --set "model.hf=$T/guess-sft/export" --set "run.dir=$T/guess" --set "data.rollout_dir=$T/guess/rollouts"
      --set "rollout.prompts=$T/guess-task/prompts.h5" --set run.max_steps=30 --set log.interval=1
      --set "env.program=\"$PY tools/envs/guess.py --max-turns 4\"")
job > "$T/guess.log" 2>&1
check "30 RL steps against the game: exit $? (0)" test $? = 0
check "... the reward rises: the last 5 steps' mean over the first 5's by 0.1; the episode metrics logged" \
  "$PY" - "$T/guess" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/rollouts.jsonl")]
r = [row["reward_mean"] for row in rows]
first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
print(f"reward {first:.3f} -> {last:.3f}; turns {rows[0]['turns_mean']:.2f} -> {rows[-1]['turns_mean']:.2f}; "
      f"inconsistent {rows[0]['env_inconsistent']:.3f} -> {rows[-1]['env_inconsistent']:.3f}")
assert len(rows) == 30 and last > first + 0.1, (first, last)
for key in ("env_guesses", "env_invalid", "env_inconsistent", "episode_end_env", "episode_end_max_turns",
            "episode_end_length"):
    assert key in rows[-1], key
assert all(abs(row["episode_end_env"] + row["episode_end_max_turns"] + row["episode_end_length"] - 1) < 1e-9
           for row in rows)
PYEOF
echo "test_rl_env: $(( $(date +%s) - start )) s"
exit $((failures > 0))

