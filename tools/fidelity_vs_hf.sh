#!/usr/bin/env bash
# fidelity_vs_hf.sh — shardlm's loss curve beside transformers' (eager and
# torch.compile) over a long run on the GPU machine
# (tools/fidelity_vs_hf.py says what it runs). The 1B shape's 150 steps take about
# 3 minutes for shardlm and 4-5 for each transformers run on an H200.
#
#   tools/fidelity_vs_hf.sh --shape llama-1b --steps 150 --out runs/fidelity
#   tools/fidelity_vs_hf.sh --shape llama-1b --out runs/fidelity --skip-hf runs/fidelity/losses.json \
#       --label SWITCH --set KEY=VALUE          (another shardlm curve against the same transformers runs)
#   tools/fidelity_vs_hf.sh --stream markov --steps 65 --out runs/fidelity-markov   (the Markov stream;
#       tools/fidelity_markov.sh runs it with the precision emulations in one call)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
PY=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
  if "$p" -c 'import torch, transformers, h5py, numpy' 2>/dev/null; then PY=$p; break; fi
done
[ -n "$PY" ] || { echo "fidelity_vs_hf.sh: no python with torch, transformers, h5py and numpy (set PYTHON)" >&2; exit 1; }
exec "$PY" tools/fidelity_vs_hf.py --shardlm "${SHARDLM:-build/shardlm}" "$@"
