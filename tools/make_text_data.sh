#!/usr/bin/env bash
# make_text_data.sh — build build/data/kjv.h5, the real-text dataset of
# inputs/text-sft.toml: the King James Bible, one document per chapter (1,189
# documents, about 4.3 MB of text), byte-level tokens (vocab 258) with a BOS at
# the start and an EOS at the end of each chapter. Nothing is held out.
#
#   tools/make_text_data.sh [OUTPUT]      (default build/data/kjv.h5)
#
# The text comes from Debian's bible-kjv-text package (/usr/lib/bible.data, a
# compressed format) and is read out by its reader, the `bible` program from the
# bible-kjv package (which depends on bible-kjv-text):
#
#   apt-get install bible-kjv
#
# This script installs nothing. It does nothing when OUTPUT is newer than the
# text, this script and tools/make_dataset.py, and takes well under a second
# otherwise. Environment: PYTHON (default /usr/bin/python3, needs h5py + numpy),
# BIBLE (the reader, default `bible`), BIBLE_DATA (default /usr/lib/bible.data).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build/data/kjv.h5}
PYTHON=${PYTHON:-/usr/bin/python3}
BIBLE=${BIBLE:-bible}
BIBLE_DATA=${BIBLE_DATA:-/usr/lib/bible.data}

if [ ! -f "$BIBLE_DATA" ] || ! command -v "$BIBLE" >/dev/null 2>&1; then
  echo "make_text_data: needs the KJV text ($BIBLE_DATA) and its reader ('$BIBLE');" >&2
  echo "                install them with: apt-get install bible-kjv" >&2
  exit 1
fi

if [ -f "$out" ] && [ "$out" -nt "$BIBLE_DATA" ] && [ "$out" -nt "$root/tools/make_text_data.sh" ] \
   && [ "$out" -nt "$root/tools/make_dataset.py" ]; then
  exit 0   # up to date
fi

mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$out.tmp"' EXIT

# `bible` pretty-prints "\nGenesis 1\n\n  1 In the beginning ...\n  2 ...";
# -l with a huge width turns its line wrapping off (one verse per line). Reshape
# to one blank-line separated paragraph per chapter:
#   Genesis 1
#   1 In the beginning God created the heaven and the earth.
#   2 And the earth was without form, ...
(cd "$(dirname "$BIBLE_DATA")" && "$BIBLE" -p "$(dirname "$BIBLE_DATA")" \
    -d "$(basename "$BIBLE_DATA")" -l 1000000 'Gen1:1-Rev22:21') \
  | awk 'NF == 0 { next }
         /^[^ ]/ { if (n++) printf "\n"; print; next }
         { sub(/^ +/, ""); print }' > "$tmp/kjv.txt"

chapters=$(( $(grep -c '^$' "$tmp/kjv.txt" || true) + 1 ))
if [ "$chapters" != 1189 ]; then
  echo "make_text_data: expected 1189 chapters from '$BIBLE', got $chapters" >&2
  exit 1
fi

"$PYTHON" "$root/tools/make_dataset.py" --split paragraphs --prepend-bos --append-eos \
  -o "$out.tmp" "$tmp/kjv.txt" >/dev/null
mv "$out.tmp" "$out"
echo "make_text_data: wrote $out (KJV, $chapters chapters, byte tokens)" >&2
