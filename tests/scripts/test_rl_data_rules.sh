#!/usr/bin/env bash
# test_rl_data_rules.sh — DAPO's data rules on the copy task (CPU, -np 1 train :
# -np 1 generate, SFT warm start, a few steps each), read back from the rollout
# files the trainers train on:
#   rollout.dynamic_sampling: no group whose rewards are all equal is ever in a
#     file; each file holds prompts_per_step groups; the rounds and the dropped
#     groups are counted in the metrics (dynamic_rounds, dynamic_dropped_groups);
#   rollout.truncated = "mask": exactly the completions cut at max_new_tokens
#     (no stop token) carry no loss;
#   rollout.truncated = "penalty": each reward is the verifier's plus the soft
#     overlong penalty of its length (DAPO, arXiv:2503.14476, eq. 13), and the
#     logged mean is the penalties' mean.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_data_rules  # BIN, PY, MPI, T, checks.sh
start=$(date +%s)

copy_task_warm_start --set run.max_steps=20

# rl NAME SETS...: the copy task's RL job into $T/NAME, 4 steps
rl() {
  local name=$1
  shift
  local a=(inputs/copy-rl.toml --set "model.hf=$T/sft/export" --set "run.dir=$T/$name"
           --set "data.rollout_dir=$T/$name/rollouts" --set "rollout.prompts=$T/task/prompts.h5" --set run.max_steps=4
           --set log.interval=1 --set rollout.prompts_per_step=8 --set rollout.n=4 "$@")
  timeout 300 "${MPI[@]}" -np 1 "$BIN" train "${a[@]}" : -np 1 "$BIN" generate "${a[@]}" > "$T/$name.log" 2>&1
}

rl dynamic --set rollout.dynamic_sampling=true
check "dynamic sampling: the job finishes (exit $?)" test $? = 0
check "... no file holds a group whose rewards are all equal; each holds 8 groups; rounds and drops are counted" \
  "$PY" - "$T/dynamic" <<'EOF'
import json, sys, h5py, numpy as np
d = sys.argv[1]
rows = [json.loads(l) for l in open(f"{d}/rollouts.jsonl")]
assert len(rows) == 4, rows
dropped = 0
for r in rows:
    with h5py.File(f"{d}/rollouts/step_{r['step']}.h5") as f:
        rewards = f["rewards"][:]
    groups = rewards.reshape(-1, 4)
    assert len(groups) == 8 == r["dynamic_groups"], (len(groups), r)
    assert all(len(set(g)) > 1 for g in groups), groups
    assert r["dynamic_rounds"] >= 1 + (r["dynamic_dropped_groups"] > 0), r
    dropped += r["dynamic_dropped_groups"]
assert dropped > 0, "no group was ever dropped: the filter was not exercised"
print(f"groups dropped over 4 steps: {dropped:g}; rounds: {[r['dynamic_rounds'] for r in rows]}")
EOF

rl mask --set 'rollout.truncated="mask"'
check "truncated = mask: the job finishes (exit $?)" test $? = 0
check "... exactly the completions cut at max_new_tokens carry no loss" "$PY" - "$T/mask" "$T/task/prompts.h5" <<'EOF'
import json, sys, h5py, numpy as np
d, prompts = sys.argv[1], sys.argv[2]
with h5py.File(prompts) as f:
    stops = set(int(x) for x in f.attrs.get("stop_token_ids", []))
rows = [json.loads(l) for l in open(f"{d}/rollouts.jsonl")]
masked_total = 0
for r in rows:
    with h5py.File(f"{d}/rollouts/step_{r['step']}.h5") as f:
        tokens, offsets, mask = f["tokens"][:], f["offsets"][:], f["loss_mask"][:]
        plen = None
    masked = 0
    for s in range(len(offsets) - 1):
        m = mask[offsets[s]:offsets[s + 1]]
        t = tokens[offsets[s]:offsets[s + 1]]
        completion = np.nonzero(m)[0]
        if len(completion) == 0:
            masked += 1
    # the stopped fraction the inference rank measured: the rest were cut
    expected = round((1 - r["stopped_fraction"]) * r["samples"])
    assert masked == expected, (r["step"], masked, expected)
    masked_total += masked
assert masked_total > 0, "no completion was cut: nothing checked"
print("completions masked:", masked_total)
EOF

rl penalty --set 'rollout.truncated="penalty"' --set rollout.overlong_window=1
check "truncated = penalty: the job finishes (exit $?)" test $? = 0
check "... rewards are the verifier's plus (budget - window - length) / window past budget - window" \
  "$PY" - "$T/penalty" <<'EOF'
import json, sys, h5py, numpy as np
d = sys.argv[1]
rows = [json.loads(l) for l in open(f"{d}/rollouts.jsonl")]
for r in rows:
    with h5py.File(f"{d}/rollouts/step_{r['step']}.h5") as f:
        offsets, mask, rewards = f["offsets"][:], f["loss_mask"][:], f["rewards"][:]
    lengths = np.array([int(mask[offsets[s]:offsets[s + 1]].sum()) for s in range(len(offsets) - 1)], dtype=np.int64)
    penalty = np.where(lengths <= 2 - 1, 0.0, (2 - 1 - lengths) / 1.0)   # budget 2, window 1
    verifier = rewards - penalty
    assert np.all(np.isin(verifier, [0.0, 1.0])), (verifier, lengths)
    assert abs(r["overlong_penalty_mean"] - penalty.mean()) < 1e-6, (r["overlong_penalty_mean"], penalty.mean())
    assert abs(r["reward_exact"] - verifier.mean()) < 1e-6, (r["reward_exact"], verifier.mean())
print("penalties checked on", len(rows), "steps")
EOF

"$BIN" check inputs/copy-rl.toml --set rollout.overlong_window=1 > "$T/check.log" 2>&1
check "check refuses overlong_window without truncated = penalty (exit $?)" \
  has "$T/check.log" 'rollout.overlong_window = 1 is set but rollout.truncated = "train"'

echo "test_rl_data_rules: $(( $(date +%s) - start )) s"
exit $((failures > 0))
