#!/usr/bin/env bash
# test_multinode.sh — the multi-node job scripts under a real Slurm of four nodes
# on this one machine: each node a network namespace with its own address on a
# bridge and its own hostname (UTS namespace), running its own slurmd; one
# slurmctld and one munged for all; Open MPI's TCP transport between the nodes;
# the checkout and the run dirs on the filesystem all nodes share, as on a cluster.
#
# It builds the cluster itself and takes it down by the pids and namespaces it
# made, on failure and on SIGINT/SIGTERM too (and a reaper process does the same
# if this shell is SIGKILLed). Cases: slurm-multinode.sbatch on 2 nodes x 1 and
# 2 tasks and 4 nodes x 1 task, each with the losses of the single-node run of the
# same deck and world size (bit-identical, CPU backend) and the node, local rank
# and node count every rank reports; a checkpoint written by 2 nodes resumed on 4;
# SIGUSR1 -> checkpoint -> requeue -> resume; an RL job (trainers and a receiver,
# jobs/slurm-rl.sbatch) across three nodes; a sweep array spread over the nodes;
# one node's processes killed, and one node's network cut, mid-run: the job ends
# within comm.timeout_s naming the node and rank, the last checkpoint is intact
# and a requeue resumes it to the reference losses.
#
# Prints SKIP (and passes) only when it cannot run here at all: Slurm, munge or
# iproute2 missing, not root, or no network namespaces. SHARDLM_TEST_KEEP=1 keeps
# the temp dir (every daemon's and job's log).
set -u
cd "$(dirname "$0")/../.."
repo=$PWD
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-/usr/bin/python3}
case $BUILD in /*) build_dir=$BUILD ;; *) build_dir=$repo/$BUILD ;; esac
source tests/scripts/lib/checks.sh
pass() { echo "PASS multinode: $*"; }
fail() { echo "FAIL multinode: $*"; failures=$((failures + 1)); }
skip() { echo "SKIP multinode: $*"; exit 0; }
t_start=$SECONDS

for cmd in munged mungekey slurmctld slurmd sbatch srun scontrol scancel squeue sinfo ip unshare nsenter mpirun; do
  command -v "$cmd" >/dev/null 2>&1 || skip "$cmd not installed (tools/install-deps.sh installs slurm-wlm and munge)"
done
[ "$(id -u)" = 0 ] || skip "network namespaces and slurmd need root; not root here"
unshare --net --uts true 2>/dev/null || skip "cannot make network and UTS namespaces here (unshare --net --uts failed)"
if [ ! -x "$build_dir/shardlm" ]; then fail "$build_dir/shardlm not built"; exit 1; fi

tmp=$(mktemp -d /tmp/shardlm-multinode.XXXXXX)
conf=$tmp/slurm.conf
nodes=(mn1 mn2 mn3 mn4)
# Every process this test starts carries this variable (sbatch passes the
# environment on), so the cleanup can find stragglers by it and by nothing broader.
export SHARDLM_MN_TEST_DIR=$tmp
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# ------------------------------------------------------------------ teardown
# What was started is recorded in $tmp/pids (daemons and namespace holders) and
# $tmp/netns (the network namespaces' inodes), so that the teardown, run from the
# EXIT trap or from the reaper, needs nothing but the temp dir.
marked_processes() {   # pids (other than this shell) with the marker, or in one of our namespaces
  local p ns=" $(tr '\n' ' ' < "$tmp/netns" 2>/dev/null) "
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = "$$" ] || [ "$p" = "${reaper_pid:-}" ] || [ "$p" = "$BASHPID" ] && continue
    if grep -qzxF "SHARDLM_MN_TEST_DIR=$tmp" "/proc/$p/environ" 2>/dev/null; then echo "$p"; continue; fi
    case $ns in *" $(readlink "/proc/$p/ns/net" 2>/dev/null) "*) echo "$p" ;; esac
  done
  return 0
}
stop_pid() {   # stop_pid PID: TERM, up to 10 s, then KILL
  local pid=$1 i
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null || return 0
  for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null
  return 0
}
# hard_stop: every process we started or that runs in our namespaces, by pid; the
# namespaces go with their last process, and the bridge and veth pairs with them.
hard_stop() {
  local p what
  while read -r what p; do [ "$what" = holder ] || stop_pid "$p"; done < <(tac "$tmp/pids" 2>/dev/null)
  for p in $(marked_processes); do kill -KILL "$p" 2>/dev/null; done
  sleep 0.5
  for p in $(marked_processes); do kill -KILL "$p" 2>/dev/null; done
  return 0
}
stopped=0
stop_cluster() {
  [ $stopped = 1 ] && return 0
  stopped=1
  local i
  if [ -n "${ctld_pid:-}" ] && kill -0 "$ctld_pid" 2>/dev/null; then
    scancel --user="$(id -un)" >/dev/null 2>&1
    for i in $(seq 1 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.3; done
  fi
  hard_stop
}
cleanup() {
  stop_cluster
  [ -n "${reaper_pid:-}" ] && kill "$reaper_pid" 2>/dev/null
  if [ "${SHARDLM_TEST_KEEP:-0}" = 1 ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
: > "$tmp/pids"; : > "$tmp/netns"
# The reaper: if this shell dies without its EXIT trap (SIGKILL), take it all down.
( trap '' INT TERM HUP
  while kill -0 $$ 2>/dev/null; do sleep 1; done
  hard_stop; [ "${SHARDLM_TEST_KEEP:-0}" = 1 ] || rm -rf "$tmp" ) </dev/null >/dev/null 2>&1 &
reaper_pid=$!

dump_logs() {
  local f
  for f in "$tmp"/log/*; do echo "--- $f"; tail -n 15 "$f"; done
}

# ------------------------------------------------------------------ the network
# A free 10.x.y.0/24: no address or route of this machine in it (two runs at once
# pick different ones: the holder of the fabric is made before the address is
# taken, and the check is repeated after).
net=""
for i in $(seq 1 50); do
  cand="10.$(( RANDOM % 100 + 100 )).$(( RANDOM % 250 + 1 ))"
  if ! ip -4 addr show | grep -q " $cand\." && ! ip -4 route show | grep -q "^$cand\."; then net=$cand; break; fi
done
[ -n "$net" ] || { fail "no free 10.x.y.0/24 subnet found"; exit 1; }
host_if=smn$$            # the one interface in this machine's namespace (IFNAMSIZ: 15)
ctl_addr=$net.1

# new_ns NAME UNSHARE_FLAGS...: a process holding fresh namespaces (recorded); echoes its pid.
new_ns() {
  local name=$1 pid i
  shift
  unshare "$@" -- sh -c "hostname $name 2>/dev/null; exec sleep 100000000" </dev/null >/dev/null 2>&1 &
  pid=$!
  for i in $(seq 1 100); do   # until unshare has switched namespaces (before that, a veth would land here)
    [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" != "$(readlink /proc/$$/ns/net)" ] && break
    sleep 0.05
  done
  echo "holder $pid" >> "$tmp/pids"
  readlink "/proc/$pid/ns/net" >> "$tmp/netns"
  echo "$pid"
}
in_ns() { local pid=$1; shift; nsenter -t "$pid" -n -u "$@"; }

fabric=$(new_ns fabric --net)
in_ns "$fabric" sh -c 'ip link set lo up && ip link add br0 type bridge && ip link set br0 up' ||
  { fail "could not make a bridge in a network namespace"; exit 1; }
ip link add "$host_if" type veth peer name uplink netns "$fabric" &&
  ip addr add "$ctl_addr/24" dev "$host_if" && ip link set "$host_if" up &&
  in_ns "$fabric" sh -c 'ip link set uplink master br0 && ip link set uplink up' ||
  { fail "could not connect the bridge to this machine ($host_if, $ctl_addr/24)"; exit 1; }
declare -A node_pid node_addr
for i in "${!nodes[@]}"; do
  n=${nodes[$i]}
  node_pid[$n]=$(new_ns "$n" --net --uts)
  node_addr[$n]=$net.$(( 11 + i ))
  in_ns "$fabric" ip link add "$n" type veth peer name eth0 netns "${node_pid[$n]}" &&
    in_ns "$fabric" sh -c "ip link set $n master br0 && ip link set $n up" &&
    in_ns "${node_pid[$n]}" sh -c "ip link set lo up && ip addr add ${node_addr[$n]}/24 dev eth0 && ip link set eth0 up" ||
    { fail "could not wire node $n (${node_addr[$n]})"; exit 1; }
done
if [ "$(in_ns "${node_pid[mn2]}" hostname)" != mn2 ]; then fail "node mn2's UTS namespace has hostname '$(in_ns "${node_pid[mn2]}" hostname)'"; exit 1; fi

# ------------------------------------------------------------------ munge, slurmctld, slurmd x 4
mkdir -p "$tmp/log" "$tmp/state" "$tmp/munge" "$tmp/jobtmp"
chmod 700 "$tmp/munge"
mungekey --create --keyfile="$tmp/munge/munge.key" >/dev/null 2>&1 || { fail "mungekey could not make a key"; exit 1; }
munged --foreground --force --socket="$tmp/munge/socket" --key-file="$tmp/munge/munge.key" \
       --pid-file="$tmp/munge/munged.pid" --seed-file="$tmp/munge/seed" \
       --log-file="$tmp/log/munged.log" < /dev/null > "$tmp/log/munged.out" 2>&1 &
echo "munged $!" >> "$tmp/pids"

# slurmctld listens in this namespace (the nodes reach it at $ctl_addr); each
# slurmd in its own, so they can share one port number.
read -r ctld_port slurmd_port < <("$PYTHON" -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("0.0.0.0", 0))
print(*[x.getsockname()[1] for x in s])')
first_job_id=$(( (RANDOM * 32768 + RANDOM) % 60000000 + 1000 ))
node_lines=""
for n in "${nodes[@]}"; do
  node_lines+="NodeName=$n NodeHostname=$n NodeAddr=${node_addr[$n]} CPUs=2 State=UNKNOWN"$'\n'
  mkdir -p "$tmp/spool/$n" "$tmp/tmpfs/$n"
done
cat > "$conf" <<EOF
# generated by tests/scripts/test_multinode.sh: ${#nodes[@]} nodes, each a network namespace on $net.0/24
ClusterName=shardlmmn
FirstJobId=$first_job_id
SlurmctldHost=$(hostname -s)($ctl_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/munge/socket,cred_expire=5
StateSaveLocation=$tmp/state
# %n: per node, as each node has its own disk on a cluster (the PMIx server's
# client dirs live under TmpFS and would clash between the nodes of one job)
SlurmdSpoolDir=$tmp/spool/%n
TmpFS=$tmp/tmpfs/%n
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/spool/%n/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd-%n.log
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
$node_lines
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$conf
export TMPDIR=$tmp/jobtmp   # the jobs' scratch (Open MPI's session dirs, named by host) stays in the test's dir

for i in $(seq 1 50); do [ -S "$tmp/munge/socket" ] && break; sleep 0.2; done
if [ ! -S "$tmp/munge/socket" ]; then fail "munged did not start"; dump_logs; exit 1; fi
slurmctld -D -f "$conf" < /dev/null > "$tmp/log/slurmctld.out" 2>&1 &
ctld_pid=$!
echo "slurmctld $ctld_pid" >> "$tmp/pids"
for n in "${nodes[@]}"; do
  in_ns "${node_pid[$n]}" slurmd -D -N "$n" -f "$conf" < /dev/null > "$tmp/log/slurmd-$n.out" 2>&1 &
  echo "slurmd $!" >> "$tmp/pids"
done
up=0
for i in $(seq 1 300); do
  [ "$(sinfo -h -o '%T %D' 2>/dev/null)" = "idle ${#nodes[@]}" ] && { up=1; break; }
  sleep 0.2
done
if [ $up = 0 ]; then fail "slurmctld + ${#nodes[@]} slurmd did not bring the nodes up within 60 s ($(sinfo -h 2>&1))"; dump_logs; exit 1; fi
if ! srun --mpi=list 2>&1 | grep -q pmix; then fail "srun has no pmix plugin"; srun --mpi=list; exit 1; fi
hosts=$(srun -N ${#nodes[@]} --ntasks-per-node=1 hostname 2>&1 | sort | paste -sd' ')
check "cluster up: ${#nodes[@]} nodes on $net.0/24, each with its own hostname ($hosts; ctld port $ctld_port)" \
  test "$hosts" = "${nodes[*]}"
[ "$hosts" = "${nodes[*]}" ] || { dump_logs; exit 1; }
