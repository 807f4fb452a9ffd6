#!/usr/bin/env bash
# build_and_run.sh — build the GPU kernel test into build-gpu/ and run it.
#
#   bash tests/gpu/build_and_run.sh [--seed N] [--no-timing]
#   BUILD_GPU=/tmp/x bash tests/gpu/build_and_run.sh    # build elsewhere
#   BUILD_ONLY=1 bash tests/gpu/build_and_run.sh        # compile and link only
#
# One nvcc command (below, also in tests/gpu/README.md); it needs only the CUDA
# toolkit (nvcc, cuBLASLt) and a host g++ with OpenMP: no BLAS, no MPI. The CPU
# reference (src/cpu/ops.cpp) gets its two CBLAS calls from the naive loops in the
# test (tests/gpu/cblas_shim). Arguments are passed to the test binary.
source "$(dirname "$0")/nvcc.sh"

"$NVCC" "${NVCC_FLAGS[@]}" -Itests/gpu/cblas_shim \
  -Xcompiler -fopenmp,-ffp-contract=off,-Wall,-Wextra \
  tests/gpu/test_cuda_ops.cu src/cuda/embedding.cu src/cuda/rmsnorm.cu src/cuda/elementwise.cu src/cuda/cross_entropy.cu \
  src/cuda/reduce.cu src/cuda/optim_kernels.cu src/cuda/gemm.cu src/cpu/ops.cpp \
  -o "$BUILD_GPU/test_cuda_ops" \
  -L"$CUDA_HOME/lib64" -Xlinker -rpath,"$CUDA_HOME/lib64" -lcublasLt -lcublas -lgomp

# Passive OpenMP waiting: the CPU reference shares the cores with nothing else here,
# but busy-waiting threads would slow the host side between GPU calls.
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
exec "$BUILD_GPU/test_cuda_ops" "$@"
