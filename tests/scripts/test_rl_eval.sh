#!/usr/bin/env bash
# test_rl_eval.sh — accuracy on held-out prompts during RL (the deck's eval.prompts),
# against the same weights scored offline.
#   warm start: inputs/copy-sft.toml (60 SFT steps on the copy task), exported in bf16:
#     the values the trainers broadcast, so the inference ranks' starting weights
#     are exactly the export's;
#   RL: `mpirun -np 1 shardlm train : -np 2 shardlm generate`, 4 steps, the reward
#     regex ^{answer}$ (what tools/score_generate.py calls right), eval.prompts =
#     another draw of 64 copy-task prompts, eval.interval = 2, eval.samples = 4:
#     <run.dir>/eval.jsonl holds policy steps 0, 2 and 4, split over both inference ranks;
#   the same weights offline: `shardlm generate` on the warm start's export (step 0)
#     and the RL job's final export (step 4), greedy and with 4 samples at the
#     evaluation's seed, scored by tools/score_generate.py: the same correct
#     counts, accuracy, pass@4 and pass@1 as the job logged;
#   the job resumed to step 6 from its step-2 checkpoint: eval.jsonl holds policy
#     steps 0, 2, 4, 6 once each, 2 and 4 scored again with the same numbers;
#   bad input: `check` and a job refuse a missing eval prompt file, one without
#     answers, and eval.max_new_tokens past data.seq_len, each naming it.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_eval  # BIN, PY, MPI, T, checks.sh
t_start=$(date +%s.%N)

"$PY" tools/make_copy_task.py --out-dir "$T/task" > "$T/task.log" 2>&1 || { fail "make_copy_task.py"; cat "$T/task.log"; }
"$PY" tools/make_copy_task.py --out-dir "$T/held" --seed 1 --prompts 64 --sft-docs 1 > "$T/held.log" 2>&1 ||
  { fail "make_copy_task.py (held-out prompts)"; cat "$T/held.log"; }
timeout 120 "$BIN" train inputs/copy-sft.toml --set "data.path=$T/task/sft.h5" --set "run.dir=$T/sft" \
  --set "run.export_dir=$T/sft/export" --set 'run.export_dtype="bf16"' > "$T/sft.log" 2>&1
check "SFT warm start: 60 steps, exported in bf16" test -f "$T/sft/export/model.safetensors"

ARGS=(inputs/copy-rl.toml --set "model.hf=$T/sft/export" --set "run.dir=$T/rl" --set "data.rollout_dir=$T/rl/rollouts"
      --set "rollout.prompts=$T/task/prompts.h5" --set run.max_steps=4 --set "run.export_dir=$T/rl/export"
      --set 'run.export_dtype="bf16"' --set 'rollout.reward="regex"' --set 'rollout.reward_regex="^{answer}$"'
      --set "eval.prompts=$T/held/prompts.h5" --set eval.interval=2 --set eval.samples=4 --set ckpt.interval=2)

"$BIN" check "${ARGS[@]}" > "$T/check.log" 2>&1
check "check passes the deck with eval.prompts and names what is evaluated" \
  grep -qE "^eval: 64 prompts of $T/held/prompts.h5 \(with answers\), greedy and pass@4 \(sampled, seed [0-9]+\), at most 2 new tokens, on the starting weights, then every 2 policy steps and the last ones; correct = reward > 0; rows in $T/rl/eval.jsonl$" "$T/check.log"
check_seed=$(sed -nE 's/^eval: .*\(sampled, seed ([0-9]+)\).*/\1/p' "$T/check.log")

t0=$(date +%s.%N)
timeout 300 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 2 "$BIN" generate "${ARGS[@]}" > "$T/rl.log" 2>&1
rc=$?
rl_s=$("$PY" -c "import time; print(f'{time.time() - $t0:.1f}')")
check "RL job (1 trainer, 2 inference ranks, eval every 2 policy steps) exits 0 ($rl_s s)" test $rc = 0
check "... and exports its final weights (step 4) in bf16" test -f "$T/rl/export/model.safetensors"
seed=$(sed -nE 's/^eval: .*\(sampled, seed ([0-9]+)\).*/\1/p' "$T/rl.log" | head -1)
check "the inference ranks' start-up line gives the evaluation's seed, check's (${seed:-none})" \
  test -n "$seed" -a "$seed" = "$check_seed"
check "one eval line per evaluation: policy steps 0, 2, 4" \
  test "$(grep -E '^eval policy step [0-9]+ \| accuracy ' "$T/rl.log" | sed -E 's/^eval policy step ([0-9]+) .*/\1/' | tr '\n' ' ')" = "0 2 4 "
check "eval.jsonl: the rows of policy steps 0, 2, 4 over 64 prompts x 4 samples; rollouts.jsonl: 4 steps" \
  "$PY" - "$T/rl" <<'EOF'
import json, sys
d = sys.argv[1]
rows = [json.loads(l) for l in open(f"{d}/eval.jsonl")]
assert [r["step"] for r in rows] == [0, 2, 4], rows
for r in rows:
    assert r["eval_policy_step"] == r["step"] and r["eval_prompts"] == 64 and r["eval_samples"] == 4, r
    assert r["eval_accuracy"] == r["eval_correct"] / 64 and r["eval_seconds"] > 0, r
    assert 0 <= r["eval_pass_at_1"] <= r["eval_pass_at_k"] <= 1 and 1 <= r["eval_response_length_mean"] <= 2, r
    assert r["eval_reward_mean"] == r["eval_accuracy"], r  # the regex reward is 0 or 1
assert len(open(f"{d}/rollouts.jsonl").readlines()) == 4
EOF
check "the trainers log each evaluation beside the training reward (metrics.jsonl eval_*, the next rollout file's \
step): policy steps 0 and 2, eval.jsonl's numbers" "$PY" - "$T/rl" <<'EOF'
import json, sys
d = sys.argv[1]
evals = {r["step"]: r for r in map(json.loads, open(f"{d}/eval.jsonl"))}
logged = [r for r in map(json.loads, open(f"{d}/metrics.jsonl")) if "eval_accuracy" in r]
assert [int(r["eval_policy_step"]) for r in logged] == [0, 2], logged
for r in logged:
    e = evals[int(r["eval_policy_step"])]
    for key in ("eval_accuracy", "eval_reward_mean", "eval_pass_at_k", "eval_pass_at_1"):
        assert abs(r[key] - e[key]) < 1e-6, (key, r, e)
    assert "rollout_reward_mean" in r, r
EOF

# The same weights offline: shardlm generate + tools/score_generate.py.
offline() {  # offline NAME MODEL_DIR GENERATE_ARGS...: scores in $T/NAME.json
  local name=$1 model=$2
  shift 2
  "$BIN" generate --hf "$model" --prompts "$T/held/prompts.h5" --max-new-tokens 2 --device cpu --out "$T/$name.h5" "$@" \
    > "$T/$name.log" 2>&1 &&
    "$PY" tools/score_generate.py "$T/$name.h5" "$T/held/prompts.h5" --json "$T/$name.json" >> "$T/$name.log" 2>&1
}
offline greedy0 "$T/sft/export" --temperature 0
offline greedy4 "$T/rl/export" --temperature 0
offline sampled4 "$T/rl/export" --temperature 1 --n 4 --seed "${seed:-0}"
check "offline scoring ran (greedy on both exports, 4 samples on the final one)" \
  test -f "$T/greedy0.json" -a -f "$T/greedy4.json" -a -f "$T/sampled4.json"
compare=$("$PY" - "$T" <<'EOF'
import json, sys
t = sys.argv[1]
rows = {r["step"]: r for r in (json.loads(l) for l in open(f"{t}/rl/eval.jsonl"))}
g0, g4, s4 = (json.load(open(f"{t}/{n}.json")) for n in ("greedy0", "greedy4", "sampled4"))
ok = (g0["right"] == rows[0]["eval_correct"] and g0["samples"] == 64 and g0["accuracy"] == rows[0]["eval_accuracy"]
      and g4["right"] == rows[4]["eval_correct"] and g4["samples"] == 64 and g4["accuracy"] == rows[4]["eval_accuracy"]
      and s4["k"] == 4 and s4["prompts"] == 64 and abs(s4["pass_at_k"] - rows[4]["eval_pass_at_k"]) < 1e-9
      and abs(s4["accuracy"] - rows[4]["eval_pass_at_1"]) < 1e-9)
print(int(ok), g0["right"], rows[0]["eval_correct"], g4["right"], rows[4]["eval_correct"],
      f'{s4["pass_at_k"]:.4f}', f'{rows[4]["eval_pass_at_k"]:.4f}', f'{s4["accuracy"]:.4f}', f'{rows[4]["eval_pass_at_1"]:.4f}')
EOF
)
read -r same r0 e0 r4 e4 pk epk p1 ep1 <<< "${compare:-0 ? ? ? ? ? ? ? ?}"
echo "held-out accuracy, offline / in the job: step 0 $r0 / $e0 of 64, step 4 $r4 / $e4 of 64; pass@4 $pk / $epk, pass@1 $p1 / $ep1"
check "in-run evaluation = score_generate.py on the same weights (greedy at steps 0 and 4, pass@4 and pass@1 at step 4)" \
  test "$same" = 1
check "... on numbers that can tell them apart: 0 < correct < 64 at step 0 ($e0)" test "${e0:-0}" -gt 0 -a "${e0:-64}" -lt 64

# --- resumed to step 6 from the step-2 checkpoint (ckpt.interval = 2; the deck saves no final one): the
# launch drops eval.jsonl's rows from step 2 on and scores steps 2 and 4 again, with the same numbers (the
# CPU backend retrains them bit for bit), then step 6; each policy step once
cp "$T/rl/eval.jsonl" "$T/eval-before-resume.jsonl"
timeout 300 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" --set run.max_steps=6 : \
  -np 2 "$BIN" generate "${ARGS[@]}" --set run.max_steps=6 > "$T/resume.log" 2>&1
rc=$?
check "the job resumed to step 6 exits 0" test $rc = 0
check "... from the step-2 checkpoint" grep -qE "checkpoint: resumed from .*/step_2\.h5" "$T/resume.log"
check "eval.jsonl after the resume: policy steps 0, 2, 4, 6 once each; steps 2 and 4 scored again with the same numbers" \
  "$PY" - "$T/rl/eval.jsonl" "$T/eval-before-resume.jsonl" <<'EOF2'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
before = {r["step"]: r for r in (json.loads(l) for l in open(sys.argv[2]))}
assert [r["step"] for r in rows] == [0, 2, 4, 6], rows
keys = ("eval_correct", "eval_accuracy", "eval_pass_at_k", "eval_pass_at_1", "eval_reward_mean")
assert all(rows[i][k] == before[s][k] for i, s in ((1, 2), (2, 4)) for k in keys), (rows, before)
assert rows[0] == before[0]
EOF2

# --- bad input, named
"$PY" - "$T/held/prompts.h5" "$T/no-answers.h5" <<'EOF'
import sys, h5py
with h5py.File(sys.argv[1]) as f, h5py.File(sys.argv[2], "w") as g:
    for name in ("tokens", "offsets"):
        g[name] = f[name][()]
    for k, v in f.attrs.items():
        g.attrs[k] = v
EOF
refused() {  # refused LOG TEXT: `check` exited 1 and said TEXT
  "$BIN" check "${ARGS[@]}" "${@:3}" > "$1" 2>&1
  local rc=$?
  test $rc = 1 && has "$1" "$2"
}
check "check refuses a missing eval prompt file, naming the key and the file" \
  refused "$T/bad1.log" "eval.prompts: prompt file '$T/none.h5' does not exist" --set "eval.prompts=$T/none.h5"
check "check refuses an eval prompt file without answers for the answer-based reward" \
  refused "$T/bad2.log" "prompt file '$T/no-answers.h5' (eval.prompts) has no 'answer' dataset, and rollout.reward's \"regex\"" \
  --set "eval.prompts=$T/no-answers.h5"
check "check refuses eval.max_new_tokens = 5 with 5-token prompts and data.seq_len = 8" \
  refused "$T/bad3.log" "prompt file '$T/held/prompts.h5' (eval.prompts): prompt 0 has 5 tokens; with eval.max_new_tokens = 5 a sample can have 10 tokens, more than data.seq_len + 1 = 9" \
  --set eval.max_new_tokens=5
ARGS_BAD=("${ARGS[@]}" --set "run.dir=$T/bad" --set "data.rollout_dir=$T/bad/rollouts" --set "eval.prompts=$T/none.h5")
timeout 120 "${MPI[@]}" -np 1 "$BIN" train "${ARGS_BAD[@]}" : -np 1 "$BIN" generate "${ARGS_BAD[@]}" > "$T/bad4.log" 2>&1
rc=$?
check "a job with a missing eval prompt file ends (exit $rc) with a message naming it" \
  test $rc != 0 -a $rc != 124 -a "$(grep -c "eval.prompts: prompt file '$T/none.h5' does not exist" "$T/bad4.log")" -ge 1

total=$("$PY" -c "import time; print(f'{time.time() - $t_start:.1f}')")
echo "test_rl_eval: $total s (the RL job $rl_s s)"
exit $((failures > 0))
