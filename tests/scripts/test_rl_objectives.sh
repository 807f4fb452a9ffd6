#!/usr/bin/env bash
# test_rl_objectives.sh — the RL losses and advantages against numpy: the
# reference script (tests/scripts/rl_objectives_reference.py: the papers'
# formulas, its gradients checked by central differences) writes 36 seeded
# cases, every objective x aggregation x importance-sampling level, and the four
# advantage kinds; test_unit's skipped suite rl_objectives runs each through the
# trainer's CPU path in double and compares loss and d loss / d logits to 1e-6
# relative (tests/unit/test_rl_objectives.cpp). A few seconds.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-/usr/bin/python3}
UNIT=${BUILD:-build}/test_unit
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has
if [ ! -x "$UNIT" ]; then echo "FAIL rl_objectives: $UNIT is not built"; exit 1; fi
T=$(mktemp -d /tmp/shardlm-rl-objectives-XXXXXX)
trap 'rm -rf "$T"' EXIT

check "numpy reference: 36 loss cases and 4 advantage kinds written, gradients checked by central differences" \
  "$PY" tests/scripts/rl_objectives_reference.py --out "$T/cases.txt"
# The suite's own counts are not make test's (its result file is not passed on).
env -u SHARDLM_TEST_RESULTS SHARDLM_RL_REFERENCE="$T/cases.txt" OMP_NUM_THREADS=1 \
  "$UNIT" -ts=rl_objectives --no-skip > "$T/unit.log" 2>&1
rc=$?
grep '^rl_objectives' "$T/unit.log"
check "the CPU loss kernel, packing, sample sums and divisor equal the numpy reference (loss and gradient to 1e-6)" \
  test $rc = 0
if [ $rc != 0 ]; then tail -40 "$T/unit.log"; fi
check "every case ran: 36 loss cases, 4 advantage kinds" \
  grep -q '^rl_objectives: 36 loss cases, .* 4 advantage kinds' "$T/unit.log"
exit $((failures > 0))
