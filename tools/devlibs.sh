#!/usr/bin/env bash
# devlibs.sh — copy the shared libraries a build/shardlm made here needs but a
# stock Ubuntu GPU machine lacks (parallel HDF5, TOML++, OpenBLAS-OpenMP and
# their dependencies), and CUPTI for tools/kernel_trace.cpp (the same CUDA
# release as the build), into .devlibs/, to carry with the build to that machine:
#   export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devlibs
for lib in libhdf5_openmpi.so.103 libsz.so.2 libaec.so.0 libtomlplusplus.so.3 libgfortran.so.5 libquadmath.so.0; do
  cp -L "/lib/x86_64-linux-gnu/$lib" .devlibs/
done
cp -L /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0 .devlibs/
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/extras/CUPTI/lib64; do
  [ -f "$d/libcupti.so.13" ] && { cp -L "$d/libcupti.so.13" .devlibs/; break; }
done
du -sh .devlibs
