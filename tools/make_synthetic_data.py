#!/usr/bin/env python3
"""make_synthetic_data.py — random-token HDF5 data for benchmarks (docs/data.md layout):
documents of random ids in [0, vocab). Run with an interpreter that has h5py and numpy.

    python3 tools/make_synthetic_data.py OUT.h5 --vocab 128256 --tokens 2000000 --doc-len 4097
"""
import argparse
import os

import h5py
import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--doc-len", type=int, default=4097, help="tokens per document (seq_len + 1 fills a row)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.vocab < 2 or a.tokens < a.doc_len or a.doc_len < 2:
        ap.error("need vocab >= 2 and tokens >= doc-len >= 2")
    rng = np.random.default_rng(a.seed)
    docs = a.tokens // a.doc_len
    total = docs * a.doc_len
    offsets = np.arange(0, total + 1, a.doc_len, dtype=np.int64)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".tmp"
    with h5py.File(tmp, "w") as f:
        # Written in blocks: a 12 GB file needs 256 MB of memory, not 12 GB.
        # One random block, then each next block is the first shifted by its
        # number mod vocab: every id still equally likely, and the file is
        # written at disk speed instead of the generator's.
        tokens = f.create_dataset("tokens", shape=(total,), dtype=np.int32)
        block = 1 << 26
        first = rng.integers(0, a.vocab, size=min(block, total), dtype=np.int32)
        for i, start in enumerate(range(0, total, block)):
            n = min(block, total - start)
            tokens[start:start + n] = first[:n] if i == 0 else (first[:n] + np.int32(i % a.vocab)) % np.int32(a.vocab)
        f["offsets"] = offsets
        f.attrs["vocab_size"] = np.int64(a.vocab)
        f.attrs["tokenizer"] = "random"
    os.replace(tmp, a.out)
    print(f"{a.out}: {docs} documents of {a.doc_len} random tokens, vocab {a.vocab}")


if __name__ == "__main__":
    main()
