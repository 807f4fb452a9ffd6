#!/usr/bin/env python3
"""make_copy_task.py — a verifiable toy task for RL on a tiny model: repeat the
last digit of the prompt.

Vocabulary (16 ids, no tokenizer): digits 0..9 are ids 0..9, BOS = 10,
SEP = 11, EOS = 12 (13..15 unused). A prompt is [BOS, d1, d2, d3, SEP]; the
answer is d3 followed by EOS. Writes, into --out-dir:

    sft.h5      SFT token file (docs/data.md): [BOS d1 d2 d3 SEP d3 EOS], loss on "d3 EOS"
    prompts.h5  RL prompt file (docs/data.md, "RL prompt files"): the prompts, each
                with its 'answer' = str(d3) (the id in decimal: with no tokenizer,
                shardlm's verifiers see a completion's ids in decimal), stop id EOS

    /usr/bin/python3 tools/make_copy_task.py --out-dir runs/copy-task

Used by inputs/copy-sft.toml, inputs/copy-rl.toml and tests/scripts/test_rl_learns.sh.
"""

import argparse
import os

import h5py
import numpy as np

BOS, SEP, EOS, VOCAB = 10, 11, 12, 16


def write_atomic(path, fill):
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        fill(f)
    os.replace(tmp, path)


def write_sft_file(path, docs, masks, vocab):
    """An SFT token file (docs/data.md): documents of ids, a loss mask over each."""
    def fill(f):
        f["tokens"] = np.concatenate(docs).astype(np.int32)
        f["offsets"] = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
        f["loss_mask"] = np.concatenate(masks).astype(np.uint8)
        f.attrs["vocab_size"] = np.int64(vocab)

    write_atomic(path, fill)


def write_prompt_file(path, prompts, answers, vocab, stop_ids):
    """An RL prompt file (docs/data.md): id lists, an 'answer' each, the stop ids."""
    def fill(f):
        text = h5py.string_dtype("utf-8")
        f["tokens"] = np.concatenate(prompts).astype(np.int32)
        f["offsets"] = np.cumsum([0] + [len(q) for q in prompts]).astype(np.int64)
        f.create_dataset("answer", data=np.asarray(answers, dtype=object), dtype=text)
        f.attrs["format"] = "shardlm-prompts-1"
        f.attrs["vocab_size"] = np.int64(vocab)
        f.attrs["stop_token_ids"] = np.asarray(stop_ids, dtype=np.int64)

    write_atomic(path, fill)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--sft-docs", type=int, default=2000)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    rng = np.random.default_rng(a.seed)

    digits = rng.integers(0, 10, size=(a.sft_docs, 3))
    docs = [[BOS, *map(int, d), SEP, int(d[2]), EOS] for d in digits]
    masks = [[0, 0, 0, 0, 0, 1, 1] for _ in docs]

    write_sft_file(os.path.join(a.out_dir, "sft.h5"), docs, masks, VOCAB)

    digits = rng.integers(0, 10, size=(a.prompts, 3))
    prompts = [[BOS, *map(int, d), SEP] for d in digits]
    answers = [str(int(d[2])) for d in digits]

    write_prompt_file(os.path.join(a.out_dir, "prompts.h5"), prompts, answers, VOCAB, [EOS])
    print(f"wrote {a.out_dir}/sft.h5 ({len(docs)} documents) and {a.out_dir}/prompts.h5 ({len(prompts)} prompts)")


if __name__ == "__main__":
    main()
