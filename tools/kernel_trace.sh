#!/usr/bin/env bash
# kernel_trace.sh — builds build-gpu/libkernel_trace.so (tools/kernel_trace.cpp),
# the CUPTI activity tracer that tools/profile_step.py loads into a training run.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p build-gpu
g++ -O2 -std=c++17 -shared -fPIC -fvisibility=hidden -I"$CUDA_HOME/include" tools/kernel_trace.cpp \
  -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib" -lcupti -Wl,-rpath,'$ORIGIN' -o build-gpu/libkernel_trace.so
echo "build-gpu/libkernel_trace.so"
