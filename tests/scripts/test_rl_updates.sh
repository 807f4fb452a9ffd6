#!/usr/bin/env bash
# test_rl_updates.sh — several optimizer updates per RL rollout step
# (loss.epochs, loss.mini_batches; docs/rl.md "Several updates per rollout
# step"), on the tiny model and synthetic rollouts (tools/make_rollouts.py), no
# inference ranks:
#   every logged step carries its updates (epochs x mini_batches of them), each
#     one's loss, gradient norm and clip fraction; the step's loss and gradient
#     norm are their means;
#   the optimizer's step count advances once per update: the checkpoint of step
#     3 holds 3 x 6 = 18;
#   a run stopped after step 3 and resumed gives the uninterrupted run's steps
#     4..6 bit for bit (every update's loss and gradient norm);
#   the same updates at 1 and 2 ranks agree (world-size invariance);
#   a rollout file with fewer samples than loss.mini_batches, and bad values of
#     the keys, are refused with a message that says what to do.
# The reward rising under several updates is test_rl_learns.sh's (the copy task).
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_updates  # BIN, PY, MPI, T, checks.sh

"$PY" tools/make_rollouts.py inputs/data/tiny.h5 --out "$T/rollouts" --steps 6 --samples-per-step 8 --seed 3 --max-tokens 129 \
  > "$T/rollouts.log" 2>&1 || { fail "make_rollouts.py"; cat "$T/rollouts.log"; }

# train NP RUN_DIR SETTINGS...: the tiny RL deck (the masked objective) on the synthetic rollouts, 2 epochs x 3
# parts a step.
train() {
  local np=$1 dir=$2
  shift 2
  local sets=(--set "run.dir=\"$dir\"" --set "data.rollout_dir=\"$T/rollouts\"" --set 'broadcast.backend="none"'
              --set data.max_async=4 --set data.seq_len=128 --set log.interval=1 --set loss.epochs=2
              --set loss.mini_batches=3)
  for s in "$@"; do sets+=(--set "$s"); done
  "${MPI[@]}" -np "$np" "$BIN" train inputs/tiny-rl.toml "${sets[@]}" > "$dir.log" 2>&1
}

train 2 "$T/full" run.max_steps=6 ckpt.interval=3
check "2 ranks, 6 rollout steps of 2 epochs x 3 parts: exit 0" test $? = 0
check "each logged step has 6 updates with their loss, gradient norm and masked fraction; the step's loss and norm are \
their means" "$PY" - "$T/full" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"loss"' in l]
assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], rows
for r in rows:
    assert r["updates"] == 6, r
    for key in ("update_loss", "update_grad_norm", "update_masked_fraction"):
        assert len(r[key]) == 6, (key, r)
    assert abs(sum(r["update_loss"]) / 6 - r["loss"]) <= 1e-7 * max(abs(r["loss"]), 1e-3), r
    assert abs(sum(r["update_grad_norm"]) / 6 - r["grad_norm"]) <= 1e-7 * r["grad_norm"], r
    assert all(0 <= c <= 1 for c in r["update_masked_fraction"]), r
    assert len(set(r["update_loss"])) == 6, r  # six different updates, not one repeated
EOF
check "the progress line shows each update's masked fraction" \
  grep -qE "masked high [0-9.]+ low [0-9.]+ \(6 updates:( [0-9.]+){6}\)" "$T/full.log"
check "the optimizer counts updates: step 3's checkpoint says steps_taken = 3 x 6 = 18" "$PY" - "$T/full" <<'EOF'
import sys, h5py
with h5py.File(f"{sys.argv[1]}/checkpoints/step_3.h5") as f:
    assert f.attrs["step"] == 3 and f["optim"].attrs["steps_taken"] == 18, (f.attrs["step"], f["optim"].attrs["steps_taken"])
EOF

# Stopped after step 3 (its final checkpoint), then the same run dir to step 6: a resume.
train 2 "$T/resumed" run.max_steps=3
rc1=$?
train 2 "$T/resumed" run.max_steps=6
rc2=$?
check "3 steps, then the same run resumed to 6: exit 0 both ($rc1, $rc2)" test $rc1 = 0 -a $rc2 = 0
check "... resumed from step 3" grep -q "checkpoint: resumed from .*/step_3\.h5" "$T/resumed.log"
check "... steps 4..6 equal the uninterrupted run's bit for bit: every update's loss and gradient norm" \
  "$PY" - "$T/full" "$T/resumed" <<'EOF'
import json, sys
full, resumed = ({r["step"]: r for r in (json.loads(l, parse_float=str) for l in open(f"{d}/metrics.jsonl"))
                  if "loss" in r} for d in sys.argv[1:])
for s in (4, 5, 6):
    for key in ("loss", "grad_norm", "update_loss", "update_grad_norm", "update_masked_fraction"):
        assert full[s][key] == resumed[s][key], (s, key, full[s][key], resumed[s][key])
EOF

train 1 "$T/np1" run.max_steps=3
check "1 rank: exit 0" test $? = 0
check "the updates at 1 and 2 ranks agree to 1e-5 (world-size invariance)" "$PY" - "$T/full" "$T/np1" <<'EOF'
import json, sys
two, one = ([json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l][:3] for d in sys.argv[1:])
for a, b in zip(two, one):
    for key in ("update_loss", "update_grad_norm"):
        for x, y in zip(a[key], b[key]):
            assert abs(x - y) <= 1e-5 * max(abs(x), 1e-2), (a["step"], key, a[key], b[key])
EOF

train 1 "$T/few" run.max_steps=1 loss.mini_batches=9
rc=$?
check "9 parts of a rollout file of 8 samples: exit 1 (got $rc)" test $rc = 1
check "... naming the file and what to do" has "$T/few.log" \
  "rollout file '$T/rollouts/step_0.h5' holds 8 samples, fewer than loss.mini_batches = 9: every update needs a sample at least; lower loss.mini_batches to at most 8"

"$BIN" check inputs/tiny-rl.toml --set loss.epochs=0 > "$T/bad1.log" 2>&1
check "check refuses loss.epochs = 0, naming the range" test $? = 1 -a \
  "$(grep -c 'loss.epochs = 0 is out of range: it must be between 1 and 1000' "$T/bad1.log")" = 1
"$BIN" check inputs/tiny-rl.toml --set loss.mini_batches=0 > "$T/bad2.log" 2>&1
check "check refuses loss.mini_batches = 0, naming the range" test $? = 1 -a \
  "$(grep -c 'loss.mini_batches = 0 is out of range: it must be between 1 and 1048576' "$T/bad2.log")" = 1
"$BIN" check inputs/tiny-sft.toml --set loss.epochs=2 > "$T/bad3.log" 2>&1
check "check refuses loss.epochs on an SFT deck" test $? = 1 -a \
  "$(grep -c 'loss.epochs sets the RL policy loss; it needs loss.type = "rl"' "$T/bad3.log")" = 1

exit $((failures > 0))
