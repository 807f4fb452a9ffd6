#!/usr/bin/env bash
# bench_tokenizer.sh — MB/s of text that tools/make_dataset.py turns into a token file with a
# tokenizer.json, at several worker counts (docs/benchmarks.md records the results).
#   tools/bench_tokenizer.sh TOKENIZER CORPUS.jsonl [WORKERS...]     (default workers: 1 and the cores)
# MB counts the UTF-8 bytes of the documents' text; the time is the whole run (tokenizer
# load, JSON parsing, tokenizing, writing the HDF5 file).
set -euo pipefail
PYTHON=${PYTHON:-/usr/bin/python3}
root=$(cd "$(dirname "$0")/.." && pwd)
tokenizer=$1 corpus=$2
shift 2
workers=("$@")
[ ${#workers[@]} -gt 0 ] || workers=(1 "$(nproc)")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mb=$("$PYTHON" -c "
import json, sys
print(sum(len(json.loads(l).get('text', '').encode()) for l in open(sys.argv[1], 'rb') if l.strip()) / 1e6)" "$corpus")
for w in "${workers[@]}"; do
  start=$(date +%s.%N)
  "$PYTHON" "$root/tools/make_dataset.py" -o "$out/bench.h5" --workers "$w" --tokenizer "$tokenizer" "$corpus" >/dev/null
  end=$(date +%s.%N)
  "$PYTHON" -c "import sys; mb, s = float(sys.argv[1]), float(sys.argv[3]) - float(sys.argv[2]); print(f'workers {sys.argv[4]:>3}: {mb:.1f} MB in {s:.2f} s = {mb / s:.1f} MB/s')" \
    "$mb" "$start" "$end" "$w"
done
