#!/usr/bin/env bash
# gpu_ab.sh — two builds of shardlm on the same GPU in one call: a bench deck's (the
# 1B one unless DECK names another) step losses with run.deterministic = true (must be bit-identical for a change
# that keeps the numbers), then its speed, alternating A B A B so drift in the
# machine's clocks falls on both.
#
#   tools/gpu_ab.sh BUILD_A BUILD_B [STEPS]     e.g. build/shardlm-base build/shardlm
#   SET="--set data.seq_len=32768 --set data.global_batch=1 --set model.activation_checkpointing=selective" \
#     TAG=ab32k tools/gpu_ab.sh BUILD_A BUILD_B 5
#       the same at 32K tokens a sequence: SET's --set overrides go to every run, the
#       deterministic ones and the timed ones; TAG (default ab) names the runs' dirs
#       and logs under runs/, so two invocations keep theirs apart. Where a default
#       changed between the two builds, name it in SET on both sides (630e6dd's norm
#       weights were bf16: SET="--set model.norm_dtype=fp32"), or the losses part.
#
#   DECK=inputs/bench/qwen3-30b-a3b-4l.toml TAG=abmoe tools/gpu_ab.sh BUILD_A BUILD_B 6
#       another bench deck (here the model of experts; its GPU kernels are deterministic too)
#
# Data: runs/bench-data/random-128k.h5 (tools/bench.sh makes it; its documents are
# 32769 tokens, so up to 32K a sequence). Prints one "identical" or "DIFFER" line
# for the losses and one throughput line per run.
set -u
cd "$(dirname "$0")/.."
a=${1:?BUILD_A}; b=${2:?BUILD_B}; steps=${3:-8}
deck=${DECK:-inputs/bench/llama-1b.toml}
tag=${TAG:-ab}
export OMP_WAIT_POLICY=passive
read -r -a extra <<< "${SET:-}"
common=(--set ckpt.resume=none --set ckpt.interval=0 --set ckpt.save_final=false --set log.interval=1 "${extra[@]}")
losses() { /usr/bin/env python3 -c '
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l, parse_float=str)
    if "loss" in r and "step" in r: print(r["step"], r["loss"], r["grad_norm"])' "$1"; }
for which in a b; do
  bin=${!which}
  "$bin" train $deck "${common[@]}" --set run.dir=runs/$tag-det-$which --set run.deterministic=true \
    --set run.max_steps=6 > runs/$tag-det-$which.log 2>&1 || { echo "$which: deterministic run failed"; tail -5 runs/$tag-det-$which.log; }
  losses runs/$tag-det-$which/metrics.jsonl > runs/$tag-det-$which.txt
done
echo "deterministic losses ($deck), A:"; cat runs/$tag-det-a.txt
if [ -s runs/$tag-det-a.txt ] && cmp -s runs/$tag-det-a.txt runs/$tag-det-b.txt; then echo "deterministic losses: identical";
else echo "deterministic losses: DIFFER"; diff runs/$tag-det-a.txt runs/$tag-det-b.txt | head; fi
for round in 1 2; do
  for which in a b; do
    bin=${!which}
    "$bin" train $deck "${common[@]}" --set run.dir=runs/$tag-speed-$which --set run.max_steps=$steps \
      > runs/$tag-speed-$which-$round.log 2>&1
    echo "round $round $which: $(grep -E '^throughput' runs/$tag-speed-$which-$round.log)"
  done
done
