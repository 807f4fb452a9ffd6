#!/usr/bin/env python3
"""summarize_runs.py — one table of shardlm runs, best first.

    tools/summarize_runs.py runs/sweep/task-*            # aligned text
    tools/summarize_runs.py --csv runs/a runs/b > runs.csv
    tools/summarize_runs.py --markdown runs/*

Columns: the run (run.name, then its directory), every deck key whose value
differs between the runs (from each run's config.toml), steps done / run.max_steps,
status (running, done, stopped, checkpoint_failed, crashed), final, min and
smoothed loss (the mean over the last --window logged steps), tokens/s and MFU
(medians over the logged steps, leaving out the first after each start); for RL
runs also the mean reward of the rollouts trained on (metrics.jsonl's
rollout_reward_mean): at the last logged step, smoothed over --window, and
sampling tokens/s (median). Rows
are sorted by smoothed loss, lowest first; runs without a finite loss go last.
Reads metrics.jsonl as docs/metrics.md describes it; needs only the standard library.
"""

import argparse
import csv
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_metrics  # noqa: E402


def summarize(runs, window):
    keys = run_metrics.differing_keys(runs)
    table = []
    for run in runs:
        _, losses = run.series("loss")
        finite = [v for v in losses if math.isfinite(v)]
        mfu = run_metrics.steady_median(run, "mfu")
        table.append({
            "run": run.name,
            "dir": run.path,
            **{k: run_metrics.format_value(run.deck.get(k)) for k in keys},
            "steps": f"{run.last_step()}/{run.max_steps() if run.max_steps() is not None else '?'}",
            "status": run.status(),
            "final_loss": losses[-1] if losses else math.nan,
            "min_loss": min(finite) if finite else math.nan,
            "smoothed_loss": run_metrics.smoothed(losses, window),
            "tokens_per_s": run_metrics.steady_median(run, "tokens_per_s"),
            "mfu_pct": 100.0 * mfu if math.isfinite(mfu) else math.nan,
        })
        _, rewards = run.series("rollout_reward_mean")
        table[-1].update({
            "final_reward": rewards[-1] if rewards else math.nan,
            "smoothed_reward": run_metrics.smoothed(rewards, window),
            "sampling_tokens_per_s": run_metrics.steady_median(run, "rollout_sampling_tokens_per_s"),
        })
    table.sort(key=lambda r: (not math.isfinite(r["smoothed_loss"]), r["smoothed_loss"]))
    return keys, table


def cell(v):
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="comma-separated values (full precision)")
    fmt.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument("--window", type=int, default=10, help="logged steps the smoothed loss averages (10)")
    args = parser.parse_args()
    if args.window < 1:
        parser.error("--window must be at least 1")

    runs = [run_metrics.Run(p) for p in args.runs]
    keys, table = summarize(runs, args.window)
    columns = ["run", "dir", *keys, "steps", "status", "final_loss", "min_loss", "smoothed_loss", "tokens_per_s",
               "mfu_pct"]
    if any(math.isfinite(row["final_reward"]) for row in table):  # RL runs: the reward beside the loss
        columns += ["final_reward", "smoothed_reward", "sampling_tokens_per_s"]
    if args.csv:
        out = csv.writer(sys.stdout)
        out.writerow(columns)
        for row in table:
            out.writerow(["" if isinstance(row[c], float) and not math.isfinite(row[c]) else row[c] for c in columns])
        return
    text = [[cell(row[c]) for c in columns] for row in table]
    if args.markdown:
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join("---" if c in ("run", "dir", "status", *keys) else "---:" for c in columns) + "|")
        for row in text:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in text:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    for run in runs:
        if run.bad_lines:
            print(f"note: {run.metrics_path()}: {run.bad_lines} unreadable line(s) skipped", file=sys.stderr)


if __name__ == "__main__":
    main()
