#!/usr/bin/env bash
# tests/gpu/build_sdpa_fp8.sh — build cuDNN's FP8 attention test (test_sdpa_fp8.cu:
# CudnnSdpa's FP8 graphs and cuda::Fp8Attention against the bf16 graphs) into build-gpu/ (or $BUILD_GPU),
# then run it (needs a Hopper GPU and cuDNN 9; exit status is the test's).
#   BUILD_ONLY=1 bash tests/gpu/build_sdpa_fp8.sh   compile only
source "$(dirname "$0")/nvcc.sh"
"$NVCC" "${NVCC_FLAGS[@]}" -Xcompiler -fopenmp,-Wall,-Wextra -DSHARDLM_CUDNN=1 -I"$CUDA_HOME/include" -ldl \
  -o "$BUILD_GPU/test_sdpa_fp8" tests/gpu/test_sdpa_fp8.cu src/cuda/sdpa_cudnn.cu src/cuda/fp8_attention.cu \
  src/cuda/fp8.cu src/cuda/gemm.cu src/cuda/reduce.cu src/cpu/fp8.cpp \
  -L"$CUDA_HOME/lib64" -Xlinker -rpath,"$CUDA_HOME/lib64" -lcublasLt -lgomp
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
exec "$BUILD_GPU/test_sdpa_fp8" "$@"
