#!/usr/bin/env python3
"""rl_arith_report.py — the numbers of tools/bench_rl_arith.sh's run: held-out accuracy
before and after RL, the reward curve, where the time goes; a plot with --plot.

    python3 tools/rl_arith_report.py WORK_DIR --rl-seconds S --sft-steps N [--plot docs/images/rl-arith.png]
"""

import argparse
import json
import os
import re


def rows(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work")
    p.add_argument("--rl-seconds", type=float, default=0.0)
    p.add_argument("--sft-steps", type=int, default=0)
    p.add_argument("--plot", default="")
    a = p.parse_args()
    before = json.load(open(os.path.join(a.work, "heldout-before.json")))
    after = json.load(open(os.path.join(a.work, "heldout-after.json")))
    ro = rows(os.path.join(a.work, "rl", "rollouts.jsonl"))
    tm = [r for r in rows(os.path.join(a.work, "rl", "metrics.jsonl")) if "step_time_s" in r]
    rew = [r["reward_mean"] for r in ro]
    n5, n10 = min(5, len(rew)), min(10, len(rew))
    print(f"held-out greedy accuracy: before RL {before['accuracy']:.3f} ({before['right']} of {before['samples']}), "
          f"after RL {after['accuracy']:.3f} ({after['right']} of {after['samples']}): "
          f"{100 * (after['accuracy'] - before['accuracy']):+.1f} points; SFT warm start {a.sft_steps} steps")
    print(f"training reward (sampled, temperature 1): first {n5} steps {sum(rew[:n5]) / max(n5, 1):.3f}, "
          f"last {n10} {sum(rew[-n10:]) / max(n10, 1):.3f}, over {len(rew)} steps")
    sampling = sum(r.get("sampling_s", 0) for r in ro)
    reward = sum(r.get("reward_s", 0) for r in ro)
    waiting = sum(r.get("weights_wait_s", 0) for r in ro)
    tokens = sum(r.get("generated_tokens", 0) for r in ro)
    print(f"inference rank: sampling {sampling:.1f} s ({tokens / max(sampling, 1e-9):.0f} tokens/s), rewards "
          f"{reward:.1f} s, waiting for weights {waiting:.1f} s; the job {a.rl_seconds:.1f} s for {len(ro)} steps")
    if tm:
        step = sum(r["step_time_s"] for r in tm) / len(tm)
        wait = sum(r.get("rollout_wait_s", 0) for r in tm) / len(tm)
        print(f"trainer (mean over {len(tm)} logged steps): step {step:.3f} s, of which waiting for rollouts "
              f"{wait:.3f} s")
    # The weight broadcast's phases: each receive line of the inference rank, and the trainer's summary.
    log = os.path.join(a.work, "rl.log")
    if os.path.isfile(log):
        text = open(log).read()
        phases = re.findall(r"^receive\[0\]: step \d+: .* in ([0-9.]+) ms \(.*?\) \(transfer ([0-9.]+), "
                            r"(?:to host ([0-9.]+), )?check ([0-9.]+), load ([0-9.]+) ms\)", text, re.M)
        if phases:
            mean = [sum(float(p[i] or 0) for p in phases) / len(phases) for i in range(5)]
            print(f"weights received ({len(phases)} times), mean {mean[0]:.1f} ms: transfer {mean[1]:.1f} (with the "
                  f"sender's gather), to host {mean[2]:.1f}, checksums {mean[3]:.1f}, into the model {mean[4]:.1f} ms")
        sent = re.search(r"^broadcast: \d+ sends.*$", text, re.M)
        if sent:
            print(f"trainer: {sent.group(0)}")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(range(len(rew)), rew, label="mean reward of the step's samples (temperature 1)")
        ax.axhline(before["accuracy"], color="gray", ls="--", label=f"held-out greedy before RL {before['accuracy']:.2f}")
        ax.axhline(after["accuracy"], color="green", ls="--", label=f"held-out greedy after RL {after['accuracy']:.2f}")
        ax.set_xlabel("RL step")
        ax.set_ylabel("reward / accuracy")
        ax.set_ylim(0, 1)
        ax.set_title("a + b, 0.97 B Llama-shaped model, trainer + inference rank on one H200")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
