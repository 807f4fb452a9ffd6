#!/usr/bin/env python3
"""rl_long_report.py — the numbers of tools/bench_rl_long.sh: for each run (sync,
async2), held-out greedy accuracy before and after RL, the reward and held-out
curves (eval during the run), the staleness histogram, where the time goes on
both sides, wall-clock per step and the idle fractions; a plot with --plot.

    python3 tools/rl_long_report.py WORK_DIR [--sft-steps N] [--plot docs/images/rl-long.png]

Reads WORK_DIR/runs.tsv (name, deck keys, the job's seconds), heldout-before.json,
heldout-NAME.json and each run's rl-NAME/{rollouts,metrics,eval}.jsonl.
"""

import argparse
import json
import os

from run_metrics import jsonl_rows


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def load_run(work, name, keys, seconds):
    d = os.path.join(work, f"rl-{name}")
    ro = jsonl_rows(os.path.join(d, "rollouts.jsonl"))
    tm = [r for r in jsonl_rows(os.path.join(d, "metrics.jsonl")) if "step_time_s" in r]
    ev = jsonl_rows(os.path.join(d, "eval.jsonl"))
    stale = {}
    for r in ro:
        for k, v in r.items():
            if k.startswith("staleness_"):
                stale[int(k.split("_")[1])] = stale.get(int(k.split("_")[1]), 0.0) + v * r["samples"]
    return dict(name=name, keys=keys, seconds=seconds, ro=ro, tm=tm, ev=ev, stale=stale,
                after=json.load(open(os.path.join(work, f"heldout-{name}.json"))))


def report(run, before):
    ro, tm, ev = run["ro"], run["tm"], run["ev"]
    steps = len(tm)
    rew = [r["reward_mean"] for r in ro]
    n = min(5, len(rew))
    out = [f"### {run['name']} ({run['keys']})",
           f"- held-out greedy accuracy {before['accuracy']:.3f} -> {run['after']['accuracy']:.3f} "
           f"({run['after']['right']} of {run['after']['samples']}); training reward (lines right before the first slip, temperature 1) first {n} steps "
           f"{mean(rew[:n]):.3f}, last {n} {mean(rew[-n:]):.3f}; mean response length "
           f"{mean([r['response_length_mean'] for r in ro]):.0f} tokens (longest {max([r['response_length_max'] for r in ro] or [0]):.0f})"]
    if ev:
        curve = ", ".join(f"{int(e['eval_policy_step'])}: {e['eval_accuracy']:.3f}"
                          + (f" (pass@{int(e['eval_samples'])} {e['eval_pass_at_k']:.3f})" if e.get("eval_samples") else "")
                          for e in ev)
        out.append(f"- eval during the run (policy step: greedy accuracy): {curve}")
    total = sum(run["stale"].values())
    if total:
        hist = ", ".join(f"{k} steps old {100 * v / total:.1f}%" for k, v in sorted(run["stale"].items()))
        out.append(f"- staleness of the samples trained on (their oldest token): {hist}")
    if tm:
        wall = run["seconds"] / max(steps, 1)
        out.append(f"- trainer: {steps} steps, {mean([r['step_time_s'] for r in tm]):.2f} s a step "
                   f"(job wall clock {run['seconds']:.0f} s, {wall:.2f} s a step, start-up included); idle waiting "
                   f"for rollouts {100 * mean([r.get('rollout_wait_fraction', 0) for r in tm]):.1f}% of its time")
    if ro:
        sampling = sum(r.get("sampling_s", 0) for r in ro)
        tokens = sum(r.get("generated_tokens", 0) for r in ro)
        out.append(f"- inference rank: sampling {sampling:.1f} s ({tokens / max(sampling, 1e-9):.0f} tokens/s, "
                   f"{tokens / 1e6:.2f} M tokens), rewards {sum(r.get('reward_s', 0) for r in ro):.1f} s, waiting for "
                   f"weights {sum(r.get('weights_wait_s', 0) for r in ro):.1f} s = "
                   f"{100 * mean([r.get('sampler_wait_fraction', 0) for r in ro]):.1f}% idle; weights taken mid-step "
                   f"{sum(r.get('in_flight_updates', 0) for r in ro):.0f} times")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work")
    p.add_argument("--sft-steps", type=int, default=0)
    p.add_argument("--plot", default="")
    a = p.parse_args()
    before = json.load(open(os.path.join(a.work, "heldout-before.json")))
    runs = []
    for line in open(os.path.join(a.work, "runs.tsv")):
        name, keys, seconds = line.rstrip("\n").split("\t")
        runs.append(load_run(a.work, name, keys, float(seconds)))
    print(f"SFT warm start: {a.sft_steps} steps, held-out greedy accuracy {before['accuracy']:.3f} "
          f"({before['right']} of {before['samples']})\n")
    for run in runs:
        print(report(run, before) + "\n")
    if len(runs) > 1 and all(r["tm"] for r in runs):
        base = runs[0]["seconds"] / len(runs[0]["tm"])
        print("| run | wall clock a step | vs " + runs[0]["name"] + " | trainer idle | sampler idle |")
        print("|---|---|---|---|---|")
        for r in runs:
            per = r["seconds"] / len(r["tm"])
            print(f"| {r['name']} | {per:.2f} s | {base / per:.2f}x | "
                  f"{100 * mean([m.get('rollout_wait_fraction', 0) for m in r['tm']]):.1f}% | "
                  f"{100 * mean([m.get('sampler_wait_fraction', 0) for m in r['ro']]):.1f}% |")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (left, mid, right) = plt.subplots(1, 3, figsize=(13, 4))
        for run in runs:
            left.plot([r["step"] for r in run["ro"]], [r["reward_mean"] for r in run["ro"]], label=run["name"])
            if run["ev"]:
                mid.plot([e["eval_policy_step"] for e in run["ev"]], [e["eval_accuracy"] for e in run["ev"]],
                         marker="o", label=f"{run['name']} greedy")
                if run["ev"][0].get("eval_samples"):
                    mid.plot([e["eval_policy_step"] for e in run["ev"]], [e["eval_pass_at_k"] for e in run["ev"]],
                             ls="--", label=f"{run['name']} pass@{int(run['ev'][0]['eval_samples'])}")
        width = 0.8 / max(len(runs), 1)
        for i, run in enumerate(runs):
            total = sum(run["stale"].values()) or 1
            ks = sorted(run["stale"])
            right.bar([k + (i - (len(runs) - 1) / 2) * width for k in ks], [run["stale"][k] / total for k in ks], width,
                      label=run["name"])
        oldest = max((k for run in runs for k in run["stale"]), default=0)
        right.set_xticks(range(oldest + 1))
        left.set(xlabel="RL step", ylabel="mean reward: lines right (temperature 1)", ylim=(0, 1), title="training reward")
        mid.set(xlabel="policy step", ylabel="held-out", ylim=(0, 1), title="eval during the run")
        right.set(xlabel="steps old (oldest token)", ylabel="fraction of samples", title="staleness")
        for ax in (left, mid, right):
            ax.legend(fontsize=8)
        fig.suptitle("chain task (answers of 106-981 tokens), 25 M Llama-shaped model, trainer + inference rank on one GPU")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
