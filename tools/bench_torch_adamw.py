#!/usr/bin/env python3
"""bench_torch_adamw.py — PyTorch's CPU AdamW on one flat fp32 tensor, the baseline
for tools/bench_cpu_adamw.cpp: same parameter count, hyper-parameters, thread
counts and table format.

    python3 tools/bench_torch_adamw.py [--params 256M] [--threads 1,2,4]
        [--impl fused,foreach,default] [--steps 10] [--triad-numel N]

impl: torch.optim.AdamW(fused=True) | (foreach=True) | () (on CPU tensors the
default is the per-tensor for-loop). Bytes are counted as for shardlm: 28 per
parameter (p, grad, exp_avg, exp_avg_sq read; p, exp_avg, exp_avg_sq written),
the minimum traffic, whatever temporaries an implementation adds. The triad
a = b + 3 c is torch.add(b, c, alpha=3, out=a) on float64 (24 bytes per element,
STREAM's count), at the same thread count. Each time is the median of --steps
runs after two warm-up runs. Needs only torch (no numpy).
"""
import argparse
import gc
import os
import statistics
import time

import torch

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # as bench_cpu_adamw
IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "default": dict()}


def parse_count(text):
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def median_s(runs, fn):
    fn()
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(impl, isa, bf16, threads, numel, ms, bytes_per_elem, triad):
    gbps = bytes_per_elem * numel / (ms / 1e3) / 1e9
    print(f"{impl:<16} {isa:<8} {bf16:<4} {threads:7d} {numel:11d} {ms:10.3f} "
          f"{numel / (ms / 1e3) / 1e9:9.3f} {gbps:8.1f} {triad:10.1f} {100.0 * gbps / triad:7.1f}", flush=True)


def triad_gbps(n, runs):
    # (n) fp64 each; empty() leaves pages untouched, the fills place them with the
    # intra-op threads the triad then uses.
    a, b, c = (torch.empty(n, dtype=torch.float64) for _ in range(3))
    a.zero_()
    b.fill_(1.0)
    c.fill_(2.0)
    t = median_s(runs, lambda: torch.add(b, c, alpha=3.0, out=a))
    if a[n // 2].item() != 7.0:
        print(f"# triad check failed: {a[n // 2].item()}")
    return 24.0 * n / t / 1e9


def adamw_ms(n, impl, runs):
    # (n) fp32: parameters and gradients; the optimizer adds exp_avg, exp_avg_sq.
    param = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-1.0, 1.0))
    param.grad = torch.empty(n, dtype=torch.float32).uniform_(-0.01, 0.01)
    opt = torch.optim.AdamW([param], **HYPER, **IMPLS[impl])
    with torch.no_grad():
        t = median_s(runs, opt.step)
    del opt, param
    gc.collect()
    return t * 1e3


def main():
    cores = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="256M", help="parameters (K, M, G binary suffixes)")
    parser.add_argument("--threads", default="", help="comma list; default 1, 2, 4, ... up to every core")
    parser.add_argument("--impl", default="fused,foreach,default", help="comma list of fused, foreach, default")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--triad-numel", default="0", help="0: max(params, 32M) doubles")
    args = parser.parse_args()
    n = parse_count(args.params)
    triad_n = parse_count(args.triad_numel) or max(n, 32 << 20)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else []
    if not threads:
        t = 1
        while t < cores:
            threads.append(t)
            t *= 2
        threads.append(cores)
    impls = args.impl.split(",")
    for impl in impls:
        if impl not in IMPLS:
            parser.error(f"--impl {impl}: not one of {', '.join(IMPLS)}")
    isa = torch.backends.cpu.get_cpu_capability().lower()

    print(f"# bench_torch_adamw: params={n} steps={args.steps} cores={cores} torch={torch.__version__} "
          f"cpu_capability={isa} triad_numel={triad_n}")
    print("# bytes/param: 28 (p,g,m,v read; p,m,v written); triad 24/element")
    print(f"# ms_step: median of {args.steps} after 2 warm-up; pct: GB_s / triad_GB_s at the same thread count")
    print("# the triad's write-allocate read of a is not counted (STREAM's rule), AdamW has none: pct may pass 100")
    print(f"{'impl':<16} {'isa':<8} {'bf16':<4} {'threads':>7} {'params':>11} {'ms_step':>10} {'Gparam_s':>9} "
          f"{'GB_s':>8} {'triad_GB_s':>10} {'pct':>7}", flush=True)
    for t in threads:
        torch.set_num_threads(t)
        triad = triad_gbps(triad_n, args.steps)
        row("triad", "-", "-", t, triad_n, 24.0 * triad_n / triad / 1e6, 24.0, triad)
        gc.collect()
        for impl in impls:
            row(f"torch-{impl}", isa, "no", t, n, adamw_ms(n, impl, args.steps), 28.0, triad)


if __name__ == "__main__":
    main()
