#!/usr/bin/env bash
# test_offload.sh — model.optim_cpu_offload on the GPU (the offload pipeline of
# src/offload.cpp) against device-resident state, run by `make test-gpu`:
# losses with gradient accumulation (tiny-sft has 4 micro-batches per step), at
# -np 2 on one GPU, and checkpoints crossing the two: saved with offload and
# resumed without, and the reverse, continue the straight run's trajectory.
# Prints one PASS/FAIL line per check.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=$(command -v python3 || command -v "${PYTHON:-python3}")
out=$(mktemp -d /tmp/shardlm-offload.XXXXXX)
trap 'rm -rf "$out"' EXIT

# train DIR NP STEPS SETS...: tiny-sft on the GPU into $out/DIR (resumes from its latest checkpoint).
train() {
  local dir=$1 np=$2 steps=$3
  shift 3
  local sets=(--set device.backend=cuda --set run.deterministic=true --set run.max_steps=$steps --set log.interval=1
              --set ckpt.interval=0 --set run.dir="$out/$dir")
  for s in "$@"; do sets+=(--set "$s"); done
  if ! $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -np "$np" \
      "$BUILD/shardlm" train inputs/tiny-sft.toml "${sets[@]}" >> "$out/$dir.log" 2>&1; then
    echo "FAIL $dir: the run failed:"; tail -5 "$out/$dir.log"
    return 1
  fi
}

# compare A B TOL FIRST LAST WHAT: losses of steps FIRST..LAST (as logged) agree within TOL.
compare() {
  "$PY" - "$out/$1/metrics.jsonl" "$out/$2/metrics.jsonl" "$3" "$4" "$5" "$6" <<'EOF'
import json, sys
def losses(p):
    return {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(p) if l.strip()}
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
first, last, what = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
steps = sorted(s for s in a if first <= s <= last)
if not steps or any(s not in b for s in steps):
    print(f"FAIL {what}: steps {steps} not all in both runs"); sys.exit(0)
worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)
print(f"{'PASS' if worst <= tol else 'FAIL'} {what}: worst relative loss difference {worst:.3e} over steps "
      f"{steps[0]}..{steps[-1]} (limit {tol:g})")
EOF
}

train device 1 20 || exit 1
train offload 1 20 model.optim_cpu_offload=true || exit 1
train offload-again 1 20 model.optim_cpu_offload=true || exit 1
train offload-np2 2 20 model.optim_cpu_offload=true comm.backend=mpi || exit 1
# bf16 parameters from fp32 masters updated by the same formula on another
# processor (AdamW on the host vs the GPU kernel: the same operation order, no FMA
# on either side), so the steps agree to bf16 rounding of the uploads.
compare offload device 2e-2 1 20 "offload pipeline vs device-resident state (4 micro-batches per step)"
compare offload-again offload 0 1 20 "offload pipeline twice: bit-identical losses"
compare offload-np2 offload 2e-2 1 20 "offload pipeline at -np 2 (staged MPI) vs -np 1"

# Checkpoints: the straight runs again, saving at step 10; then steps 11..20
# resumed from that file with the other setting (same max_steps: same schedule).
train device-ckpt 1 20 ckpt.interval=10 || exit 1
train offload-ckpt 1 20 ckpt.interval=10 model.optim_cpu_offload=true || exit 1
train dev-then-off 1 20 ckpt.resume="$out/device-ckpt/checkpoints/step_10.h5" model.optim_cpu_offload=true || exit 1
train off-then-dev 1 20 ckpt.resume="$out/offload-ckpt/checkpoints/step_10.h5" || exit 1
# The first step after a resume reads only the saved weights, cast to bf16 the
# same way on both sides: the same bits as the straight run. Later steps update
# with the other optimizer placement and drift by bf16 roundings.
compare dev-then-off device 0 11 11 "saved with device state, resumed with offload: first step bit-identical"
compare dev-then-off device 2e-2 11 20 "saved with device state, resumed with offload: continues the trajectory"
compare off-then-dev offload 0 11 11 "saved with offload, resumed with device state: first step bit-identical"
compare off-then-dev offload 2e-2 11 20 "saved with offload, resumed with device state: continues the trajectory"

# The memory plan: offload moves the fp32 masters and moments off the GPU (12 B
# per parameter; the fp32 gradient accumulator stays).
plan() { "$BUILD/shardlm" check inputs/bench/llama-1b.toml --set device.backend=cuda "$@" | awk '/total +GPU/ {print $3}'; }
on=$(plan --set model.optim_cpu_offload=true); off=$(plan)
"$PY" -c "import sys; on, off = float('$on'), float('$off'); ok = abs((off - on) - 12 * 1.2358e9 / 2**20) < 0.001 * off
print(('PASS' if ok else 'FAIL') + f' 1B memory plan: GPU {off:.0f} MiB -> {on:.0f} MiB with optim_cpu_offload')"

# device.memory_limit_gib below the plan: the run stops at its first allocation
# past the cap, naming the cap and the allocation, and writes no checkpoint.
if "$BUILD/shardlm" train inputs/tiny-sft.toml --set device.backend=cuda --set device.memory_limit_gib=0.01 \
    --set run.dir="$out/cap" > "$out/cap.log" 2>&1; then
  echo "FAIL device.memory_limit_gib = 0.01: the run succeeded"
elif grep -q "device.memory_limit_gib = 0.01: allocating .* MiB for .* over the limit of 10.2 MiB" "$out/cap.log" &&
     [ -z "$(ls -A "$out/cap/checkpoints" 2>/dev/null)" ]; then
  echo "PASS device.memory_limit_gib = 0.01: refused with \"$(grep -o 'allocating .* MiB for [a-z ]*' "$out/cap.log" | head -1)\""
else
  echo "FAIL device.memory_limit_gib = 0.01: unexpected output:"; tail -3 "$out/cap.log"
fi
