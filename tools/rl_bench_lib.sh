# rl_bench_lib.sh — what the RL benchmarks on a verifiable task share (sourced by
# tools/bench_rl_arith.sh, bench_rl_objectives.sh and bench_rl_long.sh): the
# environment, the --small CPU model, held-out scoring and the SFT warm start.
#
#   NAME=bench_x.sh; source tools/rl_bench_lib.sh; rl_bench_init "$@"
#
# rl_bench_init sets BIN (SHARDLM, else build/shardlm), PY (PYTHON, else a python
# with h5py and numpy), DEV (cuda; cpu with --small) and SETS (the --set of the
# --small model: SMALL_HIDDEN, SMALL_LAYERS). The callers set W (their work dir)
# and HELDOUT (the held-out prompt file) before scoring.

rl_bench_init() {
  BIN=${SHARDLM:-build/shardlm}
  PY=""
  for p in ${PYTHON:-} python3 /usr/bin/python3; do
    if "$p" -c 'import h5py, numpy' 2>/dev/null; then PY=$p; break; fi
  done
  [ -n "$PY" ] || { echo "$NAME: no python with h5py and numpy (set PYTHON)" >&2; exit 1; }
  if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
  DEV=cuda
  SETS=()
  if [ "${1:-}" = --small ]; then
    DEV=cpu
    local h=${SMALL_HIDDEN:-64}
    SETS=(--set model.hidden_size=$h --set model.intermediate_size=$((h * 2)) --set model.num_layers=${SMALL_LAYERS:-2}
          --set model.num_heads=4 --set model.num_kv_heads=2 --set model.head_dim=16 --set device.backend=cpu)
  fi
}

now() { date +%s.%N; }
since() { awk -v t0="$1" -v t1="$(now)" 'BEGIN { printf "%.1f", t1 - t0 }'; }

# heldout LABEL MAX_NEW MODEL-ARGS...: greedy on $HELDOUT, scored into $W/heldout-LABEL.json.
heldout() {
  local label=$1 max_new=$2
  shift 2
  "$BIN" generate "$@" --prompts "$HELDOUT" --temperature 0 --max-new-tokens "$max_new" --batch 256 \
    --device "$DEV" --out "$W/heldout-$label.h5" > "$W/heldout-$label.log" 2>&1 ||
    { cat "$W/heldout-$label.log"; return 1; }
  "$PY" tools/score_generate.py "$W/heldout-$label.h5" "$HELDOUT" --label "$label" --json "$W/heldout-$label.json"
}
accuracy() { "$PY" -c "import json; print(json.load(open('$W/heldout-$1.json'))['accuracy'])"; }

# sft_warm_start DECK SFT_FILE MAX_NEW [--set K=V ...]: SFT in segments of SEG steps, each from the
# last one's export (a fresh AdamW, a new data order), scored on $HELDOUT after
# each, until the greedy accuracy reaches MIN_ACC or MAX_SFT steps. Leaves the
# export in $W/sft-export, its score in $W/heldout-before.json, and the steps
# taken in SFT_STEPS.
sft_warm_start() {
  local deck=$1 data=$2 max_new=$3 acc from=()
  shift 3
  SFT_STEPS=0
  while :; do
    SFT_STEPS=$((SFT_STEPS + SEG))
    "$BIN" train "$deck" --set "run.dir=$W/sft/run-$SFT_STEPS" --set "data.path=$data" \
      --set "run.max_steps=$SEG" --set "run.seed=$((7 + SFT_STEPS))" --set "run.export_dir=$W/sft/export-$SFT_STEPS" \
      --set 'run.export_dtype="fp32"' --set ckpt.save_final=false "${from[@]}" ${SETS[@]+"${SETS[@]}"} "$@" \
      >> "$W/sft.log" 2>&1 || { tail -30 "$W/sft.log"; exit 1; }
    [ ${#from[@]} -gt 0 ] && rm -rf "${from[1]#model.hf=}"
    from=(--set "model.hf=$W/sft/export-$SFT_STEPS" --set sched.warmup=0)
    heldout "sft-$SFT_STEPS" "$max_new" --hf "$W/sft/export-$SFT_STEPS"
    acc=$(accuracy "sft-$SFT_STEPS")
    "$PY" -c "import sys; sys.exit(0 if $acc >= $MIN_ACC or $SFT_STEPS >= $MAX_SFT else 1)" && break
  done
  mv "$W/sft/export-$SFT_STEPS" "$W/sft-export"
  cp "$W/heldout-sft-$SFT_STEPS.json" "$W/heldout-before.json"
}
