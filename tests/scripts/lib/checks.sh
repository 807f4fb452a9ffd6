#!/usr/bin/env bash
# checks.sh — the PASS/FAIL vocabulary the command-line test scripts share
# (test_runs.sh, test_checkpoint_faults.sh, test_signals.sh):
#   source tests/scripts/lib/checks.sh      (from the repository root; tests/run.sh runs
#                                          tests/scripts/*.sh, not this folder)
#   pass WHAT | fail WHAT              print one line; fail counts into $failures
#   check WHAT COMMAND...              PASS when COMMAND succeeds, else FAIL
#   has FILE TEXT                      FILE contains TEXT (fixed string)
#   wait_for SECONDS COMMAND...        poll until COMMAND succeeds (a guard against hangs, not a timing)
#   tree_pids PID                      every pid in the process tree under PID, PID included
# The script ends with: exit $((failures > 0)).
failures=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
check() {
  local what=$1
  shift
  if "$@"; then pass "$what"; else fail "$what"; fi
}
has() { grep -qF -- "$2" "$1"; }
wait_for() {
  local limit=$1 i
  shift
  for ((i = 0; i < limit * 10; i++)); do "$@" && return 0; sleep 0.1; done
  return 1
}
tree_pids() {
  local p
  echo "$1"
  for p in $(pgrep -P "$1"); do tree_pids "$p"; done
}
