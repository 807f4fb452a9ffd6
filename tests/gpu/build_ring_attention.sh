#!/usr/bin/env bash
# tests/gpu/build_ring_attention.sh — build the context-parallel ring's masked
# attention kernels and their test (tests/gpu/test_ring_attention.cu) into
# build-gpu/ (or $BUILD_GPU), then run it (needs a GPU; exit status is the test's).
#   bash tests/gpu/build_ring_attention.sh [--seed N] [--no-timing]
#   BUILD_ONLY=1 bash tests/gpu/build_ring_attention.sh   compile only (no GPU needed)
# Needs nvcc and g++ with OpenMP only (no MPI, no BLAS: src/cpu/ops.cpp's CBLAS
# symbols are stubs in the test). The block passes (src/cuda/ring_attention.cu) need
# attention.cu's kernel choice (attention_set_kernel) and no Comm: the walk over the
# group that does is src/cuda/ring_walk.cu, left out here.
source "$(dirname "$0")/nvcc.sh"
"$NVCC" "${NVCC_FLAGS[@]}" --threads 0 -Itests/gpu/cblas_shim -Xcompiler -fopenmp,-Wall,-Wextra \
  -o "$BUILD_GPU/test_ring_attention" tests/gpu/test_ring_attention.cu src/cuda/ring_attention.cu \
  src/cuda/attention.cu src/cpu/ops.cpp -lgomp
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
exec "$BUILD_GPU/test_ring_attention" "$@"
