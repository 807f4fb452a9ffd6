#!/usr/bin/env python3
"""make_guess_task.py — a game of several turns for RL with an environment
(tools/envs/guess.py): guess a secret digit from "higher" / "lower" replies.

Vocabulary (16 ids, no tokenizer): digits 0..9 are ids 0..9, BOS = 10, SEP = 11,
EOS = 12, HIGHER = 13, LOWER = 14. A prompt is [BOS, SEP]; its answer is the
secret digit. Each assistant turn is one guess, [digit, EOS]; the environment
answers [HIGHER] or [LOWER], or ends the episode with reward 1 when the guess
is right (0 when the turns run out). Halving the range of digits still
possible always wins within 4 turns; guesses drawn at random among the digits
still possible win 0.76 of the games, guesses that ignore the replies 0.40.

Writes, into --out-dir:
    sft.h5      SFT token file (docs/data.md): played games, loss on the guesses; a
                game's guesses are drawn at random among the digits still possible
                (or, with probability --blind, among the digits not guessed yet,
                ignoring the replies), so RL has the search left to learn
    prompts.h5  RL prompt file: [BOS SEP], answer = the secret digit, stop id EOS

    /usr/bin/python3 tools/make_guess_task.py --out-dir runs/guess-task

Used by inputs/guess-sft.toml, inputs/guess-rl.toml and tests/scripts/test_rl_env.sh.
"""

import argparse
import os

import numpy as np

from make_copy_task import write_prompt_file, write_sft_file

BOS, SEP, EOS, HIGHER, LOWER, VOCAB = 10, 11, 12, 13, 14, 16
DIGITS = 10


def play(secret, rng, max_turns, blind):
    """One game: (ids after the prompt, loss mask)."""
    ids, mask = [], []
    lo, hi, tried = 0, DIGITS - 1, set()
    for _ in range(max_turns):
        if blind:
            guess = int(rng.choice([d for d in range(DIGITS) if d not in tried]))
        else:
            guess = int(rng.integers(lo, hi + 1))
        tried.add(guess)
        ids += [guess, EOS]
        mask += [1, 1]
        if guess == secret:
            break
        if secret > guess:
            lo = max(lo, guess + 1)
        else:
            hi = min(hi, guess - 1)
        ids.append(HIGHER if secret > guess else LOWER)
        mask.append(0)
    if ids[-1] in (HIGHER, LOWER):  # the turns ran out: no reply after the last guess
        ids.pop(), mask.pop()
    return ids, mask


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--sft-docs", type=int, default=8000)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--blind", type=float, default=0.5, help="fraction of SFT games that ignore the replies")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    rng = np.random.default_rng(a.seed)

    docs, masks = [], []
    for _ in range(a.sft_docs):
        ids, mask = play(int(rng.integers(0, DIGITS)), rng, a.max_turns, rng.random() < a.blind)
        docs.append([BOS, SEP] + ids)
        masks.append([0, 0] + mask)
    write_sft_file(os.path.join(a.out_dir, "sft.h5"), docs, masks, VOCAB)

    secrets = rng.integers(0, DIGITS, size=a.prompts)
    write_prompt_file(os.path.join(a.out_dir, "prompts.h5"), [[BOS, SEP] for _ in secrets],
                      [str(int(s)) for s in secrets], VOCAB, [EOS])
    print(f"wrote {a.out_dir}/sft.h5 ({len(docs)} games) and {a.out_dir}/prompts.h5 ({len(secrets)} prompts)")


if __name__ == "__main__":
    main()
