#!/usr/bin/env python3
"""guess.py — the environment of tools/make_guess_task.py's game (env.program;
docs/rl.md "Environments"): the policy guesses a secret digit, one [digit, EOS]
a turn; the environment answers [HIGHER] or [LOWER] until it is right.

Each episode ends with
    reward   1 for a right guess within max_turns, else 0
    metrics  "guesses" (turns played), "invalid" (1 when a turn was not one digit
             and EOS: the episode ends there with reward 0), "inconsistent"
             (guesses outside the range the replies left possible)

    env.program = "python3 tools/envs/guess.py --max-turns 4"

--max-turns should equal the deck's rollout.max_turns (the deck's ends the episode
at its own).
"""

import argparse
import json
import sys

HIGHER, LOWER, EOS, DIGITS = 13, 14, 12, 10


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-turns", type=int, default=4)
    a = p.parse_args()
    games = {}  # episode -> [lo, hi, inconsistent]
    for line in sys.stdin:
        m = json.loads(line)
        episode, ids, turn = m["episode"], m["ids"], m["turn"]
        lo, hi, inconsistent = games.pop(episode, [0, DIGITS - 1, 0])
        valid = len(ids) == 2 and 0 <= ids[0] < DIGITS and ids[1] == EOS
        answer = {"episode": episode}
        if valid:
            guess, secret = ids[0], int(m["answer"])
            inconsistent += not lo <= guess <= hi
            if guess == secret:
                answer["reward"] = 1.0
            elif not m.get("end") and turn < a.max_turns:
                lo, hi = (max(lo, guess + 1), hi) if secret > guess else (lo, min(hi, guess - 1))
                games[episode] = [lo, hi, inconsistent]
                answer["observation"] = [HIGHER if secret > guess else LOWER]
            else:
                answer["reward"] = 0.0
        else:
            answer["reward"] = 0.0
        if "reward" in answer:
            answer["metrics"] = {"guesses": turn, "invalid": int(not valid), "inconsistent": inconsistent}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
