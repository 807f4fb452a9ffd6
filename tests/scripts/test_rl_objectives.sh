#!/usr/bin/env bash
# test_rl_objectives.sh — the RL losses and advantages against numpy: the
# reference script (tests/scripts/rl_objectives_reference.py: the papers'
# formulas, its gradients checked by central differences) writes 48 seeded
# cases, every objective x aggregation x importance-sampling level, and every
# objective x aggregation again split into 2 or 3 parts (several updates per
# step) with the KL term against frozen reference weights (k1, k2, k3), and the
# four advantage kinds; test_unit's skipped suite rl_objectives runs each through the
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

check "numpy reference: 48 loss cases and 4 advantage kinds written, gradients checked by central differences" \
  "$PY" tests/scripts/rl_objectives_reference.py --out "$T/cases.txt"
# The suite's own counts are not make test's (its result file is not passed on).
env -u SHARDLM_TEST_RESULTS SHARDLM_RL_REFERENCE="$T/cases.txt" OMP_NUM_THREADS=1 \
  "$UNIT" -ts=rl_objectives --no-skip > "$T/unit.log" 2>&1
rc=$?
grep '^rl_objectives' "$T/unit.log"
check "the CPU loss kernel, packing, sample sums and divisor equal the numpy reference (loss and gradient to 1e-6)" \
  test $rc = 0
if [ $rc != 0 ]; then tail -40 "$T/unit.log"; fi
check "every case ran: 48 loss cases (12 in parts, with the reference KL), 4 advantage kinds" \
  grep -q '^rl_objectives: 48 loss cases, .* 4 advantage kinds' "$T/unit.log"
exit $((failures > 0))
