#!/usr/bin/env python3
"""profile_step.py — where a training step's GPU time goes: kernels, copies and idle gaps.

    tools/profile_step.py run DECK STEPS OUT.csv [--set k=v ...]   (on the GPU machine)
    tools/profile_step.py show OUT.csv [TOP] [--step-end REGEX]

A trace of another program (`shardlm generate` with CUDA_INJECTION64_PATH and
KERNEL_TRACE_OUT set) is cut at the kernels --step-end names instead: for the
decoder, `--step-end token_logprobs` cuts after each step's draw, so a "step" is
the decode graph, the draw and the host's gaps between them.

`run` starts `shardlm train DECK` for STEPS steps with the CUPTI tracer
(tools/kernel_trace.cpp, built by tools/kernel_trace.sh into
build-gpu/libkernel_trace.so, or $KERNEL_TRACE_LIB) injected: every kernel, copy
and memset with its device start and end, at the program's own speed. `show`
cuts the trace into steps at the optimizer's last kernel (adamw / sgd; the first
step, warm-up, is left out), and prints per step: the wall time, the time the GPU
ran something, the idle time and its largest gaps (with the kernels on each side),
and the kernels grouped by name with their time, launches and share.

Names are shortened: template arguments and parameter lists dropped; cuBLASLt's
nvjet kernels keep their tile names, cuDNN's generated SDPA kernels become
"cuDNN SDPA fprop" / "cuDNN SDPA bprop".
"""
import collections
import csv
import os
import re
import subprocess
import sys


def run(deck, steps, out, extra):
    shardlm = os.environ.get("SHARDLM", "build/shardlm")
    lib = os.path.abspath(os.environ.get("KERNEL_TRACE_LIB", "build-gpu/libkernel_trace.so"))
    if not os.path.exists(lib):
        sys.exit(f"profile_step.py: no tracer at {lib} (build it with tools/kernel_trace.sh)")
    cmd = [shardlm, "train", deck, "--set", f"run.max_steps={steps}", "--set", "run.dir=runs/profile-step",
           "--set", "ckpt.resume=none", "--set", "ckpt.interval=0", "--set", "ckpt.save_final=false"]
    for kv in extra:
        cmd += ["--set", kv]
    subprocess.run(["rm", "-rf", "runs/profile-step"], check=True)
    env = dict(os.environ, CUDA_INJECTION64_PATH=lib, KERNEL_TRACE_OUT=os.path.abspath(out))
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0:
        sys.exit(f"profile_step.py: the traced run exited with status {rc}")


def short_name(name):
    n = re.sub(r"^void ", "", name).replace("(anonymous namespace)", "")
    if "(" in n:
        n = n[: n.index("(")]
    while re.search(r"<[^<>]*>", n):
        n = re.sub(r"<[^<>]*>", "", n)
    n = re.sub(r"(::)+", "::", n)
    m = re.search(r"sdpa_sm90_flash_(fprop|bprop)", n)
    if m:
        return "cuDNN SDPA " + m.group(1)
    return n


def load(path):
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            rows.append((r["kind"], int(r["start_ns"]), int(r["end_ns"]), r["name"]))
    rows.sort(key=lambda r: r[1])
    return rows


OPTIMIZER_END = r"\b(adamw|sgd)_kernel"


def step_ends(rows, marker=OPTIMIZER_END):
    """End time of each step: the last kernel matching `marker` of each run of them. The
    optimizer's (adamw / sgd, one per unit, the default) run ends where 50 other kernels follow;
    another marker's where any other kernel does."""
    within = 50 if marker == OPTIMIZER_END else 1
    ends, others = [], None
    for kind, _, end, name in rows:
        if kind != "kernel":
            continue
        if re.search(marker, name):
            if others is not None and others < within:
                ends[-1] = max(ends[-1], end)
            else:
                ends.append(end)
            others = 0
        elif others is not None:
            others += 1
    return ends


def show(path, top=40, marker=OPTIMIZER_END):
    rows = load(path)
    ends = step_ends(rows, marker)
    if len(ends) < 2:
        sys.exit(f"profile_step.py: {path} holds {len(ends)} steps ending in a kernel matching '{marker}'; "
                 "two or more are needed")
    steps = len(ends) - 1
    wall = busy = 0
    names = collections.defaultdict(lambda: [0, 0])
    gaps = []
    for s in range(steps):
        t0, t1 = ends[s], ends[s + 1]
        inside = [r for r in rows if r[1] >= t0 and r[2] <= t1]
        wall += t1 - t0
        cursor, prev = t0, "(step start)"
        for kind, a, b, name in inside:
            if a > cursor:
                gaps.append((a - cursor, prev, short_name(name) if kind == "kernel" else f"{kind} {name}"))
            if b > cursor:
                busy += b - max(a, cursor)
                cursor = b
                prev = short_name(name) if kind == "kernel" else f"{kind} {name}"
            key = short_name(name) if kind == "kernel" else f"({kind} {name.split()[0]})"
            names[key][0] += b - a
            names[key][1] += 1
    ms = lambda ns: ns / 1e6 / steps
    print(f"{steps} steps after the first: wall {ms(wall):.2f} ms a step, GPU busy {ms(busy):.2f} ms, "
          f"idle {ms(wall - busy):.2f} ms ({100 * (wall - busy) / wall:.1f}%)")
    total = sum(v[0] for v in names.values())
    print(f"{'kernel / copy':<64} {'ms/step':>8} {'per step':>9} {'us each':>8} {'share':>6}")
    for name, (ns, n) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{name[:64]:<64} {ms(ns):8.2f} {n / steps:9.0f} {ns / n / 1e3:8.1f} {100 * ns / total:5.1f}%")
    by_pair = collections.defaultdict(lambda: [0, 0])
    for g, before, after in gaps:
        by_pair[(before[:40], after[:40])][0] += g
        by_pair[(before[:40], after[:40])][1] += 1
    print(f"\nidle gaps by the kernels around them (ms a step, count a step):")
    for (before, after), (ns, n) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"  {ms(ns):7.2f} {n / steps:6.0f}  {before} -> {after}")


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) >= 4 and a[0] == "run":
        extra = [a[i + 1] for i in range(4, len(a) - 1) if a[i] == "--set"]
        run(a[1], int(a[2]), a[3], extra)
    elif len(a) >= 2 and a[0] == "show":
        marker = OPTIMIZER_END
        if "--step-end" in a:
            i = a.index("--step-end")
            if i + 1 >= len(a):
                sys.exit(__doc__)
            marker = a[i + 1]
            a = a[:i] + a[i + 2:]
        if len(a) > 3:
            sys.exit(__doc__)
        show(a[1], int(a[2]) if len(a) == 3 else 40, marker)
    else:
        sys.exit(__doc__)
