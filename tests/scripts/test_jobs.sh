#!/usr/bin/env bash
# test_jobs.sh — the job scripts parse, the sweep picks the right line and names its
# run dir, and the exit-code contract, all without Slurm (stand-in srun and
# scontrol). tests/scripts/test_slurm.sh runs the same scripts under a real Slurm.
set -u
cd "$(dirname "$0")/../.."
for f in jobs/*.sh jobs/*.sbatch tools/*.sh .ci/run tests/run.sh; do
  if bash -n "$f" 2>/tmp/bashn.$$; then echo "PASS bash -n $f"; else echo "FAIL bash -n $f: $(cat /tmp/bashn.$$)"; fi
done
rm -f /tmp/bashn.$$

# Stand-ins: srun prints its arguments and exits with $FAKE_RC; scontrol prints
# its arguments and fails when FAKE_SCONTROL_RC says so; the "binary" only has to
# be executable. Run from the checkout's root, as sbatch would.
fake=$(mktemp -d)
trap 'rm -rf "$fake"' EXIT
cat > "$fake/srun" <<'EOF'
#!/bin/bash
echo srun "$@"
if [ "${FAKE_WAIT:-0}" = 1 ]; then   # run until a signal, like a training step
  trap 'echo "srun got USR1"; exit 75' USR1
  trap 'echo "srun got TERM"; exit 75' TERM
  echo ready > "$FAKE_READY"
  sleep 60 & wait
  exit 1
fi
exit ${FAKE_RC:-0}
EOF
printf '#!/bin/sh\necho scontrol "$@"\nexit ${FAKE_SCONTROL_RC:-0}\n' > "$fake/scontrol"
printf '#!/bin/sh\nexit 0\n' > "$fake/shardlm"
chmod +x "$fake/srun" "$fake/scontrol" "$fake/shardlm"
job() { env PATH="$fake:$PATH" SHARDLM_BIN="$fake/shardlm" SLURM_JOB_ID=41 "$@" 2>&1; }

out=$(job SLURM_ARRAY_TASK_ID=2 SLURM_ARRAY_JOB_ID=77 bash jobs/sweep.sbatch inputs/tiny-sft.toml jobs/sweep-example.txt)
expect="train inputs/tiny-sft.toml --set optim.lr=3e-3 --set optim.weight_decay=0.1 --set run.dir=runs/tiny-sft-sweep-example/lr=3e-3,weight_decay=0.1"
if grep -q -- "$expect" <<< "$out"; then echo "PASS sweep task 2 gets line 3 in a dir named by its settings"; else echo "FAIL sweep task 2: $out"; fi
out=$(job SLURM_ARRAY_TASK_ID=1 SLURM_ARRAY_JOB_ID=77 bash jobs/sweep.sbatch inputs/tiny-sft.toml jobs/sweep-example.txt \
      --base runs/b --set run.max_steps=7)
expect="train inputs/tiny-sft.toml --set run.max_steps=7 --set optim.lr=3e-3 --set run.dir=runs/b/lr=3e-3"
if grep -q -- "$expect" <<< "$out"; then echo "PASS sweep --base and common --set"; else echo "FAIL sweep --base: $out"; fi
out=$(job SLURM_ARRAY_TASK_ID=9 SLURM_ARRAY_JOB_ID=77 bash jobs/sweep.sbatch inputs/tiny-sft.toml jobs/sweep-example.txt); rc=$?
if [ $rc != 0 ] && grep -q "has no line for task 9 (it has 4 tasks: 0-3)" <<< "$out" && ! grep -q '^srun' <<< "$out"; then
  echo "PASS sweep task past the end fails before srun"; else echo "FAIL sweep past end: rc=$rc $out"; fi

# The exit-code contract (jobs/slurm-common.sh), the same in every script.
for script in jobs/slurm-node.sbatch jobs/slurm-multinode.sbatch; do
  out=$(job FAKE_RC=0 bash "$script" inputs/tiny-sft.toml); rc=$?
  if [ $rc = 0 ] && grep -q '^srun --mpi=pmix --cpu-bind=cores .*/shardlm train inputs/tiny-sft.toml$' <<< "$out" &&
     ! grep -q scontrol <<< "$out"; then echo "PASS $script: exit 0 -> done"; else echo "FAIL $script exit 0: rc=$rc $out"; fi
  out=$(job FAKE_RC=75 SLURM_RESTART_COUNT=3 bash "$script" inputs/tiny-sft.toml); rc=$?
  if [ $rc = 0 ] && grep -q '^scontrol requeue 41$' <<< "$out" && grep -q 'requeueing job 41 (restart 4)' <<< "$out"; then
    echo "PASS $script: exit 75 -> scontrol requeue"; else echo "FAIL $script exit 75: rc=$rc $out"; fi
  out=$(job FAKE_RC=74 bash "$script" inputs/tiny-sft.toml); rc=$?
  if [ $rc = 74 ] && ! grep -q scontrol <<< "$out" && grep -q 'could not be written (exit 74' <<< "$out"; then
    echo "PASS $script: exit 74 -> fails, not requeued"; else echo "FAIL $script exit 74: rc=$rc $out"; fi
  out=$(job FAKE_RC=3 bash "$script" inputs/tiny-sft.toml); rc=$?
  if [ $rc = 3 ] && ! grep -q scontrol <<< "$out"; then echo "PASS $script: exit 3 -> fails with 3"; else echo "FAIL $script exit 3: rc=$rc $out"; fi
done
out=$(job FAKE_RC=0 bash jobs/slurm-multinode.sbatch inputs/tiny-sft.toml); rc=$?
if grep -q '^srun --mpi=pmix --cpu-bind=cores --kill-on-bad-exit=1 .*/shardlm train' <<< "$out"; then
  echo "PASS slurm-multinode.sbatch: a task that dies ends the step (--kill-on-bad-exit=1)"; else echo "FAIL multinode kill-on-bad-exit: $out"; fi

# The RL script: the trainers first, the receivers last, one srun --multi-prog step.
out=$(job FAKE_RC=0 SLURM_NTASKS=4 SHARDLM_RECEIVERS=2 bash jobs/slurm-rl.sbatch inputs/tiny-rl.toml --set run.max_steps=3); rc=$?
if [ $rc = 0 ] && grep -q '^srun --mpi=pmix --cpu-bind=cores --kill-on-bad-exit=1 --multi-prog ' <<< "$out" &&
   grep -qx "      0-1 $fake/shardlm train inputs/tiny-rl.toml --set run.max_steps=3" <<< "$out" &&
   grep -qx "      2-3 $fake/shardlm receive inputs/tiny-rl.toml --set run.max_steps=3" <<< "$out"; then
  echo "PASS slurm-rl.sbatch: tasks 0-1 train, 2-3 receive, srun --multi-prog"; else echo "FAIL slurm-rl multi-prog: rc=$rc $out"; fi
out=$(job FAKE_RC=0 SLURM_NTASKS=3 bash jobs/slurm-rl.sbatch inputs/tiny-rl.toml); rc=$?
if [ $rc = 0 ] && grep -qx "      0-1 $fake/shardlm train inputs/tiny-rl.toml" <<< "$out" &&
   grep -qx "      2 $fake/shardlm receive inputs/tiny-rl.toml" <<< "$out"; then
  echo "PASS slurm-rl.sbatch: one receiver by default, the last task"; else echo "FAIL slurm-rl default: rc=$rc $out"; fi
out=$(job FAKE_RC=75 SLURM_NTASKS=3 bash jobs/slurm-rl.sbatch inputs/tiny-rl.toml); rc=$?
if [ $rc = 0 ] && grep -q '^scontrol requeue 41$' <<< "$out"; then echo "PASS slurm-rl.sbatch: exit 75 -> scontrol requeue"; else echo "FAIL slurm-rl 75: rc=$rc $out"; fi
out=$(job SLURM_NTASKS=1 bash jobs/slurm-rl.sbatch inputs/tiny-rl.toml); rc=$?
if [ $rc = 2 ] && grep -q 'cannot hold SHARDLM_RECEIVERS=1 receivers and at least one trainer' <<< "$out" && ! grep -q '^srun' <<< "$out"; then
  echo "PASS slurm-rl.sbatch: no room for a trainer -> clear error before srun"; else echo "FAIL slurm-rl one task: rc=$rc $out"; fi
out=$(job SLURM_NTASKS=3 bash jobs/slurm-rl.sbatch inputs/tiny-rl.toml --set 'run.name=a b'); rc=$?
if [ $rc = 2 ] && grep -q "argument 'run.name=a b' holds a space" <<< "$out" && ! grep -q '^srun' <<< "$out"; then
  echo "PASS slurm-rl.sbatch: an argument multi-prog cannot pass -> clear error"; else echo "FAIL slurm-rl space: rc=$rc $out"; fi

out=$(job FAKE_RC=75 SLURM_RESTART_COUNT=2 SHARDLM_MAX_REQUEUES=2 bash jobs/slurm-node.sbatch inputs/tiny-sft.toml); rc=$?
if [ $rc = 75 ] && ! grep -q '^scontrol' <<< "$out" && grep -q 'already requeued 2 times (SHARDLM_MAX_REQUEUES=2)' <<< "$out"; then
  echo "PASS exit 75 past SHARDLM_MAX_REQUEUES -> fails with 75"; else echo "FAIL max requeues: rc=$rc $out"; fi
out=$(job FAKE_RC=75 FAKE_SCONTROL_RC=1 bash jobs/slurm-node.sbatch inputs/tiny-sft.toml); rc=$?
if [ $rc = 75 ] && grep -q 'scontrol requeue 41 failed' <<< "$out"; then
  echo "PASS exit 75 with a refused requeue -> fails with 75"; else echo "FAIL refused requeue: rc=$rc $out"; fi
out=$(job FAKE_RC=75 SLURM_ARRAY_TASK_ID=0 SLURM_ARRAY_JOB_ID=77 bash jobs/sweep.sbatch inputs/tiny-sft.toml jobs/sweep-example.txt); rc=$?
if [ $rc = 0 ] && grep -q '^scontrol requeue 41$' <<< "$out"; then echo "PASS sweep task: exit 75 -> requeues itself"; else echo "FAIL sweep 75: rc=$rc $out"; fi
# Signals to the batch shell: USR1 is forwarded to srun and the job requeues;
# TERM (scancel, preemption) is forwarded too, but the job is not requeued.
for sig in USR1 TERM; do
  rm -f "$fake/ready"
  env PATH="$fake:$PATH" SHARDLM_BIN="$fake/shardlm" SLURM_JOB_ID=41 FAKE_WAIT=1 FAKE_READY="$fake/ready" \
    bash jobs/slurm-node.sbatch inputs/tiny-sft.toml > "$fake/out.$sig" 2>&1 &
  pid=$!
  for i in $(seq 1 100); do [ -f "$fake/ready" ] && break; sleep 0.1; done
  kill -"$sig" "$pid"
  rc=0; wait "$pid" || rc=$?
  out=$(cat "$fake/out.$sig")
  if [ $sig = USR1 ] && [ $rc = 0 ] && grep -q '^srun got USR1$' <<< "$out" && grep -q '^scontrol requeue 41$' <<< "$out"; then
    echo "PASS batch-shell USR1 -> forwarded to srun, requeued"
  elif [ $sig = TERM ] && [ $rc = 75 ] && grep -q '^srun got TERM$' <<< "$out" && ! grep -q '^scontrol' <<< "$out" &&
       grep -q 'stopped by SIGTERM after a checkpoint (exit 75); not requeued' <<< "$out"; then
    echo "PASS batch-shell TERM -> forwarded to srun, exit 75, not requeued"
  else
    echo "FAIL batch-shell $sig: rc=$rc $out"
  fi
done
out=$(env PATH="$fake:$PATH" SHARDLM_BIN=/nonexistent/shardlm bash jobs/slurm-node.sbatch inputs/tiny-sft.toml 2>&1); rc=$?
if [ $rc = 2 ] && grep -q '/nonexistent/shardlm not found' <<< "$out" && ! grep -q '^srun' <<< "$out"; then
  echo "PASS missing binary -> clear error before srun"; else echo "FAIL missing binary: rc=$rc $out"; fi

# Run-dir names (tools/sweep.sh): short keys unless two would clash, values made
# safe, long names cut with a hash, explicit run.dir kept, bad lines refused.
cat > "$fake/s.txt" <<'EOF'
# comment
optim.lr=1e-3 sched.warmup=10   # trailing comment

optim.lr=2e-3 muon.lr=0.02
data.path="inputs/data/x+y.h5"
data.path=inputs/data/tiny.h5 optim.lr=1e-4 optim.weight_decay=0.123456789 sched.warmup=12345 sched.min_lr=1e-5 run.seed=424242
optim.lr=5e-3 run.dir=runs/mine
EOF
out=$(tools/sweep.sh list --base B deck.toml "$fake/s.txt" 2>&1 | cut -f1,2)
# 94 characters in full: the first 71 and the line's hash
long="path=inputs_data_tiny.h5,lr=1e-4,weight_decay=0.123456789,warmup=12345,min_lr=1e-5,seed=424242"
hash=$(printf '%s' "data.path=inputs/data/tiny.h5 optim.lr=1e-4 optim.weight_decay=0.123456789 sched.warmup=12345 sched.min_lr=1e-5 run.seed=424242" | sha1sum | cut -c1-8)
expect=$(printf '0\tB/lr=1e-3,warmup=10\n1\tB/optim.lr=2e-3,muon.lr=0.02\n2\tB/path=inputs_data_x+y.h5\n3\tB/%s-%s\n4\truns/mine' "${long:0:71}" "$hash")
if [ "$out" = "$expect" ]; then echo "PASS sweep run-dir names"; else printf 'FAIL sweep run-dir names:\n%s\nwanted:\n%s\n' "$out" "$expect"; fi
if [ "$(tools/sweep.sh array "$fake/s.txt")" = 0-4 ]; then echo "PASS sweep array range 0-4"; else echo "FAIL sweep array range"; fi
printf 'optim.lr=1e-3\noptim.lr=1e-3 # again\n' > "$fake/dup.txt"
out=$(tools/sweep.sh list deck.toml "$fake/dup.txt" 2>&1); rc=$?
if [ $rc != 0 ] && grep -q "dup.txt:2 and line 1 both run in runs/deck-dup/lr=1e-3" <<< "$out"; then
  echo "PASS sweep refuses two tasks in one run dir"; else echo "FAIL sweep duplicates: rc=$rc $out"; fi
printf 'optim.lr=1e-3\noptim.lr 3e-3\n' > "$fake/bad.txt"
out=$(tools/sweep.sh list deck.toml "$fake/bad.txt" 2>&1); rc=$?
if [ $rc != 0 ] && grep -q "bad.txt:2: 'optim.lr' is not section.key=value" <<< "$out"; then
  echo "PASS sweep refuses a token without =, naming file:line"; else echo "FAIL sweep bad token: rc=$rc $out"; fi
out=$(tools/sweep.sh submit --print --throttle 2 --time=1:00:00 inputs/tiny-sft.toml jobs/sweep-example.txt --set run.max_steps=9 2>/dev/null)
if [ "$out" = "sbatch --array=0-3%2 --time=1:00:00 jobs/sweep.sbatch inputs/tiny-sft.toml jobs/sweep-example.txt --set run.max_steps=9 " ]; then
  echo "PASS sweep submit --print"; else echo "FAIL sweep submit --print: '$out'"; fi
out=$(tools/sweep.sh submit --print -p gpu inputs/tiny-sft.toml jobs/sweep-example.txt 2>&1); rc=$?
if [ $rc != 0 ] && grep -q "deck gpu not found (sbatch options before the deck go as --option=value)" <<< "$out"; then
  echo "PASS sweep submit: a split sbatch option is refused clearly"; else echo "FAIL sweep submit split option: rc=$rc $out"; fi
