#!/usr/bin/env bash
# devlibs.sh — copy the shared libraries a build/shardlm made here needs but a
# stock Ubuntu GPU machine lacks (parallel HDF5, TOML++, OpenBLAS-OpenMP and
# their dependencies) into .devlibs/, to carry with the build to that machine:
#   export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devlibs
for lib in libhdf5_openmpi.so.103 libsz.so.2 libaec.so.0 libtomlplusplus.so.3 libgfortran.so.5 libquadmath.so.0; do
  cp -L "/lib/x86_64-linux-gnu/$lib" .devlibs/
done
cp -L /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0 .devlibs/
du -sh .devlibs
