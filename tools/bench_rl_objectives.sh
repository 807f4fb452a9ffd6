#!/usr/bin/env bash
# bench_rl_objectives.sh — the RL losses side by side on the arithmetic task of
# tools/bench_rl_arith.sh (a 0.97 B-parameter model of Llama-3.2-1B's layers,
# 16-id vocabulary, learns a + b of two-digit numbers; 1,000 problems held out):
#   1. the SFT warm start as bench_rl_arith.sh makes it (inputs/bench/arith-sft.toml
#      in segments of SEG steps until the held-out greedy accuracy reaches MIN_ACC
#      or MAX_SFT steps), its held-out accuracy the "before" of every variant;
#   2. for each variant, RL_STEPS steps of inputs/bench/arith-rl.toml from that one
#      warm start (one trainer and one inference rank in one mpirun sharing the
#      GPU, the same seed, so the first step's samples are the same), each in its
#      own run dir, then its held-out greedy accuracy;
#   3. tools/rl_objectives_report.py: a markdown table (variant, its deck keys,
#      held-out accuracy before -> after, training reward over the first and last
#      10 steps, the RL job's wall time) and the reward curves in one PNG.
#
# The variants (VARIANTS, space separated, picks some of them, in its order):
#   masked    the masked objective (mask_high = mask_low = 0.2)
#   clipped   PPO/GRPO's clipped surrogate, 0.2 / 0.28
#   gspo      the clip on each sample's ratio, at 0.2 / 0.28: GSPO's paper's 3e-4 / 4e-4
#             clip most samples of 1-4-token completions on the train/inference
#             mismatch alone (docs/rl.md "The policy term")
#   cispo     the truncated weight on every token, no lower bound (1 / 0.28)
#   dr_grpo   Dr. GRPO: advantages not divided by the group's std, the summed loss
#             divided by max_new_tokens x prompts_per_step x n (docs/rl.md "Aggregation")
#   dapo      clipped at 0.2 / 0.28 with DAPO's data rules (docs/rl.md): dynamic
#             sampling, and completions cut at max_new_tokens carry no loss (overlong
#             filtering; the soft penalty would punish every right three-digit
#             answer, whose EOS is the fourth and last token of the budget)
# Every variant runs from arith-rl.toml less its clip bounds (the masked objective
# refuses them; each objective's own defaults apply unless the variant sets them).
#
#   tools/bench_rl_objectives.sh [--small]     --small: a tiny model on the CPU (checks the script here)
#   WORK=runs/rl-objectives RL_STEPS=60 SEG=30 MIN_ACC=0.2 MAX_SFT=120 VARIANTS="clipped gspo" \
#     PLOT=docs/images/rl-objectives.png tools/bench_rl_objectives.sh
#   SHARDLM (build/shardlm), PYTHON (one with h5py and numpy; matplotlib for the plot),
#   PLOT (docs/images/rl-objectives.png; with --small, WORK/rl-objectives.png)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WORK:-runs/rl-objectives}
SEG=${SEG:-30}
MIN_ACC=${MIN_ACC:-0.2}
MAX_SFT=${MAX_SFT:-120}
RL_STEPS=${RL_STEPS:-60}
VARIANTS=${VARIANTS:-masked clipped gspo cispo dr_grpo dapo}
NAME=bench_rl_objectives.sh
source tools/rl_bench_lib.sh
rl_bench_init "$@"
# The plot of a --small run stays in its work dir.
PLOT=${PLOT:-$([ "$DEV" = cuda ] && echo docs/images/rl-objectives.png || echo "$W/rl-objectives.png")}

variant_keys() {  # NAME: the deck keys the variant sets, space separated
  case $1 in
    masked)  echo 'loss.objective="masked"' ;;
    clipped) echo 'loss.objective="clipped" loss.clip_low=0.2 loss.clip_high=0.28' ;;
    gspo)    echo 'loss.objective="gspo" loss.clip_low=0.2 loss.clip_high=0.28' ;;
    cispo)   echo 'loss.objective="cispo" loss.clip_low=1.0 loss.clip_high=0.28' ;;
    dr_grpo) echo 'loss.objective="clipped" rollout.advantage="mean" loss.normalize="constant"' ;;
    dapo)    echo 'loss.objective="clipped" loss.clip_low=0.2 loss.clip_high=0.28 rollout.dynamic_sampling=true rollout.truncated="mask"' ;;
    *) return 1 ;;
  esac
}
for v in $VARIANTS; do
  variant_keys "$v" > /dev/null ||
    { echo "bench_rl_objectives.sh: unknown variant '$v' (masked clipped gspo cispo dr_grpo dapo)" >&2; exit 1; }
done

T_ALL=$(now)
rm -rf "$W"
mkdir -p "$W"
t0=$(now)
"$PY" tools/make_arith_task.py --out-dir "$W/task" | tee "$W/task.log"
echo "phase task: $(since "$t0") s"

HELDOUT=$W/task/heldout.h5

# 1. The warm start of tools/bench_rl_arith.sh, step for step (tools/rl_bench_lib.sh).
t0=$(now)
sft_warm_start inputs/bench/arith-sft.toml "$W/task/sft.h5" 4
steps=$SFT_STEPS
echo "phase sft: $steps steps, each segment scored on the held-out problems, $(since "$t0") s; warm start: $W/sft-export"

# 2. The shared RL deck, and every variant checked against it before any runs.
grep -Ev '^clip_(low|high)[[:space:]]*=' inputs/bench/arith-rl.toml > "$W/arith-rl.toml"
rl_args() {  # VARIANT: the deck and --set of its RL job
  local keys k
  read -ra keys <<< "$(variant_keys "$1")"
  RL=("$W/arith-rl.toml" --set "model.hf=$W/sft-export" --set "run.dir=$W/rl-$1" --set "run.max_steps=$RL_STEPS"
      --set "data.rollout_dir=$W/rl-$1/rollouts" --set "rollout.prompts=$W/task/prompts.h5"
      --set "run.export_dir=$W/rl-$1/export")
  for k in "${keys[@]}"; do RL+=(--set "$k"); done
  RL+=(${SETS[@]+"${SETS[@]}"})
}
t0=$(now)
for v in $VARIANTS; do
  rl_args "$v"
  "$BIN" check "${RL[@]}" --world 1 > "$W/check-$v.log" 2>&1 ||
    { echo "bench_rl_objectives.sh: variant $v is refused:" >&2; cat "$W/check-$v.log" >&2; exit 1; }
done
echo "phase check: $VARIANTS: $(since "$t0") s"

# 3. Each variant from the warm start, scored after; a variant that fails is
#    reported as such and the others still run.
: > "$W/variants.tsv"
failed=()
for v in $VARIANTS; do
  rl_args "$v"
  t0=$(now)
  if mpirun --oversubscribe --bind-to none -x OMP_WAIT_POLICY -np 1 "$BIN" train "${RL[@]}" : \
       -np 1 "$BIN" generate "${RL[@]}" > "$W/rl-$v.log" 2>&1; then
    rl_s=$(since "$t0")
    t1=$(now)
    if heldout "$v" 4 --hf "$W/rl-$v/export"; then
      echo "phase rl $v: $RL_STEPS steps in $rl_s s; held-out scoring $(since "$t1") s"
    else
      failed+=("$v")
    fi
    rm -rf "$W/rl-$v/export"  # 4 GB at fp32 on the GPU
  else
    rl_s=$(since "$t0")
    tail -40 "$W/rl-$v.log"
    echo "phase rl $v: FAILED after $rl_s s (log: $W/rl-$v.log)"
    failed+=("$v")
  fi
  printf '%s\t%s\t%s\n' "$v" "$(variant_keys "$v")" "$rl_s" >> "$W/variants.tsv"
done

# 4. The report.
"$PY" tools/rl_objectives_report.py "$W" --sft-steps "$steps" --rl-steps "$RL_STEPS" --plot "$PLOT"
echo "phase all: $(since "$T_ALL") s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "bench_rl_objectives.sh: failed: ${failed[*]}" >&2
  exit 1
fi
