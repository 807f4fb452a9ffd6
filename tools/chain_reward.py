#!/usr/bin/env python3
"""chain_reward.py — a reward program (rollout.reward_program; docs/rl.md "A
reward program") for tools/make_chain_task.py's problems: the share of the
answer's lines written right before the first slip, so that a completion that
gets further down the chain scores higher. 1 only for the whole answer exact
and then EOS; an answer line counts when its 7 ids (countdown, term, SEP) equal
the reference's at the same place.

    rollout.reward_program = "python3 tools/chain_reward.py"
    eval.correct_above = 0.999          (correct = the whole answer exact)
"""

import json
import sys

SEP, EOS = 10, 13


def lines(ids):
    out, cur = [], []
    for t in ids:
        cur.append(t)
        if t == SEP:
            out.append(cur)
            cur = []
    return out, cur


def score(completion_ids, answer):
    want, _ = lines([int(x) for x in answer.split()])
    got, rest = lines(completion_ids)
    right = 0
    for g, w in zip(got, want):
        if g != w:
            break
        right += 1
    if right == len(want) and len(got) == len(want) and rest == [EOS]:
        return 1.0
    return min(right, len(want) - 1) / len(want)


def main():
    for line in sys.stdin:
        m = json.loads(line)
        print(score(m["completion_ids"], m["answer"]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
