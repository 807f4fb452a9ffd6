#!/usr/bin/env bash
# lib.sh — what the GPU training scripts share (test_multirank.sh, test_offload.sh):
# the environment, a scratch directory removed on exit, tiny-sft runs on the GPU
# and loss comparisons printed as PASS/FAIL lines.
#
#   source "$(dirname "$0")/lib.sh" NAME     sets BUILD, MPIRUN, PY and $out
#
# SHARDLM_TEST_DEVICE=cpu runs the same commands on the CPU backend: a check of
# the scripts' own logic on a machine without a GPU, not of the GPU paths.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} NCCL_NVLS_ENABLE=0
PY=$(tools/find_python.sh)  # make_rollouts.py needs h5py and numpy
out=$(mktemp -d "/tmp/shardlm-$1.XXXXXX")
trap '[ -n "${KEEP:-}" ] && echo "kept $out" || rm -rf "$out"' EXIT

# train_tiny DIR NP STEPS SETS...: tiny-sft on the GPU, deterministic, STEPS
# steps into $out/DIR, the log appended to $out/DIR.log; a DIR with checkpoints
# resumes from its latest (ckpt.resume as the deck says unless SETS say else).
train_tiny() {
  local dir=$1 np=$2 steps=$3
  shift 3
  local sets=(--set device.backend="${SHARDLM_TEST_DEVICE:-cuda}" --set run.deterministic=true
              --set run.max_steps="$steps" --set log.interval=1 --set ckpt.interval=0 --set run.dir="$out/$dir")
  for s in "$@"; do sets+=(--set "$s"); done
  if ! $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x NCCL_NVLS_ENABLE -np "$np" \
      "$BUILD/shardlm" train inputs/tiny-sft.toml "${sets[@]}" >> "$out/$dir.log" 2>&1; then
    echo "FAIL $dir: the run failed:"; tail -5 "$out/$dir.log"
    return 1
  fi
}

# compare_losses A B TOL FIRST LAST WHAT [descent]: the losses that runs A and B
# logged for steps FIRST..LAST agree within TOL (worst relative difference);
# with "descent", A's loss must also fall by more than 2 over those steps.
compare_losses() {
  "$PY" - "$out/$1/metrics.jsonl" "$out/$2/metrics.jsonl" "$3" "$4" "$5" "$6" "${7:-}" <<'PYEOF'
import json, sys
def losses(p):  # step rows only (event rows carry "event"; the last row of a step wins)
    rows = [json.loads(l) for l in open(p) if l.strip()]
    return {r["step"]: r["loss"] for r in rows if "event" not in r}
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
first, last, what, descent = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7] == "descent"
steps = sorted(s for s in a if first <= s <= last)
if not steps or any(s not in b for s in steps) or (descent and len(steps) != last - first + 1):
    print(f"FAIL {what}: steps {steps} not all in both runs"); sys.exit(0)
worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)
ok = worst <= tol and (not descent or a[steps[-1]] < a[steps[0]] - 2.0)
print(f"{'PASS' if ok else 'FAIL'} {what}: worst relative loss difference {worst:.3e} over steps "
      f"{steps[0]}..{steps[-1]} (limit {tol:g}); loss {a[steps[0]]:.4f} -> {a[steps[-1]]:.4f}")
PYEOF
}
