#!/usr/bin/env python3
"""fidelity_vs_hf.py — shardlm's loss curve beside Hugging Face transformers' over a long run
with the same model, data, order and optimizer, on the GPU machine, in one call.

  1. a model of the Llama-3.2-1B (--shape llama-1b) or Qwen3-1.7B (--shape qwen3-1.7b) shape,
     random init by transformers (seed 0), saved in fp32 (shardlm reads it through model.hf);
  2. a learnable token stream of --docs documents of seq + 1 tokens (one document fills one row,
     and the loss falls fast from ln(vocab)), seeded; --stream picks it:
       zipf    each document a run of "words" drawn (Zipf) from a fixed dictionary of random
               token sequences;
       markov  a Markov chain over --markov-ids active ids drawn at random from the vocabulary:
               the next id is the current one's fixed successor (a random permutation of the
               active ids) with probability --markov-p, else uniform over the active ids; each
               document starts at a uniform active id. The rest of the vocabulary never occurs,
               so the fast descent is mostly the model learning to push 124K never-seen ids
               down (at the 1B shape) and the successor table;
  3. shardlm train on it: rows in file order (data.shuffle = false), --rows rows a step,
     AdamW (lr --lr constant, betas 0.9 / 0.95, eps 1e-8, weight decay 0.1 on matrices and the
     embedding, clip 1.0), `--set` overrides appended (the precision switches under study);
  4. transformers on the same rows in the same order: fp32 parameters, bf16 autocast, one row
     per micro-batch (loss / rows each, so the step's loss is the mean over its tokens), fused
     torch AdamW with the same groups, clip_grad_norm_ 1.0; eager, and torch.compile
     (--variants eager,compile);
     Emulations of shardlm's precision on the transformers side, one at a time, find where a gap
     comes from without a shardlm build per switch (--variants eager+bf16-residual, ...):
       bf16-residual  the residual stream (the embedding's output, each block's two sums) and its
                      gradient rounded to bf16, as shardlm's CUDA backend keeps them between kernels;
       bf16-params    the forward reads bf16-rounded parameters (the norm weights and the embedding
                      rows too, which autocast leaves fp32) and AdamW updates fp32 masters with the
                      gradients of those: FSDP's bf16 gather, as shardlm's units are gathered;
       bf16-norms     the same for the norm weights alone (RMSNorms, Qwen3's q/k norms: every 1-D
                      parameter), bf16-embed for the embedding alone: which half of bf16-params
                      moves the curve;
       fp32-wgrad     every linear's weight gradient (the tied lm head's too) leaves its GEMM in fp32,
                      as shardlm's cuBLASLt GEMMs accumulate into the fp32 gradient (autocast's bf16
                      GEMM rounds each micro-batch's weight gradient to bf16 before the fp32 sum);
                      the forward and the input gradients stay autocast's;
       bf16-dembed    the stream's gradient at the embedding's output rounded to bf16 before the
                      table's fp32 sum (the forward unchanged), as shardlm's fp32 stream hands the
                      embedding backward its bf16 copy;
  5. the table: per window of steps, the mean relative loss difference to transformers eager
     (and its max |.|) for shardlm and for compile (transformers' own spread), and the mean
     loss of the last 10 steps; each window's mean gradient norm (before clipping) per curve;
     losses.json with every curve and gradnorms.json with their norms, both rewritten after
     each run (a call cut short keeps the runs it finished).

  python3 tools/fidelity_vs_hf.py --shardlm build/shardlm --shape llama-1b --steps 150 --out runs/fidelity
  python3 tools/fidelity_vs_hf.py ... --label bf16-stream --set model.residual_dtype=bf16   (a switch)
  python3 tools/fidelity_vs_hf.py ... --skip-hf runs/fidelity/losses.json   (reuse transformers' curves)
  python3 tools/fidelity_vs_hf.py ... --variants eager,eager+bf16-residual,eager+bf16-params
  python3 tools/fidelity_vs_hf.py ... --variants eager,eager+bf16-norms,eager+bf16-embed
  python3 tools/fidelity_vs_hf.py ... --repeats 3 --hf-repeats 2   (shardlm 3 times, each transformers variant
      twice: how far a rerun alone moves a window, and the test on the mean curves)
  python3 tools/fidelity_vs_hf.py ... --stream markov --steps 65   (the Markov stream; tools/fidelity_markov.sh)
  python3 tools/fidelity_vs_hf.py ... --skip-hf OUT/losses.json --skip-done --repeats 2   (add runs to OUT's
      curves: only those losses.json lacks, here shardlm's second run)
  python3 tools/fidelity_vs_hf.py ... --skip-hf OUT/losses.json --variants "" --repeats 0   (the tables alone)
  python3 tools/fidelity_vs_hf.py ... --variants eager,compile --hf-repeats 2   (with eager's rerun: the table
      then adds the rerun bound, each window within the larger of 2x |compile - eager| and |eager #k - eager|,
      the farthest of eager's reruns)

Needs torch, transformers, h5py and numpy (tools/fidelity_vs_hf.sh finds that python).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np

WINDOWS = [(1, 10), (11, 20), (21, 40), (41, 65), (66, 90), (91, 150)]

SHAPES = {
    "llama-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen3-1.7b": dict(arch="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def make_model(path, shape, seq):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    s = dict(SHAPES[shape])
    arch = s.pop("arch")
    common = dict(max_position_embeddings=max(seq, 4096), bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        config, cls = LlamaConfig(**s, **common), LlamaForCausalLM
    else:
        config, cls = Qwen3Config(**s, **common), Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return config


def make_data(path, vocab, docs, doc_len, seed):
    """Documents of doc_len tokens: Zipf-drawn words of a fixed dictionary of random id sequences."""
    rng = np.random.default_rng(seed)
    words = [rng.integers(0, vocab, size=int(n), dtype=np.int32) for n in rng.integers(2, 9, size=4096)]
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    p /= p.sum()
    out = np.empty(docs * doc_len, dtype=np.int32)
    for d in range(docs):
        picks = rng.choice(len(words), size=doc_len // 2 + 1, p=p)  # words have >= 2 ids: always enough
        out[d * doc_len:(d + 1) * doc_len] = np.concatenate([words[i] for i in picks])[:doc_len]
    with h5py.File(path + ".tmp", "w") as f:
        f.create_dataset("tokens", data=out)
        f.create_dataset("offsets", data=np.arange(0, out.size + 1, doc_len, dtype=np.int64))
        f.attrs["vocab_size"] = np.int64(vocab)
        f.attrs["tokenizer"] = "fidelity_vs_hf.py: Zipf words of random ids"
    os.replace(path + ".tmp", path)
    return out.reshape(docs, doc_len)


def make_markov(path, vocab, docs, doc_len, seed, active=4096, p_next=0.8):
    """Documents of doc_len tokens: a Markov chain over `active` ids drawn at random from the vocabulary.
    From id a the next id is succ(a) (a fixed random permutation of the active ids) with probability
    p_next, else uniform over the active ids (succ(a) included); each document starts uniformly.
    Documents are independent draws, written in the order drawn."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(vocab, size=active, replace=False)).astype(np.int32)
    succ = rng.permutation(active)
    state = rng.integers(0, active, size=docs)
    out = np.empty((docs, doc_len), dtype=np.int32)
    for t in range(doc_len):  # all documents a position at a time
        out[:, t] = ids[state]
        jump = rng.random(docs) >= p_next
        state = np.where(jump, rng.integers(0, active, size=docs), succ[state])
    with h5py.File(path + ".tmp", "w") as f:
        f.create_dataset("tokens", data=out.reshape(-1))
        f.create_dataset("offsets", data=np.arange(0, out.size + 1, doc_len, dtype=np.int64))
        f.attrs["vocab_size"] = np.int64(vocab)
        f.attrs["tokenizer"] = f"fidelity_vs_hf.py: Markov chain over {active} random ids, successor p {p_next}"
        f.attrs["markov_ids"] = ids
        f.attrs["markov_successor"] = ids[succ]
    os.replace(path + ".tmp", path)
    return out


def markov_entropy(active, p_next):
    """The chain's entropy rate in nats a token: the loss a model that knows the chain reaches."""
    q = (1 - p_next) / active
    return -((p_next + q) * np.log(p_next + q) + (active - 1) * q * np.log(q))


def model_and_data(args, data_suffix=""):
    """The model directory (--model, or --shape's random init made once under --out), its tag, and
    the data file data-TAG{data_suffix}.h5 under --out (--docs documents of --stream, made once; the
    Markov stream's name says its parameters)."""
    model_dir = os.path.abspath(args.model) if args.model else os.path.join(args.out, f"model-{args.shape}")
    tag = os.path.basename(model_dir.rstrip("/")) if args.model else args.shape
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        make_model(model_dir, args.shape, args.seq)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    stream = getattr(args, "stream", "zipf")
    if stream == "markov":
        data_suffix = f"-markov{args.markov_ids}-p{args.markov_p:g}-s{args.markov_seed}{data_suffix}"
    data_path = os.path.join(args.out, f"data-{tag}{data_suffix}.h5")
    if not os.path.isfile(data_path):
        if stream == "markov":
            make_markov(data_path, vocab, args.docs, args.seq + 1, args.markov_seed, args.markov_ids, args.markov_p)
        else:
            make_data(data_path, vocab, args.docs, args.seq + 1, seed=1)
    return model_dir, tag, data_path


def run_shardlm(args, model_dir, data_path, run_dir, label, norms=None):
    """shardlm train on the deck below (+ --set): its losses a step; norms, if given, gets its gradient
    norms (before clipping)."""
    deck = os.path.join(args.out, f"fidelity-{label}.toml")
    with open(deck, "w") as f:
        f.write(f"""[run]
name = "fidelity-{label}"
dir = "{run_dir}"
max_steps = {args.steps}
seed = 0

[model]
hf = "{model_dir}"

[data]
path = "{data_path}"
seq_len = {args.seq}
micro_batch = 1
global_batch = {args.rows}
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

[ckpt]
interval = 0
save_final = false
resume = "none"

[device]
backend = "{args.device}"

[log]
interval = 1
""")
    cmd = [args.shardlm, "train", deck]
    for s in args.set:
        cmd += ["--set", s]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(args.out, f"shardlm-{label}.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        sys.exit(f"shardlm train failed ({p.returncode}); log in {args.out}/shardlm-{label}.log:\n{p.stderr[-3000:]}")
    losses, gnorms = {}, {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and "loss" in r:
                losses[int(r["step"])] = float(r["loss"])
                if "grad_norm" in r:
                    gnorms[int(r["step"])] = float(r["grad_norm"])
    print(f"shardlm {label}: {len(losses)} steps in {time.time() - t0:.0f} s", flush=True)
    if norms is not None:
        norms.extend(gnorms.get(s, float("nan")) for s in sorted(losses))
    return [losses[s] for s in sorted(losses)]


EMULATIONS = ("bf16-residual", "bf16-params", "bf16-norms", "bf16-embed", "fp32-wgrad", "bf16-dembed")


def round_bf16_fn():
    """x -> x rounded to bf16 (kept in x's dtype), and the gradient likewise on the way back."""
    import torch

    class RoundBF16(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.to(torch.bfloat16).to(x.dtype)

        @staticmethod
        def backward(ctx, g):
            return g.to(torch.bfloat16).to(g.dtype)

    return RoundBF16.apply


def round_grad_bf16_fn():
    """x -> x unchanged, its gradient rounded to bf16 (kept in its dtype) on the way back."""
    import torch

    class RoundGradBF16(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g.to(torch.bfloat16).to(g.dtype)

    return RoundGradBF16.apply


def emulate_bf16_dembed(embed):
    """A hook that rounds the gradient reaching the embedding's output to bf16."""
    rnd = round_grad_bf16_fn()
    return embed.register_forward_hook(lambda m, i, out: rnd(out))


def emulate_bf16_residual(model, decoder_layers, embed):
    """Hooks that round the residual stream and its gradient to bf16 where shardlm's CUDA backend
    stores it: the embedding's output, and each block's sum after attention and after the MLP.
    A block computes x + attn(x) and mid + mlp(mid); the hooks return round(x + h) - x for h, so
    the block's own sum gives round(x + h) (exact: x and round(x + h) are both bf16 values)."""
    rnd = round_bf16_fn()
    handles = [embed.register_forward_hook(lambda m, i, out: rnd(out))]

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def replace_first(out, h):
        return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

    for layer in decoder_layers:
        seen = {}

        def block_in(m, args, seen=seen):  # the block's input is its first norm's
            seen["x"] = args[0]

        def attn_out(m, inputs, out, seen=seen):
            x = seen["x"]
            return replace_first(out, rnd(x + first(out)) - x)

        def mlp_in(m, args, seen=seen):
            seen["mid"] = args[0]

        def mlp_out(m, inputs, out, seen=seen):
            mid = seen["mid"]
            return rnd(mid + out) - mid

        handles += [layer.input_layernorm.register_forward_pre_hook(block_in),
                    layer.self_attn.register_forward_hook(attn_out),
                    layer.post_attention_layernorm.register_forward_pre_hook(mlp_in),
                    layer.mlp.register_forward_hook(mlp_out)]
    return handles


def wgrad_fp32_product(g, x):
    """g^T x of bf16 matrices with fp32 accumulation and an fp32 result (no bf16 rounding of the sum)."""
    import torch
    if g.is_cuda:
        try:
            return torch.mm(g.t(), x, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # an older torch: tf32 holds bf16 values exactly
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return g.t().float() @ x.float()
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
    return g.t().float() @ x.float()


def linear_fp32_wgrad_fn():
    """(x, w) -> x w^T as autocast computes it (bf16 operands, bf16 out, dx from a bf16 GEMM), except
    that dw leaves its GEMM in fp32."""
    import torch
    import torch.nn.functional as F

    class LinearF32WGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
            ctx.save_for_backward(xb, wb)
            ctx.x_dtype = x.dtype
            return F.linear(xb, wb)

        @staticmethod
        def backward(ctx, g):
            xb, wb = ctx.saved_tensors
            gb = g.to(torch.bfloat16)
            dx = (gb @ wb).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
            dw = None
            if ctx.needs_input_grad[1]:
                dw = wgrad_fp32_product(gb.reshape(-1, gb.shape[-1]), xb.reshape(-1, xb.shape[-1]))
            return dx, dw

    return LinearF32WGrad.apply


def emulate_fp32_wgrad(model):
    """Every nn.Linear of the model (the lm head too) through linear_fp32_wgrad_fn; returns how many."""
    import types
    import torch.nn as nn
    fn = linear_fp32_wgrad_fn()

    def forward(self, x):
        out = fn(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.forward = types.MethodType(forward, m)
            n += 1
    return n


def run_hf(args, model_dir, rows, variant, device="cuda", norms=None):
    """One transformers run: variant = eager | compile, optionally +EMULATION...; norms, if given, gets
    its gradient norms (before clipping)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    base, *emulate = variant.split("+")
    assert base in ("eager", "compile") and all(e in EMULATIONS for e in emulate), variant
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(device)
    model.config.use_cache = False
    params = list(model.parameters())
    # bf16-params (-norms, -embed): AdamW owns fp32 masters of those parameters; the model's hold their
    # bf16 roundings (the other parameters are their own masters).
    embed_weight = model.get_input_embeddings().weight
    rounded = [("bf16-params" in emulate or ("bf16-norms" in emulate and p.ndim < 2) or
                ("bf16-embed" in emulate and p is embed_weight)) for p in params]
    masters = [p.detach().clone() if r else p for p, r in zip(params, rounded)]
    decay = [m for p, m in zip(params, masters) if p.ndim >= 2]
    no_decay = [m for p, m in zip(params, masters) if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if device == "cuda" else {}))
    if "bf16-residual" in emulate:
        emulate_bf16_residual(model, model.model.layers, model.model.embed_tokens)
    if "fp32-wgrad" in emulate:
        emulate_fp32_wgrad(model)
    if "bf16-dembed" in emulate:
        emulate_bf16_dembed(model.model.embed_tokens)
    step_fn = torch.compile(model) if base == "compile" else model
    losses = []
    t0 = time.time()
    for step in range(args.steps):
        with torch.no_grad():
            for p, m, r in zip(params, masters, rounded):
                if r:
                    p.copy_(m.to(torch.bfloat16))
        total = 0.0
        for r in range(args.rows):
            doc = torch.from_numpy(rows[(step * args.rows + r) % len(rows)].astype(np.int64)).to(device)
            x, y = doc[:-1][None], doc[1:]
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = step_fn(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y) / args.rows
            loss.backward()
            total += loss.item()
        for p, m, r in zip(params, masters, rounded):
            if r:
                m.grad, p.grad = p.grad, None
        gnorm = torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if norms is not None:
            norms.append(float(gnorm))
    print(f"transformers {variant}: {args.steps} steps in {time.time() - t0:.0f} s", flush=True)
    del model, opt, step_fn, masters, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return losses


def table(curves, reference="transformers eager"):
    ref = np.asarray(curves[reference])
    lines = ["| steps | " + " | ".join(f"{k} − eager: mean (max abs)" for k in curves if k != reference) + " |",
             "| --- |" + " --- |" * (len(curves) - 1)]
    for a, b in WINDOWS:
        if a > len(ref):
            break
        b = min(b, len(ref))
        cells = []
        for k, v in curves.items():
            if k == reference:
                continue
            rel = (np.asarray(v[a - 1:b]) - ref[a - 1:b]) / ref[a - 1:b]
            cells.append(f"{rel.mean():+.1e} ({np.abs(rel).max():.1e})")
        lines.append(f"| {a}–{b} | " + " | ".join(cells) + " |")
    last = " | ".join(f"{k} {np.mean(v[-10:]):.4f}" for k, v in curves.items())
    lines.append(f"\nlast 10 steps, mean loss: {last}")
    return "\n".join(lines)


def norm_table(norms, steps):
    """Each window's mean gradient norm (before clipping) per curve."""
    names = [k for k, v in norms.items() if v]
    if not names:
        return ""
    lines = ["| steps | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for a, b in WINDOWS:
        if a > steps:
            break
        b = min(b, steps)
        lines.append(f"| {a}–{b} | " + " | ".join(f"{np.nanmean(norms[k][a - 1:b]):.3f}" if len(norms[k]) >= b
                                                   else "" for k in names) + " |")
    return "\n".join(lines)


# The fidelity test: in each of these windows the mean relative difference to
# transformers eager is within 1.5x transformers' own compile - eager mean, and
# the last 10 steps' mean loss within 0.1% of eager's.
ISSUE_WINDOWS = [(1, 10), (11, 20), (21, 40), (41, 65)]


def issue_test(curves, reference="transformers eager", spread="transformers compile", factor=1.5,
               last_tolerance=1e-3):
    """One line per shardlm curve: each window's |mean| against factor x |spread's mean|, and the last 10.
    Returns (lines, {curve: holds})."""
    if reference not in curves or spread not in curves:
        return [f"(the fidelity test needs '{reference}' and '{spread}')"], {}
    ref, comp = np.asarray(curves[reference]), np.asarray(curves[spread])
    lines, verdicts = [], {}
    for k, v in curves.items():
        if not k.startswith("shardlm"):
            continue
        v = np.asarray(v)
        holds, cells = True, []
        for a, b in ISSUE_WINDOWS:
            if b > len(ref):
                break
            mine = float(np.mean((v[a - 1:b] - ref[a - 1:b]) / ref[a - 1:b]))
            theirs = float(np.mean((comp[a - 1:b] - ref[a - 1:b]) / ref[a - 1:b]))
            ok = abs(mine) <= factor * abs(theirs)
            holds &= ok
            cells.append(f"{a}–{b} {abs(mine):.1e} vs {factor} x {abs(theirs):.1e} {'ok' if ok else 'NO'}")
        last = float(np.mean(v[-10:]) / np.mean(ref[-10:]) - 1)
        ok = abs(last) <= last_tolerance
        holds &= ok
        cells.append(f"last 10 {last:+.2%} (within {last_tolerance:.1%}: {'ok' if ok else 'NO'})")
        verdicts[k] = holds
        lines.append(f"{k}: {'HOLDS' if holds else 'does not hold'}: " + "; ".join(cells))
    return lines, verdicts


# The rerun bound: each window's mean relative difference of shardlm to transformers eager is
# within the larger of 2x transformers' own compile - eager and eager's rerun - eager: what a
# change of kernels alone, or no change at all, moves the curve by.
BOUND_WINDOWS = [(1, 10), (11, 20), (21, 40), (41, 65), (66, 100)]


def bound_test(curves, reference="transformers eager", spread="transformers compile", factor=2.0):
    """A table, one row per window: each shardlm setting's mean relative difference to the reference
    (the mean of its runs' window means), compile - eager, the reference's reruns ('transformers
    eager #2', '#3', ...) - eager (the one farthest from it), the bound (the larger of factor x
    |compile - eager| and the farthest rerun's |rerun - eager|, and which set it) and whether every
    setting is within it. Returns (lines, {setting: holds}); empty without eager, a rerun of it and
    compile."""
    reruns = [k for k in curves if base_name(k) == reference and k != reference]
    if reference not in curves or spread not in curves or not reruns:
        return [], {}
    ref = np.asarray(curves[reference])
    _, counts = mean_curves(curves)
    settings = [k for k in counts if k.startswith("shardlm")]

    def window_mean(v, a, b):
        v = np.asarray(v)
        return float(np.mean((v[a - 1:b] - ref[a - 1:b]) / ref[a - 1:b]))

    lines = ["| steps | " + " | ".join(f"{k} (n = {counts[k]})" for k in settings) +
             f" | compile − eager | rerun − eager (farthest of {len(reruns)}) | bound | within |",
             "| --- |" + " --- |" * (len(settings) + 4)]
    verdicts = {k: True for k in settings}
    for a, b in BOUND_WINDOWS:
        if b > len(ref):
            break
        comp = window_mean(curves[spread], a, b)
        again = max((window_mean(curves[k], a, b) for k in reruns), key=abs)
        bound = max(factor * abs(comp), abs(again))
        which = f"{factor:g} × compile" if factor * abs(comp) >= abs(again) else "rerun"
        cells, ok_all = [], True
        for k in settings:
            runs = [v for name, v in curves.items() if base_name(name) == k]
            mine = float(np.mean([window_mean(v, a, b) for v in runs]))
            ok = abs(mine) <= bound
            verdicts[k] &= ok
            ok_all &= ok
            cells.append(f"{mine:+.1e}")
        lines.append(f"| {a}–{b} | " + " | ".join(cells) +
                     f" | {comp:+.1e} | {again:+.1e} | {bound:.1e} ({which}) | {'yes' if ok_all else 'NO'} |")
    return lines, verdicts


def base_name(curve):
    """'shardlm default #2' -> 'shardlm default': the setting a repeated run belongs to."""
    return curve.split(" #")[0]


def mean_curves(curves):
    """Each setting's curves (its repeats 'NAME', 'NAME #2', ...) averaged step by step, under its
    name with ' (mean of N)' when N > 1; returns (means, {setting: N})."""
    groups = {}
    for k, v in curves.items():
        groups.setdefault(base_name(k), []).append(np.asarray(v, dtype=np.float64))
    means, counts = {}, {}
    for k, runs in groups.items():
        n = min(len(r) for r in runs)
        means[k] = list(np.mean([r[:n] for r in runs], axis=0))
        counts[k] = len(runs)
    return means, counts


def spread_table(curves, reference="transformers eager"):
    """For each setting run more than once: per window, the range (max - min) over its runs of the
    window's mean relative difference to the reference's mean curve: how far a rerun alone moves a
    window (cuDNN's and torch's backward kernels are not bitwise reproducible)."""
    means, counts = mean_curves(curves)
    if reference not in means:
        return ""
    ref = np.asarray(means[reference])
    repeated = [k for k, n in counts.items() if n > 1]
    if not repeated:
        return ""
    lines = ["| steps | " + " | ".join(f"{k}: range over {counts[k]} runs" for k in repeated) + " |",
             "| --- |" + " --- |" * len(repeated)]
    for a, b in WINDOWS:
        if b > len(ref):
            break
        cells = []
        for k in repeated:
            runs = [np.asarray(v) for name, v in curves.items() if base_name(name) == k]
            window = [float(np.mean((r[a - 1:b] - ref[a - 1:b]) / ref[a - 1:b])) for r in runs]
            cells.append(f"{max(window) - min(window):.1e}")
        lines.append(f"| {a}–{b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardlm", default="build/shardlm")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rows", type=int, default=4, help="rows (documents) a step")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--stream", choices=("zipf", "markov"), default="zipf", help="the token stream (see above)")
    ap.add_argument("--markov-ids", type=int, default=4096, help="markov: active ids")
    ap.add_argument("--markov-p", type=float, default=0.8, help="markov: the chance of the fixed successor")
    ap.add_argument("--markov-seed", type=int, default=1, help="markov: the seed of the ids, successors and documents")
    ap.add_argument("--out", default="runs/fidelity")
    ap.add_argument("--label", default="default", help="the shardlm curve's name (a switch under study)")
    ap.add_argument("--set", action="append", default=[], help="a shardlm --set override (repeatable)")
    ap.add_argument("--variants", default="eager,compile",
                    help="transformers runs: eager, compile, each optionally +" + "+".join(EMULATIONS))
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of the shardlm setting: NAME, NAME #2, ...; the table then adds each window's range "
                    "over a setting's runs, and the test on the mean curves")
    ap.add_argument("--hf-repeats", type=int, default=1, help="runs of each transformers variant in --variants")
    ap.add_argument("--skip-hf", default="", help="a losses.json of an earlier call: its transformers curves "
                    "(--variants then runs only those it does not have)")
    ap.add_argument("--skip-done", action="store_true", help="run no shardlm repeat that losses.json under --out "
                    "already has (without it a label's runs are made again)")
    ap.add_argument("--model", default="", help="an existing HF model directory instead of --shape's random init")
    ap.add_argument("--device", default="cuda", help="shardlm's device.backend (cpu: a check of this script)")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    model_dir, tag, data_path = model_and_data(args)
    with h5py.File(data_path) as f:
        rows = f["tokens"][()].reshape(-1, args.seq + 1)
    if args.stream == "markov":
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        print(f"Markov stream: {args.markov_ids} active ids, successor p {args.markov_p}, seed {args.markov_seed}; "
              f"entropy rate {markov_entropy(args.markov_ids, args.markov_p):.4f} nats a token "
              f"(ln(vocab) {np.log(vocab):.4f})", flush=True)
    curves, norms = {}, {}
    saved = os.path.join(args.out, "losses.json")
    saved_norms = os.path.join(args.out, "gradnorms.json")
    if os.path.isfile(saved):  # the curves of earlier calls (other switches) stay in the table
        with open(saved) as f:
            curves.update({k: v for k, v in json.load(f).items() if k.startswith("shardlm")})
    if os.path.isfile(saved_norms):
        with open(saved_norms) as f:
            norms.update(json.load(f))
    if args.skip_hf:
        with open(args.skip_hf) as f:
            earlier = json.load(f)
        curves.update({k: v for k, v in earlier.items() if k.startswith("transformers")})
    norms = {k: v for k, v in norms.items() if k in curves}

    def save():  # after every run: a call cut short keeps what it finished
        for path, what in ((saved, curves), (saved_norms, norms)):
            with open(path + ".tmp", "w") as f:
                json.dump(what, f)
            os.replace(path + ".tmp", path)

    def repeat(name, i):
        return name if i == 1 else f"{name} #{i}"

    for v in filter(None, args.variants.split(",")):  # the ones --skip-hf's file does not have
        for i in range(1, args.hf_repeats + 1):
            name = repeat(f"transformers {v}", i)
            if name not in curves:
                norms[name] = []
                curves[name] = run_hf(args, model_dir, rows, v, norms=norms[name])
                save()
    for i in range(1, args.repeats + 1):
        label = args.label if i == 1 else f"{args.label}-{i}"  # file and run names: no '#'
        name = f"shardlm {repeat(args.label, i)}"
        if args.skip_done and name in curves:
            continue
        norms[name] = []
        curves[name] = run_shardlm(args, model_dir, data_path, os.path.join(args.out, f"run-{label}"), label,
                                   norms=norms[name])
        save()
    save()
    if "transformers eager" not in curves:
        print("\n(no 'transformers eager' curve: no table)")
        return
    print(f"\n{tag}, {args.stream} stream, {args.steps} steps of {args.rows} x {args.seq} tokens, lr {args.lr}; "
          f"relative loss difference to transformers eager:\n")
    print(table(curves))
    nt = norm_table(norms, len(curves["transformers eager"]))
    if nt:
        print("\ngradient norm before clipping, window means:\n")
        print(nt)
    print("\nfidelity test (each window's |mean| within 1.5x transformers' compile - eager; last 10 within 0.1%):")
    print("\n".join(issue_test(curves)[0]))
    bound_lines, bound_verdicts = bound_test(curves)
    if bound_lines:
        print("\nrerun bound (each window within the larger of 2x |compile - eager| and the farthest eager rerun's "
              "|eager #k - eager|):\n")
        print("\n".join(bound_lines))
        print("\n".join(f"{k}: {'WITHIN' if ok else 'OUTSIDE'} the rerun bound" for k, ok in bound_verdicts.items()))
    spread = spread_table(curves)
    if spread:
        means, counts = mean_curves(curves)
        print("\nrun-to-run: each window's mean relative difference to transformers eager (mean of its runs), "
              "max - min over a setting's runs:\n")
        print(spread)
        print("\nfidelity test on each setting's mean curve (" +
              ", ".join(f"{k}: {n} run{'s' if n > 1 else ''}" for k, n in counts.items()) + "):")
        print("\n".join(issue_test(means)[0]))


if __name__ == "__main__":
    main()
