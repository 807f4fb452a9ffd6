#!/usr/bin/env python3
"""moe_vs_hf.py — a Qwen3-30B-A3B-shaped model of experts trained by shardlm and by transformers in one call.

    python3 tools/moe_vs_hf.py --out runs/moe-vs-hf [--layers 4] [--steps 20] [--variants default,compile]
                               [--shardlm-only-layers 8] [--set KEY=VALUE ...]

The shape is Qwen3-30B-A3B's (hidden 2048, 32 query and 4 key/value heads of 128, 128 experts of width
768, 8 a token, renormalised, vocabulary 151,936, untied) with --layers layers, every one a layer of
experts; transformers makes the random init (seed 0, fp32) and saves it, shardlm reads it (model.hf).
Data: tools/fidelity_vs_hf.py's Markov stream (4,096 active ids, successor probability 0.8), one row of
--seq tokens a step, the same rows in the same order on both sides. Both add the load-balancing loss at
router_aux_loss_coef 0.001. AdamW lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices,
clip 1.0; transformers: fp32 parameters, bf16 autocast, fused AdamW, its default experts backend (the
name is printed) and torch.compile of it.

Prints the losses, each window's mean relative difference to transformers (and compile's, its own
spread), and the throughput: tokens/s over the steps after the second, MFU counted on the active
parameters (shardlm's own count; transformers' from the same FLOPs a token), peak GPU memory.
--shardlm-only-layers K adds a shardlm run with K layers and model.optim_cpu_offload (random init), to
show the largest model of this shape the GPU holds. Results land in OUT/results.json.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fidelity_vs_hf import make_markov  # noqa: E402

SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
             num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
             decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=True)
WINDOWS = [(1, 5), (6, 10), (11, 15), (16, 20)]


def make_model(path, layers, seq):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(num_hidden_layers=layers, max_position_embeddings=max(seq, 4096), bos_token_id=None,
                            eos_token_id=None, pad_token_id=None, **SHAPE)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()


def run_hf(args, model_dir, rows, variant):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    model.config.use_cache = False
    backend = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else "?"
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_fn = torch.compile(model) if variant == "compile" else model
    coef = model.config.router_aux_loss_coef
    losses, aux, times = [], [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.time()
        doc = torch.from_numpy(rows[step % len(rows)].astype(np.int64)).cuda()
        x, y = doc[:-1][None], doc[1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step_fn(input_ids=x, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().view(-1, out.logits.shape[-1]), y)
        loss = ce + coef * out.aux_loss.float()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(ce))
        aux.append(float(out.aux_loss))
        torch.cuda.synchronize()
        times.append(time.time() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, step_fn
    torch.cuda.empty_cache()
    timed = times[2:]
    tps = args.seq * len(timed) / sum(timed)
    print(f"transformers {variant} (experts backend {backend}): {tps:,.0f} tok/s, peak {peak:.1f} GiB, "
          f"losses {losses[0]:.4f} .. {losses[-1]:.4f}", flush=True)
    return dict(losses=losses, aux=aux, tokens_per_s=tps, peak_gib=peak, experts_backend=str(backend))


def run_shardlm(args, label, model_lines, data_path, steps, extra=()):
    run_dir = os.path.join(args.out, f"run-{label}")
    deck = os.path.join(args.out, f"{label}.toml")
    with open(deck, "w") as f:
        f.write(f"""[run]
name = "moe-{label}"
dir = "{run_dir}"
max_steps = {steps}
seed = 0

[model]
{model_lines}

[data]
path = "{data_path}"
seq_len = {args.seq}
micro_batch = 1
global_batch = 1
shuffle = false

[optim]
name = "adamw"
lr = {args.lr}
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
weight_decay = 0.1
max_norm = 1.0

[sched]
name = "constant"
warmup = 0

[loss]
chunk_tokens = 4096

[ckpt]
interval = 0
save_final = false
resume = "none"

[device]
backend = "cuda"

[log]
interval = 1
""")
    cmd = [args.shardlm, "train", deck] + [a for s in list(args.set) + list(extra) for a in ("--set", s)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    with open(os.path.join(args.out, f"shardlm-{label}.log"), "w") as f:
        f.write(log)
    if p.returncode != 0:
        print(f"shardlm {label} failed ({p.returncode}):\n{log[-3000:]}", flush=True)
        return None
    losses, aux = {}, {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and "loss" in r:
                losses[int(r["step"])] = float(r["loss"])
                aux[int(r["step"])] = float(r.get("router_aux_loss", "nan"))
    lines = [l for l in log.splitlines() if re.match(r"^(throughput|memory|step time|setup|attention)", l)]
    for l in lines:
        print(f"shardlm {label}: {l}", flush=True)
    tput = next((l for l in lines if l.startswith("throughput")), "")
    tps = re.search(r"([\d,]+) tok/s", tput)
    mfu = re.search(r"MFU ([\d.]+)%", tput)
    return dict(losses=[losses[s] for s in sorted(losses)], aux=[aux[s] for s in sorted(aux)], throughput=tput,
                tokens_per_s=float(tps.group(1).replace(",", "")) if tps else None,
                mfu=float(mfu.group(1)) if mfu else None)


def window_means(curve, ref):
    out = []
    for a, b in WINDOWS:
        if b > len(ref):
            break
        out.append(float(np.mean([(curve[i] - ref[i]) / ref[i] for i in range(a - 1, b)])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--variants", default="default,compile")
    ap.add_argument("--shardlm", default="build/shardlm")
    ap.add_argument("--shardlm-only-layers", type=int, default=0)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    model_dir = os.path.join(args.out, f"model-{args.layers}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        t0 = time.time()
        make_model(model_dir, args.layers, args.seq)
        print(f"random init of {args.layers} layers saved in {time.time() - t0:.0f} s", flush=True)
    data_path = os.path.join(args.out, "data.h5")
    rows = make_markov(data_path, SHAPE["vocab_size"], args.steps + 2, args.seq + 1, 7)
    results = {"layers": args.layers, "steps": args.steps, "seq": args.seq}
    results["shardlm"] = run_shardlm(args, "shardlm", f'hf = "{model_dir}"', data_path, args.steps)
    for v in args.variants.split(","):
        try:
            results[f"transformers {v}"] = run_hf(args, model_dir, rows, v)
        except Exception as e:  # a variant that fails (out of memory, compile) is reported, not fatal
            print(f"transformers {v} failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    if args.shardlm_only_layers:
        shape = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SHAPE.items()
                          if k not in ("mlp_only_layers", "output_router_logits", "decoder_sparse_step"))
        shape = shape.replace("num_attention_heads", "num_heads").replace("num_key_value_heads", "num_kv_heads")
        model_lines = (f'arch = "qwen3_moe"\nqk_norm = true\nnum_layers = {args.shardlm_only_layers}\n{shape}\n'
                       f'router_aux_loss = true\noptim_cpu_offload = true')
        results["shardlm offload"] = run_shardlm(args, f"shardlm-{args.shardlm_only_layers}-offload", model_lines,
                                                 data_path, min(args.steps, 8))
    ref = results.get("transformers default")
    s = results.get("shardlm")
    if ref and s:
        print(f"load-balancing loss, step 1 and last: shardlm {s['aux'][0]:.4f} {s['aux'][-1]:.4f}, transformers "
              f"{ref['aux'][0]:.4f} {ref['aux'][-1]:.4f}")
        print("\nstep  shardlm  " + "  ".join(f"{k[13:]:>9}" for k in results if k.startswith("transformers")))
        for i in range(args.steps):
            print(f"{i + 1:4d}  {s['losses'][i]:.4f}  " +
                  "  ".join(f"{results[k]['losses'][i]:9.4f}" for k in results if k.startswith("transformers")))
        print("\nmean relative difference to transformers default, windows " + " ".join(f"{a}-{b}" for a, b in WINDOWS))
        for k in ["shardlm"] + [k for k in results if k.startswith("transformers") and k != "transformers default"]:
            w = window_means(results[k]["losses"], ref["losses"])
            results[k]["windows_vs_default"] = w
            print(f"  {k}: " + " ".join(f"{x:+.2e}" for x in w))
        for k in results:
            if k.startswith("transformers") and s.get("tokens_per_s"):
                r = results[k]
                r["shardlm_speedup"] = s["tokens_per_s"] / r["tokens_per_s"]
                r["mfu"] = s["mfu"] * r["tokens_per_s"] / s["tokens_per_s"] if s.get("mfu") else None
                print(f"shardlm / {k}: {r['shardlm_speedup']:.2f}x (transformers at {r['mfu'] or 0:.1f}% active MFU)")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
