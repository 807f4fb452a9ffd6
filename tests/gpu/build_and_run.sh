#!/usr/bin/env bash
# build_and_run.sh — build the GPU kernel test into build-gpu/ and run it.
#
#   bash tests/gpu/build_and_run.sh [--seed N] [--no-timing]
#   BUILD_GPU=/tmp/x bash tests/gpu/build_and_run.sh    # build elsewhere
#
# One nvcc command (below, also in tests/gpu/README.md); it needs only the CUDA
# toolkit (nvcc, cuBLASLt) and a host g++ with OpenMP: no BLAS, no MPI. The CPU
# reference (src/cpu/ops.cpp) gets its two CBLAS calls from the naive loops in the
# test (tests/gpu/cblas_shim). Arguments are passed to the test binary.
set -euo pipefail
cd "$(dirname "$0")/../.."
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}
BUILD_GPU=${BUILD_GPU:-build-gpu}
mkdir -p "$BUILD_GPU"

"$NVCC" -std=c++20 -O3 -lineinfo \
  -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90 \
  -Iinclude -Itests/gpu/cblas_shim \
  -Xcompiler -fopenmp,-ffp-contract=off,-Wall,-Wextra \
  tests/gpu/test_cuda_ops.cu src/cuda/ops.cu src/cuda/gemm.cu src/cpu/ops.cpp \
  -o "$BUILD_GPU/test_cuda_ops" \
  -L"$CUDA_HOME/lib64" -Xlinker -rpath,"$CUDA_HOME/lib64" -lcublasLt -lcublas -lgomp

# Passive OpenMP waiting: the CPU reference shares the cores with nothing else here,
# but busy-waiting threads would slow the host side between GPU calls.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
exec "$BUILD_GPU/test_cuda_ops" "$@"
