#!/usr/bin/env bash
# nvcc.sh — what the standalone GPU kernel tests' build scripts share (sourced by
# build_and_run.sh, build_attention.sh, build_rl_loss.sh): the repository root as
# the working directory, the compiler, the output folder and the flags every one
# of them compiles with (Hopper: sm_90a for its own instructions, sm_90 beside it).
#   CUDA_HOME=...  NVCC=...  BUILD_GPU=dir (default build-gpu)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${NVCC:-$CUDA_HOME/bin/nvcc}
BUILD_GPU=${BUILD_GPU:-build-gpu}
mkdir -p "$BUILD_GPU"
NVCC_FLAGS=(-std=c++20 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90
            -Iinclude -Isrc)
