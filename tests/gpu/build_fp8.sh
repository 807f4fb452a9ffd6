#!/usr/bin/env bash
# tests/gpu/build_fp8.sh — build the FP8 test into build-gpu/ and run it (the
# exit status is the test's). The host part (the CPU emulation against
# cuda_fp8.h's conversions) runs anywhere: --host-only; the rest needs a Hopper GPU.
#   bash tests/gpu/build_fp8.sh [--seed N] [--host-only] [--no-timing]
#   BUILD_ONLY=1 bash tests/gpu/build_fp8.sh       compile and link only
source "$(dirname "$0")/nvcc.sh"

"$NVCC" "${NVCC_FLAGS[@]}" -Xcompiler -fopenmp,-Wall,-Wextra \
  tests/gpu/test_fp8.cu src/cuda/fp8.cu src/cuda/gemm.cu src/cuda/reduce.cu src/cpu/fp8.cpp \
  -o "$BUILD_GPU/test_fp8" -L"$CUDA_HOME/lib64" -Xlinker -rpath,"$CUDA_HOME/lib64" -lcublasLt -lgomp

[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
exec "$BUILD_GPU/test_fp8" "$@"
