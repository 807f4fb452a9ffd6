#!/usr/bin/env python3
"""bench_generate.py — `shardlm generate` on the GPU beside Hugging Face transformers' `generate`.

One call (tools/bench_generate.sh runs it on the GPU machine):
  1. a Llama-3.2-1B-shaped model with random weights (transformers, bf16, save_pretrained),
  2. BATCH prompts of PROMPT random token ids (a shardlm prompt file, no stop ids; the model has
     no EOS either, so every sequence runs to NEW tokens on both sides),
  3. shardlm generate greedy and sampled (temperature 0.8, top-k 50, top-p 0.95) at --batch BATCH,
     greedy again without CUDA graphs (SHARDLM_DECODE_GRAPHS=0: what the graphs save), and sampled
     again with the host's sampler (SHARDLM_HOST_SAMPLER=1: what drawing on the GPU saves; the tokens
     must be the same),
  4. transformers generate on the same model, prompts and lengths (bf16, KV cache on), greedy once and
     sampled three times (its rate moves between runs; the fastest is the reference),
  5. tokens/s of each and the ratios; shardlm's decode step (device time, its own line) against the
     HBM floor: (weights + the KV cache a step reads) / 4.8 TB/s, averaged over the decode steps;
  6. greedy equality: per sequence, the first position where shardlm's greedy tokens differ from
     transformers' (bf16 argmax near-ties can diverge late) and the fraction of tokens before it.

  python3 tools/bench_generate.py [--shardlm build/shardlm] [--batch 64] [--prompt 128] [--new 256]
                                  [--work DIR] [--small]   (--small: a 4-layer 512-wide model, a quick check)
                                  [--greedy-only]          (one shardlm run, no transformers)
                                  [--profile]              (that, then a sampled run with SHARDLM_DECODE_PROFILE=1)

--rollout: an RL sampler's workload instead. --prompts P prompts of --prompt tokens, --n samples of each at
temperature 1 (no top-k / top-p), up to --new tokens (no stop id), --batch sequences at once in a KV pool of
--kv-cache-tokens positions (0: every slot at its longest); --shape qwen3-1.7b for Qwen3-1.7B's shape. One
shardlm run, then transformers sampling the same (num_return_sequences = n) where its KV cache fits the GPU.
Reported: tokens/s of both; the decode step against the HBM floor of weights + the live KV the steps read
(shardlm's count of cached positions per step); prefill tokens computed against the unique prompt tokens; the
pool's peak against the positions it held then.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

def hbm_bytes_per_s():
    import torch
    return 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12  # H200, else H100 SXM


def make_model(path, shape_name, positions):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    common = dict(tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  torch_dtype="bfloat16", max_position_embeddings=max(4096, positions))
    if shape_name == "small":
        config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=64, vocab_size=32000, rope_theta=500000.0,
                             rms_norm_eps=1e-5, **common)
        cls = LlamaForCausalLM
    elif shape_name == "llama-1b":  # Llama-3.2-1B
        config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                             rms_norm_eps=1e-5, **common)
        cls = LlamaForCausalLM
    else:  # Qwen3-1.7B
        config = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                             rms_norm_eps=1e-6, **common)
        cls = Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(path, safe_serialization=True)
    return model, config


def write_prompts(path, ids, vocab):
    tokens = ids.reshape(-1).astype(np.int32)
    offsets = np.arange(0, tokens.size + 1, ids.shape[1], dtype=np.int64)
    text = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=tokens)
        f.create_dataset("offsets", data=offsets)
        for name in ("prompt", "answer", "metadata"):
            f.create_dataset(name, data=np.asarray([""] * ids.shape[0], dtype=object), dtype=text)
        f.attrs["format"] = "shardlm-prompts-1"
        f.attrs["vocab_size"] = np.int64(vocab)
        f.attrs["tokenizer"] = "random ids"
        f.attrs["chat_template"] = ""
        f.attrs["stop_token_ids"] = np.asarray([], dtype=np.int64)


def run_shardlm(args, model_dir, prompts, out, sampling, graphs=True, host_sampler=False, profile=False):
    cmd = [args.shardlm, "generate", "--hf", model_dir, "--prompts", prompts, "--max-new-tokens", str(args.new),
           "--batch", str(args.batch), "--device", "cuda", "--seed", "1", "--out", out, "--n", str(args.n),
           "--kv-cache-tokens", str(args.kv_cache_tokens)] + sampling
    t0 = time.time()
    env = dict(os.environ, SHARDLM_DECODE_GRAPHS="1" if graphs else "0",
               SHARDLM_HOST_SAMPLER="1" if host_sampler else "0", SHARDLM_DECODE_PROFILE="1" if profile else "0")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    sys.stdout.write(p.stdout)
    sys.stdout.write("".join(line + "\n" for line in p.stderr.splitlines() if line.startswith("decoder:")))
    if p.returncode != 0:
        sys.stdout.write(p.stderr)
        sys.exit(f"shardlm generate failed ({p.returncode}): {' '.join(cmd)}")
    m = re.search(r"(\d+) tokens in ([\d.]+) s", p.stdout)
    step = re.search(r"(\d+) decode steps, ([\d.]+) ms each", p.stdout)
    with h5py.File(out) as f:
        toks, offs = f["tokens"][()], f["offsets"][()]
    rows = [toks[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
    paged = re.search(r"prefill computed (\d+) of (\d+) prompt tokens .*?, (\d+) more .*? KV pool peak (\d+) of "
                      r"(\d+) blocks of (\d+) \((\d+) positions\) holding (\d+) .*?; (\d+) sequences? gave way.*"
                      r"mean batch ([\d.]+), (\d+) cached positions read each", p.stdout)
    keys = ("computed", "given", "recomputed", "peak_blocks", "blocks", "block_size", "peak_positions", "held",
            "preempted", "mean_batch", "positions_read")
    return dict(tokens=int(m.group(1)), seconds=float(m.group(2)), wall=wall,
                step_ms=float(step.group(2)) if step else float("nan"), rows=rows,
                **({k: float(v) for k, v in zip(keys, paged.groups())} if paged else {}))


def run_hf(model, ids, new, sample, n=1, rl=False):
    import torch
    x = torch.tensor(ids, dtype=torch.long, device="cuda")
    mask = torch.ones_like(x)
    kw = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95) if sample else dict(do_sample=False)
    if rl:
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n)
    with torch.no_grad():
        model.generate(x[:1], attention_mask=mask[:1], max_new_tokens=8, min_new_tokens=8, use_cache=True,
                       pad_token_id=0, **kw)  # warm-up
        torch.cuda.synchronize()
        t0 = time.time()
        out = model.generate(x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, use_cache=True,
                             pad_token_id=0, **kw)
        torch.cuda.synchronize()
        seconds = time.time() - t0
    gen = out[:, ids.shape[1]:].cpu().numpy()
    return dict(tokens=int(gen.size), seconds=seconds, rows=list(gen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardlm", default="build/shardlm")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--work", default="")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--shape", choices=("llama-1b", "qwen3-1.7b", "small"), default="llama-1b")
    ap.add_argument("--rollout", action="store_true", help="an RL sampler's workload (see the top)")
    ap.add_argument("--prompts", type=int, default=0, help="--rollout: prompts (0: --batch / --n)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--kv-cache-tokens", type=int, default=0, help="the KV pool in positions (0: every slot at its longest)")
    ap.add_argument("--greedy-only", action="store_true", help="one shardlm greedy run, no transformers: the decode step")
    ap.add_argument("--profile", action="store_true",
                    help="then one sampled run with SHARDLM_DECODE_PROFILE=1: device time per operation, host time per call")
    args = ap.parse_args()
    import torch
    import transformers
    work = args.work or tempfile.mkdtemp(prefix="shardlm-bench-generate.")
    model_dir, prompts = os.path.join(work, "model"), os.path.join(work, "prompts.h5")
    t0 = time.time()
    model, config = make_model(model_dir, "small" if args.small else args.shape, args.prompt + args.new)
    model.eval()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, random, bf16 -> {model_dir} "
          f"({time.time() - t0:.0f} s); torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name()}")
    rng = np.random.default_rng(0)
    if args.rollout:
        return rollout(args, model, config, model_dir, prompts, work, rng)
    ids = rng.integers(0, config.vocab_size, size=(args.batch, args.prompt), dtype=np.int64)
    write_prompts(prompts, ids, config.vocab_size)

    greedy = run_shardlm(args, model_dir, prompts, os.path.join(work, "greedy.h5"), ["--temperature", "0"])
    if args.greedy_only or args.profile:
        if args.profile:
            run_shardlm(args, model_dir, prompts, os.path.join(work, "profiled.h5"),
                        ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.95"], profile=True)
        return
    sampled = run_shardlm(args, model_dir, prompts, os.path.join(work, "sampled.h5"),
                          ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.95"])
    eager = run_shardlm(args, model_dir, prompts, os.path.join(work, "eager.h5"), ["--temperature", "0"],
                        graphs=False)
    host_drawn = run_shardlm(args, model_dir, prompts, os.path.join(work, "host.h5"),
                             ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.95"], host_sampler=True)
    hf_greedy = run_hf(model, ids, args.new, sample=False)
    # transformers' sampled rate moved 3,793-5,414 tok/s between calls: three runs, the fastest is the reference
    hf_runs = [run_hf(model, ids, args.new, sample=True) for _ in range(3)]
    hf_sampled = min(hf_runs, key=lambda r: r["seconds"])
    print("transformers sampled, 3 runs: " + ", ".join(f"{r['tokens'] / r['seconds']:.0f}" for r in hf_runs) +
          " tokens/s (the ratios below use the fastest)")

    # The HBM floor of a decode step: every weight once (the tied embedding is the lm-head) and the
    # keys and values of every cached position, at the mean length over the decode steps.
    weight_bytes = 2 * sum(p.numel() for p in model.parameters())
    kvd = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    mean_len = args.prompt + (args.new - 1) / 2.0
    cache_bytes = args.batch * mean_len * config.num_hidden_layers * 2 * kvd * 2
    floor_ms = 1e3 * (weight_bytes + cache_bytes) / hbm_bytes_per_s()

    def tps(r):
        return r["tokens"] / r["seconds"]

    print(f"\nbatch {args.batch}, prompt {args.prompt}, {args.new} new tokens")
    for name, s, h in (("greedy", greedy, hf_greedy), ("sampled", sampled, hf_sampled),
                       ("host-sampled", host_drawn, hf_sampled)):
        print(f"{name:8s} shardlm {tps(s):9.0f} tokens/s ({s['seconds']:.2f} s, process {s['wall']:.1f} s)   "
              f"transformers {tps(h):8.0f} tokens/s ({h['seconds']:.2f} s)   ratio {tps(s) / tps(h):.1f}x")
    for name, s in (("greedy", greedy), ("sampled", sampled), ("eager", eager)):
        print(f"{name:8s} decode step {s['step_ms']:.3f} ms on the device; HBM floor {floor_ms:.3f} ms "
              f"(weights {weight_bytes / 1e9:.2f} GB + cache {cache_bytes / 1e9:.2f} GB at 4.8 TB/s): "
              f"{s['step_ms'] / floor_ms:.2f}x the floor; whole step incl. logits download and sampling "
              f"{1e3 * s['seconds'] / args.new:.3f} ms")

    same_eager = sum(int(np.array_equal(a, b)) for a, b in zip(greedy["rows"], eager["rows"]))
    same_drawn = sum(int(np.array_equal(a, b)) for a, b in zip(sampled["rows"], host_drawn["rows"]))
    print(f"sampled on the GPU vs on the host (SHARDLM_HOST_SAMPLER=1): {same_drawn} of {len(sampled['rows'])} "
          f"sequences identical")
    print(f"greedy with CUDA graphs vs without (SHARDLM_DECODE_GRAPHS=0, 'eager' above): {same_eager} of "
          f"{len(greedy['rows'])} sequences identical")

    # Greedy equality, sequence by sequence.
    firsts, same, total = [], 0, 0
    for a, b in zip(greedy["rows"], hf_greedy["rows"]):
        n = min(len(a), len(b))
        diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
        first = int(diff[0]) if diff.size else n
        firsts.append(first)
        same += first
        total += len(b)
    identical = sum(1 for f, b in zip(firsts, hf_greedy["rows"]) if f == len(b))
    print(f"greedy vs transformers: {identical} of {len(firsts)} sequences identical over all {args.new} tokens; "
          f"{same} of {total} tokens ({100.0 * same / max(total, 1):.1f}%) before each sequence's first divergence; "
          f"first divergences at {sorted(f for f in firsts if f < args.new)[:16]}")


def rollout(args, model, config, model_dir, prompts, work, rng):
    import torch
    P = args.prompts or max(1, args.batch // args.n)
    ids = rng.integers(0, config.vocab_size, size=(P, args.prompt), dtype=np.int64)
    write_prompts(prompts, ids, config.vocab_size)
    s = run_shardlm(args, model_dir, prompts, os.path.join(work, "rollout.h5"), ["--temperature", "1"])
    bw = hbm_bytes_per_s()
    weight_bytes = 2 * sum(p.numel() for p in model.parameters())
    pos_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    floor_ms = 1e3 * (weight_bytes + s["positions_read"] * pos_bytes) / bw
    unique = P * args.prompt
    print(f"\n{P} prompts of {args.prompt} tokens x {args.n} samples, up to {args.new} new tokens, batch {args.batch}, "
          f"KV pool {int(s['blocks'] * s['block_size'])} positions ({s['blocks'] * s['block_size'] * pos_bytes / 2**30:.1f}"
          f" GiB at {pos_bytes} B a position) on {torch.cuda.get_device_name()}")
    print(f"shardlm   {s['tokens'] / s['seconds']:9.0f} tokens/s ({s['tokens']} tokens in {s['seconds']:.1f} s)")
    print(f"decode step {s['step_ms']:.3f} ms on the device (mean batch {s['mean_batch']:.1f}); HBM floor "
          f"{floor_ms:.3f} ms (weights {weight_bytes / 1e9:.2f} GB + {s['positions_read']:.0f} cached positions x "
          f"{pos_bytes} B = {s['positions_read'] * pos_bytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s): "
          f"{s['step_ms'] / floor_ms:.2f}x the floor")
    print(f"prefill computed {s['computed']:.0f} prompt tokens; unique prompt tokens {unique} "
          f"({'equal' if s['computed'] == unique else 'NOT equal'}); {s['recomputed']:.0f} more for "
          f"{s['preempted']:.0f} sequences that gave way")
    peak = s["peak_positions"]
    print(f"KV peak {s['peak_blocks']:.0f} blocks = {peak:.0f} positions ({peak * pos_bytes / 2**30:.2f} GiB) holding "
          f"{s['held']:.0f} live positions: {100 * (peak - s['held']) / peak:.2f}% over the live tokens' bytes")
    hf_kv = P * args.n * (args.prompt + args.new) * pos_bytes
    free = torch.cuda.mem_get_info()[0]
    if hf_kv > 0.85 * free:
        print(f"transformers: its KV cache for {P * args.n} x {args.prompt + args.new} positions is "
              f"{hf_kv / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free: not run")
        return
    try:
        h = run_hf(model, ids, args.new, sample=True, n=args.n, rl=True)
    except torch.cuda.OutOfMemoryError as e:
        print(f"transformers: out of memory at batch {P * args.n} ({str(e).splitlines()[0]})")
        return
    print(f"transformers {h['tokens'] / h['seconds']:9.0f} tokens/s ({h['tokens']} tokens in {h['seconds']:.1f} s); "
          f"shardlm {(s['tokens'] / s['seconds']) / (h['tokens'] / h['seconds']):.1f}x")


if __name__ == "__main__":
    main()
