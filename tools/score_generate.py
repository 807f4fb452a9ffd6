#!/usr/bin/env python3
"""score_generate.py — accuracy of `shardlm generate` on a prompt file with answers.

A sample is right when its ids, less a final stop id, written in decimal and
separated by spaces, equal the prompt's 'answer' (what `rollout.reward = "regex"`
with `^{answer}$` scores without a tokenizer). Prints one line:
"accuracy A (R of S samples), ..." and, with --json, writes the numbers. With
several samples per prompt (`shardlm generate --n K`) it adds pass@K, the
fraction of prompts with a right sample among their K (what an RL job's
eval.samples = K logs as eval_pass_at_k; its pass@1 is the accuracy).

    /usr/bin/python3 tools/score_generate.py OUT.h5 PROMPTS.h5 [--json FILE] [--label NAME]
"""

import argparse
import json

import h5py
import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("prompts")
    p.add_argument("--json", default="")
    p.add_argument("--label", default="")
    a = p.parse_args()
    with h5py.File(a.prompts) as f:
        answers = [x.decode() if isinstance(x, bytes) else str(x) for x in f["answer"][()]]
        stops = set(int(s) for s in f.attrs.get("stop_token_ids", []))
    with h5py.File(a.out) as f:
        toks, offs, index = f["tokens"][()], f["offsets"][()], f["prompt_index"][()]
    right, lengths, per_prompt = 0, [], {}
    for s in range(len(offs) - 1):
        ids = list(toks[offs[s]:offs[s + 1]])
        if ids and int(ids[-1]) in stops:
            ids = ids[:-1]
        lengths.append(len(ids))
        ok = " ".join(str(int(t)) for t in ids) == answers[int(index[s])]
        right += ok
        per_prompt.setdefault(int(index[s]), []).append(ok)
    n = len(offs) - 1
    result = dict(label=a.label, accuracy=right / max(n, 1), right=right, samples=n,
                  mean_length=float(np.mean(lengths)) if lengths else 0.0)
    k = max((len(v) for v in per_prompt.values()), default=1)
    pass_text = ""
    if k > 1:
        any_right = sum(any(v) for v in per_prompt.values())
        result.update(k=k, prompts=len(per_prompt), prompts_right=any_right,
                      pass_at_k=any_right / max(len(per_prompt), 1))
        pass_text = f", pass@{k} {result['pass_at_k']:.4f} ({any_right} of {len(per_prompt)} prompts)"
    print(f"{a.label + ': ' if a.label else ''}accuracy {result['accuracy']:.4f} ({right} of {n} samples){pass_text}, "
          f"mean answer length {result['mean_length']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
