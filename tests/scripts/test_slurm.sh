#!/usr/bin/env bash
# test_slurm.sh — the job scripts under a real single-node Slurm: submitted with
# sbatch from a fresh copy of the checkout, run by srun --mpi=pmix.
#
# It starts munged, slurmctld and slurmd itself (background processes, state,
# logs and slurm.conf in one temp dir, free ports, a private munge socket, so two
# runs at once do not meet) and stops them by pid at the end, on failure too.
# Cases: a 2-task job to completion; a job signalled twice mid-run (SIGUSR1 to the
# ranks, then to the batch shell) that checkpoints, requeues, resumes and reaches
# max_steps with the straight run's losses in one log; a 3-task sweep array in run
# dirs named by their settings; a deck error and a checkpoint failure (exit 74)
# that end FAILED, not requeued; a run that keeps exiting 75 stopped by
# SHARDLM_MAX_REQUEUES; the local runner on the same sweep file (same dir names,
# same losses), stopped by a signal and resumed.
# Signals at known points, each job held at a gate the test opens after
# `scancel --signal=USR1`: an RL MPMD job (jobs/slurm-rl.sbatch, a trainer and a
# receiver) stopped mid-run that requeues, resumes from the step it stopped at and
# completes, the receiver ending with the trainers' 75; a signal during setup
# (held by a run.lock of this job step "on another host") that requeues and
# completes; a signal on the last step that completes with no requeue.
#
# Prints SKIP (and passes) only when Slurm cannot run here at all: slurm-wlm or
# munge not installed (tools/install-deps.sh installs them), or not root.
# SHARDLM_TEST_KEEP=1 keeps the temp dir (logs of every daemon and job).
set -u
cd "$(dirname "$0")/../.."
repo=$PWD
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-/usr/bin/python3}
case $BUILD in /*) build_dir=$BUILD ;; *) build_dir=$repo/$BUILD ;; esac

pass() { echo "PASS slurm: $*"; }
fail() { echo "FAIL slurm: $*"; }
skip() { echo "SKIP slurm: $*"; exit 0; }
check() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; return 1; fi; }

for cmd in munged mungekey slurmctld slurmd sbatch srun scontrol scancel squeue sinfo; do
  command -v "$cmd" >/dev/null 2>&1 || skip "$cmd not installed (tools/install-deps.sh installs slurm-wlm and munge)"
done
[ "$(id -u)" = 0 ] || skip "slurmd has to run as root to start jobs; not root here"
if [ ! -x "$build_dir/shardlm" ]; then fail "$build_dir/shardlm not built"; exit 1; fi

tmp=$(mktemp -d /tmp/shardlm-slurm.XXXXXX)
conf=$tmp/slurm.conf
# Every process of this test's cluster carries this variable (sbatch passes the
# environment on), so the cleanup can find stragglers by it and by nothing broader.
export SHARDLM_SLURM_TEST_DIR=$tmp
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
munged_pid="" ctld_pid="" slurmd_pid=""

# ------------------------------------------------------------------ the cluster
cluster_processes() {   # pids (other than this shell) whose environment has the marker
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = $$ ] && continue
    grep -qzxF "SHARDLM_SLURM_TEST_DIR=$tmp" "/proc/$p/environ" 2>/dev/null && echo "$p"
  done
  return 0
}
# count_left: how many are left (the list is made before anything counts it, so
# that no helper of the count is in it), naming each one.
count_left() {
  local pids p
  pids=$(cluster_processes)
  for p in $pids; do echo "  left running: $p $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null)" >&2; done
  wc -w <<< "$pids"
}
stop_pid() {   # stop_pid PID: TERM, up to 10 s, then KILL
  local pid=$1 i
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null || return 0
  for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null
  return 0
}
stopped=0
stop_cluster() {
  [ $stopped = 1 ] && return 0
  stopped=1
  local i p
  if [ -n "$ctld_pid" ] && kill -0 "$ctld_pid" 2>/dev/null; then
    scancel --user="$(id -un)" >/dev/null 2>&1
    for i in $(seq 1 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.3; done
  fi
  stop_pid "$slurmd_pid"
  stop_pid "$ctld_pid"
  stop_pid "$munged_pid"
  # Job steps outlive slurmd (slurmstepd is detached from it): end what is left.
  for p in $(cluster_processes); do kill -KILL "$p" 2>/dev/null; done
  return 0
}
cleanup() {
  stop_cluster
  if [ "${SHARDLM_TEST_KEEP:-0}" = 1 ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

dump_logs() {
  local f
  for f in "$tmp"/log/*; do echo "--- $f"; tail -n 15 "$f"; done
}

mkdir -p "$tmp/log" "$tmp/state" "$tmp/spool" "$tmp/tmpfs" "$tmp/munge"
chmod 700 "$tmp/munge"
mungekey --create --keyfile="$tmp/munge/munge.key" >/dev/null 2>&1 ||
  { fail "mungekey could not make a key"; exit 1; }
munged --foreground --force --socket="$tmp/munge/socket" --key-file="$tmp/munge/munge.key" \
       --pid-file="$tmp/munge/munged.pid" --seed-file="$tmp/munge/seed" \
       --log-file="$tmp/log/munged.log" < /dev/null > "$tmp/log/munged.out" 2>&1 &
munged_pid=$!

# Two free ports, held together so they differ; the daemons bind them a moment later.
read -r ctld_port slurmd_port < <("$PYTHON" -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')
node=$(hostname -s)
cpus=$(nproc); [ "$cpus" -ge 2 ] || cpus=2
# Job ids of their own: Open MPI names its session files and shared-memory
# segments after the job id, and two test clusters counting from 1 would share them.
first_job_id=$(( (RANDOM * 32768 + RANDOM) % 60000000 + 1000 ))
cat > "$conf" <<EOF
# generated by tests/scripts/test_slurm.sh
ClusterName=shardlmtest
FirstJobId=$first_job_id
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (120 s by default; 5 is the least).
AuthInfo=socket=$tmp/munge/socket,cred_expire=5
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
TmpFS=$tmp/tmpfs
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=3600
KillWait=20
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$conf
export TMPDIR=$tmp/jobtmp   # the jobs' scratch (Open MPI's session dir) stays in the test's dir too
mkdir -p "$TMPDIR"

for i in $(seq 1 50); do [ -S "$tmp/munge/socket" ] && break; sleep 0.2; done
if [ ! -S "$tmp/munge/socket" ]; then fail "munged did not start"; dump_logs; exit 1; fi
slurmctld -D -f "$conf" < /dev/null > "$tmp/log/slurmctld.out" 2>&1 &
ctld_pid=$!
slurmd -D -f "$conf" < /dev/null > "$tmp/log/slurmd.out" 2>&1 &
slurmd_pid=$!
up=0
for i in $(seq 1 150); do
  case $(sinfo -h -o %T 2>/dev/null) in idle*) up=1; break ;; esac
  sleep 0.2
done
if [ $up = 0 ]; then fail "slurmctld + slurmd did not bring the node up within 30 s"; dump_logs; exit 1; fi
if ! srun --mpi=list 2>&1 | grep -q pmix; then fail "srun has no pmix plugin"; srun --mpi=list; exit 1; fi
pass "single-node cluster up (ports $ctld_port/$slurmd_port, $cpus CPUs, state in $tmp)"

# ------------------------------------------------------------------ a fresh checkout
# What a clone holds (tracked and new, not ignored, files) plus the built binary.
co=$tmp/checkout
mkdir -p "$co"
if git rev-parse --git-dir >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard jobs tools inputs logs | xargs -0 cp --parents -t "$co"
else
  cp -r jobs tools inputs logs "$co"
fi
ln -s "$build_dir" "$co/build"
cd "$co"

# job_field ID FIELD: FIELD of `scontrol show job ID` (first line: one job, or an array's first task)
job_field() { scontrol -o show job "$1" 2>/dev/null | head -1 | grep -o "\b$2=[^ ]*" | head -1 | cut -d= -f2-; }
job_done() { [ -z "$(squeue -h -j "$1" -o %i 2>/dev/null)" ]; }
# state ID: "JOBSTATE restarts N exit CODE:SIGNAL"
state() { echo "$(job_field "$1" JobState) restarts $(job_field "$1" Restarts) exit $(job_field "$1" ExitCode)"; }
# wait_done ID LIMIT_S: until the job (every task of an array) has left the queue.
wait_done() {
  local id=$1 limit=$2 t0=$SECONDS
  while ! job_done "$id"; do
    if [ $(( SECONDS - t0 )) -gt "$limit" ]; then echo "job $id still queued after ${limit}s"; squeue; return 1; fi
    case $(squeue -h -j "$id" -o %r 2>/dev/null) in
      *PartitionConfig*|*BadConstraints*) echo "job $id can never run here:"; squeue -j "$id"; return 1 ;;
    esac
    sleep 0.3
  done
}
# last_step RUN_DIR: the step of the last metrics row (0 before the first).
last_step() {
  local f=$1/metrics.jsonl
  [ -f "$f" ] || { echo 0; return; }
  grep -o '"step": *[0-9]*' "$f" | tail -1 | grep -o '[0-9]*$' || echo 0
}
# losses RUN_DIR: "step loss" for every step, the last row of a step winning (a
# resumed run may repeat steps).
losses() {
  "$PYTHON" - "$1/metrics.jsonl" <<'EOF'
import json, sys
last = {}
for line in open(sys.argv[1]):
    row = json.loads(line)
    if "loss" in row and "step" in row:
        last[row["step"]] = row["loss"]
for step in sorted(last):
    print(step, repr(last[step]))
EOF
}
# wait_for LIMIT_S CMD...: until CMD succeeds.
wait_for() {
  local limit=$1 t0=$SECONDS
  shift
  until "$@"; do
    [ $(( SECONDS - t0 )) -gt "$limit" ] && return 1
    sleep 0.2
  done
}
submit() { sbatch --parsable "$@" | cut -d';' -f1; }

cpu_job=(--gpus-per-node=0 --ntasks-per-node=2 --cpus-per-task=1)
one_cpu=(--gpus-per-node=0 --ntasks-per-node=1 --cpus-per-task=1)
# The signalled job is held after steps 5 and 20 (SHARDLM_TEST_HOLD) until the
# test has signalled it: it stops after step 6 and after step 21 wherever Slurm
# takes a while to deliver (an unheld part could finish 170 steps before a
# signal to its batch shell arrived on a loaded CI box). The straight run
# matches it step for step.
steps=40
hold1=5 hold2=20
small=(--set data.global_batch=2 --set data.micro_batch=1 --set log.interval=1 --set run.max_steps=$steps)

# ------------------------------------------------------------------ submit everything
straight=$(submit "${cpu_job[@]}" jobs/slurm-node.sbatch inputs/tiny-sft.toml "${small[@]}" --set run.dir=runs/straight)
signalled=$(SHARDLM_TEST_HOLD="$hold1:$tmp/gate-signalled-1,$hold2:$tmp/gate-signalled-2" \
            submit "${cpu_job[@]}" jobs/slurm-node.sbatch inputs/tiny-sft.toml "${small[@]}" --set run.dir=runs/signalled)
printf '# three tasks\noptim.lr=1e-3\noptim.lr=3e-3 optim.weight_decay=0.1   # decay\n\noptim.lr=1e-2 sched.warmup=2\n' \
  > inputs/sweep-test.txt
sweep_small=(--set data.global_batch=2 --set data.micro_batch=1 --set log.interval=1 --set run.max_steps=10)
submit_out=$(tools/sweep.sh submit --parsable --gpus-per-node=0 --cpus-per-task=1 \
             inputs/tiny-sft.toml inputs/sweep-test.txt "${sweep_small[@]}" 2>&1)
sweep=$(tail -1 <<< "$submit_out" | cut -d';' -f1)
check "tools/sweep.sh submit derives --array=0-2 from the 3-task file" \
  grep -q -- "--array=0-2 .*jobs/sweep.sbatch inputs/tiny-sft.toml inputs/sweep-test.txt" <<< "$submit_out"
bad_deck=$(submit "${one_cpu[@]}" jobs/slurm-node.sbatch inputs/tiny-sft.toml --set optim.lr=-1 --set run.dir=runs/bad)
ckpt_fail=$(SHARDLM_CKPT_FAULT=write@0 submit "${one_cpu[@]}" jobs/slurm-node.sbatch \
            inputs/tiny-sft.toml --set run.max_steps=3 --set sched.warmup=1 --set run.dir=runs/ckptfail)
printf '#!/bin/sh\necho "stand-in trainer: stopping with 75 at once"\nexit 75\n' > "$tmp/always75"
chmod +x "$tmp/always75"
loop=$(SHARDLM_BIN=$tmp/always75 SHARDLM_MAX_REQUEUES=1 submit "${one_cpu[@]}" \
       jobs/slurm-node.sbatch inputs/tiny-sft.toml)

# Signals at known points under Slurm. Each job waits at a gate that the
# test opens: an RL trainer for its next rollout file (the inference server's
# output, which the test writes here, renamed into place as a server would), a
# setup for a run.lock that "this job step on another host" left (a requeue
# while the old node still runs; the start waits for its heartbeat to go stale,
# shardlm's run_dir.cpp). A driver per job, in the background (a job at its gate
# holds CPUs that other jobs queue for, so the main line must not wait on it):
# wait until the job is at its gate (a line of its log), scancel --signal=USR1,
# give the signal $settle s to arrive (Slurm delivers it in milliseconds), open
# the gate. The stop then lands at a known step.
settle=3
rl_gate=3 rl_steps=6   # the RL job: rollouts for steps 1-3, saved at 3, signalled, stops after step 4
last_steps=4           # the last-step job: rollouts for steps 1-3, saved at 3, signalled, step 4 is the last
"$PYTHON" tools/make_rollouts.py inputs/data/tiny.h5 --out "$tmp/rollouts" --steps $rl_steps > "$tmp/rollouts.log" 2>&1 ||
  { fail "tools/make_rollouts.py failed"; cat "$tmp/rollouts.log"; exit 1; }
# give_rollouts DIR FIRST LAST: the files of steps FIRST..LAST (step_<N-1>.h5 feeds step N), renamed in
give_rollouts() {
  local i
  mkdir -p "$1"
  for i in $(seq $(( $2 - 1 )) $(( $3 - 1 ))); do
    cp "$tmp/rollouts/step_$i.h5" "$1/.step_$i.h5.part" && mv "$1/.step_$i.h5.part" "$1/step_$i.h5"
  done
}
# drive NAME JOB LOG GATE_PATTERN OPEN_CMD...: the driver; "ok" or what went wrong in $tmp/drive-NAME
drive() {
  local name=$1 job=$2 log=$3 gate=$4
  shift 4
  if ! wait_for 300 grep -qs -- "$gate" "$log"; then
    echo "never reached its gate ('$gate' not in $log; $(state "$job"))" > "$tmp/drive-$name"
  elif ! scancel --signal=USR1 "$job"; then
    echo "scancel --signal=USR1 $job failed ($(state "$job"))" > "$tmp/drive-$name"
  else
    sleep $settle
    echo ok > "$tmp/drive-$name"
  fi
  "$@"   # opened in any case: a job left at its gate would hold the cluster
}
rl_opts=(--set log.interval=1 --set ckpt.async=false --set data.rollout_timeout_s=300 --set broadcast.interval=2)
give_rollouts runs/rl/rollouts 1 $rl_gate
rl_job=$(submit --gpus-per-node=0 --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 jobs/slurm-rl.sbatch inputs/tiny-rl.toml \
         "${rl_opts[@]}" --set run.max_steps=$rl_steps --set ckpt.interval=$rl_gate --set run.dir=runs/rl \
         --set data.rollout_dir=runs/rl/rollouts)
# The setup job starts held, so that its lock can name its job id before it runs.
setup_job=$(submit --hold "${one_cpu[@]}" jobs/slurm-node.sbatch inputs/tiny-sft.toml --set run.max_steps=3 \
            --set sched.warmup=1 --set log.interval=1 --set run.dir=runs/setup)
mkdir -p runs/setup
printf 'host=%s\npid=4242\nstarted=%s\nrun_name=tiny-sft\ndeck=inputs/tiny-sft.toml\nslurm_job_step=%s.0\ntoken=%s:4242:0:00000000feedface\n' \
  "$node-old" "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" "$setup_job" "$node-old" > runs/setup/run.lock
scontrol release "$setup_job"
give_rollouts runs/rl-last/rollouts 1 $(( last_steps - 1 ))
last_job=$(submit "${one_cpu[@]}" jobs/slurm-node.sbatch inputs/tiny-rl.toml "${rl_opts[@]}" --set broadcast.backend=none \
           --set run.max_steps=$last_steps --set ckpt.interval=$(( last_steps - 1 )) --set run.dir=runs/rl-last \
           --set data.rollout_dir=runs/rl-last/rollouts)
# A rank hung in checkpoint I/O with a stop signal pending: rank 1's
# background write of step 6 stalls; the save of step 9 waits for it; USR1
# comes; the watchdog ends the job after comm.timeout_s with exit 75, through
# srun, and the job requeues. The stall is part 1's only: the wrapper drops the
# fault in a requeued job, which resumes from step_3.h5 and completes.
printf '#!/bin/sh\n[ "${SLURM_RESTART_COUNT:-0}" = 0 ] || unset SHARDLM_CKPT_FAULT\nexec "%s" "$@"\n' "$build_dir/shardlm" \
  > "$tmp/fault-once"
chmod +x "$tmp/fault-once"
hang_job=$(SHARDLM_BIN=$tmp/fault-once SHARDLM_CKPT_FAULT=stall:6@1 submit "${cpu_job[@]}" jobs/slurm-node.sbatch \
           inputs/tiny-sft.toml --set ckpt.async=true --set ckpt.interval=3 --set run.max_steps=40 --set log.interval=1 \
           --set comm.timeout_s=20 --set data.global_batch=2 --set data.micro_batch=1 --set run.dir=runs/hang)
for id in "$straight" "$signalled" "$sweep" "$bad_deck" "$ckpt_fail" "$loop" "$rl_job" "$setup_job" "$last_job" "$hang_job"; do
  [[ $id =~ ^[0-9]+$ ]] || { fail "sbatch did not return job ids: '$straight' '$signalled' '$sweep' '$bad_deck' '$ckpt_fail' '$loop' '$rl_job' '$setup_job' '$last_job' '$hang_job' ($submit_out)"; exit 1; }
done
drive rl "$rl_job" "logs/shardlm-rl-$rl_job.out" "checkpoint: saved runs/rl/checkpoints/step_$rl_gate.h5" \
  give_rollouts runs/rl/rollouts $(( rl_gate + 1 )) $rl_steps &
drivers=($!)
drive setup "$setup_job" "logs/shardlm-$setup_job.out" "run dir: runs/setup/run.lock is held by .* waiting up to" \
  rm -f runs/setup/run.lock &
drivers+=($!)
drive last "$last_job" "logs/shardlm-$last_job.out" "checkpoint: saved runs/rl-last/checkpoints/step_$(( last_steps - 1 )).h5" \
  give_rollouts runs/rl-last/rollouts $last_steps $last_steps &
drivers+=($!)
drive hang "$hang_job" "logs/shardlm-$hang_job.out" "^step  *9/40 " true &
drivers+=($!)

# ------------------------------------------------------------------ the signalled job
# Part 1: SIGUSR1 to the ranks (scancel --signal, what --signal=USR1@T does)
# while they are held after step $hold1; part 2: SIGUSR1 to the batch shell
# (scancel --batch, what --signal=B:USR1@T does), which forwards it to srun,
# while held after step $hold2; part 3 runs to the end. The gate opens $settle s
# after the signal, and the stop lands at the next step's end.
sig_ok=1
held_at() {   # held_at N: the job's log says its ranks are held after step N; or it has left the queue
  job_done "$signalled" && return 0
  grep -q "^test hold: after step $1 " "logs/shardlm-$signalled.out" 2>/dev/null
}
restarted() {   # restarted N: the job runs after its N-th requeue; or it has left the queue
  job_done "$signalled" && return 0
  [ "$(job_field "$signalled" Restarts)" = "$1" ] && [ "$(job_field "$signalled" JobState)" = RUNNING ]
}
# signal_part N HOLD SCANCEL_OPTION...: wait for part N to be held after step
# HOLD, signal it, open its gate, wait for the requeued part N+1 to start.
stop_step=0
signal_part() {
  local part=$1 hold=$2
  shift 2
  if ! wait_for 300 held_at "$hold" || job_done "$signalled"; then
    fail "signalled job, part $part: not held after step $hold, or finished before the signal ($(state "$signalled"))"
    return 1
  fi
  # scancel is an RPC to the controller: on a loaded machine it can time out. Its
  # failure is retried (and named), never ignored.
  local tries=0
  until scancel "$@" "$signalled" 2> "$tmp/scancel.err"; do
    tries=$(( tries + 1 ))
    if [ $tries -ge 3 ]; then
      fail "signalled job, part $part: scancel $* failed 3 times: $(cat "$tmp/scancel.err")"
      return 1
    fi
    sleep 1
  done
  sleep "$settle"
  touch "$tmp/gate-signalled-$part"
  if ! wait_for 300 restarted "$part" || job_done "$signalled"; then
    fail "signalled job, part $part: not requeued and restarted after scancel $* ($(state "$signalled"); the log: $(
      grep -m1 -i 'signal' "logs/shardlm-$signalled.out" 2>/dev/null || echo 'no signal logged'))"
    return 1
  fi
  stop_step=$(last_step runs/signalled)
}
signal_part 1 $hold1 --signal=USR1 && stop1=$stop_step && signal_part 2 $hold2 --batch --signal=USR1 && stop2=$stop_step ||
  sig_ok=0

wait "${drivers[@]}"
for id in "$straight" "$signalled" "$sweep" "$bad_deck" "$ckpt_fail" "$loop" "$rl_job" "$setup_job" "$last_job" "$hang_job"; do
  wait_done "$id" 300 || fail "job $id did not finish"
done

# ------------------------------------------------------------------ what they did

log=logs/shardlm-$straight.out
check "2-task job: COMPLETED, not requeued, exit 0 ($(state "$straight"))" \
  test "$(state "$straight")" = "COMPLETED restarts 0 exit 0:0"
check "2-task job: 2 ranks, $steps steps, final checkpoint, log at $log" \
  bash -c "grep -q '2 ranks' '$log' && grep -q 'tasks 2 (2 per node)' '$log' &&
           [ \"\$(grep -c '^step .*/$steps |' '$log')\" = $steps ] && [ -f runs/straight/checkpoints/step_$steps.h5 ]"

log=logs/shardlm-$signalled.out
if [ $sig_ok = 1 ]; then
  check "signalled job: COMPLETED after 2 requeues ($(state "$signalled"))" \
    test "$(state "$signalled")" = "COMPLETED restarts 2 exit 0:0"
  ref=$(losses runs/straight); got=$(losses runs/signalled)
  check "signalled job: losses of all $steps steps equal the straight run's (stopped after steps $stop1 and $stop2)" \
    test "$(wc -l <<< "$got")" = $steps -a "$got" = "$ref"
  # One log, every part in order: three starts, two stops and requeues, one end.
  order=$(grep -n -E '^=== slurm-node.sbatch: (job|stopped|shardlm train finished)|^stopped by signal|resumed from|^step +(1|'$steps')/'$steps' ' "$log" |
          sed -E 's/^[0-9]+:(=== slurm-node.sbatch: )?//; s/^job .*(restart [0-9]).*/job \1/; s/^(step +[0-9]+\/'$steps').*/\1/; s/^(stopped by signal [0-9]+).*/\1/;
                  s/^.*resumed from.*/resumed/; s/^(stopped after a checkpoint).*/\1/; s/^(shardlm train finished).*/\1/' | tr -s ' ' | paste -sd'|')
  expect="job restart 0|step 1/$steps|stopped by signal 10|stopped after a checkpoint|job restart 1|resumed|stopped by signal 10|stopped after a checkpoint|job restart 2|resumed|step $steps/$steps|shardlm train finished"
  check "signalled job: one log ($log) holds all three parts in order" test "$order" = "$expect"
  [ "$order" = "$expect" ] || printf '  got:    %s\n  wanted: %s\n' "$order" "$expect"
fi

sweep_dirs=$(tools/sweep.sh list inputs/tiny-sft.toml inputs/sweep-test.txt | cut -f2)
expect_dirs=$'runs/tiny-sft-sweep-test/lr=1e-3\nruns/tiny-sft-sweep-test/lr=3e-3,weight_decay=0.1\nruns/tiny-sft-sweep-test/lr=1e-2,warmup=2'
check "sweep: run dirs named by their settings" test "$sweep_dirs" = "$expect_dirs"
states=$(scontrol -o show job "$sweep" | grep -o 'ArrayTaskId=[0-9]* .*JobState=[A-Z]*' | sed -E 's/ArrayTaskId=([0-9]+) .*JobState=/\1 /' | sort -n | paste -sd,)
check "sweep: 3 array tasks COMPLETED ($states)" test "$states" = "0 COMPLETED,1 COMPLETED,2 COMPLETED"
all_there=1
while read -r d; do
  [ -f "$d/checkpoints/step_10.h5" ] && [ "$(last_step "$d")" = 10 ] || { all_there=0; echo "  missing: $d"; }
done <<< "$sweep_dirs"
check "sweep: each task trained 10 steps in its own dir, logs/shardlm-sweep-${sweep}_{0,1,2}.out" \
  bash -c "[ $all_there = 1 ] && [ -f logs/shardlm-sweep-${sweep}_0.out ] && [ -f logs/shardlm-sweep-${sweep}_2.out ]"
check "sweep: task 1 ran with its line's settings (lr 0.003, weight_decay 0.1)" \
  bash -c "grep -qx 'lr = 0.003' 'runs/tiny-sft-sweep-test/lr=3e-3,weight_decay=0.1/config.toml' &&
           grep -qx 'weight_decay = 0.1' 'runs/tiny-sft-sweep-test/lr=3e-3,weight_decay=0.1/config.toml'"

check "deck error: FAILED with exit 1, not requeued ($(state "$bad_deck"))" \
  test "$(state "$bad_deck")" = "FAILED restarts 0 exit 1:0"
check "deck error: the log names the bad key and says not requeued" \
  bash -c "grep -q 'optim.lr = -1 is out of range' logs/shardlm-$bad_deck.out && grep -q 'failed (exit 1): not requeued' logs/shardlm-$bad_deck.out"
check "checkpoint failure: FAILED with exit 74, not requeued ($(state "$ckpt_fail"))" \
  test "$(state "$ckpt_fail")" = "FAILED restarts 0 exit 74:0"
check "checkpoint failure: the log says why and that it is not requeued" \
  bash -c "grep -q 'injected write error' logs/shardlm-$ckpt_fail.out && grep -q 'could not be written (exit 74' logs/shardlm-$ckpt_fail.out"
check "exit 75 every time: requeued once, then FAILED at SHARDLM_MAX_REQUEUES=1 ($(state "$loop"))" \
  bash -c "[ '$(state "$loop")' = 'FAILED restarts 1 exit 75:0' ] && [ \$(grep -c 'stand-in trainer' logs/shardlm-$loop.out) = 2 ] &&
           grep -q 'already requeued 1 times' logs/shardlm-$loop.out"

# Signals at known points: what the drivers did, then each job's states and log.
# outline LOG: the log's parts in one line: starts, steps, stops, resumes, ends
outline() {
  grep -E '^=== [a-z-]+\.sbatch: (job|stopped|shardlm train finished)|^stopped by signal|^stop signal|^checkpoint: resumed from|^run dir: .* waiting up to|^step +[0-9]+/' "$1" |
    sed -E 's/^=== [a-z-]+\.sbatch: job .*(restart [0-9]+).*/\1/; s/^=== [a-z-]+\.sbatch: //; s/^(step +[0-9]+\/[0-9]+) .*/\1/;
            s/^(stopped after a checkpoint|shardlm train finished).*/\1/; s/^(stopped by signal [0-9]+ [a-z]+ [a-z]+( [0-9]+)?).*/\1/;
            s/^(stop signal [0-9]+ on the last step \([0-9]+\)).*/\1/; s/^checkpoint: (resumed from [^ ]+).*/\1/; s/^run dir: .*(waiting up to).*/run dir held, \1/' |
    tr -s ' ' | paste -sd'|'
}
# check_outline WHAT LOG EXPECTED
check_outline() {
  local got
  got=$(outline "$2")
  check "$1" test "$got" = "$3" || printf '  got:    %s\n  wanted: %s\n' "$got" "$3"
}
for name in rl setup last hang; do
  check "$name job: at its gate, signalled, gate opened ($(cat "$tmp/drive-$name" 2>/dev/null))" \
    test "$(cat "$tmp/drive-$name" 2>/dev/null)" = ok
done

# (a) RL MPMD: the trainer stops after step rl_gate+1, both tasks exit 75, the
# job requeues; part 2 resumes from that step's checkpoint and completes.
log=logs/shardlm-rl-$rl_job.out
stop_at=$(( rl_gate + 1 ))
check "RL MPMD job (slurm-rl.sbatch, 1 trainer + 1 receiver): USR1 -> requeued once, then COMPLETED exit 0 ($(state "$rl_job"))" \
  test "$(state "$rl_job")" = "COMPLETED restarts 1 exit 0:0"
steps_rl=$(for i in $(seq 1 $stop_at); do printf 'step %d/%d|' "$i" $rl_steps; done)
steps_rl2=$(for i in $(seq $(( stop_at + 1 )) $rl_steps); do printf 'step %d/%d|' "$i" $rl_steps; done)
check_outline "RL MPMD job: stopped after step $stop_at, requeued, resumed from step_$stop_at.h5, steps to $rl_steps, finished (one log, $log)" \
  "$log" "restart 0|${steps_rl}stopped by signal 10 after step $stop_at|stopped after a checkpoint|restart 1|resumed from runs/rl/checkpoints/step_$stop_at.h5|${steps_rl2}shardlm train finished"
part1=$(sed -n '/^=== slurm-rl.sbatch: job .*(restart 0)/,/^=== slurm-rl.sbatch: stopped after a checkpoint/p' "$log")
part2=$(sed -n '/^=== slurm-rl.sbatch: job .*(restart 1)/,$p' "$log")
recv75='receive[0]: the trainers ended with exit 75 (stopped by a signal: requeue and resume); so does this receiver'
check "RL MPMD job: part 1's receiver ended with the trainers' exit 75; part 2's with 0 after its broadcasts ($(grep -o 'receive\[0\]: trainer finished; [0-9]* broadcasts* received' <<< "$part2"))" \
  bash -c "[ \$(grep -cF '$recv75' <<< \"\$1\") = 1 ] && ! grep -qF 'the trainers ended with exit' <<< \"\$2\" &&
           grep -q 'receive\[0\]: trainer finished; [1-9][0-9]* broadcasts* received' <<< \"\$2\" &&
           [ -f runs/rl/checkpoints/step_$stop_at.h5 ] && [ -f runs/rl/checkpoints/step_$rl_steps.h5 ]" _ "$part1" "$part2"

# (b) a signal during setup: exit 75 before any step, requeued; part 2 finds
# run.lock released (no takeover) and trains from the start.
log=logs/shardlm-$setup_job.out
check "signal during setup: requeued once, then COMPLETED exit 0 ($(state "$setup_job"))" \
  test "$(state "$setup_job")" = "COMPLETED restarts 1 exit 0:0"
check_outline "signal during setup: held at run.lock, stopped during setup before step 1, requeued, 3 steps, finished ($log)" \
  "$log" "restart 0|run dir held, waiting up to|stopped by signal 10 during setup|stopped after a checkpoint|restart 1|step 1/3|step 2/3|step 3/3|shardlm train finished"
check "signal during setup: nothing to save said, run.lock released (part 2 took nothing over), final checkpoint step_3" \
  bash -c "grep -q 'during setup, before the first step: exit 75 (requeue; nothing to save)' '$log' && ! grep -q 'took over' '$log' &&
           [ -f runs/setup/checkpoints/step_3.h5 ] && [ ! -e runs/setup/run.lock ]"

# (c) a signal on the last step: the run completes, no requeue.
log=logs/shardlm-$last_job.out
check "signal on the last step: COMPLETED exit 0, not requeued ($(state "$last_job"))" \
  test "$(state "$last_job")" = "COMPLETED restarts 0 exit 0:0"
check_outline "signal on the last step: steps 1-$last_steps, 'stop signal 10 on the last step ($last_steps)', finished, no requeue ($log)" \
  "$log" "restart 0|$(for i in $(seq 1 $last_steps); do printf 'step %d/%d|' "$i" $last_steps; done)stop signal 10 on the last step ($last_steps)|shardlm train finished"
check "signal on the last step: the final checkpoint step_$last_steps saved" test -f runs/rl-last/checkpoints/step_$last_steps.h5

# (d) a rank hung in checkpoint I/O, USR1 pending: the watchdog's exit 75 reaches
# the job script through srun; requeued; part 2 resumes from the last good save.
log=logs/shardlm-$hang_job.out
check "hung write + USR1: requeued once, then COMPLETED exit 0 ($(state "$hang_job"))" \
  test "$(state "$hang_job")" = "COMPLETED restarts 1 exit 0:0"
part1=$(sed -n '/^=== slurm-node.sbatch: job .*(restart 0)/,/^=== slurm-node.sbatch: job .*(restart 1)/p' "$log")
part2=$(sed -n '/^=== slurm-node.sbatch: job .*(restart 1)/,$p' "$log")
check "hung write + USR1: part 1 names rank 1's write of step 6, exits 75 and is requeued; part 2 resumes from step_3.h5 to step 40 ($log)" \
  bash -c "grep -q \"rank 1's background write of step 6 .*has made no progress\" <<< \"\$1\" &&
           grep -q 'stopped after a checkpoint (exit 75): requeueing' <<< \"\$1\" &&
           grep -q 'resumed from runs/hang/checkpoints/step_3.h5' <<< \"\$2\" && [ -f runs/hang/checkpoints/step_40.h5 ]" \
  _ "$part1" "$part2"

# ------------------------------------------------------------------ the local runner
stop_cluster
left=$(count_left)
check "cluster stopped: munged, slurmctld, slurmd and every job process gone ($left left)" test "$left" = 0

out=$(tools/sweep.sh local -j 2 --base runs/local inputs/tiny-sft.toml inputs/sweep-test.txt "${sweep_small[@]}" 2>&1); rc=$?
check "local runner: exit 0, 3 done (exit $rc)" bash -c "[ $rc = 0 ] && grep -q '3 tasks: 3 done, 0 failed' <<< '$out'"
same=1
while read -r d; do
  l=runs/local/$(basename "$d")
  [ -d "$l" ] && [ "$(losses "$l")" = "$(losses "$d")" ] && [ "$(losses "$l" | wc -l)" = 10 ] || { same=0; echo "  differs: $l vs $d"; }
done <<< "$sweep_dirs"
check "local runner: same run dir names as the Slurm sweep, same losses for each task" test $same = 1

# Stopped by a signal (SIGTERM here; Ctrl-C, SIGINT, does the same in a terminal,
# but a background job ignores SIGINT): every run checkpoints and stops, the
# runner exits 75; the same command again resumes them and finishes.
# 400 steps (a few seconds each): long enough that the first task is still
# training when the second has started, also on a loaded machine (at 60 steps
# the first can finish before the signal).
long=(--set data.global_batch=2 --set data.micro_batch=1 --set log.interval=1 --set run.max_steps=400)
tools/sweep.sh local -j 2 --base runs/local-stop inputs/tiny-sft.toml inputs/sweep-test.txt "${long[@]}" > "$tmp/local-stop.out" 2>&1 &
runner=$!
first_dir=runs/local-stop/lr=1e-3
second_dir=runs/local-stop/lr=3e-3,weight_decay=0.1
# Both running tasks are training (a signal during start-up is handled too, but
# then there is no checkpoint to see).
rows() { cat "$1/metrics.jsonl" 2>/dev/null | grep -c '^{"step"'; }  # step rows (event rows start with "event")
both_training() { [ "$(rows "$first_dir")" -ge 3 ] && [ "$(rows "$second_dir")" -ge 1 ]; }
if wait_for 300 both_training; then
  kill -TERM "$runner"
fi
rc=0; wait "$runner" || rc=$?
out=$(cat "$tmp/local-stop.out")
stopped_at=$(last_step "$first_dir")
left=$(count_left)
check "local runner: a signal -> runs checkpoint and stop, exit 75, nothing left running (exit $rc, stopped at step $stopped_at, $left left)" \
  bash -c "[ $rc = 75 ] && [ $stopped_at -lt 400 ] && [ $left = 0 ] && grep -q '0 done, 0 failed, 3 stopped or not started' <<< '$out' &&
           [ -f '$first_dir/checkpoints/latest' ] && [ -f '$second_dir/checkpoints/latest' ]" || echo "$out"
out=$(tools/sweep.sh local -j 2 --base runs/local-stop inputs/tiny-sft.toml inputs/sweep-test.txt "${long[@]}" 2>&1); rc=$?
check "local runner: the same command resumes and finishes every task (exit $rc)" \
  bash -c "[ $rc = 0 ] && grep -q '3 tasks: 3 done' <<< '$out' && grep -q 'resumed from' 'logs/local-stop/lr=1e-3.log'" ||
  { echo "$out"; tail -n 20 logs/local-stop/*.log; }
