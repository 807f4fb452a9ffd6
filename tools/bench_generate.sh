#!/usr/bin/env bash
# bench_generate.sh — sampling speed on the GPU machine in one call: `shardlm generate`
# (greedy and sampled) beside transformers' `generate` on a random Llama-3.2-1B-shaped
# model, batch 64, 128-token prompts, 256 new tokens; tokens/s, ratio, decode step vs
# the HBM floor, greedy equality (tools/bench_generate.py). About 3 minutes on an H200
# (model init and save included).
#
#   tools/bench_generate.sh                 SHARDLM=build/shardlm by default
#   tools/bench_generate.sh --small         a 4-layer model: a quick check of the script
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
PY=$(tools/find_python.sh)
exec "$PY" tools/bench_generate.py --shardlm "${SHARDLM:-build/shardlm}" "$@"
