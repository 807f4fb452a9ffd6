#!/usr/bin/env bash
# find_python.sh — print the Python interpreter that shardlm's tools and tests use:
# $PYTHON when set, else the first of /usr/bin/python3 and python3 that imports
# h5py and numpy (on Debian the PATH python3 may be a build that cannot see
# them), else python3. Used by the Makefile, tools/bench.sh and the GPU tests.
if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; exit 0; fi
for p in /usr/bin/python3 python3; do
  if "$p" -c 'import h5py, numpy' 2>/dev/null; then command -v "$p"; exit 0; fi
done
echo python3
