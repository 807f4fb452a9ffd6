#!/usr/bin/env python3
"""plot_fidelity.py — the curves of tools/fidelity_vs_hf.py's losses.json as a figure: each curve's
relative loss difference to transformers eager, step by step (top), and the losses (bottom, log
scale), with the windows of the fidelity test (tools/fidelity_vs_hf.py) shaded.

  /usr/bin/python3 tools/plot_fidelity.py runs/fid-qwen3-150/losses.json docs/images/fidelity-qwen3.png \
      --title "Qwen3-1.7B shape, 150 steps"
  /usr/bin/python3 tools/plot_fidelity.py runs/fp8-1b/losses.json docs/images/fp8-1b-1000.png \
      --reference bf16 --windows "" --title "..."   (tools/fp8_vs_bf16.py's curves)

Needs matplotlib (Debian's python3-matplotlib: /usr/bin/python3 here).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WINDOWS = "11-20,41-65"  # shaded: every other window of the fidelity test (1–10, 21–40 and 66–90 unshaded)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("losses")
    ap.add_argument("out")
    ap.add_argument("--title", default="")
    ap.add_argument("--reference", default="transformers eager")
    ap.add_argument("--windows", default=WINDOWS, help="step ranges to shade, A-B,C-D ('' for none)")
    args = ap.parse_args()
    with open(args.losses) as f:
        curves = json.load(f)
    if args.reference not in curves:
        raise SystemExit(f"plot_fidelity.py: {args.losses} has no curve '{args.reference}' "
                         f"(it has: {', '.join(curves)})")
    ref = curves[args.reference]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[3, 2])
    for name, losses in curves.items():
        steps = range(1, len(losses) + 1)
        style = "--" if name.startswith("transformers") else "-"
        if name != args.reference:
            top.plot(steps, [a / b - 1 for a, b in zip(losses, ref)], style, lw=1.2, label=name)
        bottom.plot(steps, losses, style, lw=1.2, label=name)
    for a, b in ([int(x) for x in w.split("-")] for w in args.windows.split(",") if w):
        for ax in (top, bottom):
            ax.axvspan(a - 0.5, b + 0.5, color="0.92", zorder=0)
    top.axhline(0, color="0.3", lw=0.8)
    top.set_ylabel(f"loss / {args.reference} − 1")
    top.legend(fontsize=8, ncol=2)
    top.grid(alpha=0.3)
    bottom.set_yscale("log")
    bottom.set_ylabel("training loss")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3, which="both")
    if args.title:
        top.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_fidelity.py: wrote {args.out} ({len(curves)} curves, {len(ref)} steps)")


if __name__ == "__main__":
    main()
