#!/usr/bin/env bash
# test_make_rollouts.sh — runs tools/make_rollouts.py on inputs/data/tiny.h5 and
# checks the files it writes with h5py (layout, dtypes, prompt/completion split,
# advantages, logprobs, temperature, attributes, tmp + rename, determinism) and
# its errors. Prints PASS/FAIL per check and exits non-zero if any failed:
#   bash tests/scripts/test_make_rollouts.sh
# PYTHON overrides the interpreter (it needs h5py and numpy).
set -u
PYTHON=${PYTHON:-/usr/bin/python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TOOL="$ROOT/tools/make_rollouts.py"
DATA="$ROOT/inputs/data/tiny.h5"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardlm_test_make_rollouts.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
failed=0

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }

# check_py NAME PYTHON-CODE: the code runs with DIR = sys.argv[1], DATA =
# sys.argv[2], h5py, numpy as np, math and `files` (sorted step_*.h5 paths of
# DIR) in scope, and must set ok.
check_py() {
  local name=$1 dir=$2 code=$3
  if "$PYTHON" - "$dir" "$DATA" "$code" <<'EOF'
import sys, os, glob, math, h5py, numpy as np
DIR, DATA = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(os.path.join(DIR, "step_*.h5")), key=lambda p: int(p.rsplit("_", 1)[1][:-3]))
ok = False
exec(sys.argv[3])
if not ok:
    print("  check was false:", sys.argv[3].strip().splitlines()[-1])
sys.exit(0 if ok else 1)
EOF
  then pass "$name"; else fail "$name"; fi
}

# expect_run NAME EXPECTED-RC SUBSTRING-OF-OUTPUT ARGS...
expect_run() {
  local name=$1 rc_want=$2 text=$3
  shift 3
  local out rc
  out=$("$PYTHON" "$TOOL" "$@" 2>&1)
  rc=$?
  if [[ $rc -ne $rc_want ]]; then
    fail "$name (exit $rc, expected $rc_want)"; echo "$out" | sed 's/^/  /'
  elif [[ "$out" != *"$text"* ]]; then
    fail "$name (output lacks: $text)"; echo "$out" | sed 's/^/  /'
  else
    pass "$name"
  fi
}

# ---------------------------------------------------------------- defaults
expect_run "writes 3 step files" 0 "wrote 3 files step_0.h5 .. step_2.h5" \
  "$DATA" --out "$WORK/a" --steps 3 --seed 11
check_py "files step_0..2, no .tmp left" "$WORK/a" \
  "ok = sorted(os.listdir(DIR)) == ['step_0.h5', 'step_1.h5', 'step_2.h5']"
check_py "dtypes and 1-D datasets" "$WORK/a" "
want = dict(tokens=np.int32, offsets=np.int64, loss_mask=np.uint8, advantages=np.float32,
            inference_logprobs=np.float32, temperature=np.float32)
ok = all(all(f[k].dtype == t and f[k].ndim == 1 for k, t in want.items()) and 'loss_weight' not in f
         for f in map(h5py.File, files))"
check_py "lengths: offsets 0..len(tokens), 8 samples, per-sample advantages and temperature" "$WORK/a" "
def good(f):
    o, T = f['offsets'][:], len(f['tokens'])
    return (o[0] == 0 and o[-1] == T and np.all(np.diff(o) >= 2) and len(o) == 9
            and len(f['loss_mask']) == T and len(f['inference_logprobs']) == T
            and len(f['advantages']) == 8 and len(f['temperature']) == 8)
ok = all(good(h5py.File(p)) for p in files)"
check_py "attributes step = N and policy_step = N" "$WORK/a" "
ok = [(int(h5py.File(p).attrs['step']), int(h5py.File(p).attrs['policy_step'])) for p in files] == [(0, 0), (1, 1), (2, 2)]"
check_py "every sample is a whole document of tiny.h5, prompt half without loss, completion half with" "$WORK/a" "
with h5py.File(DATA) as d:
    t, o = d['tokens'][:], d['offsets'][:]
docs = {tuple(t[o[i]:o[i + 1]]) for i in range(len(o) - 1)}
def good(f):
    tok, off, m = f['tokens'][:], f['offsets'][:], f['loss_mask'][:]
    for s in range(len(off) - 1):
        a, b = off[s], off[s + 1]
        n, p = b - a, (b - a) // 2
        if tuple(tok[a:b]) not in docs or list(m[a:b]) != [0] * p + [1] * (n - p):
            return False
    return True
ok = all(good(h5py.File(p)) for p in files)"
check_py "logprobs: log(uniform(0.05, 0.95)) on completions, 0 on prompts" "$WORK/a" "
def good(f):
    lp, m = f['inference_logprobs'][:], f['loss_mask'][:]
    c = lp[m == 1]
    return (np.all(lp[m == 0] == 0) and np.all(c <= np.float32(math.log(0.95)) + 1e-6)
            and np.all(c >= np.float32(math.log(0.05)) - 1e-6) and c.std() > 0.1)
ok = all(good(h5py.File(p)) for p in files)"
check_py "advantages: seeded normal, differ by step; temperature 1" "$WORK/a" "
adv = [h5py.File(p)['advantages'][:] for p in files]
allv = np.concatenate(adv)
ok = (all(np.all(h5py.File(p)['temperature'][:] == 1.0) for p in files) and np.all(np.isfinite(allv))
      and abs(allv.mean()) < 1.0 and 0.4 < allv.std() < 2.0 and not np.array_equal(adv[0], adv[1]))"

# ---------------------------------------------------------------- options
expect_run "same seed again" 0 "wrote 3 files" "$DATA" --out "$WORK/b" --steps 3 --seed 11
if cmp -s "$WORK/a/step_1.h5" "$WORK/b/step_1.h5" && cmp -s "$WORK/a/step_2.h5" "$WORK/b/step_2.h5"; then
  pass "same seed: byte-identical files"; else fail "same seed: byte-identical files"; fi
expect_run "another seed" 0 "wrote 1 files" "$DATA" --out "$WORK/c" --steps 1 --seed 12
if ! cmp -s "$WORK/a/step_0.h5" "$WORK/c/step_0.h5"; then pass "another seed: other file"; else fail "another seed: other file"; fi

expect_run "options run" 0 "wrote 2 files step_5.h5 .. step_6.h5" "$DATA" --out "$WORK/d" --steps 2 \
  --first-step 5 --samples-per-step 40 --max-tokens 33 --lag 6 --temperature 0.7 --per-token-advantages \
  --logprob-range 0.5 0.6
check_py "--first-step, --lag: step 5, 6 with policy_step max(0, N - 6)" "$WORK/d" "
ok = [(int(h5py.File(p).attrs['step']), int(h5py.File(p).attrs['policy_step'])) for p in files] == [(5, 0), (6, 0)]"
check_py "--samples-per-step 40 (more than the 30 documents), --max-tokens 33" "$WORK/d" "
ok = all(len(h5py.File(p)['offsets']) == 41 and np.diff(h5py.File(p)['offsets'][:]).max() <= 33 for p in files)"
check_py "--temperature 0.7, --per-token-advantages, --logprob-range" "$WORK/d" "
def good(f):
    lp, m = f['inference_logprobs'][:], f['loss_mask'][:]
    return (np.all(f['temperature'][:] == np.float32(0.7)) and len(f['advantages']) == len(f['tokens'])
            and np.all(lp[m == 1] >= np.float32(math.log(0.5)) - 1e-6) and np.all(lp[m == 1] <= np.float32(math.log(0.6)) + 1e-6))
ok = all(good(h5py.File(p)) for p in files)"

# ---------------------------------------------------------------- errors
expect_run "missing token file" 1 "nope.h5: token file does not exist; nothing written" \
  "$WORK/nope.h5" --out "$WORK/e" --steps 1
echo "not hdf5" > "$WORK/text.h5"
expect_run "not an HDF5 file" 1 "text.h5: not an HDF5 file" "$WORK/text.h5" --out "$WORK/e" --steps 1
"$PYTHON" -c "import h5py, numpy as np; h5py.File('$WORK/notokens.h5', 'w')['offsets'] = np.array([0], np.int64)"
expect_run "token file without 'tokens'" 1 "no dataset 'tokens'" "$WORK/notokens.h5" --out "$WORK/e" --steps 1
[[ ! -e "$WORK/e" ]] && pass "nothing written on error" || fail "nothing written on error"
expect_run "--steps 0" 2 "--steps must be at least 1" "$DATA" --out "$WORK/e" --steps 0
expect_run "--temperature 0" 2 "--temperature must be positive" "$DATA" --out "$WORK/e" --steps 1 --temperature 0
expect_run "--max-tokens 1" 2 "--max-tokens must be at least 2" "$DATA" --out "$WORK/e" --steps 1 --max-tokens 1
expect_run "--logprob-range 0.9 0.1" 2 "--logprob-range needs 0 < LO < HI <= 1" "$DATA" --out "$WORK/e" --steps 1 \
  --logprob-range 0.9 0.1
expect_run "--out missing" 2 "--out" "$DATA" --steps 1

echo "test_make_rollouts: $failed failed"
[[ $failed -eq 0 ]]
