#!/usr/bin/env bash
# bench_data.sh — the streamed token reader on a workstation: host memory per
# rank and tokens/s of the tiny deck at NP ranks on a large synthetic token file,
# against a small file (which the previous, in-memory reader could hold) with
# this binary and, when IN_MEMORY_BIN is given, with a build of that reader.
#
#   tools/bench_data.sh [TOKENS [STEPS [REPEATS]]]     (defaults 3e9, 400, 3)
#
# Env: BIN (build/shardlm), IN_MEMORY_BIN (none), IN_MEMORY_DECK (the tiny deck as
# that build reads it: a deck of its day, same model and schedule), NP (4), WORK
# (/tmp/shardlm-bench-data; big.h5 is made once there and kept until
# KEEP=0 removes it at the end), PYTHON (with h5py and numpy).
# Prints one line per run: tok/s, per-rank peak RSS (from /usr/bin/time), the
# plan's host total and the data reader's share. Results: docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/shardlm}
PYTHON=${PYTHON:-/usr/bin/python3}
WORK=${WORK:-/tmp/shardlm-bench-data}
NP=${NP:-4}
TOKENS=${1:-3000000000}
STEPS=${2:-400}
REPEATS=${3:-3}
mkdir -p "$WORK"
if [[ ! -f "$WORK/big.h5" ]]; then
  t0=$(date +%s)
  nice "$PYTHON" tools/make_synthetic_data.py "$WORK/big.h5" --vocab 258 --tokens "$TOKENS" --doc-len 1000
  echo "made $WORK/big.h5 ($(du -h "$WORK/big.h5" | cut -f1)) in $(( $(date +%s) - t0 )) s"
fi
[[ -f "$WORK/small.h5" ]] || "$PYTHON" tools/make_synthetic_data.py "$WORK/small.h5" --vocab 258 --tokens 20000000 \
  --doc-len 1000 >/dev/null

# run NAME BINARY FILE [DECK]: one training run; prints its numbers on one line.
run() {
  local name=$1 bin=$2 file=$3 deck=${4:-inputs/tiny-sft.toml} out
  rm -rf "$WORK/run-$name"
  out=$(OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive mpirun --allow-run-as-root --oversubscribe -np "$NP" \
          /usr/bin/time -f "rss_kib %M" "$bin" train "$deck" --set data.path="$file" \
          --set run.max_steps="$STEPS" --set log.interval="$STEPS" --set ckpt.save_final=false \
          --set run.dir="$WORK/run-$name" --set device.cpu_threads=1 2>&1)
  local toks rss plan data_ms
  toks=$(grep -o 'throughput (steps [0-9.]*): [0-9]* tok/s' <<<"$out" | grep -o '[0-9]* tok/s')
  data_ms=$(grep -o 'step time [0-9.]* ms: data [0-9.]*' <<<"$out" | sed 's/step time \([0-9.]*\) ms: data \([0-9.]*\)/step \1 ms, data \2 ms/')
  rss=$(grep -o 'rss_kib [0-9]*' <<<"$out" | awk '{printf "%s%.1f", (NR > 1 ? " " : ""), $2 / 1024}')
  plan=$(grep -o 'memory: peak .*' <<<"$out")
  echo "$name: $toks | $data_ms | peak RSS per rank (MiB): $rss | $plan"
}

for r in $(seq 1 "$REPEATS"); do
  run "big-$r" "$BIN" "$WORK/big.h5"
  run "small-$r" "$BIN" "$WORK/small.h5"
  [[ -n "${IN_MEMORY_BIN:-}" ]] && run "small-in-memory-$r" "$IN_MEMORY_BIN" "$WORK/small.h5" \
    "${IN_MEMORY_DECK:-inputs/tiny-sft.toml}"
done
"$BIN" check inputs/tiny-sft.toml --world "$NP" --set data.path="$WORK/big.h5" | sed -n '/memory plan/,$p'
[[ "${KEEP:-1}" == 0 ]] && rm -f "$WORK/big.h5" "$WORK/small.h5"
exit 0
