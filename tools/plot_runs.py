#!/usr/bin/env python3
"""plot_runs.py — PNGs of shardlm runs: loss, lr, grad norm, tokens/s and memory over steps.

    /usr/bin/python3 tools/plot_runs.py runs/tiny-sft                  # -> runs/tiny-sft/plots/*.png
    /usr/bin/python3 tools/plot_runs.py runs/sweep/task-* --out plots  # the runs overlaid

Writes loss.png, lr.png, grad_norm.png, tokens_per_s.png, memory.png (host peak,
and GPU peak where the run logged one), for RL runs reward.png (the mean reward of
the rollouts each step trained on, and each reward component's mean when there
are several: metrics.jsonl's rollout_reward_*) and overview.png (all of them). Several runs
share each plot, labelled by run.name and the deck keys that differ between them;
a dotted line marks each resume. --x tokens or --x time puts tokens seen or wall
time (hours since the first row) on the x axis instead of steps. NaN/Inf losses
(null in metrics.jsonl) leave gaps. Needs matplotlib (Debian: python3-matplotlib).
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_metrics  # noqa: E402

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    raise SystemExit("plot_runs.py needs matplotlib: apt-get install python3-matplotlib (or pip install matplotlib)")

MIB = 1024.0 * 1024.0
# (file name, title, y label, [(row key, scale, line style, legend suffix)])
PANELS = [
    ("loss", "loss", "loss (mean NLL per loss token)", [("loss", 1.0, "-", "")]),
    ("lr", "learning rate", "lr", [("lr", 1.0, "-", "")]),
    ("grad_norm", "gradient norm (before clipping)", "grad norm", [("grad_norm", 1.0, "-", "")]),
    ("tokens_per_s", "throughput", "tokens/s (all ranks)", [("tokens_per_s", 1.0, "-", "")]),
    ("memory", "peak memory on rank 0", "MiB",
     [("mem_peak_bytes", 1.0 / MIB, "-", " host"), ("device_mem_peak_bytes", 1.0 / MIB, "--", " GPU")]),
    ("reward", "RL: mean reward of the step's rollouts", "reward",
     [("rollout_reward_mean", 1.0, "-", "")] +
     [(f"rollout_reward_{kind}", 1.0, "--", f" {kind}") for kind in ("exact", "numeric", "regex", "program")]),
]
# Panels drawn only when some run has their first series (RL runs have a reward).
OPTIONAL = {"reward"}


def x_values(run, axis):
    if axis == "step":
        return [r["step"] for r in run.rows]
    if axis == "tokens":
        return [run_metrics.number(r.get("tokens")) for r in run.rows]
    t0 = next((r["time"] for r in run.rows if isinstance(r.get("time"), (int, float))), 0.0)
    return [(run_metrics.number(r.get("time")) - t0) / 3600.0 for r in run.rows]


def draw(ax, runs, labels, colors, panel, axis):
    _, title, ylabel, series = panel
    points = 0
    for run, label, color in zip(runs, labels, colors):
        xs = x_values(run, axis)
        drawn = []
        for key, scale, style, suffix in series:
            ys = [run_metrics.number(r.get(key)) * scale for r in run.rows]
            # a series equal to one already drawn (one reward component = the mean) adds nothing
            if not any(math.isfinite(y) for y in ys) or ys in drawn:
                continue
            drawn.append(ys)
            ax.plot(xs, ys, style, color=color, linewidth=1.2, label=label + suffix)
            points += sum(1 for y in ys if math.isfinite(y))
        if axis == "step":
            for s in run.resume_steps():
                ax.axvline(s, color=color, linestyle=":", linewidth=0.8)
    ax.set_title(title)
    ax.set_xlabel({"step": "step", "tokens": "tokens seen", "time": "hours"}[axis])
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if points:
        ax.legend(fontsize="small")
    return points


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", help="directory for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)")
    parser.add_argument("--x", choices=("step", "tokens", "time"), default="step", help="the x axis (step)")
    args = parser.parse_args()

    runs = [run_metrics.Run(p) for p in args.runs]
    empty = [r.path for r in runs if not r.rows]
    if empty:
        raise SystemExit(f"no step rows in {', '.join(empty)} (metrics.jsonl missing or empty)")
    out = args.out or (os.path.join(runs[0].path, "plots") if len(runs) == 1 else "plots")
    os.makedirs(out, exist_ok=True)
    keys = run_metrics.differing_keys(runs)
    labels = [run_metrics.label(r, keys) for r in runs]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]

    def present(panel):
        key = panel[3][0][0]
        return panel[0] not in OPTIONAL or any(key in r for run in runs for r in run.rows)

    panels = [p for p in PANELS if present(p)]
    for panel in panels:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        points = draw(ax, runs, labels, colors, panel, args.x)
        fig.tight_layout()
        path = os.path.join(out, panel[0] + ".png")
        fig.savefig(path)
        plt.close(fig)
        print(f"plot_runs: wrote {path} ({len(runs)} run{'s' if len(runs) != 1 else ''}, {points} points)")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), dpi=80)
    for ax, panel in zip(axes.flat, panels):
        draw(ax, runs, labels, colors, panel, args.x)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path = os.path.join(out, "overview.png")
    fig.savefig(path)
    plt.close(fig)
    print(f"plot_runs: wrote {path}")


if __name__ == "__main__":
    main()
