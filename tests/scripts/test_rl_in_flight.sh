#!/usr/bin/env bash
# test_rl_in_flight.sh — weights taken between two decode steps
# (rollout.in_flight_updates; docs/rl.md "In-flight weight updates"), on the
# copy task (tools/make_copy_task.py) with 1 trainer and 1 inference rank,
# data.max_async = 2, and each of the inference rank's forwards slowed
# (SHARDLM_FAULT=sample_slow, 100 ms; 48 of a step's 256 sequences at a time, the last wave 16: free slots for the next step) so that a step's sampling outlasts the
# trainer's step and weights arrive while it samples:
#   over the MPI broadcast and the filesystem one, the job ends (exit 0) with
#     weights taken mid-step and steps whose samples started while the step
#     before was sampled (continuous rollouts: rollout_started_ahead_fraction); every rollout file's policy_step is its oldest
#     sample's and within data.max_async of its step (the trainer accepts it);
#     each step's staleness histogram (rollout_staleness_0..2) sums to 1 and,
#     with in-flight updates, some samples are fresher than the step's start;
#   without rollout.in_flight_updates the same job takes no weights mid-step and
#     every sample of a step is as old as the step's policy_step;
#   eval during the run (eval.interval = 4) evaluates the starting weights first;
#   in-flight updates with 2 inference ranks are refused, naming the key.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_in_flight  # BIN, PY, MPI, T, checks.sh
start=$(date +%s)

copy_task_warm_start --set run.max_steps=20 --set 'run.export_dtype="bf16"'

# rl RUN_DIR EXTRA...: ARGS = the deck for a run in RUN_DIR, then EXTRA.
rl() {
  local dir=$1
  shift
  ARGS=(inputs/copy-rl.toml --set "model.hf=$T/sft/export" --set "run.dir=$dir" --set "data.rollout_dir=$dir/rollouts"
        --set "rollout.prompts=$T/task/prompts.h5" --set run.max_steps=8 --set log.interval=1 --set data.max_async=2 --set rollout.batch=48
        --set "broadcast.dir=\"$dir/weights\"" "$@")
}
job() {
  SHARDLM_FAULT=sample_slow@1 SHARDLM_SAMPLE_SLOW_MS=100 timeout 180 "${MPI[@]}" -x SHARDLM_FAULT -x SHARDLM_SAMPLE_SLOW_MS \
    "$@" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}"
}
# staleness DIR IN_FLIGHT: the rollout files and rollouts.jsonl of the run in DIR.
staleness() {
  "$PY" - "$1" "$2" <<'EOF'
import json, sys, h5py
d, in_flight = sys.argv[1], sys.argv[2] == "1"
rows = [json.loads(l) for l in open(f"{d}/rollouts.jsonl")]
assert [r["step"] for r in rows] == list(range(8)), [r["step"] for r in rows]
loads = sum(r["in_flight_updates"] for r in rows)
fresher = 0
for r in rows:
    hist = [r[f"staleness_{k}"] for k in range(3)]
    assert abs(sum(hist) - 1) < 1e-9, (r["step"], hist)
    with h5py.File(f"{d}/rollouts/step_{r['step']}.h5") as f:
        policy = int(f.attrs["policy_step"])
    assert policy == r["policy_step"] and 0 <= r["step"] - policy <= 2, (r["step"], policy)
    oldest = max(k for k in range(3) if hist[k] > 0)
    assert r["step"] - oldest == policy, (r["step"], hist, policy)  # the file's policy step is its oldest sample's
    fresher += any(hist[k] > 0 for k in range(oldest))
    assert 0 <= r["sampler_wait_fraction"] <= 1, r
ahead = [r.get("started_ahead_fraction", 0) for r in rows]
assert all(0 <= a <= 1 for a in ahead), ahead
if in_flight:
    # Continuous rollouts: a step's samples start while the last one's tail decodes.
    assert loads >= 2 and fresher >= 1 and sum(a > 0 for a in ahead) >= 2, (loads, fresher, ahead)
else:
    assert loads == 0 and fresher == 0 and not any("started_ahead_fraction" in r for r in rows), (loads, fresher)
print(f"weights taken mid-step {loads} times; {fresher} of 8 steps hold samples fresher than their oldest; "
      f"started during the step before: {['%.2f' % a for a in ahead]}")
EOF
}

"$PY" tools/make_copy_task.py --out-dir "$T/held" --seed 1 --prompts 16 --sft-docs 1 > "$T/held.log" 2>&1 ||
  { fail "make_copy_task.py (held-out prompts)"; cat "$T/held.log"; }
EVAL=(--set "eval.prompts=$T/held/prompts.h5" --set eval.interval=4 --set eval.samples=2)
for path in nccl filesystem; do
  rl "$T/on-$path" --set rollout.in_flight_updates=true --set "broadcast.backend=\"$path\"" "${EVAL[@]}"
  s0=$(date +%s); job > "$T/on-$path.log" 2>&1; rc=$?; echo "$path: $(( $(date +%s) - s0 )) s"; (exit $rc)
  check "$path, in-flight updates: exit $? (0)" test $? = 0
  check "... weights taken mid-step; files' policy steps are their oldest samples', within data.max_async; \
histograms sum to 1" staleness "$T/on-$path" 1
done
check "... the trainer logs the histogram and its wait fraction" "$PY" - "$T/on-nccl/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert len(rows) == 8 and all("rollout_staleness_2" in r and 0 <= r["rollout_wait_fraction"] <= 1 for r in rows), rows[0]
EOF
check "... eval during the run: the starting weights first, though later weights arrive while the step before \
the first evaluation finishes" "$PY" - "$T/on-nccl/eval.jsonl" <<'EOF'
import json, sys
steps = [json.loads(l)["eval_policy_step"] for l in open(sys.argv[1])]
assert steps[0] == 0 and steps == sorted(set(steps)) and steps[-1] == 8, steps
EOF
rl "$T/off"
job > "$T/off.log" 2>&1
check "without in-flight updates: exit $? (0)" test $? = 0
check "... no weights taken mid-step; every sample as old as its step's policy step" staleness "$T/off" 0

rl "$T/two" --set rollout.in_flight_updates=true
timeout 120 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 2 "$BIN" generate "${ARGS[@]}" > "$T/two.log" 2>&1
check "in-flight updates with 2 inference ranks: refused (exit $?)" test $? != 0
check "... naming rollout.in_flight_updates and the ranks" \
  grep -q "rollout.in_flight_updates = true with 2 inference ranks" "$T/two.log"

echo "test_rl_in_flight: $(( $(date +%s) - start )) s"
exit $((failures > 0))
