#!/usr/bin/env bash
# sweep.sh — one sweep file, run as a Slurm job array or on a workstation, with the
# same run dirs either way.
#
#   tools/sweep.sh list   [--base DIR] DECK SWEEP          task, run dir, overrides of each line
#   tools/sweep.sh array  SWEEP                            the array range (0-N)
#   tools/sweep.sh submit [--print] [--base DIR] [--throttle K] [SBATCH_OPTION=VALUE...] \
#                         DECK SWEEP [--set key=value]...  sbatch --array=0-N jobs/sweep.sbatch ...
#   tools/sweep.sh local  [-j N] [--np R] [--base DIR] DECK SWEEP [--set key=value]...
#                                                          every task here, N at a time, R ranks each
#   tools/sweep.sh task   [--base DIR] DECK SWEEP INDEX    "RUN_DIR<TAB>OVERRIDES" (jobs/sweep.sbatch)
#
# A sweep file holds one task per line: --set overrides separated by spaces
# (key=value, no spaces inside a value). Empty lines and lines starting with # are
# skipped and " #" starts a comment; task i is the i-th remaining line, from 0.
#
# Run dirs: BASE/NAME. BASE is runs/<deck>-<sweep> (both file names without their
# extension) unless --base gives it. NAME joins the line's key=value pairs with
# commas in the line's order; a key loses its section (optim.lr -> lr) unless two
# keys of the line would then share a name; quotes are dropped and any character
# of a value outside [A-Za-z0-9._+-] becomes _; a name over 80 characters keeps
# its first 71 and appends - and 8 hex digits of the line's sha1. A line that sets
# run.dir keeps its own. Two lines with the same run dir are refused.
#
# Extra --set options after SWEEP apply to every task, before the line's own.
# Exit codes of `local`: 0 every task done; 1 a task failed; 75 stopped by a
# signal before all were done (rerun the same command: finished runs are kept and
# stopped ones resume from their checkpoint).
set -euo pipefail

prog=tools/sweep.sh
die() { echo "$prog: $*" >&2; exit 1; }
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 1; }

root=$(cd "$(dirname "$0")/.." && pwd)
caller_dir=$PWD

# abs_path PATH: PATH as given from the caller's directory, so that it still names
# the same file after `cd "$root"` (relative paths inside the checkout stay short).
abs_path() {
  local p=$1
  if [[ $p != /* ]] && [ "$caller_dir" != "$root" ]; then p="$caller_dir/$p"; fi
  printf '%s\n' "$p"
}

# parse_sweep FILE: task_line[i] (line number), task_sets[i] (normalised
# overrides), task_name[i] (the run dir's last part, or "" with task_dir_given[i]).
task_line=() task_sets=() task_name=() task_dir_given=()
parse_sweep() {
  local file=$1 lineno=0 raw text tok key value short name h i j
  [ -f "$file" ] || die "sweep file $file not found"
  while IFS= read -r raw || [ -n "$raw" ]; do
    lineno=$(( lineno + 1 ))
    text=" $raw"
    text=${text%%[[:space:]]#*}
    local -a toks=()
    read -r -a toks <<< "$text" || true
    [ ${#toks[@]} -eq 0 ] && continue
    local -A short_count=() seen=()
    for tok in "${toks[@]}"; do
      key=${tok%%=*}
      value=${tok#*=}
      if [ "$key" = "$tok" ] || [ -z "$value" ] || ! [[ $key =~ ^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)+$ ]]; then
        die "$file:$lineno: '$tok' is not section.key=value (a line is --set overrides separated by spaces)"
      fi
      [ -n "${seen[$key]:-}" ] && die "$file:$lineno: $key is set twice"
      seen[$key]=1
      short=${key##*.}
      short_count[$short]=$(( ${short_count[$short]:-0} + 1 ))
    done
    local -a parts=()
    local dir_given=""
    for tok in "${toks[@]}"; do
      key=${tok%%=*}
      value=${tok#*=}
      value=${value//[\"\']/}
      if [ "$key" = run.dir ]; then dir_given=$value; continue; fi
      short=${key##*.}
      [ "${short_count[$short]}" -gt 1 ] && short=$key
      parts+=("$short=${value//[^A-Za-z0-9._+-]/_}")
    done
    name=$(IFS=,; printf '%s' "${parts[*]}")
    if [ ${#name} -gt 80 ]; then
      h=$(printf '%s' "${toks[*]}" | sha1sum | cut -c1-8)
      name="${name:0:71}-$h"
    fi
    task_line+=("$lineno")
    task_sets+=("${toks[*]}")
    task_name+=("$name")
    task_dir_given+=("$dir_given")
  done < "$file"
  [ ${#task_line[@]} -gt 0 ] || die "$file has no tasks (every line is empty or a comment)"
  # Two tasks in one run dir would resume each other's checkpoints.
  local -A owner=()
  for i in "${!task_line[@]}"; do
    local d
    d=$(task_dir "$i")
    if [ -n "${owner[$d]:-}" ]; then
      j=${owner[$d]}
      die "$file:${task_line[$i]} and line ${task_line[$j]} both run in $d: give one of them a different setting or run.dir"
    fi
    owner[$d]=$i
  done
}

base=""
# default_base DECK SWEEP
default_base() {
  local d s
  d=$(basename "$1"); d=${d%.*}
  s=$(basename "$2"); s=${s%.*}
  printf 'runs/%s-%s\n' "$d" "$s"
}
task_dir() {
  if [ -n "${task_dir_given[$1]}" ]; then printf '%s\n' "${task_dir_given[$1]}"
  else printf '%s/%s\n' "$base" "${task_name[$1]}"; fi
}
# task_args I: the --set options of task I, run.dir last.
task_args() {
  local -a a=() kv
  for kv in ${task_sets[$1]}; do a+=(--set "$kv"); done
  [ -z "${task_dir_given[$1]}" ] && a+=(--set "run.dir=$(task_dir "$1")")
  printf '%s\n' "${a[@]}"
}
need_deck() {
  [ -f "$1" ] || die "deck $1 not found (sbatch options before the deck go as --option=value)"
}
check_common() {
  local a
  for a in "$@"; do
    case $a in --set|--set=*|*=*) ;; *) die "after DECK SWEEP only --set key=value options are accepted, not '$a'" ;; esac
  done
}

cmd_list() {
  while [ $# -gt 0 ]; do
    case $1 in --base) base=${2:?--base needs a directory}; shift 2 ;; --base=*) base=${1#*=}; shift ;; *) break ;; esac
  done
  [ $# -eq 2 ] || usage
  base=${base:-$(default_base "$1" "$2")}
  parse_sweep "$2"
  local i
  for i in "${!task_line[@]}"; do
    printf '%s\t%s\t%s\n' "$i" "$(task_dir "$i")" "${task_sets[$i]}"
  done
}

cmd_array() {
  [ $# -eq 1 ] || usage
  base=BASE   # only the names matter for the range
  parse_sweep "$1"
  printf '0-%d\n' $(( ${#task_line[@]} - 1 ))
}

cmd_task() {
  while [ $# -gt 0 ]; do
    case $1 in --base) base=${2:?--base needs a directory}; shift 2 ;; --base=*) base=${1#*=}; shift ;; *) break ;; esac
  done
  [ $# -eq 3 ] || usage
  local deck=$1 sweep=$2 index=$3
  [[ $index =~ ^[0-9]+$ ]] || die "task index '$index' is not a number"
  base=${base:-$(default_base "$deck" "$sweep")}
  parse_sweep "$sweep"
  [ "$index" -lt ${#task_line[@]} ] || die "$sweep has no line for task $index (it has ${#task_line[@]} tasks: 0-$(( ${#task_line[@]} - 1 )))"
  printf '%s\t%s\n' "$(task_dir "$index")" "${task_sets[$index]}"
}

cmd_submit() {
  local print_only=0 throttle=""
  local -a sbatch_opts=()
  while [ $# -gt 0 ]; do
    case $1 in
      --print) print_only=1; shift ;;
      --base) base=${2:?--base needs a directory}; shift 2 ;;
      --base=*) base=${1#*=}; shift ;;
      --throttle) throttle=${2:?--throttle needs a number}; shift 2 ;;
      --throttle=*) throttle=${1#*=}; shift ;;
      --array|--array=*|-a) die "the array range comes from the sweep file; use --throttle K for at most K tasks at once" ;;
      -*) sbatch_opts+=("$1"); shift ;;
      *) break ;;
    esac
  done
  [ $# -ge 2 ] || usage
  local deck sweep
  deck=$(abs_path "$1"); sweep=$(abs_path "$2"); shift 2
  cd "$root"
  need_deck "$deck"
  check_common "$@"
  local shown_base=${base:-$(default_base "$deck" "$sweep")}
  local given_base=$base
  base=$shown_base
  parse_sweep "$sweep"
  base=$given_base
  local range="0-$(( ${#task_line[@]} - 1 ))"
  if [ -n "$throttle" ]; then
    [[ $throttle =~ ^[1-9][0-9]*$ ]] || die "--throttle $throttle is not a positive number"
    range+="%$throttle"
  fi
  local -a cmd=(sbatch "--array=$range" "${sbatch_opts[@]}" jobs/sweep.sbatch "$deck" "$sweep")
  [ -n "$base" ] && cmd+=(--base "$base")
  cmd+=("$@")
  echo "${#task_line[@]} tasks, run dirs under $shown_base/ (tools/sweep.sh list prints them)" >&2
  printf '%q ' "${cmd[@]}"; echo
  [ $print_only = 1 ] && return 0
  command -v sbatch >/dev/null 2>&1 || die "sbatch not found: not on a Slurm login node? (--print shows the command)"
  exec "${cmd[@]}"
}

# ------------------------------------------------------------------ local runner
local_stopping=0
local_signals=0
declare -A local_pid_task=()

local_on_signal() {
  local_stopping=1
  local_signals=$(( local_signals + 1 ))
  local pid sig=USR1
  # The first signal asks every run to checkpoint and stop (exit 75); a second one
  # ends them at once.
  [ $local_signals -gt 1 ] && sig=TERM
  echo "$prog: stopping: SIG$sig to ${#local_pid_task[@]} running task(s); rerun the same command to resume" >&2
  for pid in "${!local_pid_task[@]}"; do kill -"$sig" "$pid" 2>/dev/null || true; done
}

cmd_local() {
  local jobs=1 np=1
  while [ $# -gt 0 ]; do
    case $1 in
      -j) jobs=${2:?-j needs a number}; shift 2 ;;
      -j*) jobs=${1#-j}; shift ;;
      --jobs=*) jobs=${1#*=}; shift ;;
      --np) np=${2:?--np needs a number}; shift 2 ;;
      --np=*) np=${1#*=}; shift ;;
      --base) base=${2:?--base needs a directory}; shift 2 ;;
      --base=*) base=${1#*=}; shift ;;
      -*) die "unknown option $1 for local (accepted: -j N, --np R, --base DIR)" ;;
      *) break ;;
    esac
  done
  [[ $jobs =~ ^[1-9][0-9]*$ ]] || die "-j $jobs is not a positive number"
  [[ $np =~ ^[1-9][0-9]*$ ]] || die "--np $np is not a positive number"
  [ $# -ge 2 ] || usage
  local deck sweep
  deck=$(abs_path "$1"); sweep=$(abs_path "$2"); shift 2
  local -a common=("$@")
  cd "$root"
  need_deck "$deck"
  check_common "${common[@]}"
  [ -x build/shardlm ] || die "build/shardlm not found in $root: run make first"
  base=${base:-$(default_base "$deck" "$sweep")}
  parse_sweep "$sweep"
  local ntasks=${#task_line[@]}
  local logdir="logs/$(basename "$base")"
  mkdir -p "$logdir"

  local cores threads gpus=0
  cores=$(nproc)
  threads=$(( cores / (np * jobs) )); [ $threads -ge 1 ] || threads=1
  threads=${OMP_NUM_THREADS:-$threads}
  if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
  if [ "$gpus" -gt 0 ] && [ $(( np * jobs )) -gt "$gpus" ]; then
    echo "$prog: note: $jobs tasks of $np ranks on $gpus GPUs: tasks share GPUs" >&2
  fi
  echo "$prog: $ntasks tasks from $sweep, $jobs at a time, $np rank(s) each, OMP_NUM_THREADS=$threads; run dirs under $base/, logs in $logdir/" >&2

  local -a queue=() status=() rcs=() starts=()
  local i
  for i in "${!task_line[@]}"; do queue+=("$i"); status+=(pending); rcs+=(""); starts+=(0); done
  local -A pid_slot=()
  local -a slot_busy=()
  for (( i = 0; i < jobs; i++ )); do slot_busy+=(0); done
  local max_requeues=${SHARDLM_MAX_REQUEUES:-20}

  trap local_on_signal USR1 TERM INT
  # Should this runner end early (an error here), it ends its runs with it.
  trap 'for pid in "${!local_pid_task[@]}"; do kill -TERM "$pid" 2>/dev/null; done' EXIT
  while :; do
    while [ $local_stopping = 0 ] && [ ${#local_pid_task[@]} -lt "$jobs" ] && [ ${#queue[@]} -gt 0 ]; do
      local t=${queue[0]} slot=0 dir log
      queue=("${queue[@]:1}")
      while [ "${slot_busy[$slot]}" = 1 ]; do slot=$(( slot + 1 )); done
      dir=$(task_dir "$t")
      log=${task_name[$t]:-${dir//\//_}}
      log="$logdir/$log.log"
      local -a args=()
      mapfile -t args < <(task_args "$t")
      local -a envs=(OMP_NUM_THREADS="$threads" NP="$np")
      if [ "$gpus" -gt 0 ]; then
        local g list=""
        for (( g = 0; g < np; g++ )); do list+="${list:+,}$(( (slot * np + g) % gpus ))"; done
        envs+=(CUDA_VISIBLE_DEVICES="$list")
      fi
      starts[$t]=$(( ${starts[$t]} + 1 ))
      echo "=== $prog: task $t start ${starts[$t]} at $(date -u +%Y-%m-%dT%H:%M:%SZ): ${task_sets[$t]} -> $dir" >> "$log"
      # Its own session: a Ctrl-C in the terminal reaches this runner only, which
      # turns it into SIGUSR1 (checkpoint and stop) for every run.
      env "${envs[@]}" setsid jobs/workstation.sh "$deck" "${common[@]}" "${args[@]}" >> "$log" 2>&1 < /dev/null &
      local pid=$!
      local_pid_task[$pid]=$t
      pid_slot[$pid]=$slot
      slot_busy[$slot]=1
      status[$t]=running
      echo "task $t: started (${task_sets[$t]}) -> $dir, log $log" >&2
    done
    [ ${#local_pid_task[@]} -eq 0 ] && break
    local done_pid="" rc=0
    wait -n -p done_pid "${!local_pid_task[@]}" || rc=$?
    [ -z "${done_pid:-}" ] && continue   # a signal interrupted the wait
    local t=${local_pid_task[$done_pid]}
    slot_busy[${pid_slot[$done_pid]}]=0
    unset "local_pid_task[$done_pid]" "pid_slot[$done_pid]"
    rcs[$t]=$rc
    case $rc in
      0) status[$t]=done ;;
      75)
        if [ $local_stopping = 0 ] && [ $(( ${starts[$t]} - 1 )) -lt "$max_requeues" ]; then
          status[$t]=requeued
          queue=("$t" "${queue[@]}")
        else
          status[$t]=stopped
        fi ;;
      138|143)
        # Ended by the signal this runner forwarded before the run could catch it
        # (still starting up): nothing of it is lost, a rerun starts it again.
        if [ $local_stopping = 1 ]; then status[$t]=stopped; else status[$t]=failed; fi ;;
      *) status[$t]=failed ;;
    esac
    echo "task $t: ${status[$t]} (exit $rc)$([ "${status[$t]}" = requeued ] && echo ': stopped after a checkpoint, starting it again to resume')" >&2
  done
  trap - USR1 TERM INT EXIT

  local n_done=0 n_failed=0 n_stopped=0 s
  for i in "${!task_line[@]}"; do
    s=${status[$i]}
    [ "$s" = pending ] && s=stopped
    case $s in done) n_done=$(( n_done + 1 )) ;; failed) n_failed=$(( n_failed + 1 )) ;; *) n_stopped=$(( n_stopped + 1 )) ;; esac
    printf '  %-3s %-8s %-6s %s\n' "$i" "$s" "${rcs[$i]:+exit ${rcs[$i]}}" "$(task_dir "$i")"
  done
  echo "sweep $base: $ntasks tasks: $n_done done, $n_failed failed, $n_stopped stopped or not started"
  [ $n_failed -gt 0 ] && return 1
  [ $n_stopped -gt 0 ] && return 75
  return 0
}

[ $# -ge 1 ] || usage
sub=$1
shift
case $sub in
  list) cmd_list "$@" ;;
  array) cmd_array "$@" ;;
  task) cmd_task "$@" ;;
  submit) cmd_submit "$@" ;;
  local) cmd_local "$@" ;;
  -h|--help|help) usage ;;
  *) echo "$prog: unknown command '$sub'" >&2; usage ;;
esac
