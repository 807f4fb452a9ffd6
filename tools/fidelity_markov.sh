#!/usr/bin/env bash
# fidelity_markov.sh — shardlm beside transformers on the Markov token stream at the
# Llama-3.2-1B shape (tools/fidelity_vs_hf.py --stream markov: 4096 active ids of the
# 128,256, the fixed successor with probability 0.8), with the precision emulations that
# could explain a gap in the fast descent, in one GPU-machine call; MODE=bound (below) also
# on the Zipf stream and at the Qwen3-1.7B shape.
#
#   SHARDLM=.fidbin/shardlm tools/fidelity_markov.sh        (on the GPU machine)
#
# The runs, most telling first (each invocation adds its curves to OUTDIR/losses.json):
#   1. transformers eager (the reference), shardlm default (fp32 residual stream, bf16 norm weights);
#   2. shardlm model.norm_dtype = fp32, and transformers with its norm weights rounded to bf16
#      (eager+bf16-norms): the norm weights from both sides;
#   3. transformers compile (transformers' own spread) and shardlm default again (shardlm's
#      run-to-run spread: cuDNN's attention backward is not bitwise reproducible);
#   4. transformers eager+fp32-wgrad (weight gradients summed in fp32 as shardlm's GEMMs do,
#      the tied lm head's included), eager+bf16-dembed (the embedding's gradient from the bf16
#      copy of the stream's, as shardlm's), eager+bf16-residual, eager+bf16-params.
# MODE=norms runs instead transformers eager and compile, and shardlm default and
# model.norm_dtype = fp32 three times each: whether the norm weights' precision moves
# shardlm's curve by more than its reruns do.
# MODE=bound runs, for SHAPE (llama-1b, qwen3-1.7b) and STREAM (markov, zipf), transformers
# eager, shardlm default, transformers compile and eager again, in that order, and prints the
# rerun bound: each window of shardlm within the larger of 2x |compile - eager| and
# |eager #k - eager| (the farthest of eager's reruns). EAGER_RUNS=N (default 2) runs eager N
# times in all, SHARDLM_RUNS=N (default 1) shardlm N times (its window is then their mean).
# Its runs resume: an invocation runs only the curves OUTDIR's losses.json lacks, so a
# shape's two streams can take two calls. The random init is made once per shape under MODELDIR and shared by the streams. On an H100 (65 steps) a stream took about 150 s at
# the Llama-3.2-1B shape (eager 31-33 s, shardlm 22-23 s, compile 58 s, 31 s once inductor's
# cache held the graphs of the other stream) and 250 s at Qwen3-1.7B (eager 52-53 s, shardlm
# 32 s, compile 104 s, 45 s with the cache).
#   MODE=bound SHAPE=qwen3-1.7b STREAM=zipf SHARDLM=build/shardlm tools/fidelity_markov.sh
# Every invocation runs under what is left of BUDGET seconds (default 500), and starts no
# run with less than MIN_LEFT seconds left (default 40; a run cut short is lost). On an H100 the
# whole of the default mode took 374 s: 65 steps of 4 x 4096 tokens took 22-24 s for a
# shardlm run (its start included), 29-32 s for a transformers eager run and 56 s compiled,
# the random init about 25 s. One invocation cut short keeps the runs it finished, and the
# tables of all finished runs are printed last. With $OUT set (the GPU machine's folder
# that comes back), the logs, losses.json, gradnorms.json and each shardlm run's
# metrics.jsonl go into $OUT/fidelity-STREAM-SHAPE.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
BUDGET=${BUDGET:-500}
STEPS=${STEPS:-65}
SHAPE=${SHAPE:-llama-1b}
STREAM=${STREAM:-markov}
OUTDIR=${OUTDIR:-runs/fidelity-$STREAM-$SHAPE}
MODELDIR=${MODELDIR:-runs/fidelity-models/model-$SHAPE}
SHARDLM=${SHARDLM:-build/shardlm}
start=$(date +%s)
PY=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
  if "$p" -c 'import torch, transformers, h5py, numpy' 2>/dev/null; then PY=$p; break; fi
done
[ -n "$PY" ] || { echo "fidelity_markov.sh: no python with torch, transformers, h5py and numpy (set PYTHON)" >&2; exit 1; }
[ -x "$SHARDLM" ] || { echo "fidelity_markov.sh: no shardlm at $SHARDLM (set SHARDLM)" >&2; exit 1; }
if ldd "$SHARDLM" | grep -q "not found"; then
  ldd "$SHARDLM" | grep "not found" >&2
  exit 1
fi
mkdir -p "$OUTDIR"
L=$OUTDIR/losses.json

pack() {
  [ -n "${OUT:-}" ] || return 0
  (cd "$OUTDIR" && tar czf "$OUT/fidelity-$STREAM-$SHAPE.tar.gz" --ignore-failed-read \
    ./*.log ./*.json ./*.toml $(ls -d run-*/metrics.jsonl 2>/dev/null)) 2>/dev/null
  ls -la "$OUT"
}
trap pack EXIT

# The emulations' CPU check, beside the first run (seconds of CPU; no GPU); MODE=bound runs none
check_pid=""
if [ "${MODE:-}" != bound ]; then
  (CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=2 "$PY" tools/fidelity_emulation_check.py > "$OUTDIR/emulation-check.log" 2>&1;
   echo "emulation check exit $?" >> "$OUTDIR/emulation-check.log") &
  check_pid=$!
fi

fid() {  # one invocation of fidelity_vs_hf.py within what is left of BUDGET
  local left=$((start + BUDGET - $(date +%s)))
  if [ "$left" -lt "${MIN_LEFT:-40}" ]; then echo "== skipped (${left} s left): $*"; return 1; fi
  echo "== $(($(date +%s) - start)) s: fidelity_vs_hf.py $* (${left} s left)"
  timeout -k 5 "$left" "$PY" tools/fidelity_vs_hf.py --shardlm "$SHARDLM" --shape "$SHAPE" --model "$MODELDIR" \
    --stream "$STREAM" --steps "$STEPS" --out "$OUTDIR" "$@" 2>&1 | grep -v -e "^|" -e "^$" -e "^last 10" \
    -e "^fidelity test" -e "HOLDS" -e "does not hold" -e "^gradient norm" -e ", $STREAM stream," -e "^run-to-run" \
    -e "^rerun bound" -e "the rerun bound$"
  echo "   exit ${PIPESTATUS[0]}"
}

if [ "${MODE:-}" = bound ]; then
  # Each invocation reads the curves the ones before it wrote (and those of an earlier call).
  hf() { [ -f "$L" ] && echo --skip-hf "$L"; }
  fid $(hf) --variants eager --repeats 0
  fid $(hf) --skip-done --variants "" --label default
  fid $(hf) --variants compile --repeats 0
  fid $(hf) --variants eager --hf-repeats "${EAGER_RUNS:-2}" --repeats 0
  if [ "${SHARDLM_RUNS:-1}" -gt 1 ]; then
    fid $(hf) --skip-done --variants "" --label default --repeats "$SHARDLM_RUNS"
  fi
elif [ "${MODE:-}" = norms ]; then
  fid --variants eager,compile --label default --repeats 3
  fid --skip-hf "$L" --label fp32-norms --set model.norm_dtype=fp32 --repeats 3
else
  fid --variants eager --label default
  fid --skip-hf "$L" --skip-done --variants eager+bf16-norms --label fp32-norms --set model.norm_dtype=fp32
  fid --skip-hf "$L" --skip-done --variants compile --label default --repeats 2
  fid --skip-hf "$L" --variants eager+fp32-wgrad,eager+bf16-dembed,eager+bf16-residual,eager+bf16-params \
    --repeats 0
fi
if [ -n "$check_pid" ]; then
  wait "$check_pid"
  echo "== $(($(date +%s) - start)) s: the emulation check (CPU):"
  grep -E "^(PASS|FAIL)|failed|exit" "$OUTDIR/emulation-check.log"
  echo
fi
"$PY" tools/fidelity_vs_hf.py --shardlm "$SHARDLM" --shape "$SHAPE" --model "$MODELDIR" --stream "$STREAM" \
  --steps "$STEPS" --out "$OUTDIR" --skip-hf "$L" --variants "" --repeats 0 | tee "$OUTDIR/tables.log"
echo "== $(($(date +%s) - start)) s in all"
