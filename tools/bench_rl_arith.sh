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
W=${WORK:-runs/rl-arith}
SEG=${SEG:-25}
MIN_ACC=${MIN_ACC:-0.15}
MAX_SFT=${MAX_SFT:-150}
RL_STEPS=${RL_STEPS:-200}
NAME=bench_rl_arith.sh
source tools/rl_bench_lib.sh
rl_bench_init "$@"
rm -rf "$W"
mkdir -p "$W"
"$PY" tools/make_arith_task.py --out-dir "$W/task" | tee "$W/task.log"

HELDOUT=$W/task/heldout.h5

# 1. SFT in segments, each starting from the last one's export, evaluated on the
#    held-out problems after each (tools/rl_bench_lib.sh).
t0=$(now)
sft_warm_start inputs/bench/arith-sft.toml "$W/task/sft.h5" 4
steps=$SFT_STEPS
echo "sft: $steps steps, $(since "$t0") s; warm start: $W/sft-export"

# 2. The warm start's greedy continuations against transformers'.
if [ "$DEV" = cuda ] && "$PY" -c 'import torch, transformers' 2>/dev/null; then
  "$PY" tools/hf_greedy_check.py "$W/sft-export" "$W/task/heldout.h5" "$W/heldout-sft-$steps.h5" | tee "$W/hf-greedy.log"
fi

# 3. RL: trainer and inference rank in one job.
RL=(inputs/bench/arith-rl.toml --set "model.hf=$W/sft-export" --set "run.dir=$W/rl" --set "run.max_steps=$RL_STEPS"
    --set "data.rollout_dir=$W/rl/rollouts" --set "rollout.prompts=$W/task/prompts.h5"
    --set "run.export_dir=$W/rl/export" ${SETS[@]+"${SETS[@]}"})
t0=$(now)
mpirun --oversubscribe --bind-to none -x OMP_WAIT_POLICY -np 1 "$BIN" train "${RL[@]}" : \
  -np 1 "$BIN" generate "${RL[@]}" > "$W/rl.log" 2>&1 || { tail -40 "$W/rl.log"; exit 1; }
rl_s=$(since "$t0")
echo "rl: $RL_STEPS steps in $rl_s s"

# 4. After RL, and the report.
heldout after 4 --hf "$W/rl/export"
if [ "$DEV" = cuda ] && "$PY" -c 'import torch, transformers' 2>/dev/null; then
  "$PY" tools/hf_greedy_check.py "$W/rl/export" "$W/task/heldout.h5" "$W/heldout-after.h5" | tee -a "$W/hf-greedy.log"
fi
"$PY" tools/rl_arith_report.py "$W" --rl-seconds "$rl_s" --sft-steps "$steps" ${PLOT:+--plot "$PLOT"}
