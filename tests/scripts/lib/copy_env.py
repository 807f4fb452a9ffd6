#!/usr/bin/env python3
"""copy_env.py — an environment program for the copy task (tools/make_copy_task.py)
over two turns, for tests/scripts/test_rl_env.sh: after the policy's first turn
it shows one more digit, (the first turn's first id + 1) mod 10, then SEP; the
episode's reward is 1 when the second turn starts with that digit, else 0 (and
0 for an episode the policy ended). A fault, when asked for as the first
argument, on the first message: crash (exit 3), hang, badjson, wrongepisode,
badmetrics (a reward whose metrics are not named numbers);
crash-after:N exits 3 on the message after N answered ones.
With COPY_ENV_LOG set, each message's episode, prompt, turn, eval flag and
metadata are appended to that file (a line of JSON each).

    python3 copy_env.py [crash|hang|badjson|wrongepisode|badmetrics|crash-after:N]
"""

import json
import os
import sys
import time

SEP = 11
fault = sys.argv[1] if len(sys.argv) > 1 else ""
crash_after = int(fault.split(":")[1]) if fault.startswith("crash-after:") else -1
shown = {}
for answered, line in enumerate(sys.stdin):
    m = json.loads(line)
    episode, ids = m["episode"], m["ids"]
    if os.environ.get("COPY_ENV_LOG"):
        with open(os.environ["COPY_ENV_LOG"], "a") as log:
            log.write(json.dumps({"episode": episode, "prompt": m["prompt"], "eval": m.get("eval", False),
                                  "turn": m["turn"], "metadata": m.get("metadata")}) + "\n")
    if fault == "crash" or answered == crash_after:
        sys.exit(3)
    if fault == "hang":
        time.sleep(60)
    if fault == "badjson":
        print("not json", flush=True)
        continue
    if fault == "badmetrics":
        print(json.dumps({"episode": episode, "reward": 0, "metrics": {"tool calls": 1}}), flush=True)
        continue
    if fault == "wrongepisode":
        print(json.dumps({"episode": episode + "0", "reward": 0}), flush=True)
        continue
    if m.get("end") or m["turn"] >= 2:
        want = shown.pop(episode, None)
        reward = 1.0 if not m.get("end") and want is not None and ids and ids[0] == want else 0.0
        print(json.dumps({"episode": episode, "reward": reward}), flush=True)
    else:
        shown[episode] = ((ids[0] if ids else 0) + 1) % 10
        print(json.dumps({"episode": episode, "observation": [shown[episode], SEP]}), flush=True)
