#!/usr/bin/env bash
# test_multirank.sh — sharded training on the CUDA backend at world > 1, run by
# `make test-gpu` on a GPU machine. One GPU cannot host two NCCL ranks, so the
# two ranks here share it through the staged MPI device communicator
# (comm.backend = "mpi"): the same engine path as NCCL (bf16 all-gathers of
# device shards, reduce-scatters of device gradients into device-resident fp32
# state) with the wire in host memory. On a machine with 2+ GPUs the NCCL case
# runs too. Prints one PASS/FAIL line per check.
#
#   bash tests/gpu/test_multirank.sh        (after make test-gpu has built build/shardlm)
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export NCCL_NVLS_ENABLE=0
PY=$(command -v python3 || command -v "${PYTHON:-python3}")
out=$(mktemp -d /tmp/shardlm-multirank.XXXXXX)
trap 'rm -rf "$out"' EXIT
steps=30

# train NAME NP SETS...: tiny-sft on the GPU for $steps steps into $out/NAME.
train() {
  # run.deterministic: the bit-identical check below compares two runs
  local name=$1 np=$2
  shift 2
  local sets=(--set device.backend=cuda --set run.deterministic=true --set run.max_steps=$steps --set log.interval=1 --set ckpt.interval=0
              --set ckpt.resume=none --set run.dir="$out/$name")
  for s in "$@"; do sets+=(--set "$s"); done
  if ! $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x NCCL_NVLS_ENABLE -np "$np" \
      "$BUILD/shardlm" train inputs/tiny-sft.toml "${sets[@]}" > "$out/$name.log" 2>&1; then
    echo "FAIL $name: the run failed:"; tail -5 "$out/$name.log"
    return 1
  fi
}

# compare A B TOL WHAT: worst relative loss difference over the steps <= TOL.
compare() {
  local a=$1 b=$2 tol=$3 what=$4
  "$PY" - "$out/$a/metrics.jsonl" "$out/$b/metrics.jsonl" "$tol" "$what" <<'EOF'
import json, sys
def losses(p):
    return [json.loads(l)["loss"] for l in open(p) if l.strip()]
a, b, tol, what = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if len(a) != len(b) or not a:
    print(f"FAIL {what}: {len(a)} vs {len(b)} logged steps"); sys.exit(0)
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
status = "PASS" if worst <= tol and a[-1] < a[0] - 2.0 else "FAIL"
print(f"{status} {what}: worst relative loss difference {worst:.3e} over {len(a)} steps (limit {tol:g}); "
      f"loss {a[0]:.4f} -> {a[-1]:.4f}")
EOF
}

train np1 1 || exit 1
train np2 2 comm.backend=mpi || exit 1
train np2-again 2 comm.backend=mpi || exit 1
train np2-bf16 2 comm.backend=mpi model.reduce_dtype=bf16 || exit 1
train np2-offload 2 comm.backend=mpi model.optim_cpu_offload=true || exit 1
train np2-noreshard 2 comm.backend=mpi model.reshard_after_forward=false model.activation_checkpointing=full || exit 1

# bf16 parameters and activations: the two world sizes sum the same gradients in
# another order, which moves bf16 roundings; measured about 1e-3 (docs/testing.md).
compare np2 np1 2e-2 "-np 2 on one GPU (staged MPI) vs -np 1"
compare np2-again np2 0 "-np 2 twice: bit-identical losses"
compare np2-bf16 np2 2e-2 "-np 2 with model.reduce_dtype = bf16 vs fp32 reduction"
compare np2-offload np2 2e-2 "-np 2 with optim_cpu_offload vs device-resident state"
compare np2-noreshard np2 2e-2 "-np 2 without resharding, with activation checkpointing"

# The resolved deck records the communicator the run chose.
if grep -q 'backend = "mpi"' "$out/np2/config.toml"; then echo "PASS config.toml records comm.backend = \"mpi\""
else echo "FAIL config.toml does not record the staged MPI communicator"; fi
# auto on one GPU with two ranks resolves to the staged communicator, and nccl is refused with the reason.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
if [ "$gpus" -le 1 ]; then
  train np2-auto 2 && grep -q 'backend = "mpi"' "$out/np2-auto/config.toml" \
    && echo "PASS comm.backend = auto with 2 ranks on 1 GPU resolves to mpi" \
    || echo "FAIL comm.backend = auto with 2 ranks on 1 GPU did not resolve to mpi"
  if train np2-nccl 2 comm.backend=nccl > /dev/null; then echo "FAIL comm.backend = nccl on one shared GPU was accepted"
  elif grep -q "NCCL refuses two ranks on one GPU" "$out/np2-nccl.log"; then
    echo "PASS comm.backend = nccl with 2 ranks on 1 GPU is refused with the reason"
  else echo "FAIL comm.backend = nccl on one GPU failed without the reason:"; tail -3 "$out/np2-nccl.log"; fi
else
  train np2-nccl 2 comm.backend=nccl || exit 1
  compare np2-nccl np1 2e-2 "-np 2 on two GPUs (NCCL) vs -np 1"
fi

# The NCCL watchdog: a collective stuck behind a stalled stream ends the process
# with a message naming the collective and comm.timeout_s, instead of hanging.
wd=$(SHARDLM_FAULT=nccl_stall@0 timeout 120 "$BUILD/test_gpu" --test-case="NCCL device communicator*" 2>&1); rc=$?
if [ $rc != 0 ] && [ $rc != 124 ] && grep -q "has not completed after" <<< "$wd"; then
  echo "PASS a stalled NCCL collective aborts with: $(grep -o 'NCCL [a-z-]* of [0-9]* bytes has not completed[^:]*' <<< "$wd" | head -1)"
else
  echo "FAIL a stalled NCCL collective did not abort with the watchdog's message (exit $rc):"; tail -3 <<< "$wd"
fi
