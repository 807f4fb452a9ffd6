# devpack_env.sh — sourced by a GPU-machine call's script (see tools/devpack.sh):
# unpacks .devpack/pack.tar.xz into build/ and build-gpu/ when it changed, and
# sets the environment the binaries and tests need. $OUT (the call's folder
# that comes back) is made if unset.
set -u
stamp=$(md5sum .devpack/pack.tar.xz | cut -c1-12)
if [ "$(cat build/.packstamp 2>/dev/null)" != "$stamp" ]; then
  rm -rf b && tar xJf .devpack/pack.tar.xz && mkdir -p build build-gpu &&
    mv -f b/shardlm b/test_gpu b/bench_h2d b/bench_gemm_algos b/bench_moe_gemm build/ && mv -f b/* build-gpu/ && rmdir b && echo "$stamp" > build/.packstamp
fi
export LD_LIBRARY_PATH=$PWD/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
echo "pack $stamp; $(date -u)"
