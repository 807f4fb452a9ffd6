#!/usr/bin/env python3
"""make_arith_task.py — a verifiable arithmetic task for RL on the GPU: a + b.

Vocabulary (16 ids, no tokenizer): digits 0..9 are ids 0..9, PLUS = 10, EQ = 11,
BOS = 12, EOS = 13 (14, 15 unused). A problem is [BOS, digits(a), PLUS, digits(b),
EQ] with a, b in [0, 10^digits), numbers written without leading zeros; the
answer is digits(a + b) followed by EOS. Every pair is a problem; a seeded
--heldout of them never appear in training (SFT or RL). Writes into --out-dir:

    sft.h5       SFT token file (docs/data.md): the training problems with their
                 answers, loss on the answer and EOS
    prompts.h5   RL prompt file: the training problems, each with 'answer' = its
                 digits' ids in decimal separated by spaces ("1 5 7": what the
                 verifiers see of a completion without a tokenizer), stop id EOS;
                 `rollout.reward = "regex"` with `^{answer}$` scores a whole answer
    heldout.h5   the held-out problems in the same form (tools/score_generate.py
                 scores `shardlm generate` on them)

    /usr/bin/python3 tools/make_arith_task.py --out-dir runs/arith-task [--digits 2] [--heldout 1000]

Used by tools/bench_rl_arith.sh (the arithmetic RL run on the GPU).
"""

import argparse
import os

import numpy as np

from make_copy_task import write_prompt_file, write_sft_file

PLUS, EQ, BOS, EOS, VOCAB = 10, 11, 12, 13, 16


def digits(x):
    return [int(c) for c in str(int(x))]


def write_prompts(path, pairs):
    prompts = [[BOS, *digits(a), PLUS, *digits(b), EQ] for a, b in pairs]
    answers = [" ".join(map(str, digits(a + b))) for a, b in pairs]
    write_prompt_file(path, prompts, answers, VOCAB, [EOS])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--heldout", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    n = 10 ** a.digits
    pairs = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij"), axis=-1).reshape(-1, 2)
    pairs = pairs[np.random.default_rng(a.seed).permutation(len(pairs))]
    if not 0 < a.heldout < len(pairs):
        raise SystemExit(f"make_arith_task.py: --heldout {a.heldout} must be in (0, {len(pairs)})")
    heldout, train = pairs[:a.heldout], pairs[a.heldout:]

    docs = [[BOS, *digits(x), PLUS, *digits(y), EQ, *digits(x + y), EOS] for x, y in train]
    masks = [[0] * (len(d) - len(digits(x + y)) - 1) + [1] * (len(digits(x + y)) + 1)
             for d, (x, y) in zip(docs, train)]

    write_sft_file(os.path.join(a.out_dir, "sft.h5"), docs, masks, VOCAB)
    write_prompts(os.path.join(a.out_dir, "prompts.h5"), train)
    write_prompts(os.path.join(a.out_dir, "heldout.h5"), heldout)
    print(f"wrote {a.out_dir}/sft.h5 ({len(docs)} problems), prompts.h5 ({len(train)}), heldout.h5 ({len(heldout)})")


if __name__ == "__main__":
    main()
