#!/usr/bin/env bash
# workstation.sh — train a deck with mpirun on one machine.
#
#   jobs/workstation.sh DECK [--set key=value]...        one rank per GPU (CPU ranks if no GPU)
#   NP=4 jobs/workstation.sh DECK ...                    4 ranks (CPU backend: threads split)
#
# GPU choice is automatic: each rank takes GPU (local rank % GPUs). Extra
# arguments go to `shardlm train` (e.g. --set run.dir=runs/try1).
set -euo pipefail
cd "$(dirname "$0")/.."
deck=${1:?usage: jobs/workstation.sh DECK [--set key=value]...}
shift
if command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [ "${gpus:-0}" -gt 0 ]; then
  np=${NP:-$gpus}
else
  np=${NP:-2}
fi
cores=$(nproc)
threads=$(( cores / np )); [ $threads -ge 1 ] || threads=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
extra=()
[ "$np" -gt "$cores" ] && extra+=(--oversubscribe)
set -x
exec mpirun -np "$np" ${extra[@]+"${extra[@]}"} --bind-to none -x OMP_NUM_THREADS build/shardlm train "$deck" "$@"
