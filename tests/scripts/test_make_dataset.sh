#!/usr/bin/env bash
# test_make_dataset.sh — runs tools/make_dataset.py on tiny inputs and checks
# exit codes, error messages and the HDF5 contents. Prints PASS/FAIL per check
# and exits non-zero if any failed. Run from anywhere:
#   bash tests/scripts/test_make_dataset.sh
# PYTHON overrides the interpreter (it needs h5py and numpy).
set -u
PYTHON=${PYTHON:-/usr/bin/python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TOOL="$ROOT/tools/make_dataset.py"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardlm_test_make_dataset.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
failed=0

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }

# check NAME PYTHON-EXPRESSION-OVER-f  (f = the open h5py.File of $2)
check_h5() {
  local name=$1 file=$2 expr=$3
  if "$PYTHON" - "$file" "$expr" <<'EOF'
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    ok = eval(sys.argv[2])
if not ok:
    print("  expression was false:", sys.argv[2])
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

# ---------------------------------------------------------------- valid JSONL
cat > "$WORK/good.jsonl" <<'EOF'
{"text": "hi!"}

{"prompt": "Q:", "completion": "ok"}
{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
EOF
expect_run "valid jsonl is written" 0 "3 documents" -o "$WORK/good.h5" --append-eos "$WORK/good.jsonl"
# Byte ids: h=104 i=105 !=33 Q=81 :=58 o=111 k=107 a=97 b=98 '<'=60 '|'=124 '>'=62 '\n'=10; EOS=257.
check_h5 "text document tokens" "$WORK/good.h5" \
  "list(f['tokens'][0:4]) == [104, 105, 33, 257]"
check_h5 "prompt/completion tokens and mask" "$WORK/good.h5" \
  "list(f['tokens'][4:9]) == [81, 58, 111, 107, 257] and list(f['loss_mask'][4:9]) == [0, 0, 1, 1, 1]"
check_h5 "chat template and assistant-only loss" "$WORK/good.h5" \
  "bytes(f['tokens'][9:17].astype(np.uint8)).decode() == '<|user|>' and int(f['tokens'][19]) == 257 \
   and int(f['loss_mask'][18:20].sum()) == 0 \
   and bytes(f['tokens'][20:35].astype(np.uint8)).decode() == '<|assistant|>\nb' \
   and list(f['loss_mask'][20:36]) == [0] * 14 + [1, 1] and int(f['tokens'][35]) == 257"
check_h5 "offsets" "$WORK/good.h5" "list(f['offsets'][:]) == [0, 4, 9, 36]"
check_h5 "dtypes" "$WORK/good.h5" \
  "f['tokens'].dtype == np.int32 and f['offsets'].dtype == np.int64 and f['loss_mask'].dtype == np.uint8"
check_h5 "attributes" "$WORK/good.h5" "int(f.attrs['vocab_size']) == 258 and f.attrs['tokenizer'] == 'byte'"

# -------------------------------------------------------------- bad JSONL
cat > "$WORK/bad.jsonl" <<'EOF'
{"text": "fine"}
{"text": "unterminated
{"prompt": "no completion"}
{"messages": [{"role": "user", "content": "only a user"}]}
[1, 2]
{"text": 5}
{"body": "x"}
EOF
out=$("$PYTHON" "$TOOL" -o "$WORK/bad.h5" "$WORK/bad.jsonl" 2>&1); rc=$?
[[ $rc -eq 1 ]] && pass "malformed jsonl exits 1" || fail "malformed jsonl exits 1 (got $rc)"
for want in "bad.jsonl:2: invalid JSON" \
            "bad.jsonl:3: has 'prompt' but no 'completion'" \
            "bad.jsonl:4: 'messages' has no assistant turn" \
            "bad.jsonl:5: expected a JSON object, got array" \
            "bad.jsonl:6: 'text' must be a string, got number" \
            "bad.jsonl:7: expected 'text', 'prompt' and 'completion', or 'messages'; found keys: 'body'" \
            "6 error(s)"; do
  [[ "$out" == *"$want"* ]] && pass "reports: $want" || { fail "reports: $want"; echo "$out" | sed 's/^/  /'; }
done
[[ ! -e "$WORK/bad.h5" && ! -e "$WORK/bad.h5.tmp" ]] && pass "nothing written on error" \
  || fail "nothing written on error"

# ------------------------------------------------------------ text inputs
printf 'First paragraph\nstill first.\n\nSecond one.\n  \nThird.\n' > "$WORK/notes.txt"
expect_run "paragraphs are documents" 0 "3 documents" \
  -o "$WORK/notes.h5" --split paragraphs --prepend-bos "$WORK/notes.txt"
check_h5 "paragraph offsets, BOS first, no loss_mask when all loss" "$WORK/notes.h5" \
  "list(f['offsets'][:]) == [0, 29, 41, 48] and int(f['tokens'][0]) == 256 and 'loss_mask' not in f"
expect_run "--max-docs stops early" 0 "2 documents" \
  -o "$WORK/two.h5" --split paragraphs --max-docs 2 "$WORK/notes.txt"
expect_run "whole file is one document" 0 "1 documents" -o "$WORK/one.h5" "$WORK/notes.txt"

# ------------------------------------------------------------ other errors
expect_run "missing input" 1 "nope.txt: input file does not exist" -o "$WORK/x.h5" "$WORK/nope.txt"
expect_run "missing tokenizer file" 1 "tokenizer file does not exist" \
  -o "$WORK/x.h5" --tokenizer "$WORK/none.json" "$WORK/notes.txt"
echo '{"model": {"vocab": ' > "$WORK/tokenizer.json"
expect_run "corrupt tokenizer.json" 1 "tokenizer.json: invalid JSON: Expecting value (line 2, column 1)" \
  -o "$WORK/x.h5" --tokenizer "$WORK/tokenizer.json" "$WORK/notes.txt"
mkdir -p "$WORK/empty_model"
expect_run "model folder without tokenizer.json" 1 "$WORK/empty_model: folder has no tokenizer.json" \
  -o "$WORK/x.h5" --tokenizer "$WORK/empty_model" "$WORK/notes.txt"
# The tokenizer.json path with a hand-made byte-level BPE file (one piece per
# character, no merges); tools/hf_tokenizer.py reads it (tests/scripts/test_tokenizer.sh
# checks the real Llama 3 and Qwen3 files).
mkdir -p "$WORK/model"
cat > "$WORK/model/tokenizer.json" <<'JSON'
{"added_tokens": [{"id": 0, "content": "<s>", "special": true}, {"id": 1, "content": "</s>", "special": true}],
 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
 "decoder": {"type": "ByteLevel"},
 "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "h": 2, "i": 3, "Q": 4, "A": 5}, "merges": []}}
JSON
echo '{"bos_token": "<s>", "eos_token": {"content": "</s>"}}' > "$WORK/model/tokenizer_config.json"
printf '{"prompt": "Q", "completion": "A"}\n{"text": "hi"}\n' > "$WORK/hf.jsonl"
expect_run "prompt/completion without --append-eos: a note says no EOS ends them" 0 \
  "note: 1 prompt/completion documents end without EOS" \
  -o "$WORK/hf.h5" --tokenizer "$WORK/model/tokenizer.json" "$WORK/hf.jsonl"
expect_run "tokenizer.json path" 0 "2 documents" \
  -o "$WORK/hf.h5" --tokenizer "$WORK/model/tokenizer.json" --prepend-bos --append-eos "$WORK/hf.jsonl"
check_h5 "tokenizer.json ids, specials from tokenizer_config.json, attributes" "$WORK/hf.h5" \
  "list(f['tokens'][:]) == [0, 4, 5, 1, 0, 2, 3, 1] and list(f['loss_mask'][:4]) == [0, 0, 1, 1] \
   and int(f.attrs['vocab_size']) == 6 and f.attrs['tokenizer'].endswith('model/tokenizer.json')"
expect_run "unknown --eos-token" 1 "token '<eos>' (from --eos-token" \
  -o "$WORK/x.h5" --tokenizer "$WORK/model/tokenizer.json" --eos-token "<eos>" "$WORK/hf.jsonl"


# --------------------------------------- several inputs, compression, held-out split
for i in 1 2 3; do
  for j in $(seq 1 12); do printf 'Paragraph %d of file %d, with some words to compress.\n\n' "$j" "$i"; done > "$WORK/part$i.txt"
done
PARTS=("$WORK/part1.txt" "$WORK/part2.txt" "$WORK/part3.txt")
expect_run "several inputs in one file" 0 "36 documents" -o "$WORK/all.h5" --split paragraphs "${PARTS[@]}"
expect_run "gzip output" 0 "gzip 4, chunks of 64" -o "$WORK/all_gz.h5" --split paragraphs --compression gzip \
  --chunk-tokens 64 "${PARTS[@]}"
check_h5 "gzip output is chunked, shuffled and deflated with the same contents" "$WORK/all_gz.h5" \
  "f['tokens'].chunks == (64,) and f['tokens'].compression == 'gzip' and f['tokens'].shuffle \
   and (f['tokens'][:] == h5py.File('$WORK/all.h5', 'r')['tokens'][:]).all() \
   and (f['offsets'][:] == h5py.File('$WORK/all.h5', 'r')['offsets'][:]).all()"
expect_run "held out by count" 0 "wrote $WORK/eval.h5: 5 documents" -o "$WORK/train.h5" --eval-output "$WORK/eval.h5" \
  --eval-docs 5 --split paragraphs "${PARTS[@]}"
# The union of both files' documents is every document, each once.
check_h5 "train + eval documents are the inputs' documents" "$WORK/train.h5" "
sorted(bytes(t[o[i]:o[i+1]].astype(np.uint8)) for g in (f, h5py.File('$WORK/eval.h5', 'r'))
       for t, o in [(g['tokens'][:], g['offsets'][:])] for i in range(len(o) - 1)) == \
sorted(bytes(t[o[i]:o[i+1]].astype(np.uint8)) for g in [h5py.File('$WORK/all.h5', 'r')]
       for t, o in [(g['tokens'][:], g['offsets'][:])] for i in range(len(o) - 1)) \
and len(f['offsets']) - 1 == 31"
cp "$WORK/eval.h5" "$WORK/eval_first.h5"
"$PYTHON" "$TOOL" -o "$WORK/train.h5" --eval-output "$WORK/eval.h5" --eval-docs 5 --split paragraphs "${PARTS[@]}" >/dev/null
cmp -s "$WORK/eval.h5" "$WORK/eval_first.h5" && pass "the held-out choice is the same every run" \
  || fail "the held-out choice is the same every run"
"$PYTHON" "$TOOL" -o "$WORK/train7.h5" --eval-output "$WORK/eval7.h5" --eval-docs 5 --split-seed 7 --split paragraphs \
  "${PARTS[@]}" >/dev/null
cmp -s "$WORK/eval7.h5" "$WORK/eval_first.h5" && fail "another --split-seed holds out other documents" \
  || pass "another --split-seed holds out other documents"
expect_run "held out by fraction" 0 "wrote $WORK/evalf.h5:" -o "$WORK/trainf.h5" --eval-output "$WORK/evalf.h5" \
  --eval-fraction 0.25 --split paragraphs "${PARTS[@]}"
check_h5 "a fraction of 0.25 holds out between 3 and 18 of 36" "$WORK/evalf.h5" \
  "3 <= len(f['offsets']) - 1 <= 18 and len(f['offsets']) - 1 + len(h5py.File('$WORK/trainf.h5', 'r')['offsets']) - 1 == 36"
expect_run "--eval-output needs a size" 2 "--eval-output needs one of --eval-fraction or --eval-docs" \
  -o "$WORK/x.h5" --eval-output "$WORK/y.h5" "$WORK/notes.txt"
expect_run "--eval-fraction range" 2 "--eval-fraction must be between 0 and 1" \
  -o "$WORK/x.h5" --eval-output "$WORK/y.h5" --eval-fraction 1.5 "$WORK/notes.txt"
expect_run "--eval-docs without --eval-output" 2 "--eval-fraction and --eval-docs need --eval-output" \
  -o "$WORK/x.h5" --eval-docs 3 "$WORK/notes.txt"
expect_run "everything held out" 1 "nothing is left to train on" \
  -o "$WORK/x.h5" --eval-output "$WORK/y.h5" --eval-docs 50 --split paragraphs "$WORK/notes.txt"
[[ ! -e "$WORK/x.h5" && ! -e "$WORK/y.h5" ]] && pass "nothing written when the split fails" \
  || fail "nothing written when the split fails"
ls -a "$WORK" | grep -q '^\.tokens\.\|^\.mask\.' && fail "staging files removed" || pass "staging files removed"

expect_run "bad --max-docs" 2 "--max-docs must be at least 1" -o "$WORK/x.h5" --max-docs 0 "$WORK/notes.txt"

echo "test_make_dataset: $failed failed"
[[ $failed -eq 0 ]]
