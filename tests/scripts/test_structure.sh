#!/usr/bin/env bash
# test_structure.sh — src/ keeps the floors of docs/DESIGN.md's layout: no include
# climbs a floor and no two folders include each other (tools/include_floors.py),
# and the checker sees a climb and a cycle when one is planted in a copy.
# Prints PASS/FAIL per check. A second or two.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-/usr/bin/python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardlm_test_structure.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

out=$("$PYTHON" "$ROOT/tools/include_floors.py" --check 2>&1); rc=$?
if [ $rc = 0 ] && grep -q '^includes that climb a floor: 0$' <<< "$out" && grep -q '^arrows on a cycle between folders: 0$' <<< "$out"; then
  echo "PASS src/: no include climbs a floor, no cycle between folders"
else
  echo "FAIL src/: the include floors do not hold (exit $rc)"; echo "$out" | grep -A20 'climb a floor' | head -30
fi

# A kernel that includes the trainer climbs from floor 2 to 4, and train/ already
# includes cuda/: the checker must name the include and the cycle.
cp -r "$ROOT/src" "$ROOT/include" "$WORK/"
sed -i '1i #include "train/train.hpp"' "$WORK/src/cuda/gemm.hpp"
out=$("$PYTHON" "$ROOT/tools/include_floors.py" --check --root "$WORK" 2>&1); rc=$?
if [ $rc = 1 ] && grep -q 'src/cuda/gemm.hpp -> train/train.hpp' <<< "$out" && grep -q '  cuda -> train' <<< "$out"; then
  echo "PASS a planted include of train/ from cuda/ is named as a climb and a cycle"
else
  echo "FAIL the planted include of train/ from cuda/ was not caught (exit $rc)"; echo "$out" | tail -8
fi
