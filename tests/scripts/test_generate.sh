#!/usr/bin/env bash
# test_generate.sh — `shardlm generate` end to end on the CPU backend: a tiny
# model trained for 4 steps, sampled from its checkpoint and from its fp32 HF
# export (the same completions), at -np 1 and -np 2 (the same file), greedy
# against `shardlm forward`'s argmax, a prompt file from tools/make_prompts.py,
# decoded text with a tokenizer.json, and the errors of bad input (nothing
# written). Prints PASS/FAIL per check; exits non-zero if any failed:
#   bash tests/scripts/test_generate.sh
# PYTHON overrides the interpreter (h5py, numpy); BUILD the build directory.
set -u
PYTHON=${PYTHON:-/usr/bin/python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN="$ROOT/${BUILD:-build}/shardlm"
MPIRUN=${MPIRUN:-mpirun}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardlm_test_generate.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
failed=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }

# check_py NAME CODE: CODE runs with W = the work dir, h5py, numpy as np; it must set ok.
check_py() {
  local name=$1 code=$2
  if "$PYTHON" - "$WORK" "$code" <<'PY'
import sys, os, h5py, numpy as np
W = sys.argv[1]
def load(name):
    with h5py.File(os.path.join(W, name), "r") as f:
        return {k: f[k][()] for k in f}, dict(f.attrs)
ok = False
exec(sys.argv[2])
if not ok:
    print("  check was false:", sys.argv[2].strip().splitlines()[-1])
sys.exit(0 if ok else 1)
PY
  then pass "$name"; else fail "$name"; fi
}

# expect NAME RC TEXT CMD...: exit status RC and TEXT in the output.
expect() {
  local name=$1 rc_want=$2 text=$3
  shift 3
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [[ $rc -ne $rc_want ]]; then fail "$name (exit $rc, expected $rc_want)"; echo "$out" | tail -5 | sed 's/^/  /'
  elif [[ "$out" != *"$text"* ]]; then fail "$name (output lacks: $text)"; echo "$out" | tail -5 | sed 's/^/  /'
  else pass "$name"; fi
}

cd "$ROOT"
# A tiny model (inputs/tiny-sft.toml: byte vocabulary of 258, 256 positions), 4 steps, one checkpoint.
expect "train 4 steps with a checkpoint" 0 "done" "$BIN" train inputs/tiny-sft.toml \
  --set "run.dir=\"$WORK/run\"" --set run.max_steps=4 --set sched.warmup=1 --set ckpt.interval=4 --set log.interval=4
expect "export the checkpoint as fp32 HF" 0 "export:" "$BIN" export "$WORK/run" --out "$WORK/hf" --dtype fp32

# Prompts in tools/make_prompts.py's format, byte tokenizer (stop id 257 = EOS).
printf '%s\n' '{"prompt": "In the beginning"}' '{"prompt": "And God said"}' '{"prompt": "x"}' \
  '{"prompt": "Let there be light, and there was"}' '{"prompt": "The"}' > "$WORK/prompts.jsonl"
expect "make_prompts.py writes the prompt file" 0 "wrote" \
  "$PYTHON" tools/make_prompts.py -o "$WORK/prompts.h5" --tokenizer byte "$WORK/prompts.jsonl"

SAMPLE=(--prompts "$WORK/prompts.h5" --n 3 --max-new-tokens 24 --temperature 0.9 --top-p 0.95 --top-k 40 --seed 5)
expect "generate from the checkpoint (run dir)" 0 "15 completions" \
  "$BIN" generate --checkpoint "$WORK/run" "${SAMPLE[@]}" --out "$WORK/ckpt.h5" --batch 4
expect "generate from the exported HF directory" 0 "15 completions" \
  "$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/hf.h5" --batch 8
expect "generate under mpirun -np 2" 0 "over 2 ranks" \
  $MPIRUN --oversubscribe --bind-to none -np 2 "$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/np2.h5" --batch 2
# A pool of 48 positions (the longest sequence needs 33 + 23): sequences wait for
# blocks and give them way; the file is the roomy pool's.
"$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/pool.h5" --batch 8 --kv-cache-tokens 64 > "$WORK/pool.log" 2>&1
rc=$?
if [ $rc = 0 ] && grep -qE "; [1-9][0-9]* sequences? gave way" "$WORK/pool.log"; then
  pass "generate --kv-cache-tokens 64: a pool smaller than the batch's; sequences gave way"
else fail "generate --kv-cache-tokens 64 (exit $rc): no sequence gave way"; tail -3 "$WORK/pool.log"; fi
# A pool sized from a fraction of the host's memory: half of it is more than the
# batch ever needs (the pool stops at every slot at its longest, the default's);
# a billionth has no room for one sequence.
"$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/frac.h5" --batch 8 --kv-cache-memory 0.5 > "$WORK/frac.log" 2>&1
"$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/hf2.h5" --batch 8 > "$WORK/hf2.log" 2>&1
pool_of() { grep -o 'KV pool [0-9]* positions' "$1"; }
if [ -n "$(pool_of "$WORK/frac.log")" ] && [ "$(pool_of "$WORK/frac.log")" = "$(pool_of "$WORK/hf2.log")" ] &&
   cmp -s <("$PYTHON" -c "import h5py,sys; f=h5py.File(sys.argv[1]); print(list(f['tokens'][()]))" "$WORK/frac.h5") \
          <("$PYTHON" -c "import h5py,sys; f=h5py.File(sys.argv[1]); print(list(f['tokens'][()]))" "$WORK/hf.h5"); then
  pass "generate --kv-cache-memory 0.5: the pool stops at every slot at its longest ($(pool_of "$WORK/frac.log")), the same tokens"
else fail "generate --kv-cache-memory 0.5: $(pool_of "$WORK/frac.log") against $(pool_of "$WORK/hf2.log")"; tail -3 "$WORK/frac.log"; fi
expect "generate --kv-cache-memory 1e-9: no room for one sequence, said with the numbers" 1 \
  "no room for one sequence's KV blocks" \
  "$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/tiny.h5" --kv-cache-memory 1e-9
expect "generate with both --kv-cache-tokens and --kv-cache-memory: refused" 1 \
  "give one of --kv-cache-tokens (the pool in positions) and --kv-cache-memory" \
  "$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/both.h5" --kv-cache-memory 0.1 --kv-cache-tokens 64
"$BIN" generate --hf "$WORK/hf" "${SAMPLE[@]}" --out "$WORK/roomy.h5" --batch 15 > "$WORK/roomy.log" 2>&1
if grep -qE "prefill computed 65 of 195 prompt tokens \(a group's prompt once\), 0 more" "$WORK/roomy.log"; then
  pass "a roomy pool: the 5 prompts' 65 tokens computed once for their 15 samples (195 given)"
else fail "a roomy pool's prefill line: $(grep -o 'prefill computed[^;]*' "$WORK/roomy.log")"; fi
check_py "... and it writes the roomy pool's file, logprobs to the bit" "
a, _ = load('hf.h5'); b, _ = load('pool.h5')
ok = all(np.array_equal(a[k], b[k]) for k in a)"
check_py "checkpoint and fp32 export give the same completions, logprobs to the bit" "
a, _ = load('ckpt.h5'); b, _ = load('hf.h5')
ok = all(np.array_equal(a[k], b[k]) for k in ('tokens', 'offsets', 'model_logprobs', 'sampling_logprobs', 'finish_reason'))"
check_py "-np 2 writes the file -np 1 writes (batch 2 vs 8)" "
a, _ = load('hf.h5'); b, attrs = load('np2.h5')
ok = attrs['world_size'] == 2 and all(np.array_equal(a[k], b[k]) for k in a)"
check_py "layout: 5 prompts x 3 samples, offsets, logprobs <= 0, attributes" "
d, at = load('hf.h5')
S = len(d['prompt_index']); T = len(d['tokens'])
lens = np.diff(d['offsets'])
ok = (S == 15 and list(d['prompt_index']) == [p for p in range(5) for _ in range(3)]
      and list(d['sample_index']) == [0, 1, 2] * 5 and d['offsets'][0] == 0 and d['offsets'][-1] == T
      and all(len(d[k]) == T for k in ('model_logprobs', 'sampling_logprobs', 'tempered_logprobs'))
      and (d['model_logprobs'] <= 0).all() and (d['sampling_logprobs'] <= 1e-6).all()
      and (lens >= 1).all() and (lens <= 24).all()
      and at['format'] == 'shardlm-generations-1' and at['seed'] == 5 and abs(at['top_p'] - 0.95) < 1e-12
      and list(at['stop_token_ids']) == [257] and d['prompt_tokens'].dtype == np.int32)"
# --deck: the run's latest checkpoint and run.seed (1234) as the defaults.
expect "generate --deck takes the run dir's checkpoint" 0 "checkpoint $WORK/run/checkpoints/step_4.h5" \
  "$BIN" generate --deck inputs/tiny-sft.toml --set "run.dir=\"$WORK/run\"" --set sched.warmup=1 \
  --prompts "$WORK/prompts.h5" --max-new-tokens 8 --out "$WORK/deck.h5"
expect "the same with --checkpoint and --seed 1234" 0 "5 completions" \
  "$BIN" generate --checkpoint "$WORK/run/checkpoints/step_4.h5" --seed 1234 \
  --prompts "$WORK/prompts.h5" --max-new-tokens 8 --out "$WORK/seed.h5"
check_py "--deck equals --checkpoint + --seed run.seed" "
a, aa = load('deck.h5'); b, _ = load('seed.h5')
ok = aa['seed'] == 1234 and all(np.array_equal(a[k], b[k]) for k in a)"
check_py "finish reasons: length exactly at 24 tokens, stop exactly at a final 257" "
d, _ = load('hf.h5')
ok = True
for s in range(15):
    t = d['tokens'][d['offsets'][s]:d['offsets'][s + 1]]; r = d['finish_reason'][s].decode()
    ok &= (r == 'length' and len(t) == 24 and 257 not in t) or (r == 'stop' and t[-1] == 257 and 257 not in t[:-1])"

# Greedy against `shardlm forward` (the training forward, CPU fp32): every generated token is the argmax there
# (--device cpu: the same fp32 arithmetic on a GPU machine too; the GPU decoder is checked in tests/gpu).
expect "greedy generate" 0 "5 completions" \
  "$BIN" generate --hf "$WORK/hf" --prompts "$WORK/prompts.h5" --max-new-tokens 16 --temperature 0 --device cpu \
  --out "$WORK/greedy.h5"
"$PYTHON" - "$WORK" <<'PY'
import sys, h5py, numpy as np
W = sys.argv[1]
with h5py.File(f"{W}/greedy.h5") as f:
    pt, po, t, o = f["prompt_tokens"][()], f["prompt_offsets"][()], f["tokens"][()], f["offsets"][()]
rows = [np.concatenate([pt[po[p]:po[p + 1]], t[o[p]:o[p + 1]]]) for p in range(5)]
T = max(len(r) for r in rows)
with h5py.File(f"{W}/rows.h5", "w") as f:  # each row alone (padding after it is never attended to)
    f["tokens"] = np.stack([np.pad(r, (0, T - len(r))) for r in rows]).astype(np.int32)
PY
expect "shardlm forward on prompt + greedy completion" 0 "5 rows" \
  "$BIN" forward --hf "$WORK/hf" --tokens "$WORK/rows.h5" --out "$WORK/logits.h5"
check_py "greedy tokens = argmax of shardlm forward; model logprobs = its log-softmax to 1e-5" "
g, _ = load('greedy.h5')
with h5py.File(os.path.join(W, 'logits.h5')) as f: L = f['logits'][()].astype(np.float64)
worst, ok = 0.0, True
for p in range(5):
    plen = g['prompt_offsets'][p + 1] - g['prompt_offsets'][p]
    toks = g['tokens'][g['offsets'][p]:g['offsets'][p + 1]]
    lp = g['model_logprobs'][g['offsets'][p]:g['offsets'][p + 1]]
    for i, tok in enumerate(toks):
        row = L[p, plen - 1 + i]
        ok &= int(np.argmax(row)) == int(tok)
        m = row.max(); lse = m + np.log(np.exp(row - m).sum())
        worst = max(worst, abs(lp[i] - (row[tok] - lse)))
print('  max |model logprob - forward log-softmax| =', worst)
ok = ok and worst < 1e-5"

# Decoded text with a tokenizer.json: a byte-level BPE whose ids 0..255 are the bytes (as the byte tokenizer's).
"$PYTHON" - "$WORK/hf" <<'PY'
import json, sys
bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
cs, n = bs[:], 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
alphabet = {b: chr(c) for b, c in zip(bs, cs)}
json.dump({"model": {"type": "BPE", "vocab": {alphabet[b]: b for b in range(256)}, "merges": []},
           "decoder": {"type": "ByteLevel"},
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
           "added_tokens": [{"id": 256, "content": "<|bos|>", "special": True},
                            {"id": 257, "content": "<|eos|>", "special": True}]},
          open(sys.argv[1] + "/tokenizer.json", "w"))
PY
expect "generate writes text with a tokenizer.json" 0 "text from" \
  "$BIN" generate --hf "$WORK/hf" --prompt-ids "73,110,32,116,104,101" --n 2 --max-new-tokens 12 --out "$WORK/text.h5"
check_py "text is the completion's bytes (UTF-8, <|eos|> for 257)" "
d, _ = load('text.h5')
ok = True
for s in range(2):
    t = d['tokens'][d['offsets'][s]:d['offsets'][s + 1]]
    want = b''.join(b'<|eos|>' if x == 257 else b'<|bos|>' if x == 256 else bytes([x]) for x in t).decode('utf-8', 'replace')
    ok &= d['text'][s].decode() == want"

# --prompt TEXT: the same ids through the model's tokenizer.json (one byte each here),
# so the same completions as --prompt-ids with the same seed.
expect "generate --prompt TEXT encodes with the model's tokenizer" 0 "text from" \
  "$BIN" generate --hf "$WORK/hf" --prompt "In the" --n 2 --max-new-tokens 12 --out "$WORK/text2.h5"
check_py "--prompt \"In the\" = --prompt-ids 73,110,32,116,104,101: same prompt tokens, same completions" "
a, _ = load('text.h5')
b, _ = load('text2.h5')
ok = list(b['prompt_tokens']) == [73, 110, 32, 116, 104, 101] and list(a['tokens']) == list(b['tokens']) and len(b['tokens']) > 0"
expect "--prompt with --prompt-ids" 1 "needs exactly one of --prompts FILE" \
  "$BIN" generate --hf "$WORK/hf" --prompt "x" --prompt-ids "1" --out "$WORK/bad.h5"

# Bad input: a clear message naming what and where, exit 1, no output file.
expect "a missing HF directory" 1 "--hf $WORK/nope: no such directory" \
  "$BIN" generate --hf "$WORK/nope" --prompt-ids "1,2" --out "$WORK/bad.h5"
expect "a missing checkpoint" 1 "no such file" \
  "$BIN" generate --checkpoint "$WORK/nope.h5" --prompt-ids "1,2" --out "$WORK/bad.h5"
echo "not hdf5" > "$WORK/prompts.txt"
expect "a prompt file that is not HDF5" 1 "prompt file '$WORK/prompts.txt' is not an HDF5 file" \
  "$BIN" generate --hf "$WORK/hf" --prompts "$WORK/prompts.txt" --out "$WORK/bad.h5"
expect "a prompt file of another kind (a token file)" 1 "has no 'format' attribute" \
  "$BIN" generate --hf "$WORK/hf" --prompts inputs/data/tiny.h5 --out "$WORK/bad.h5"
long=$(seq -s, 1 250)
expect "a prompt longer than the positions left" 1 \
  "prompt 0 has 250 tokens; with --max-new-tokens 10 it needs 259 positions, but the model has max_position_embeddings = 256" \
  "$BIN" generate --hf "$WORK/hf" --prompt-ids "$long" --max-new-tokens 10 --out "$WORK/bad.h5"
expect "a token id outside the vocabulary" 1 "--prompt-ids: prompt 0, token 1 is 300, outside the model's vocabulary [0, 258)" \
  "$BIN" generate --hf "$WORK/hf" --prompt-ids "1,300" --out "$WORK/bad.h5"
expect "--top-p out of range" 1 "--top-p 1.5 must be in (0, 1]" \
  "$BIN" generate --hf "$WORK/hf" --prompt-ids "1" --top-p 1.5 --out "$WORK/bad.h5"
expect "no --out" 1 "needs --out FILE" "$BIN" generate --hf "$WORK/hf" --prompt-ids "1"
expect "--device takes auto, cpu or cuda" 1 "--device expects auto, cpu or cuda, got 'gpu'" \
  "$BIN" generate --hf "$WORK/hf" --prompt-ids "1" --device gpu --out "$WORK/bad.h5"
# --device cuda where it cannot run: a CPU-only build says so; a CUDA build on a machine without a GPU too.
if ! "$BIN" version | grep -q cuda; then
  expect "--device cuda in a CPU-only build" 1 "this shardlm was built without CUDA" \
    "$BIN" generate --hf "$WORK/hf" --prompt-ids "1" --device cuda --out "$WORK/bad.h5"
elif ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  expect "--device cuda without a GPU" 1 "no CUDA device is visible" \
    "$BIN" generate --hf "$WORK/hf" --prompt-ids "1" --device cuda --out "$WORK/bad.h5"
fi
expect "both --hf and --checkpoint" 1 "not both" \
  "$BIN" generate --hf "$WORK/hf" --checkpoint "$WORK/run" --prompt-ids "1" --out "$WORK/bad.h5"
expect "a bad prompt file under mpirun -np 2: one message, exit 1" 1 "is not an HDF5 file" \
  $MPIRUN --oversubscribe --bind-to none -np 2 "$BIN" generate --hf "$WORK/hf" --prompts "$WORK/prompts.txt" --out "$WORK/bad.h5"
if [ ! -e "$WORK/bad.h5" ] && [ ! -e "$WORK/bad.h5.tmp" ]; then pass "nothing written on bad input"; else fail "nothing written on bad input"; fi

echo "test_generate.sh: $failed failed"
[ "$failed" = 0 ]
