#!/usr/bin/env bash
# golden_losses.sh — every step's loss and gradient norm of the tiny decks on the
# CPU backend, as exact decimal text, for a refactor that must change nothing.
#
#   tools/golden_losses.sh record DIR     run the cases, write DIR/<case>.txt
#   tools/golden_losses.sh compare DIR    run them again, diff against DIR (exit 1 on any difference)
#
# Cases: SFT (AdamW, SGD, Muon; gradient accumulation; activation checkpointing;
# eval), RL on synthetic rollouts, each at -np 1..4. On the CPU backend the
# training state is the host one; `optim_cpu_offload = true` is accepted there
# and takes the same path, so it is one more case whose losses must not move.
# The numbers are the metrics JSONL's (9 digits) plus a SHA-256 of the final
# checkpoint's /model and /optim datasets: bit-identical means equal text.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?record|compare}; dir=${2:?DIR}
BUILD=${BUILD:-build}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/golden.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$dir"
/usr/bin/python3 tools/make_rollouts.py inputs/data/tiny.h5 --out "$work/rollouts" --steps 12 >/dev/null

# case NAME NP DECK SETTINGS...
run_case() {
  local name=$1 np=$2 deck=$3; shift 3
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  local out="$work/$name"
  mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -np "$np" "$BUILD/shardlm" train "$deck" \
    --set run.dir=\""$out"\" --set ckpt.resume=\"none\" --set log.interval=1 "${sets[@]}" > "$out.log" 2>&1 \
    || { echo "golden: $name failed:"; tail -20 "$out.log"; exit 1; }
  /usr/bin/python3 - "$out" > "$work/$name.txt" <<'PY'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
rows = [json.loads(l, parse_float=str) for p in sorted(run.glob("**/*.jsonl")) for l in open(p)]
for r in rows:
    if "loss" in r and "step" in r:
        print(r["step"], r["loss"], r.get("grad_norm"), r.get("eval_loss", "-"))
# The loss rows print 9 digits: the final checkpoint's parameters and optimizer
# state, hashed byte for byte, make the comparison exact.
import hashlib, h5py
ckpts = sorted(run.glob("checkpoints/step_*.h5"), key=lambda p: int(p.stem.split("_")[1]))
if ckpts:
    h = hashlib.sha256()
    with h5py.File(ckpts[-1], "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and (name.startswith("model/") or name.startswith("optim/")):
                h.update(name.encode()); h.update(obj[()].tobytes())
        f.visititems(visit)
    print("final", ckpts[-1].name, h.hexdigest())
PY
  [ -s "$work/$name.txt" ] || { echo "golden: $name wrote no step rows"; exit 1; }
  if [ "$mode" = record ]; then cp "$work/$name.txt" "$dir/$name.txt"; echo "recorded $name";
  elif cmp -s "$work/$name.txt" "$dir/$name.txt"; then echo "same     $name";
  else echo "DIFFERS  $name"; diff "$dir/$name.txt" "$work/$name.txt" | head -5; status=1; fi
}

status=0
for np in 1 2 3 4; do
  gb=8; [ $np = 3 ] && gb=12  # a multiple of micro_batch (2) x ranks
  run_case sft-adamw-np$np $np inputs/tiny-sft.toml run.max_steps=12 data.global_batch=$gb
  run_case sft-offload-np$np $np inputs/tiny-sft.toml run.max_steps=12 data.global_batch=$gb model.optim_cpu_offload=true
  run_case sft-sgd-accum-np$np $np inputs/tiny-sft.toml run.max_steps=10 optim.name=\"sgd\" optim.momentum=0.9 \
    data.global_batch=$((2 * gb)) model.activation_checkpointing=\"full\"
  run_case sft-muon-np$np $np inputs/tiny-sft.toml run.max_steps=8 data.global_batch=$gb optim.name=\"muon\" \
    model.activation_checkpointing=\"selective\" eval.path=\"inputs/data/tiny.h5\" eval.interval=4
  run_case rl-np$np $np inputs/tiny-rl.toml run.max_steps=10 broadcast.backend=\"none\" \
    data.rollout_dir=\""$work/rollouts"\" data.max_async=4
done
exit $status
