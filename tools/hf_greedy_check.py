#!/usr/bin/env python3
"""hf_greedy_check.py — shardlm's greedy continuations against transformers' greedy `generate`.

The model directory shardlm exported (config.json + model.safetensors), loaded by
transformers in bf16 on the GPU; the prompts of a prompt file (left-padded in
batches, stopping at its stop ids); shardlm's greedy output of the same prompts
(`shardlm generate --temperature 0`). Prints how many sequences are identical
token for token (the stop id included) and the first differences.

    python3 tools/hf_greedy_check.py MODEL_DIR PROMPTS.h5 SHARDLM_OUT.h5 [--batch 256]
"""

import argparse

import h5py
import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("prompts")
    p.add_argument("shardlm_out")
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    with h5py.File(a.prompts) as f:
        toks, offs = f["tokens"][()], f["offsets"][()]
        stops = [int(s) for s in f.attrs.get("stop_token_ids", [])]
    prompts = [toks[offs[i]:offs[i + 1]].tolist() for i in range(len(offs) - 1)]
    with h5py.File(a.shardlm_out) as f:
        gt, go, gi = f["tokens"][()], f["offsets"][()], f["prompt_index"][()]
    ours = {int(gi[s]): gt[go[s]:go[s + 1]].tolist() for s in range(len(go) - 1)}
    new = max(len(v) for v in ours.values())
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    # A model of experts: no load-balancing loss while generating (transformers
    # computes it from the router logits, and left padding breaks its mask)
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False
    pad = model.config.vocab_size - 1
    theirs = {}
    for b in range(0, len(prompts), a.batch):
        chunk = prompts[b:b + a.batch]
        width = max(len(q) for q in chunk)
        ids = torch.tensor([[pad] * (width - len(q)) + q for q in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in chunk], device="cuda")
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 eos_token_id=stops or None, pad_token_id=pad)
        for i, row in enumerate(out[:, width:].tolist()):
            seq = []
            for t in row:
                seq.append(t)
                if t in stops:
                    break
            theirs[b + i] = seq
    same = sum(1 for i in ours if ours[i] == theirs.get(i))
    diffs = [(i, ours[i], theirs.get(i)) for i in sorted(ours) if ours[i] != theirs.get(i)]
    # Where a sequence differs: transformers' own top-two logit gap at the first
    # differing position (bf16 forwards differ by ~1e-2 a logit: a small gap is a near-tie).
    gaps = []
    for i, mine, hf in diffs:
        k = next(t for t in range(min(len(mine), len(hf))) if mine[t] != hf[t])
        ids = torch.tensor([prompts[i] + hf[:k]], device="cuda")
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        gaps.append(float(top[0] - top[1]))
    print(f"greedy vs transformers ({a.model}): {same} of {len(ours)} sequences identical; "
          f"first differences (prompt, shardlm, transformers): {diffs[:5]}")
    if gaps:
        print(f"top-two logit gap (transformers) where they differ: max {max(gaps):.4f}, median "
              f"{sorted(gaps)[len(gaps) // 2]:.4f} over {len(gaps)} sequences")


if __name__ == "__main__":
    main()
