#!/usr/bin/env bash
# run-tiny.sh — what `make run` does: train inputs/tiny-sft.toml on 2 MPI ranks,
# from scratch each time (ckpt.resume=none; the run still saves its final checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
deck=${DECK:-inputs/tiny-sft.toml}
threads=$(( $(nproc) / 2 )); [ $threads -ge 1 ] || threads=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}  # see tests/run.sh
echo "+ $MPIRUN -np 2 build/shardlm train $deck"
OMP_NUM_THREADS=$threads $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -np 2 build/shardlm train "$deck" --set ckpt.resume=none "$@"
