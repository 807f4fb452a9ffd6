#!/usr/bin/env python3
"""make_rollouts.py — write synthetic RL rollout files from a shardlm token file.

Run it with an interpreter that has h5py and numpy, e.g. /usr/bin/python3:

    /usr/bin/python3 tools/make_rollouts.py inputs/data/tiny.h5 --out runs/tiny-rl/rollouts --steps 20

For each step N in FIRST .. FIRST+STEPS-1 it writes OUT/step_N.h5 (as
step_N.h5.tmp, then renamed, like a real inference server must), holding
SAMPLES documents of the token file (made by tools/make_dataset.py), each cut
to at most MAX_TOKENS tokens and split in halves: the first half is the prompt
(loss_mask 0), the second the completion (loss_mask 1). Advantages are seeded
standard normal, per sample (or per token with --per-token-advantages);
inference logprobs are log(uniform(LO, HI)) on completion tokens and 0 on
prompt tokens; temperature is --temperature for every sample; the attributes
are step = N and policy_step = max(0, N - LAG). The output for a given
(seed, step) is the same bytes every time. Format: docs/rollouts.md.

Exit status: 0 written, 1 bad input file (nothing written), 2 bad command line.
"""

import argparse
import os
import sys

try:
    import h5py
    import numpy as np
except ImportError as missing:  # pragma: no cover - depends on the interpreter
    sys.exit(f"make_rollouts.py: {missing}; run it with an interpreter that has h5py and numpy "
             f"(e.g. /usr/bin/python3 tools/make_rollouts.py ...)")


class InputError(Exception):
    """A problem with the token file, formatted as 'FILE: reason'."""


def read_documents(path, max_tokens):
    """The token file's documents, each cut to max_tokens; those with < 2 tokens dropped."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: token file does not exist")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise InputError(f"{path}: not an HDF5 file ({e})") from None
    with f:
        for name in ("tokens", "offsets"):
            if name not in f:
                raise InputError(f"{path}: no dataset '{name}'; make token files with tools/make_dataset.py")
        tokens = f["tokens"][:].astype(np.int32)
        offsets = f["offsets"][:].astype(np.int64)
        vocab_size = int(f.attrs["vocab_size"]) if "vocab_size" in f.attrs else None
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise InputError(f"{path}: 'offsets' must start at 0, not decrease and end at len(tokens)")
    docs = [tokens[offsets[d]:offsets[d + 1]][:max_tokens] for d in range(len(offsets) - 1)]
    docs = [d for d in docs if len(d) >= 2]
    if not docs:
        raise InputError(f"{path}: no document with at least 2 tokens")
    return docs, vocab_size


def make_step(docs, step, args):
    """The arrays of step_<step>.h5; a function of (seed, step) only."""
    rng = np.random.default_rng([args.seed, step])
    chosen = rng.choice(len(docs), size=args.samples_per_step, replace=args.samples_per_step > len(docs))
    samples = [docs[i] for i in chosen]
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    tokens = np.concatenate(samples).astype(np.int32)
    loss_mask = np.zeros(len(tokens), dtype=np.uint8)
    for s, n in enumerate(lengths):
        prompt = n // 2  # >= 1: the completion is the second half, at least 1 token
        loss_mask[offsets[s] + prompt:offsets[s + 1]] = 1
    n_adv = len(tokens) if args.per_token_advantages else len(samples)
    advantages = rng.standard_normal(n_adv).astype(np.float32)
    lo, hi = args.logprob_range
    logprobs = np.log(rng.uniform(lo, hi, len(tokens))).astype(np.float32)
    logprobs[loss_mask == 0] = 0.0  # prompt positions are never read; 0 by convention
    temperature = np.full(len(samples), args.temperature, dtype=np.float32)
    return dict(tokens=tokens, offsets=offsets, loss_mask=loss_mask, advantages=advantages,
                inference_logprobs=logprobs, temperature=temperature)


def write_step(out_dir, step, policy_step, arrays):
    path = os.path.join(out_dir, f"step_{step}.h5")
    tmp = path + ".tmp"
    # track_times=False: the same (seed, step) gives byte-identical files.
    with h5py.File(tmp, "w") as f:
        for name, values in arrays.items():
            f.create_dataset(name, data=values, track_times=False)
        f.attrs["step"] = np.int64(step)
        f.attrs["policy_step"] = np.int64(policy_step)
    os.replace(tmp, path)  # the final name appears only when the file is complete
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Write synthetic RL rollout files (step_N.h5) from a shardlm token file.")
    parser.add_argument("data", help="token file made by tools/make_dataset.py")
    parser.add_argument("--out", required=True, help="rollout directory (data.rollout_dir); created if missing")
    parser.add_argument("--steps", type=int, required=True, help="number of step files to write")
    parser.add_argument("--first-step", type=int, default=0, help="N of the first file (default 0)")
    parser.add_argument("--samples-per-step", type=int, default=8, help="samples per file (default 8)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cut samples to this many tokens (<= data.seq_len + 1 for the trainer)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sample choice, advantages, logprobs")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every sample")
    parser.add_argument("--lag", type=int, default=0, help="policy_step = max(0, step - LAG) (default 0)")
    parser.add_argument("--per-token-advantages", action="store_true",
                        help="one advantage per token instead of per sample")
    parser.add_argument("--logprob-range", type=float, nargs=2, default=(0.05, 0.95), metavar=("LO", "HI"),
                        help="inference probabilities are uniform in [LO, HI) (default 0.05 0.95)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.first_step < 0:
        parser.error("--first-step must be >= 0")
    if args.samples_per_step < 1:
        parser.error("--samples-per-step must be at least 1")
    if args.max_tokens is not None and args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 (a prompt token and a completion token)")
    if not (args.temperature > 0 and np.isfinite(args.temperature)):
        parser.error("--temperature must be positive")
    if args.lag < 0:
        parser.error("--lag must be >= 0")
    lo, hi = args.logprob_range
    if not 0 < lo < hi <= 1:
        parser.error("--logprob-range needs 0 < LO < HI <= 1")

    try:
        docs, vocab_size = read_documents(args.data, args.max_tokens)
    except InputError as e:
        print(f"make_rollouts.py: {e}; nothing written", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    n_tokens = n_loss = 0
    for step in range(args.first_step, args.first_step + args.steps):
        arrays = make_step(docs, step, args)
        write_step(args.out, step, max(0, step - args.lag), arrays)
        n_tokens += len(arrays["tokens"])
        n_loss += int(arrays["loss_mask"].sum())
    last = args.first_step + args.steps - 1
    vocab = f", vocab_size {vocab_size}" if vocab_size is not None else ""
    print(f"wrote {args.steps} files step_{args.first_step}.h5 .. step_{last}.h5 to {args.out}: "
          f"{args.samples_per_step} samples each, {n_tokens} tokens, {n_loss} completion tokens{vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
