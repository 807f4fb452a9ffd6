#!/usr/bin/env python3
"""fp8_vs_bf16.py — the FP8 loss test: shardlm with `model.fp8` against bf16 on the same model,
learnable data and order, one call on the GPU machine.

  1. the model and data of tools/fidelity_vs_hf.py (--shape llama-1b | qwen3-1.7b, random init by
     transformers, seed 0; Zipf words of random ids), --docs documents so that --steps x --rows rows
     pass over it at most a few times;
  2. shardlm train twice, rows in file order: `model.fp8 = "none"` (bf16) and `model.fp8 = MODE`,
     AdamW as fidelity_vs_hf.py, lr --lr with --warmup steps of linear warmup then constant;
  3. per window of --window steps, the mean relative loss difference fp8 - bf16 (and its max |.|);
     the last 100 steps' mean losses; loss spikes of each curve (a step more than --spike above the
     median of the 20 before it) and whether the other curve rises by at least half that within 5
     steps of it (a threshold with hysteresis: a hard batch lifts both);
  4. the verdict of the FP8 loss test: the last 100 steps agree within 1% relative, and neither
     spikes where the other does not. losses.json keeps both curves.

  python3 tools/fp8_vs_bf16.py --shardlm build/shardlm --shape llama-1b --steps 1000 --out runs/fp8-1b
  python3 tools/fp8_vs_bf16.py ... --mode rowwise
  python3 tools/fp8_vs_bf16.py ... --fp8-attention          (the FP8 run with model.fp8_attention too)
  python3 tools/fp8_vs_bf16.py ... --mode none --fp8-attention   (FP8 attention alone against bf16)
  python3 tools/fp8_vs_bf16.py --model tests/fixtures/llama-gqa-tied --device cpu --seq 32 --steps 60 ...
      (a check of the script on the CPU)

Needs h5py and numpy; torch and transformers only to make --shape's model (not with --model).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fidelity_vs_hf as F  # noqa: E402

SPIKE_WINDOW = 20   # a spike: above the median of this many steps before it ...
SPIKE_MATCH = 5     # ... and matched when the other curve rises within this many steps ...
MATCH_FRACTION = 0.5  # ... by at least this fraction of the spike threshold (hysteresis)


def excess(losses):
    """Each step's loss relative to the median of the SPIKE_WINDOW steps before it, minus 1
    (0 for the first SPIKE_WINDOW steps)."""
    x = np.zeros(len(losses))
    for i in range(SPIKE_WINDOW, len(losses)):
        x[i] = losses[i] / float(np.median(losses[i - SPIKE_WINDOW:i])) - 1
    return x


def spikes(losses, rise):
    """Steps (1-based) whose loss is more than `rise` (relative) above the median of the
    SPIKE_WINDOW steps before them."""
    return [i + 1 for i, e in enumerate(excess(losses)) if e > rise]


def unmatched(mine, theirs, rise):
    """Spike steps of the curve `mine` where the curve `theirs` does not rise by MATCH_FRACTION of
    `rise` within SPIKE_MATCH steps. A threshold with hysteresis: the same hard batch lifts both
    curves, one to 5.2% and the other to 4.9%, and that is one spike in both, not a spike in one."""
    ex = excess(theirs)
    return [s for s in spikes(mine, rise)
            if ex[max(0, s - 1 - SPIKE_MATCH):s + SPIKE_MATCH].max() <= MATCH_FRACTION * rise]


def compare(bf16, fp8, window, rise, last=100, tolerance=0.01):
    """The table, the spike lines and the verdict line, for two curves of equal length."""
    b, f = np.asarray(bf16, dtype=np.float64), np.asarray(fp8, dtype=np.float64)
    n = min(len(b), len(f))
    b, f = b[:n], f[:n]
    rel = (f - b) / b
    lines = ["| steps | fp8 − bf16: mean (max abs) |", "| --- | --- |"]
    for a in range(0, n, window):
        z = min(a + window, n)
        lines.append(f"| {a + 1}–{z} | {rel[a:z].mean():+.1e} ({np.abs(rel[a:z]).max():.1e}) |")
    k = min(last, n)
    lb, lf = float(b[-k:].mean()), float(f[-k:].mean())
    diff = lf / lb - 1
    sb, sf = spikes(b, rise), spikes(f, rise)
    ub, uf = unmatched(b, f, rise), unmatched(f, b, rise)
    lines.append(f"\nlast {k} steps, mean loss: bf16 {lb:.4f} | fp8 {lf:.4f} ({diff:+.2%})")
    lines.append(f"spikes (a step > {rise:.0%} above the median of the {SPIKE_WINDOW} before it): "
                 f"bf16 at {sb or 'none'}, fp8 at {sf or 'none'}; "
                 f"unmatched (the other rises by less than {MATCH_FRACTION * rise:.1%} within {SPIKE_MATCH} "
                 f"steps): bf16 {ub or 'none'}, fp8 {uf or 'none'}")
    holds = abs(diff) <= tolerance and not ub and not uf
    lines.append(f"FP8 loss test (last {k} within {tolerance:.0%}; no spike without the other): "
                 f"{'HOLDS' if holds else 'does not hold'}")
    return lines, holds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardlm", default="build/shardlm")
    ap.add_argument("--shape", choices=sorted(F.SHAPES), default="llama-1b")
    ap.add_argument("--model", default="", help="an existing HF model directory instead of --shape's random init")
    ap.add_argument("--mode", choices=["tensorwise", "rowwise", "none"], default="tensorwise",
                    help="the FP8 run's model.fp8 (none: only with --fp8-attention)")
    ap.add_argument("--fp8-attention", action="store_true", help="the FP8 run sets model.fp8_attention = true")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=4, help="rows (documents) a step")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--docs", type=int, default=1600)
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--spike", type=float, default=0.05, help="a spike's rise over the median before it")
    ap.add_argument("--set", action="append", default=[], help="a shardlm --set override for both runs")
    ap.add_argument("--out", default="runs/fp8-vs-bf16")
    ap.add_argument("--device", default="cuda", help="shardlm's device.backend (cpu: a check of this script)")
    ap.add_argument("--reuse", default="", help="a losses.json of an earlier call: its curves of the same label and "
                    "length are taken instead of run again (a call cut off after the first run)")
    args = ap.parse_args()
    if args.mode == "none" and not args.fp8_attention:
        ap.error("--mode none compares bf16 with itself: add --fp8-attention")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    model_dir, tag, data_path = F.model_and_data(args, f"-{args.docs}")
    base = list(args.set) + [f"sched.warmup={args.warmup}"]  # fidelity_vs_hf.py's deck: constant after it
    curves = {}
    if args.reuse:
        with open(args.reuse) as f:
            earlier = json.load(f)
    fp8_label = "+".join(([f"fp8-{args.mode}"] if args.mode != "none" else []) +
                         (["fp8-attention"] if args.fp8_attention else []))
    runs = (("bf16", ["model.fp8=none"]),
            (fp8_label, [f"model.fp8={args.mode}"] + (["model.fp8_attention=true"] if args.fp8_attention else [])))
    for label, sets in runs:
        if args.reuse and len(earlier.get(label, [])) == args.steps:
            curves[label] = earlier[label]
            print(f"{label}: {args.steps} steps from {args.reuse}")
            continue
        args.set = base + sets
        curves[label] = F.run_shardlm(args, model_dir, data_path, os.path.join(args.out, f"run-{label}"), label)
        with open(os.path.join(args.out, "losses.json"), "w") as f:  # after each run: a cut-off call keeps the first
            json.dump(curves, f)
    lines, _ = compare(curves["bf16"], curves[fp8_label], args.window, args.spike)
    print(f"\n{tag}, {args.steps} steps of {args.rows} x {args.seq} tokens, lr {args.lr} after {args.warmup} "
          f"warmup steps; {fp8_label} against bf16:\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
