#!/usr/bin/env bash
# setup.sh — the opening the RL job scripts share (test_rl_jobs.sh, test_rl_faults.sh,
# test_rl_data_rules.sh, test_rl_eval.sh, test_rl_updates.sh, test_rl_ref_kl.sh):
#   source tests/scripts/lib/setup.sh NAME      (from the repository root)
# sets BIN (the build under test: $SHARDLM, else $BUILD/shardlm), PY, MPIRUN and MPI
# (mpirun with the flags every script uses), exports one OpenMP thread, passive
# waits and root's Open MPI permission, ends the script with "FAIL NAME" when BIN
# is not built, makes T (/tmp/shardlm-NAME-*, removed on exit unless KEEP is
# set) and sources checks.sh (pass, fail, check, has, wait_for, tree_pids).
# copy_task_warm_start makes the copy task and the SFT warm start most of them train from.
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
PY=${PYTHON:-/usr/bin/python3}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
if [ ! -x "$BIN" ]; then echo "FAIL $1: $BIN is not built"; exit 1; fi
T=$(mktemp -d "/tmp/shardlm-$1-XXXXXX")
cleanup() { [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"; }
trap cleanup EXIT
source tests/scripts/lib/checks.sh
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY)

# copy_task_warm_start [--set K=V ...]: tools/make_copy_task.py's task in $T/task and
# inputs/copy-sft.toml trained on it (the deck's steps unless the arguments say
# otherwise), exported to $T/sft/export; a check line says whether it was.
copy_task_warm_start() {
  "$PY" tools/make_copy_task.py --out-dir "$T/task" > "$T/task.log" 2>&1 || { fail "make_copy_task.py"; cat "$T/task.log"; }
  timeout 300 "$BIN" train inputs/copy-sft.toml --set "data.path=$T/task/sft.h5" --set "run.dir=$T/sft" \
    --set "run.export_dir=$T/sft/export" "$@" > "$T/sft.log" 2>&1
  check "SFT warm start exported" test -f "$T/sft/export/model.safetensors"
}
