#!/usr/bin/env bash
# bench_generate.sh — sampling speed on the GPU machine in one call: `shardlm generate`
# (greedy and sampled, and greedy without CUDA graphs) beside transformers' `generate`
# on a random Llama-3.2-1B-shaped model, batch 64, 128-token prompts, 256 new tokens;
# tokens/s, ratio, decode step vs the HBM floor, greedy equality
# (tools/bench_generate.py). About 1.5 minutes on an H200 (model init and save included).
#
#   tools/bench_generate.sh                 SHARDLM=build/shardlm by default
#   tools/bench_generate.sh --greedy-only   one shardlm run: the decode step (~30 s)
#   tools/bench_generate.sh --profile       that, then a sampled run with SHARDLM_DECODE_PROFILE=1 (~1 min)
#   tools/bench_generate.sh --small         a 4-layer model: a quick check of the script
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
# The interpreter that has torch, transformers and h5py (on the GPU machine the
# PATH python3; tools/find_python.sh looks for h5py alone).
PY=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
  if "$p" -c 'import torch, transformers, h5py, numpy' 2>/dev/null; then PY=$p; break; fi
done
[ -n "$PY" ] || { echo "bench_generate.sh: no python with torch, transformers, h5py and numpy (set PYTHON)" >&2; exit 1; }
exec "$PY" tools/bench_generate.py --shardlm "${SHARDLM:-build/shardlm}" "$@"
