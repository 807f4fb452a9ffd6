#!/usr/bin/env python3
"""make_chain_task.py — a verifiable task whose answers are 100-1,000 tokens of work.

A problem gives two three-digit numbers a, b and a count K; the answer writes out
K lines of the chain x0 = a, x1 = b, x(j+1) = (x(j) + x(j-1)) mod 1000, each line a
countdown from K to 1 and the next term, both as three digits, least
significant first (so that carries and borrows flow the way the tokens are
written) and zero-padded. Every line depends on the two before it, so one slip anywhere makes the
rest wrong: the reward (the whole answer, exact) needs every line of the work.

Vocabulary (16 ids, no tokenizer): digits 0..9 are ids 0..9, SEP = 10 ends a
line, EQ = 11, BOS = 12, EOS = 13 (14, 15 unused).

    prompt   [BOS, a a a, b b b, K K K, EQ]                         11 ids
    answer   K lines [c c c, x x x, SEP], c = K, K-1, ..., 1, then EOS   7 K + 1 ids

With K in [--min-lines, --max-lines] (default 15..140) an answer is 106-981 ids.
Writes into --out-dir:

    sft.h5       SFT token file (docs/data.md): --sft problems with their answers,
                 loss on the answer and EOS
    prompts.h5   RL prompt file: --prompts problems, each with 'answer' = the
                 answer's ids in decimal separated by spaces (what the verifiers
                 see without a tokenizer; `rollout.reward = "regex"` with
                 `^{answer}$` scores the whole worked answer), stop id EOS
    heldout.h5   --heldout problems in the same form, none of them in sft.h5 or
                 prompts.h5 (tools/score_generate.py scores `shardlm generate`)

    /usr/bin/python3 tools/make_chain_task.py --out-dir runs/chain-task [--max-lines 140]

Used by tools/bench_rl_long.sh (RL with long completions on the GPU).
"""

import argparse
import os

import numpy as np

from make_copy_task import write_prompt_file, write_sft_file

SEP, EQ, BOS, EOS, VOCAB = 10, 11, 12, 13, 16


def three(x):
    """x in [0, 1000) as three digits, least significant first."""
    return [x % 10, x // 10 % 10, x // 100]


def problem(a, b, k):
    return [BOS, *three(a), *three(b), *three(k), EQ]


def answer(a, b, k):
    ids, prev, cur = [], a, b
    for c in range(k, 0, -1):
        prev, cur = cur, (prev + cur) % 1000
        ids += [*three(c), *three(cur), SEP]
    return ids


def write_prompts(path, problems):
    prompts = [problem(*p) for p in problems]
    answers = [" ".join(map(str, answer(*p))) for p in problems]
    write_prompt_file(path, prompts, answers, VOCAB, [EOS])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--min-lines", type=int, default=15)
    p.add_argument("--max-lines", type=int, default=140)
    p.add_argument("--sft", type=int, default=20000)
    p.add_argument("--prompts", type=int, default=4096)
    p.add_argument("--heldout", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if not 1 <= a.min_lines <= a.max_lines <= 999:
        raise SystemExit(f"make_chain_task.py: need 1 <= --min-lines <= --max-lines <= 999 "
                         f"(got {a.min_lines}, {a.max_lines})")
    os.makedirs(a.out_dir, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    total = a.sft + a.prompts + a.heldout
    # Distinct (a, b, K) triples: a held-out problem is never seen in SFT or RL.
    space = 1000 * 1000 * (a.max_lines - a.min_lines + 1)
    if total > space // 2:
        raise SystemExit(f"make_chain_task.py: {total} problems asked of a space of {space}")
    seen, problems = set(), []
    while len(problems) < total:
        t = (int(rng.integers(1000)), int(rng.integers(1000)), int(rng.integers(a.min_lines, a.max_lines + 1)))
        if t not in seen:
            seen.add(t)
            problems.append(t)
    heldout, rl, sft = problems[:a.heldout], problems[a.heldout:a.heldout + a.prompts], problems[a.heldout + a.prompts:]

    docs, masks = [], []
    for t in sft:
        q, ans = problem(*t), answer(*t) + [EOS]
        docs.append(q + ans)
        masks.append([0] * len(q) + [1] * len(ans))
    write_sft_file(os.path.join(a.out_dir, "sft.h5"), docs, masks, VOCAB)
    write_prompts(os.path.join(a.out_dir, "prompts.h5"), rl)
    write_prompts(os.path.join(a.out_dir, "heldout.h5"), heldout)
    lengths = [len(d) for d in docs]
    print(f"wrote {a.out_dir}/sft.h5 ({len(docs)} problems, {sum(lengths)} tokens, {min(lengths)}-{max(lengths)} "
          f"a document), prompts.h5 ({len(rl)}), heldout.h5 ({len(heldout)}); answers of "
          f"{7 * a.min_lines + 1}-{7 * a.max_lines + 1} ids")


if __name__ == "__main__":
    main()
