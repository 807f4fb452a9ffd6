#!/usr/bin/env python3
"""hf_logits_check.py — an HF model directory shardlm wrote, loaded by transformers: the same logits.

Loads MODEL_DIR with transformers' AutoModelForCausalLM in fp32 (eager
attention, on the GPU when there is one), draws seeded random token rows, and
compares transformers' logits with `shardlm forward --hf MODEL_DIR` (the CPU
backend, fp32) on the same rows. Prints the architecture, the worst relative
error (max |a - b| / max |b| per row) and exits 1 above --tol. Any architecture
shardlm exports (dense and experts); the check an export must pass before a
user hands it to another tool.

    python3 tools/hf_logits_check.py MODEL_DIR --shardlm build/shardlm [--rows 4 --len 24 --tol 1e-5]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import h5py
import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--shardlm", default="build/shardlm")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--len", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-5)
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    with open(os.path.join(a.model, "config.json")) as fh:
        cfg = json.load(fh)
    rng = np.random.default_rng(a.seed)
    tokens = rng.integers(0, cfg["vocab_size"], size=(a.rows, a.len), dtype=np.int32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="eager").to(dev)
    model.eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens.astype(np.int64)).to(dev)).logits.float().cpu().numpy()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "tokens.h5"), os.path.join(tmp, "logits.h5")
        with h5py.File(src, "w") as f:
            f["tokens"] = tokens
        subprocess.run([a.shardlm, "forward", "--hf", a.model, "--tokens", src, "--out", out], check=True)
        with h5py.File(out) as f:
            got = f["logits"][()]
    if got.shape != ref.shape:
        print(f"hf_logits_check.py: shardlm's logits {got.shape}, transformers' {ref.shape}")
        sys.exit(1)
    worst = max(float(np.abs(got[r] - ref[r]).max() / np.abs(ref[r]).max()) for r in range(a.rows))
    print(json.dumps({"model": a.model, "architecture": cfg["architectures"][0], "rows": a.rows, "len": a.len,
                      "worst_relative_error": worst, "tol": a.tol, "pass": worst <= a.tol}))
    sys.exit(0 if worst <= a.tol else 1)


if __name__ == "__main__":
    main()
