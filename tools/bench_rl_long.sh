#!/usr/bin/env bash
# bench_rl_long.sh — RL with long completions on one GPU: a 25 M-parameter
# Llama-shaped model (16-id vocabulary) learns the chain task of
# tools/make_chain_task.py, whose answers are 106-981 tokens of worked lines,
# every one checked (the whole answer exact):
#   1. SFT warm start (inputs/bench/chain-sft.toml) in segments of SEG steps, each
#      from the last one's export, until the held-out greedy accuracy reaches
#      MIN_ACC (or MAX_SFT steps; tools/rl_bench_lib.sh);
#   2. RL (inputs/bench/chain-rl.toml), trainer and inference rank in one mpirun
#      sharing the GPU, greedy accuracy and pass@4 on the held-out problems every
#      5 policy steps during the run, twice from the same warm start and seed:
#        sync    data.max_async = 0: the sampler waits for each step's weights,
#                the trainer for each step's samples
#        async2  data.max_async = 2 with rollout.in_flight_updates: the sampler
#                runs up to two steps ahead, taking new weights between decode steps
#   3. held-out greedy accuracy after each, and tools/rl_long_report.py: reward and
#      held-out curves, the staleness histogram, where the time goes, wall-clock
#      per step and the idle fractions side by side (a table and a PNG).
#
#   tools/bench_rl_long.sh [--small]      --small: a tiny model on the CPU, short chains (checks the script here)
#   WORK=runs/rl-long RL_STEPS=30 SEG=150 MIN_ACC=0.3 MAX_SFT=1200 RUNS="sync async2" \
#     PLOT=docs/images/rl-long.png tools/bench_rl_long.sh
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WORK:-runs/rl-long}
SEG=${SEG:-150}
MIN_ACC=${MIN_ACC:-0.3}
MAX_SFT=${MAX_SFT:-1200}
RL_STEPS=${RL_STEPS:-30}
RUNS=${RUNS:-sync async2}
NAME=bench_rl_long.sh
source tools/rl_bench_lib.sh
rl_bench_init "$@"
TASK=()
MAX_NEW=1000
SFT_SETS=()
RL_SETS=()
if [ "$DEV" = cpu ]; then  # short chains, a few problems: the script's paths, not its numbers
  TASK=(--min-lines 2 --max-lines 6 --sft 400 --prompts 64 --heldout 16)
  MAX_NEW=48
  SFT_SETS=(--set data.seq_len=64 --set data.micro_batch=8 --set data.global_batch=8 --set sched.warmup=2)
  RL_SETS=(--set data.seq_len=64 --set data.micro_batch=8 --set rollout.prompts_per_step=4 --set rollout.n=4
           --set rollout.batch=16 --set eval.batch=16 --set eval.samples=2)
fi
PLOT=${PLOT:-$([ "$DEV" = cuda ] && echo docs/images/rl-long.png || echo "$W/rl-long.png")}

run_keys() {  # NAME: the deck keys of the run
  case $1 in
    sync)   echo 'data.max_async=0' ;;
    async2) echo 'data.max_async=2 rollout.in_flight_updates=true' ;;
    *) return 1 ;;
  esac
}
for r in $RUNS; do
  run_keys "$r" > /dev/null || { echo "$NAME: unknown run '$r' (sync async2)" >&2; exit 1; }
done

T_ALL=$(now)
rm -rf "$W"
mkdir -p "$W"
"$PY" tools/make_chain_task.py --out-dir "$W/task" ${TASK[@]+"${TASK[@]}"} | tee "$W/task.log"
HELDOUT=$W/task/heldout.h5

# 1. The warm start.
t0=$(now)
sft_warm_start inputs/bench/chain-sft.toml "$W/task/sft.h5" "$MAX_NEW" ${SFT_SETS[@]+"${SFT_SETS[@]}"}
echo "phase sft: $SFT_STEPS steps, each segment scored on the held-out problems, $(since "$t0") s"

# 2. and 3. Each run from the warm start, then scored.
: > "$W/runs.tsv"
for r in $RUNS; do
  RL=(inputs/bench/chain-rl.toml --set "model.hf=$W/sft-export" --set "run.dir=$W/rl-$r" --set "run.max_steps=$RL_STEPS"
      --set "data.rollout_dir=$W/rl-$r/rollouts" --set "rollout.prompts=$W/task/prompts.h5"
      --set "eval.prompts=$HELDOUT" --set "rollout.max_new_tokens=$MAX_NEW" --set "run.export_dir=$W/rl-$r/export")
  for k in $(run_keys "$r"); do RL+=(--set "$k"); done
  RL+=(${SETS[@]+"${SETS[@]}"} ${RL_SETS[@]+"${RL_SETS[@]}"})
  t0=$(now)
  mpirun --oversubscribe --bind-to none -x OMP_WAIT_POLICY -np 1 "$BIN" train "${RL[@]}" : \
    -np 1 "$BIN" generate "${RL[@]}" > "$W/rl-$r.log" 2>&1 || { tail -40 "$W/rl-$r.log"; exit 1; }
  rl_s=$(since "$t0")
  heldout "$r" "$MAX_NEW" --hf "$W/rl-$r/export"
  echo "phase rl $r: $RL_STEPS steps in $rl_s s"
  printf '%s\t%s\t%s\n' "$r" "$(run_keys "$r")" "$rl_s" >> "$W/runs.tsv"
done

"$PY" tools/rl_long_report.py "$W" --sft-steps "$SFT_STEPS" --plot "$PLOT"
echo "phase all: $(since "$T_ALL") s"
