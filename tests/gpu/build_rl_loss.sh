#!/usr/bin/env bash
# tests/gpu/build_rl_loss.sh — build the RL loss kernel test into build-gpu/ and run
# it (needs a Hopper GPU; the exit status is the test's). No MPI, no BLAS: the test
# links the kernel (src/cuda/rl_loss.cu) and its CPU reference (src/cpu/rl_loss.cpp).
#   bash tests/gpu/build_rl_loss.sh [--seed N] [--no-timing]
#   BUILD_ONLY=1 bash tests/gpu/build_rl_loss.sh       compile and link only
#   BUILD_GPU=/tmp/x bash tests/gpu/build_rl_loss.sh   build elsewhere
source "$(dirname "$0")/nvcc.sh"

"$NVCC" "${NVCC_FLAGS[@]}" -Xcompiler -fopenmp,-Wall,-Wextra \
  tests/gpu/test_cuda_rl_loss.cu src/cuda/rl_loss.cu src/cpu/rl_loss.cpp \
  -o "$BUILD_GPU/test_cuda_rl_loss" -lgomp

[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
exec "$BUILD_GPU/test_cuda_rl_loss" "$@"
