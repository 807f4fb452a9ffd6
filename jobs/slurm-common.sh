# slurm-common.sh — what every shardlm sbatch script does around `srun shardlm train`:
# the job header, the step in the background with batch-level signals forwarded
# to it, and the exit-code contract. Sourced by jobs/*.sbatch; knows nothing of
# decks or sweeps. docs/slurm.md describes the whole flow.
#
# Exit codes of `shardlm train` and what the job then does:
#   0   done                                   -> job COMPLETED
#   75  stopped by a signal after a checkpoint -> `scontrol requeue`; the job runs
#                                                 again and resumes from `latest`
#   74  a checkpoint could not be written      -> job FAILED, not requeued
#   *   an error                               -> job FAILED, not requeued
#
# Environment a user may set (sbatch passes the submitting shell's environment):
#   SHARDLM_BIN           the binary (default build/shardlm in the submit directory)
#   SHARDLM_MPI           srun's --mpi plugin (default pmix; pmi2 on clusters without PMIx)
#   SHARDLM_SRUN_ARGS     extra srun options, split on spaces (e.g. "--cpu-bind=none")
#   SHARDLM_MAX_REQUEUES  give up after this many requeues (default 20): a run that
#                         stops with 75 at once every time must not loop for ever
#   PMIX_MCA_gds          PMIx's job-data store in the ranks (default here: hash)

SHARDLM_BIN=${SHARDLM_BIN:-build/shardlm}
SHARDLM_MPI=${SHARDLM_MPI:-pmix}
SHARDLM_MAX_REQUEUES=${SHARDLM_MAX_REQUEUES:-20}
# PMIx's shared-memory job-data stores (gds ds12/ds21) crash now and then in
# MPI_Init under srun (a rank dies of SIGSEGV at address 0 before any shardlm
# code runs: openpmix#1114, ompi#7335); the hash store is the known remedy and
# costs start-up nothing at these rank counts. Exported to the ranks by srun.
export PMIX_MCA_gds=${PMIX_MCA_gds:-hash}

# shardlm_job_header SCRIPT ARGS...: one block at every start of the job (a requeued
# job appends to the same log, so each part is marked with its restart count).
shardlm_job_header() {
  local script=$1
  shift
  local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
  gpus=${gpus##*:}   # "gpu:h100:8" -> 8
  echo "=== $script: job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID})}" \
       "start $(( ${SLURM_RESTART_COUNT:-0} + 1 )) (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURMD_NODENAME:-$(hostname)}" \
       "at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "    nodes ${SLURM_JOB_NUM_NODES:-1} (${SLURM_JOB_NODELIST:-?}), tasks ${SLURM_NTASKS:-?}" \
       "(${SLURM_NTASKS_PER_NODE:-?} per node), cpus per task ${SLURM_CPUS_PER_TASK:-1}, GPUs per node $gpus"
  echo "    cwd $PWD; $SHARDLM_BIN train $*"
  if [ "$gpus" -gt 0 ] 2>/dev/null && [ -n "${SLURM_NTASKS_PER_NODE:-}" ] &&
     [ "${SLURM_NTASKS_PER_NODE%%(*}" != "$gpus" ]; then
    echo "    note: ${SLURM_NTASKS_PER_NODE} tasks per node on $gpus GPUs per node: ranks share GPUs" \
         "(set --ntasks-per-node to the GPU count for one rank per GPU)"
  fi
}

# shardlm_check_checkout SCRIPT: the binary must be there before Slurm starts ranks.
shardlm_check_checkout() {
  if [ ! -x "$SHARDLM_BIN" ]; then
    echo "$1: $SHARDLM_BIN not found or not executable (cwd $PWD): submit from the checkout's root" \
         "after \`make\`, or set SHARDLM_BIN" >&2
    exit 2
  fi
}

# shardlm_srun [SRUN_OPTION...] -- TRAIN_ARGS...: srun the trainer and wait for
# it; sets shardlm_rc and shardlm_got_term. `--signal=USR1@T` (no B:) reaches the
# ranks directly; a signal sent to the batch shell (`--signal=B:USR1@T`,
# `scancel --batch --signal=USR1`) is forwarded to srun, which passes it on to
# every rank.
shardlm_srun() {
  local -a opts=() extra=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  [ -n "${SHARDLM_SRUN_ARGS:-}" ] && read -r -a extra <<< "$SHARDLM_SRUN_ARGS"
  # ${a[@]+"${a[@]}"}: an empty array under set -u breaks bash < 4.4 as "${a[@]}"
  shardlm_step srun --mpi="$SHARDLM_MPI" ${opts[@]+"${opts[@]}"} ${extra[@]+"${extra[@]}"} "$SHARDLM_BIN" train "$@"
}

# shardlm_step COMMAND...: run the job step COMMAND (an srun) in the background with
# the batch shell's USR1 and TERM forwarded to it, and wait for it; sets
# shardlm_rc and shardlm_got_term. shardlm_srun and slurm-rl.sbatch's MPMD step use it.
shardlm_step() {
  shardlm_got_term=0
  "$@" &
  local step=$! rc last=""
  trap 'shardlm_interrupted=1; kill -USR1 "$step" 2>/dev/null' USR1
  trap 'shardlm_interrupted=1; shardlm_got_term=1; kill -TERM "$step" 2>/dev/null' TERM
  # A trapped signal cuts `wait` short (status > 128): wait again for srun's own
  # status; "not a child" (127) then means the status before was already its own.
  shardlm_rc=""
  while [ -z "$shardlm_rc" ]; do
    shardlm_interrupted=0
    rc=0
    wait "$step" || rc=$?
    if [ "$shardlm_interrupted" = 1 ] && [ "$rc" -gt 128 ]; then
      last=$rc
    elif [ "$rc" = 127 ] && [ -n "$last" ]; then
      shardlm_rc=$last
    else
      shardlm_rc=$rc
    fi
  done
  trap - USR1 TERM
}

# shardlm_finish SCRIPT: the exit-code contract (the table above).
shardlm_finish() {
  local script=$1 rc=$shardlm_rc restarts=${SLURM_RESTART_COUNT:-0}
  case $rc in
    0)
      echo "=== $script: shardlm train finished (exit 0)"
      exit 0 ;;
    75)
      if [ "$shardlm_got_term" = 1 ]; then
        # SIGTERM to the batch shell is scancel, preemption or the time limit: Slurm
        # itself decides about a requeue; the checkpoint is there for a resubmission.
        echo "=== $script: stopped by SIGTERM after a checkpoint (exit 75); not requeued by this script" \
             "(Slurm requeues preempted jobs itself); resubmit the same command to resume" >&2
        exit 75
      fi
      if [ "$restarts" -ge "$SHARDLM_MAX_REQUEUES" ]; then
        echo "=== $script: stopped after a checkpoint (exit 75) but the job was already requeued $restarts" \
             "times (SHARDLM_MAX_REQUEUES=$SHARDLM_MAX_REQUEUES): not requeued again" >&2
        exit 75
      fi
      echo "=== $script: stopped after a checkpoint (exit 75): requeueing job $SLURM_JOB_ID" \
           "(restart $(( restarts + 1 ))); it resumes from the latest checkpoint"
      # Slurm ends this shell as soon as the requeue is accepted.
      if ! scontrol requeue "$SLURM_JOB_ID"; then
        echo "=== $script: scontrol requeue $SLURM_JOB_ID failed (submitted with --no-requeue, or" \
             "requeue not allowed here): resubmit the same command to resume" >&2
        exit 75
      fi
      exit 0 ;;
    74)
      echo "=== $script: a checkpoint could not be written (exit 74; the reason is above): not requeued," \
           "since a rerun would fail the same way" >&2
      exit 74 ;;
    *)
      echo "=== $script: shardlm train failed (exit $rc): not requeued" >&2
      exit "$rc" ;;
  esac
}
