#!/usr/bin/env python3
"""bench_attention_torch.py — torch's scaled_dot_product_attention, FlashAttention-2
and cuDNN backends, at the shapes of tests/gpu/test_attention.cu's `cmp` group, timed
the same way (3 warm-ups, median of 20, CUDA events): causal, one document, bf16,
GQA 32:8 heads. TFLOP/s count the causal FLOPs (forward 4*N^2*H*D/2 per document,
backward 2.5x), as test_attention.cu does, so the two tables compare line by line.
Packed documents of equal length (test_attention's "8 x 512", "64 x 512") run as a
batch of B sequences, the call a trainer without varlen attention makes, and what
shardlm's cuDNN path does for them.

Run it on the GPU machine in the same call as
    bash tests/gpu/build_attention.sh --only cmp
(docs/benchmarks.md, "Attention"). Needs torch with CUDA.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (documents, tokens per document, head dim)
SHAPES = [(1, 4096, 64), (1, 4096, 128), (1, 32768, 64), (1, 32768, 128), (1, 131072, 128),
          (8, 512, 64), (8, 512, 128), (64, 512, 128)]
H, KV = 32, 8


def median_ms(fn, reps=20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'shape':<14} {'backend':<8} {'fwd ms':>9} {'TFLOP/s':>8} {'bwd ms':>9} {'TFLOP/s':>8}  note")
    for b, n, d in SHAPES:
        q = torch.randn(b, H, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, KV, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, KV, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(b, H, n, d, device="cuda", dtype=torch.bfloat16)
        flops = b * 4.0 * n * n * H * d / 2
        shape = f"N{n} D{d}" if b == 1 else f"{b}x{n} D{d}"
        for name, backend in (("flash2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            note = ""
            try:
                with sdpa_kernel(backend):
                    try:
                        attn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        out = attn()
                    except RuntimeError:
                        # A backend without native GQA: the kv heads repeated (what HF does).
                        kr = k.repeat_interleave(H // KV, dim=1)
                        vr = v.repeat_interleave(H // KV, dim=1)
                        attn = lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
                        out = attn()
                        note = "kv heads repeated"
                    fwd = median_ms(attn)
                    bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                print(f"{shape:<14} {name:<8} {fwd:9.3f} {flops / fwd / 1e9:8.1f} {bwd:9.3f} "
                      f"{2.5 * flops / bwd / 1e9:8.1f}  {note}", flush=True)
                del out
            except RuntimeError as e:
                print(f"{shape:<14} {name:<8} unavailable: {str(e).splitlines()[0][:100]}", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
