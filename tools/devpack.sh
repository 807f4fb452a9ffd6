#!/usr/bin/env bash
# devpack.sh — build here and pack what the GPU machine needs into
# .devpack/pack.tar.xz: build/shardlm, test_gpu, bench_h2d, bench_gemm_algos and bench_moe_gemm (stripped: the
# copy that travels is at most 64 MiB), the standalone kernel tests
# (build-gpu/test_cuda_ops, test_fp8, test_cuda_rl_loss, test_sdpa_fp8, test_ring_attention),
# the CUPTI tracer and .devlibs/ (parallel HDF5, TOML++, OpenBLAS: tools/devlibs.sh).
#
#   tools/devpack.sh            build (make, ccache when present) and pack
#   PACK_ONLY=1 tools/devpack.sh  pack what is built
#
# On the GPU machine, with carry [".devpack"], a call's script starts with
#   source tools/devpack_env.sh
# which unpacks the pack into build/ and build-gpu/ (again only when the pack
# changed) and sets LD_LIBRARY_PATH and the MPI/OpenMP variables.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${PACK_ONLY:-0}" != 1 ]; then
  cc=()
  if command -v ccache > /dev/null; then
    export CCACHE_BASEDIR=$PWD/.. CCACHE_NOHASHDIR=1
    cc=(MPICXX="ccache mpicxx" NVCC="ccache ${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  fi
  make -j"$(nproc)" "${cc[@]}" CUDA=1 all build/test_gpu build/bench_h2d build/bench_gemm_algos build/bench_moe_gemm
  for t in build_and_run build_fp8 build_rl_loss build_sdpa_fp8 build_ring_attention; do BUILD_ONLY=1 BUILD_GPU=build-gpu bash tests/gpu/$t.sh; done
  bash tools/kernel_trace.sh > /dev/null
  [ -d .devlibs ] || bash tools/devlibs.sh
fi
rm -rf .devpack/b
mkdir -p .devpack/b
for x in shardlm test_gpu bench_h2d bench_gemm_algos bench_moe_gemm; do strip -o .devpack/b/$x build/$x; done
cp build-gpu/{test_fp8,test_cuda_rl_loss,test_cuda_ops,test_sdpa_fp8,test_ring_attention,libkernel_trace.so} .devpack/b/
(cd .devpack && rm -f pack.tar.xz && tar cJf pack.tar.xz b -C .. .devlibs && rm -rf b)
ls -la .devpack/pack.tar.xz
