#!/usr/bin/env bash
# bench_rl_arith.sh — the arithmetic RL run on one GPU: a 0.97 B-parameter model of
# Llama-3.2-1B's layers (16-id vocabulary) learns a + b of two-digit numbers
# (tools/make_arith_task.py; 1,000 problems held out of SFT and RL).
#   1. SFT warm start (inputs/bench/arith-sft.toml) in segments of SEG steps, each
#      from the last one's export, until the held-out greedy accuracy reaches
#      MIN_ACC (or MAX_SFT steps);
#   2. greedy equality with transformers' `generate` on the warm start and after
#      RL (tools/hf_greedy_check.py; skipped without torch or with --small);
#   3. RL (inputs/bench/arith-rl.toml): one trainer and one inference rank in one
#      mpirun sharing the GPU, weights every step over the staged MPI broadcast;
#   4. held-out greedy accuracy before and after RL, the reward curve and where
#      the time goes (tools/rl_arith_report.py: a table and docs/images/rl-arith.png).
#
#   tools/bench_rl_arith.sh [--small]      --small: a tiny model on the CPU (checks the script here)
#   WORK=runs/rl-arith RL_STEPS=200 SEG=25 MIN_ACC=0.15 MAX_SFT=200 tools/bench_rl_arith.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${SHARDLM:-build/shardlm}
W=${WORK:-runs/rl-arith}
SEG=${SEG:-25}
MIN_ACC=${MIN_ACC:-0.15}
MAX_SFT=${MAX_SFT:-150}
RL_STEPS=${RL_STEPS:-200}
PY=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
  if "$p" -c 'import h5py, numpy' 2>/dev/null; then PY=$p; break; fi
done
[ -n "$PY" ] || { echo "bench_rl_arith.sh: no python with h5py and numpy (set PYTHON)" >&2; exit 1; }
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
DEV=cuda
SETS=()
if [ "${1:-}" = --small ]; then
  DEV=cpu
  SETS=(--set model.hidden_size=${SMALL_HIDDEN:-64} --set model.intermediate_size=$((${SMALL_HIDDEN:-64} * 2)) --set model.num_layers=${SMALL_LAYERS:-2}
        --set model.num_heads=4 --set model.num_kv_heads=2 --set model.head_dim=16 --set device.backend=cpu)
fi
rm -rf "$W"
mkdir -p "$W"
"$PY" tools/make_arith_task.py --out-dir "$W/task" | tee "$W/task.log"

heldout() {  # heldout LABEL MODEL-ARGS...: greedy on the held-out problems, scored
  local label=$1
  shift
  "$BIN" generate "$@" --prompts "$W/task/heldout.h5" --temperature 0 --max-new-tokens 4 --batch 256 \
    --device "$DEV" --out "$W/heldout-$label.h5" > "$W/heldout-$label.log" 2>&1 ||
    { cat "$W/heldout-$label.log"; exit 1; }
  "$PY" tools/score_generate.py "$W/heldout-$label.h5" "$W/task/heldout.h5" --label "$label" \
    --json "$W/heldout-$label.json"
}
accuracy() { "$PY" -c "import json; print(json.load(open('$W/heldout-$1.json'))['accuracy'])"; }

# 1. SFT in segments, each starting from the last one's export (a fresh AdamW,
#    a new data order), evaluated on the held-out problems after each.
t0=$(date +%s.%N)
steps=0
from=()
while :; do
  steps=$((steps + SEG))
  "$BIN" train inputs/bench/arith-sft.toml --set "run.dir=$W/sft/run-$steps" --set "data.path=$W/task/sft.h5" \
    --set "run.max_steps=$SEG" --set "run.seed=$((7 + steps))" --set "run.export_dir=$W/sft/export-$steps" \
    --set 'run.export_dtype="fp32"' --set ckpt.save_final=false "${from[@]}" ${SETS[@]+"${SETS[@]}"} \
    >> "$W/sft.log" 2>&1 || { tail -30 "$W/sft.log"; exit 1; }
  [ ${#from[@]} -gt 0 ] && rm -rf "${from[1]#model.hf=}"
  from=(--set "model.hf=$W/sft/export-$steps" --set sched.warmup=0)
  heldout "sft-$steps" --hf "$W/sft/export-$steps"
  acc=$(accuracy "sft-$steps")
  "$PY" -c "import sys; sys.exit(0 if $acc >= $MIN_ACC or $steps >= $MAX_SFT else 1)" && break
done
mv "$W/sft/export-$steps" "$W/sft-export"
echo "sft: $steps steps, $("$PY" -c "import time; print(f'{time.time() - $t0:.0f}')") s; warm start: $W/sft-export"
cp "$W/heldout-sft-$steps.json" "$W/heldout-before.json"

# 2. The warm start's greedy continuations against transformers'.
if [ "$DEV" = cuda ] && "$PY" -c 'import torch, transformers' 2>/dev/null; then
  "$PY" tools/hf_greedy_check.py "$W/sft-export" "$W/task/heldout.h5" "$W/heldout-sft-$steps.h5" | tee "$W/hf-greedy.log"
fi

# 3. RL: trainer and inference rank in one job.
RL=(inputs/bench/arith-rl.toml --set "model.hf=$W/sft-export" --set "run.dir=$W/rl" --set "run.max_steps=$RL_STEPS"
    --set "data.rollout_dir=$W/rl/rollouts" --set "rollout.prompts=$W/task/prompts.h5"
    --set "run.export_dir=$W/rl/export" ${SETS[@]+"${SETS[@]}"})
t0=$(date +%s.%N)
mpirun --oversubscribe --bind-to none -x OMP_WAIT_POLICY -np 1 "$BIN" train "${RL[@]}" : \
  -np 1 "$BIN" generate "${RL[@]}" > "$W/rl.log" 2>&1 || { tail -40 "$W/rl.log"; exit 1; }
rl_s=$("$PY" -c "import time; print(f'{time.time() - $t0:.1f}')")
echo "rl: $RL_STEPS steps in $rl_s s"

# 4. After RL, and the report.
heldout after --hf "$W/rl/export"
if [ "$DEV" = cuda ] && "$PY" -c 'import torch, transformers' 2>/dev/null; then
  "$PY" tools/hf_greedy_check.py "$W/rl/export" "$W/task/heldout.h5" "$W/heldout-after.h5" | tee -a "$W/hf-greedy.log"
fi
"$PY" tools/rl_arith_report.py "$W" --rl-seconds "$rl_s" --sft-steps "$steps" ${PLOT:+--plot "$PLOT"}
