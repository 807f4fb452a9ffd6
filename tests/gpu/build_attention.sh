#!/usr/bin/env bash
# tests/gpu/build_attention.sh — build the attention kernels and their test into
# build-gpu/, then run the test (needs a GPU; exit status is the test's).
#   bash tests/gpu/build_attention.sh           every case, timings included
#   bash tests/gpu/build_attention.sh --only tiny|big|long|race   one group of cases
#   BUILD_ONLY=1 bash tests/gpu/build_attention.sh   compile (and print ptxas usage) only
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
mkdir -p build-gpu
"$NVCC" -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90 \
  -Iinclude -lineinfo -Xptxas -v --threads 0 -Xcompiler -fopenmp,-Wall,-Wextra \
  -o build-gpu/test_attention tests/gpu/test_attention.cu src/cuda/attention.cu \
  2> build-gpu/ptxas.log || { cat build-gpu/ptxas.log; exit 1; }
grep -E "error|warning" build-gpu/ptxas.log || true
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
exec ./build-gpu/test_attention "$@"
