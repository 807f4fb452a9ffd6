#!/usr/bin/env bash
# test_rl_ref_kl.sh — the RL loss's KL term against the run's starting weights
# (loss.ref_kl_coef, loss.ref_kl_estimator; docs/rl.md "KL to the starting
# weights"), on the CPU backend:
#   the copy task (tools/make_copy_task.py, an SFT warm start, then RL with one
#     inference rank, 20 rollout steps): with the k3 penalty the policy's exact
#     KL to the starting weights, KL(pi || pi_start) summed over the
#     vocabulary at the completion's two positions of every prompt (`shardlm
#     forward` on both models' weights), ends well below the run without it;
#     the logged ref_kl is exactly 0 at step 1 (the weights are the reference's)
#     and positive after;
#   the frozen weights survive a resume: they are rebuilt from the deck (the
#     seeded init, or model.hf) at every launch, so a run stopped after step 3
#     and resumed gives the uninterrupted run's steps 4..6 bit for bit (losses
#     and ref_kl, with two parts a step);
#   `check` plans the frozen copy (a row the size of the parameter shards) and
#     refuses an unknown estimator, an estimator without the term, and the CUDA
#     backend (not built there).
# The estimators' values and gradients against numpy: test_rl_objectives.sh.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_ref_kl  # BIN, PY, MPI, T, checks.sh

# --- the penalty keeps the policy near its start (copy task, seeded)
copy_task_warm_start --set 'run.export_dtype="fp32"'
# rl RUN_DIR SETTINGS...: 20 on-policy rollout steps of the copy task, the final weights exported in fp32.
rl() {
  local dir=$1
  shift
  local args=(inputs/copy-rl.toml --set "model.hf=$T/sft/export" --set "run.dir=$dir" --set "data.rollout_dir=$dir/rollouts"
              --set "rollout.prompts=$T/task/prompts.h5" --set run.max_steps=20 --set log.interval=1
              --set "run.export_dir=$dir/export" --set 'run.export_dtype="fp32"')
  for s in "$@"; do args+=(--set "$s"); done
  "${MPI[@]}" -np 2 "$BIN" train "${args[@]}" : -np 1 "$BIN" generate "${args[@]}" > "$dir.log" 2>&1
}
rl "$T/free"
rc1=$?
rl "$T/k3" loss.ref_kl_coef=2.0
rc2=$?
check "copy task, 20 rollout steps without and with ref_kl_coef = 2 (k3): exit 0 both ($rc1, $rc2)" \
  test $rc1 = 0 -a $rc2 = 0
# Every prompt with its answer digit: [BOS d1 d2 d3 SEP d3]; positions 4 and 5 predict the completion.
"$PY" - "$T" <<'EOF'
import sys, h5py, numpy as np
t = sys.argv[1]
prompts = h5py.File(f"{t}/task/prompts.h5")["tokens"][:].reshape(-1, 5)
with h5py.File(f"{t}/rows.h5", "w") as f:
    f["tokens"] = np.concatenate([prompts, prompts[:, 3:4]], axis=1).astype(np.int32)
EOF
for m in sft free k3; do "$BIN" forward --hf "$T/$m/export" --tokens "$T/rows.h5" --out "$T/logits_$m.h5" > /dev/null 2>&1; done
check "with the penalty the exact KL to the starting weights ends below half of the run without it; the logged ref_kl \
is 0 at step 1 and positive after" "$PY" - "$T" <<'EOF'
import json, sys, h5py, numpy as np
t = sys.argv[1]
def log_softmax(name):
    x = h5py.File(f"{t}/logits_{name}.h5")["logits"][:].astype(np.float64)[:, 4:6]
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
start = log_softmax("sft")
kl = {m: float((np.exp(log_softmax(m)) * (log_softmax(m) - start)).sum(-1).mean()) for m in ("free", "k3")}
rows = [json.loads(l) for l in open(f"{t}/k3/metrics.jsonl") if '"ref_kl"' in l]
print(f"KL(pi || pi_start) at the completion after 20 steps: without {kl['free']:.4f}, with k3 x 2 {kl['k3']:.4f}; "
      f"logged ref_kl at steps 1, 2, 20: {rows[0]['ref_kl']}, {rows[1]['ref_kl']}, {rows[-1]['ref_kl']}")
assert kl["free"] > 0.02 and kl["k3"] < 0.5 * kl["free"], kl
assert len(rows) == 20 and rows[0]["ref_kl"] == 0 and all(r["ref_kl"] > 0 for r in rows[1:]), rows
EOF

# --- the frozen weights survive a resume: seeded init (tiny-rl) and model.hf (the copy task's warm start)
"$PY" tools/make_rollouts.py inputs/data/tiny.h5 --out "$T/tiny-rollouts" --steps 6 --samples-per-step 8 --seed 5 \
  --max-tokens 129 > /dev/null 2>&1 || fail "make_rollouts.py (tiny)"
"$PY" tools/make_rollouts.py "$T/task/sft.h5" --out "$T/copy-rollouts" --steps 6 --samples-per-step 64 --seed 5 \
  --max-tokens 7 > /dev/null 2>&1 || fail "make_rollouts.py (copy task)"
# offline DECK ROLLOUTS RUN_DIR SETTINGS...: the trainers alone on synthetic rollouts, k2 x 0.1, two parts a step.
offline() {
  local deck=$1 rollouts=$2 dir=$3
  shift 3
  local sets=(--set "run.dir=\"$dir\"" --set "data.rollout_dir=\"$rollouts\"" --set 'broadcast.backend="none"'
              --set data.max_async=4 --set log.interval=1 --set loss.ref_kl_coef=0.1 --set 'loss.ref_kl_estimator="k2"'
              --set loss.mini_batches=2)
  for s in "$@"; do sets+=(--set "$s"); done
  "${MPI[@]}" -np 2 "$BIN" train "$deck" "${sets[@]}" > "$dir.log" 2>&1
}
for variant in tiny copy; do
  if [ $variant = tiny ]; then deck=inputs/tiny-rl.toml extra=(data.seq_len=128)
  else deck=inputs/copy-rl.toml extra=("model.hf=\"$T/sft/export\"" ckpt.save_final=true)
  fi
  offline $deck "$T/$variant-rollouts" "$T/$variant-full" run.max_steps=6 "${extra[@]}"
  rc0=$?
  offline $deck "$T/$variant-rollouts" "$T/$variant-resumed" run.max_steps=3 "${extra[@]}"
  rc1=$?
  offline $deck "$T/$variant-rollouts" "$T/$variant-resumed" run.max_steps=6 "${extra[@]}"
  rc2=$?
  check "$variant: 6 steps, and 3 then resumed to 6: exit 0 ($rc0, $rc1, $rc2)" test $rc0 = 0 -a $rc1 = 0 -a $rc2 = 0
  check "$variant: ... resumed from step 3" grep -q "checkpoint: resumed from .*/step_3\.h5" "$T/$variant-resumed.log"
  check "$variant: ... steps 4..6 equal the uninterrupted run's bit for bit (loss, grad_norm, ref_kl > 0)" \
    "$PY" - "$T/$variant-full" "$T/$variant-resumed" <<'EOF'
import json, sys
full, resumed = ({r["step"]: r for r in (json.loads(l, parse_float=str) for l in open(f"{d}/metrics.jsonl"))
                  if "loss" in r} for d in sys.argv[1:])
for s in (4, 5, 6):
    assert float(full[s]["ref_kl"]) > 0, full[s]
    for key in ("loss", "grad_norm", "ref_kl", "update_loss"):
        assert full[s][key] == resumed[s][key], (s, key, full[s][key], resumed[s][key])
EOF
done

# --- check: the plan's row, the refusals
"$BIN" check inputs/tiny-rl.toml --set loss.ref_kl_coef=0.1 > "$T/plan.log" 2>&1
check "check plans the frozen copy: a 'reference weights' row the size of the parameter shards" "$PY" - "$T/plan.log" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
shards = re.search(r"parameter shards\s+host\s+([0-9.]+) MiB", text).group(1)
ref = re.search(r"reference weights\s+host\s+([0-9.]+) MiB", text).group(1)
assert shards == ref and float(ref) > 0, (shards, ref)
EOF
"$BIN" check inputs/tiny-rl.toml > "$T/plan0.log" 2>&1
check "... and none without the term" test "$(grep -c 'reference weights' "$T/plan0.log")" = 0
"$BIN" check inputs/tiny-rl.toml --set loss.ref_kl_coef=0.1 --set 'loss.ref_kl_estimator="k4"' > "$T/bad1.log" 2>&1
check "check refuses loss.ref_kl_estimator = \"k4\", listing k1, k2, k3" test $? = 1 -a \
  "$(grep -c 'loss.ref_kl_estimator = "k4" is not accepted: it must be one of "k1", "k2", "k3"' "$T/bad1.log")" = 1
"$BIN" check inputs/tiny-rl.toml --set 'loss.ref_kl_estimator="k2"' > "$T/bad2.log" 2>&1
check "check refuses an estimator without loss.ref_kl_coef" test $? = 1 -a \
  "$(grep -c 'loss.ref_kl_estimator estimates the KL term against the starting weights, which loss.ref_kl_coef = 0 turns off' "$T/bad2.log")" = 1
"$BIN" check inputs/tiny-rl.toml --set loss.ref_kl_coef=0.1 --set 'device.backend="cuda"' > "$T/plan_cuda.log" 2>&1
if grep -q "built without CUDA" "$T/plan_cuda.log"; then
  echo "(a CPU-only build: the CUDA memory plan is not available, its check skipped)"
else
check "check plans the term on the CUDA backend: the fp32 host copy and a bf16 GPU copy the size of the parameter copies" \
  "$PY" - "$T/plan_cuda.log" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
row = lambda name, where: float(re.search(name + r"\s+" + where + r"\s+([0-9.]+) MiB", text).group(1))
assert row("reference weights", "host") == row("parameter shards", "host") > 0, text
assert row("reference copies", "GPU") == row("parameter copies", "GPU") > 0, text
assert abs(row("reference copies", "GPU") * 2 - row("reference weights", "host")) < 0.01, text
EOF
fi

exit $((failures > 0))
