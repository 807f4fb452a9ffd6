#!/usr/bin/env python3
"""rl_objectives_report.py — the learning table of tools/bench_rl_objectives.sh: per RL loss
variant, its deck keys, held-out greedy accuracy before and after, the training reward over
the first and last 10 steps and the RL job's wall time; the reward curves in one plot.

Reads WORK_DIR/variants.tsv (name, deck keys, seconds: one line per variant run),
WORK_DIR/heldout-before.json, WORK_DIR/heldout-NAME.json (tools/score_generate.py) and
WORK_DIR/rl-NAME/rollouts.jsonl (reward_mean per rollout step).

    python3 tools/rl_objectives_report.py WORK_DIR [--sft-steps N] [--rl-steps N] [--plot docs/images/rl-objectives.png]
"""

import argparse
import json
import os
import re

from run_metrics import jsonl_rows

EDGE = 10  # steps averaged at each end of the reward curve
SMOOTH = 5  # moving-average window of the plotted curves
NOTES = {  # why a variant's keys are what they are
    "gspo": "gspo: the sample's ratio clipped at 0.2 / 0.28, not GSPO's paper's 3e-4 / 4e-4: on completions of 1-4 "
            "tokens the train/inference mismatch alone passes those (docs/rl.md \"The policy term\").",
    "cispo": "cispo: clip_low = 1 is no lower bound on the weight (MiniMax-M1's setting).",
    "dr_grpo": "dr_grpo: the summed loss over max_new_tokens x prompts_per_step x n, advantages not divided by "
               "the group's std (docs/rl.md \"Aggregation\").",
    "dapo": "dapo: groups with equal rewards dropped and redrawn; completions cut at max_new_tokens carry no loss "
            "(the soft overlong penalty would punish every right three-digit answer, whose EOS is the budget's "
            "fourth token).",
}


def load(path):
    return json.load(open(path)) if os.path.isfile(path) else None


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def resolved(work, name, key):
    """`key`'s value in the run's resolved deck (<run.dir>/config.toml), or None."""
    path = os.path.join(work, f"rl-{name}", "config.toml")
    found = re.search(rf"^{key} = (\S+)", open(path).read(), re.M) if os.path.isfile(path) else None
    return found.group(1) if found else None


def moving_average(xs, window):
    """Trailing mean over up to `window` values, as long as xs (the first points average fewer)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        out.append(total / min(i + 1, window))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work")
    p.add_argument("--sft-steps", type=int, default=0)
    p.add_argument("--rl-steps", type=int, default=0)
    p.add_argument("--plot", default="")
    a = p.parse_args()
    before = load(os.path.join(a.work, "heldout-before.json"))
    variants = []
    for line in open(os.path.join(a.work, "variants.tsv")):
        if line.strip():
            name, keys, seconds = line.rstrip("\n").split("\t")
            variants.append(dict(name=name, keys=keys, seconds=float(seconds),
                                 after=load(os.path.join(a.work, f"heldout-{name}.json")),
                                 reward=[r["reward_mean"]
                                         for r in jsonl_rows(os.path.join(a.work, f"rl-{name}", "rollouts.jsonl"))
                                         if "reward_mean" in r]))

    print(f"RL losses from one SFT warm start ({a.sft_steps} SFT steps, held-out greedy accuracy "
          f"{before['accuracy']:.3f}, {before['right']} of {before['samples']}), {a.rl_steps} RL steps each, "
          f"deck inputs/bench/arith-rl.toml less its clip bounds, plus:\n")
    print(f"| variant | deck overrides | held-out accuracy before -> after | reward first {EDGE} -> last {EDGE} steps "
          f"| RL wall s |")
    print("| --- | --- | --- | --- | --- |")
    for v in variants:
        keys = " ".join(f"`{k}`" for k in v["keys"].split())
        divisor = resolved(a.work, v["name"], "normalize_constant")
        if 'loss.normalize="constant"' in v["keys"] and divisor:
            keys += f" (divisor {float(divisor):g})"
        if v["after"]:
            acc = (f"{before['accuracy']:.3f} -> {v['after']['accuracy']:.3f} "
                   f"({100 * (v['after']['accuracy'] - before['accuracy']):+.1f})")
        else:
            acc = f"{before['accuracy']:.3f} -> failed"
        rew = v["reward"]
        n = min(EDGE, len(rew))
        reward = f"{mean(rew[:n]):.3f} -> {mean(rew[-n:]):.3f}" if rew else "none"
        print(f"| {v['name']} | {keys} | {acc} | {reward} | {v['seconds']:.1f} |")
    print()
    for v in variants:
        if v["name"] in NOTES:
            print(f"- {NOTES[v['name']]}")
    print(f"- Held-out: greedy answers to the 1,000 problems kept out of SFT and RL (tools/score_generate.py). "
          f"Reward: the mean over each step's samples at temperature 1 (every sample drawn, dropped groups of "
          f"dynamic sampling included), from rl-NAME/rollouts.jsonl. RL wall s: the whole job, start-up and the "
          f"final export included.")

    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, v in enumerate(variants):
            if not v["reward"]:
                continue
            color = f"C{i}"
            steps = range(1, len(v["reward"]) + 1)
            after = f", held-out {v['after']['accuracy']:.2f}" if v["after"] else ", failed"
            ax.plot(steps, v["reward"], color=color, alpha=0.2, lw=0.8)
            ax.plot(steps, moving_average(v["reward"], SMOOTH), color=color, lw=1.6, label=v["name"] + after)
        ax.axhline(before["accuracy"], color="gray", ls="--", lw=1,
                   label=f"held-out greedy at the warm start {before['accuracy']:.2f}")
        ax.set_xlabel("RL step")
        ax.set_ylabel(f"mean reward of the step's samples (T = 1), {SMOOTH}-step mean")
        ax.set_ylim(0, 1)
        ax.set_title(f"a + b: RL losses from one SFT warm start ({a.sft_steps} SFT steps)", fontsize=10)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
        fig.savefig(a.plot, dpi=110)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
