#!/usr/bin/env bash
# test_jobs.sh — the job scripts parse, and the sweep picks the right line.
set -u
cd "$(dirname "$0")/../.."
for f in jobs/*.sh jobs/*.sbatch tools/*.sh .ci/run tests/run.sh; do
  if bash -n "$f" 2>/tmp/bashn.$$; then echo "PASS bash -n $f"; else echo "FAIL bash -n $f: $(cat /tmp/bashn.$$)"; fi
done
rm -f /tmp/bashn.$$

# The sweep script: fake srun prints its arguments; task 2 must get line 3 of the
# example (comments skipped) and its own run dir.
fake=$(mktemp -d)
printf '#!/bin/sh\necho srun "$@"\n' > "$fake/srun"; chmod +x "$fake/srun"
out=$(cd "$fake" && PATH="$fake:$PATH" SLURM_ARRAY_TASK_ID=2 SLURM_ARRAY_JOB_ID=77 \
      bash "$OLDPWD/jobs/sweep.sbatch" inputs/tiny-sft.toml "$OLDPWD/jobs/sweep-example.txt" 2>&1)
expect="--set optim.lr=3e-3 --set optim.weight_decay=0.1 --set run.dir=runs/sweep-tiny-sft-77/task-2"
if grep -q -- "$expect" <<< "$out"; then echo "PASS sweep task 2 gets line 3"; else echo "FAIL sweep task 2: $out"; fi
out=$(cd "$fake" && PATH="$fake:$PATH" SLURM_ARRAY_TASK_ID=9 SLURM_ARRAY_JOB_ID=77 \
      bash "$OLDPWD/jobs/sweep.sbatch" inputs/tiny-sft.toml "$OLDPWD/jobs/sweep-example.txt" 2>&1); rc=$?
if [ $rc != 0 ] && grep -q "has no line for task 9" <<< "$out"; then echo "PASS sweep task past the end fails"; else echo "FAIL sweep past end: rc=$rc $out"; fi
rm -rf "$fake"
