#!/usr/bin/env bash
# tests/gpu/build_attention.sh — build the attention kernels and their test into
# build-gpu/ (or $BUILD_GPU), then run the test (needs a GPU; exit status is the test's).
#   bash tests/gpu/build_attention.sh           every case, timings included
#   bash tests/gpu/build_attention.sh --only tiny|big|long|race|cudnn|cmp   one group of cases
#   BUILD_ONLY=1 bash tests/gpu/build_attention.sh   compile (and print ptxas usage) only
source "$(dirname "$0")/nvcc.sh"
"$NVCC" "${NVCC_FLAGS[@]}" -Xptxas -v --threads 0 -Xcompiler -fopenmp,-Wall,-Wextra \
  -DSHARDLM_CUDNN=1 -I"$CUDA_HOME/include" -ldl \
  -o "$BUILD_GPU/test_attention" tests/gpu/test_attention.cu src/cuda/attention.cu src/cuda/sdpa_cudnn.cu \
  2> "$BUILD_GPU/ptxas.log" || { cat "$BUILD_GPU/ptxas.log"; exit 1; }
grep -E "error|warning" "$BUILD_GPU/ptxas.log" || true
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
exec "$BUILD_GPU/test_attention" "$@"
