#!/usr/bin/env python3
"""make_fixtures.py — tiny Hugging Face models and PyTorch reference outputs for shardlm's tests.

Usage:  python3 tools/make_fixtures.py --out tests/fixtures [--only NAME ...]

Needs torch, transformers (5.x; 4.x also works), safetensors, h5py, numpy. Runs on CPU
in a few seconds. docs/fixtures.md describes what each fixture holds and how the tests
compare against it.

For each fixture (llama-gqa-tied, qwen3-qknorm, qwen2-bias, and the mixtures of experts
qwen3-moe and qwen2-moe, whose loss adds the load-balancing loss) it
  1. builds the model with transformers from a config, fills every parameter from a
     seeded generator (weights ~ N(0, 0.1^2), norm weights 1 + 0.1 N(0,1), biases
     0.1 N(0,1)), so every parameter matters and logits are far from uniform;
  2. saves it with save_pretrained in float32 (config.json as transformers writes it,
     model.safetensors);
  3. computes, in float64 on CPU, logits, the masked mean next-token NLL and its
     gradient for one packed batch (2 rows x 24 tokens, documents restarting their
     positions), by running each document alone through transformers and concatenating
     (that is exactly "a token never attends across documents");
  4. writes reference.h5.
It checks itself on the way: parameter names and shapes against the HF naming shardlm
uses, the saved safetensors against the in-memory weights, the config.json against the
intended architecture (both RoPE spellings), a reload through from_pretrained, and the
transformers reference against an independent float64 implementation written here that
runs the packed batch directly with block-diagonal causal masks (logits, loss and every
gradient). Any mismatch stops the script with a non-zero exit.
"""

import argparse
import inspect
import json
import math
import os
import platform
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import torch
import transformers
from safetensors import safe_open

# ----------------------------------------------------------------------------
# What the fixtures are
# ----------------------------------------------------------------------------

VOCAB = 258          # bytes 0..255, then two specials
BOS = 256
EOS = 257
SEQ_LEN = 24
INIT_STD = 0.1       # also written as initializer_range
ROW_DOC_LENGTHS = [[10, 14], [24]]   # packed rows: documents of these lengths
# Loss mask: the first k tokens of a document are a "prompt" with no loss, keyed by
# (row, document index within the row). The last token of every document has no target.
PROMPT_TOKENS = {(0, 0): 3, (0, 1): 2, (1, 0): 5}
DOC_TEXTS = [b"Hi shard", b"Packed docs!", b"The quick brown fox jumps"]   # cut to length - 2

FIXTURES = [
    dict(
        name="llama-gqa-tied",
        model_class="LlamaForCausalLM",
        config_class="LlamaConfig",
        model_type="llama",
        seed=1001,
        sizes=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
        extra=dict(attention_bias=False, mlp_bias=False),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        # With head_dim 16 and original_max 32, the 8 frequencies fall in all three llama3
        # bands (unchanged, smoothed, divided by factor) at positions < 24.
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32),
        attention_bias=False,   # q/k/v biases
        qk_norm=False,
    ),
    dict(
        name="qwen3-qknorm",
        model_class="Qwen3ForCausalLM",
        config_class="Qwen3Config",
        model_type="qwen3",
        seed=1002,
        sizes=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256),
        extra=dict(attention_bias=False, use_sliding_window=False),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rope_scaling=None,
        attention_bias=False,
        qk_norm=True,
    ),
    dict(
        name="qwen2-bias",
        model_class="Qwen2ForCausalLM",
        config_class="Qwen2Config",
        model_type="qwen2",
        seed=1003,
        sizes=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
        extra=dict(use_sliding_window=False),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rope_scaling=None,
        attention_bias=True,
        qk_norm=False,
    ),
    # Mixtures of experts, the load-balancing loss in the loss (output_router_logits).
    dict(
        name="qwen3-moe",
        model_class="Qwen3MoeForCausalLM",
        config_class="Qwen3MoeConfig",
        model_type="qwen3_moe",
        seed=1004,
        sizes=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
        extra=dict(attention_bias=False, use_sliding_window=False),
        moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=0.05),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rope_scaling=None,
        attention_bias=False,
        qk_norm=True,
    ),
    dict(
        # Three layers, decoder_sparse_step 2: layer 1 has the experts, 0 and 2 the dense MLP.
        name="qwen2-moe",
        model_class="Qwen2MoeForCausalLM",
        config_class="Qwen2MoeConfig",
        model_type="qwen2_moe",
        seed=1005,
        sizes=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
        extra=dict(use_sliding_window=False),
        moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[], output_router_logits=True,
                 router_aux_loss_coef=0.05),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rope_scaling=None,
        attention_bias=True,
        qk_norm=False,
    ),
]


def sparse_layer(fx, i):
    """Whether layer i's MLP is the experts (transformers' rule: decoder_sparse_step, mlp_only_layers)."""
    moe = fx.get("moe")
    return bool(moe) and i not in moe["mlp_only_layers"] and (i + 1) % moe["decoder_sparse_step"] == 0

# Self-check tolerances, as ||a - b|| / ||b||. transformers computes RMSNorm, RoPE
# cos/sin and the attention softmax in float32 even for a float64 model, so its
# "float64" reference carries ~1e-7 relative error; these bounds leave room for that
# and nothing else.
TOL_LOGITS = 1e-5
TOL_LOSS = 1e-6
TOL_GRADS = 1e-4
MAX_DIR_BYTES = 1_300_000


class FixtureError(RuntimeError):
    pass


def check(cond, message):
    if not cond:
        raise FixtureError(message)


def rel_err(a, b):
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


# ----------------------------------------------------------------------------
# The batch
# ----------------------------------------------------------------------------

def make_batch():
    """tokens, positions, seq_ids, targets, weights: int32/float32 arrays (rows, SEQ_LEN);
    docs: per row, a list of (start, length)."""
    rows = len(ROW_DOC_LENGTHS)
    tokens = np.zeros((rows, SEQ_LEN), np.int32)
    positions = np.zeros((rows, SEQ_LEN), np.int32)
    seq_ids = np.zeros((rows, SEQ_LEN), np.int32)
    targets = np.full((rows, SEQ_LEN), -1, np.int32)
    weights = np.zeros((rows, SEQ_LEN), np.float32)
    docs = []
    text_index = 0
    for r, lengths in enumerate(ROW_DOC_LENGTHS):
        check(sum(lengths) == SEQ_LEN, f"row {r}: documents {lengths} do not fill {SEQ_LEN} tokens")
        row_docs = []
        start = 0
        for d, n in enumerate(lengths):
            text = DOC_TEXTS[text_index][: n - 2]
            text_index += 1
            check(len(text) == n - 2, f"document text too short for length {n}")
            doc = [BOS] + list(text) + [EOS]
            tokens[r, start:start + n] = doc
            positions[r, start:start + n] = np.arange(n)
            seq_ids[r, start:start + n] = d
            prompt = PROMPT_TOKENS.get((r, d), 0)
            for t in range(n - 1):
                targets[r, start + t] = doc[t + 1]
                weights[r, start + t] = 0.0 if t < prompt else 1.0
            row_docs.append((start, n))
            start += n
        docs.append(row_docs)
    return tokens, positions, seq_ids, targets, weights, docs


def masked_mean_nll(logits, targets, weights):
    """sum over tokens of weight * NLL(target) / sum of weights; logits (R, T, V) float64."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    t = torch.as_tensor(targets, dtype=torch.long).clamp(min=0)
    nll = -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    w = torch.as_tensor(weights, dtype=torch.float64)
    return (nll * w).sum() / w.sum()


# ----------------------------------------------------------------------------
# Building the model with transformers (4.x and 5.x)
# ----------------------------------------------------------------------------

def make_config(fx):
    config_cls = getattr(transformers, fx["config_class"])
    kwargs = dict(fx["sizes"])
    kwargs.update(fx["extra"])
    kwargs.update(fx.get("moe", {}))
    kwargs.update(rms_norm_eps=fx["rms_norm_eps"], tie_word_embeddings=fx["tie_word_embeddings"],
                  initializer_range=INIT_STD, hidden_act="silu", bos_token_id=BOS, eos_token_id=EOS,
                  pad_token_id=None, use_cache=False, attention_dropout=0.0)
    params = inspect.signature(config_cls.__init__).parameters
    if "rope_parameters" in params:
        # transformers 5.x: one dict holds the base and the scaling.
        rope = dict(fx["rope_scaling"] or dict(rope_type="default"))
        rope["rope_theta"] = fx["rope_theta"]
        kwargs["rope_parameters"] = rope
    else:
        # transformers 4.x: rope_theta + rope_scaling.
        kwargs["rope_theta"] = fx["rope_theta"]
        kwargs["rope_scaling"] = dict(fx["rope_scaling"]) if fx["rope_scaling"] else None
    config = config_cls(**kwargs)
    check(config.model_type == fx["model_type"], f"{fx['name']}: config model_type {config.model_type}")
    return config


def effective_rope(config_or_json):
    """(theta, scaling dict or None) from a config object or a config.json dict, in either spelling."""
    get = (config_or_json.get if isinstance(config_or_json, dict)
           else lambda k, d=None: getattr(config_or_json, k, d))
    params = get("rope_parameters", None)
    scaling = get("rope_scaling", None)
    theta = get("rope_theta", None)
    d = params if params else scaling
    if d and "full_attention" in d and "rope_type" not in d:
        d = d["full_attention"]
    if d and d.get("rope_theta") is not None:
        theta = d["rope_theta"]
    rope_type = (d or {}).get("rope_type", (d or {}).get("type", "default"))
    if rope_type == "default":
        return theta, None
    keys = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    out = dict(rope_type=rope_type)
    for k in keys:
        out[k] = d.get(k, get(k, None) if k == "original_max_position_embeddings" else None)
    return theta, out


def check_rope(fx, where, theta, scaling):
    check(theta is not None and float(theta) == fx["rope_theta"],
          f"{fx['name']}: {where} has rope_theta {theta}, expected {fx['rope_theta']}")
    want = fx["rope_scaling"]
    if want is None:
        check(scaling is None, f"{fx['name']}: {where} has RoPE scaling {scaling}, expected none")
    else:
        check(scaling is not None, f"{fx['name']}: {where} lost the llama3 RoPE scaling")
        for k, v in want.items():
            check(scaling.get(k) == v, f"{fx['name']}: {where} RoPE {k} = {scaling.get(k)}, expected {v}")


def build_model(fx, config):
    model_cls = getattr(transformers, fx["model_class"])
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except TypeError:
        config._attn_implementation = "eager"
        model = model_cls(config)
    check(type(model).__name__ == fx["model_class"], f"{fx['name']}: built {type(model).__name__}")
    # transformers 5 runs experts through torch's grouped_mm by default, which
    # has no float64: the per-expert loop instead
    if fx.get("moe") and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model = model.to(torch.float32)
    model.eval()   # no dropout anywhere; gradients still flow
    return model


def expected_parameters(fx):
    """The HF names and shapes shardlm's model uses, derived from the sizes alone."""
    s = fx["sizes"]
    C, F, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    H, KV, D = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    out = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (C,)
        out[p + "post_attention_layernorm.weight"] = (C,)
        out[p + "self_attn.q_proj.weight"] = (H * D, C)
        out[p + "self_attn.k_proj.weight"] = (KV * D, C)
        out[p + "self_attn.v_proj.weight"] = (KV * D, C)
        out[p + "self_attn.o_proj.weight"] = (C, H * D)
        if fx["attention_bias"]:
            out[p + "self_attn.q_proj.bias"] = (H * D,)
            out[p + "self_attn.k_proj.bias"] = (KV * D,)
            out[p + "self_attn.v_proj.bias"] = (KV * D,)
        if fx["qk_norm"]:
            out[p + "self_attn.q_norm.weight"] = (D,)
            out[p + "self_attn.k_norm.weight"] = (D,)
        if sparse_layer(fx, i):
            m = fx["moe"]
            E, Im, Is = m["num_experts"], m["moe_intermediate_size"], m.get("shared_expert_intermediate_size", 0)
            out[p + "mlp.gate.weight"] = (E, C)
            for e in range(E):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (Im, C)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (Im, C)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (C, Im)
            if Is:
                out[p + "mlp.shared_expert.gate_proj.weight"] = (Is, C)
                out[p + "mlp.shared_expert.up_proj.weight"] = (Is, C)
                out[p + "mlp.shared_expert.down_proj.weight"] = (C, Is)
                out[p + "mlp.shared_expert_gate.weight"] = (1, C)
            continue
        out[p + "mlp.gate_proj.weight"] = (F, C)
        out[p + "mlp.up_proj.weight"] = (F, C)
        out[p + "mlp.down_proj.weight"] = (C, F)
    if not fx["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, C)
    return out


def canonical_views(fx, model, grads=False):
    """name -> tensor in the HF checkpoint naming shardlm uses (expected_parameters):
    the model's parameters (their .grad with grads=True), each expert's weights a
    view into transformers 5's fused stacks where the model keeps them fused
    (mlp.experts.gate_up_proj (E, 2 I, C): gate rows then up rows; mlp.experts.down_proj
    (E, C, I)), else the per-expert parameters as they are."""
    named = dict(model.named_parameters())   # tied weights appear once
    get = (lambda t: t.grad) if grads else (lambda t: t)
    out = {}
    for name, p in named.items():
        t = get(p)
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :I, :]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, I:, :]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        elif name.endswith("mlp.gate.weight") or not name.endswith("mlp.gate"):
            out[name] = t
        else:  # a router kept as a bare parameter
            out[name + ".weight"] = t
    return out


def randomise_parameters(fx, model):
    """Every parameter from one seeded generator, in name order, independent of transformers' init."""
    torch.manual_seed(fx["seed"])
    gen = torch.Generator().manual_seed(fx["seed"])
    named = canonical_views(fx, model)
    want = expected_parameters(fx)
    check(set(named) == set(want),
          f"{fx['name']}: parameter names differ from the HF naming shardlm expects:\n"
          f"  missing {sorted(set(want) - set(named))}\n  unexpected {sorted(set(named) - set(want))}")
    with torch.no_grad():
        for name in sorted(named):
            p = named[name]
            check(tuple(p.shape) == want[name], f"{fx['name']}: {name} has shape {tuple(p.shape)}, expected {want[name]}")
            noise = torch.randn(tuple(p.shape), generator=gen, dtype=torch.float64)
            if name.endswith(".bias"):
                value = 0.1 * noise
            elif p.dim() == 1:            # every RMSNorm weight, q_norm/k_norm included
                value = 1.0 + 0.1 * noise
            else:
                value = INIT_STD * noise
            p.copy_(value.to(p.dtype))
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if fx["tie_word_embeddings"]:
        check(emb.data_ptr() == head.data_ptr(), f"{fx['name']}: lm_head is not tied to embed_tokens")
    else:
        check(emb.data_ptr() != head.data_ptr(), f"{fx['name']}: lm_head is unexpectedly tied")
        check(not torch.equal(emb, head), f"{fx['name']}: lm_head equals embed_tokens")


def save_model(fx, model, out_dir):
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:   # 5.x dropped the argument: safetensors is the only format
        model.save_pretrained(out_dir)
    st = out_dir / "model.safetensors"
    check(st.is_file(), f"{fx['name']}: save_pretrained wrote no {st.name} "
                        f"(files: {sorted(p.name for p in out_dir.iterdir())})")
    # The file holds the checkpoint naming (per-expert tensors), whatever the model keeps in memory.
    named = canonical_views(fx, model)
    with safe_open(str(st), framework="pt") as f:
        keys = set(f.keys())
        check(keys == set(named), f"{fx['name']}: {st.name} holds {sorted(keys ^ set(named))} unexpectedly")
        for name in keys:
            t = f.get_tensor(name)
            check(t.dtype == torch.float32, f"{fx['name']}: {name} saved as {t.dtype}")
            check(torch.equal(t, named[name].detach()), f"{fx['name']}: {name} saved differs from the model")

    with open(out_dir / "config.json") as fh:
        cj = json.load(fh)
    check(cj.get("model_type") == fx["model_type"], f"{fx['name']}: config.json model_type {cj.get('model_type')}")
    check(cj.get("architectures") == [fx["model_class"]], f"{fx['name']}: config.json architectures {cj.get('architectures')}")
    for k, v in fx["sizes"].items():
        if k == "head_dim" and fx["model_type"] == "qwen2":
            check(cj.get(k) in (None, v), f"{fx['name']}: config.json head_dim {cj.get(k)}")
            continue
        check(cj.get(k) == v, f"{fx['name']}: config.json {k} = {cj.get(k)}, expected {v}")
    check(cj.get("rms_norm_eps") == fx["rms_norm_eps"], f"{fx['name']}: config.json rms_norm_eps {cj.get('rms_norm_eps')}")
    check(bool(cj.get("tie_word_embeddings", False)) == fx["tie_word_embeddings"],
          f"{fx['name']}: config.json tie_word_embeddings {cj.get('tie_word_embeddings')}")
    check(not cj.get("attention_bias", False) or fx["model_type"] in ("qwen2", "qwen2_moe"),
          f"{fx['name']}: attention_bias set")
    for k, v in fx.get("moe", {}).items():
        # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
        got = cj.get(k, cj.get("num_local_experts")) if k == "num_experts" else cj.get(k)
        check(got == v, f"{fx['name']}: config.json {k} = {got}, expected {v}")
    check(not cj.get("use_sliding_window", False), f"{fx['name']}: sliding window on")
    theta, scaling = effective_rope(cj)
    check_rope(fx, "config.json", theta, scaling)
    return cj


def reload_check(fx, model, out_dir, tokens):
    """from_pretrained of what was saved computes what the in-memory model computes."""
    kwargs = dict(attn_implementation="eager")
    try:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, **kwargs)
    except TypeError:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32, **kwargs)
    reloaded.eval()
    ids = torch.as_tensor(tokens[1:2], dtype=torch.long)
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=False).logits
        b = reloaded(input_ids=ids, use_cache=False).logits
    err = rel_err(b, a)
    check(err <= 1e-6, f"{fx['name']}: reloaded model's logits differ from the saved one's (rel {err:.2e})")


# ----------------------------------------------------------------------------
# The reference: transformers, one document at a time, float64
# ----------------------------------------------------------------------------

def hf_reference(fx, model, tokens, docs, targets, weights):
    """logits, loss, grads (checkpoint names) and, with experts, the load-balancing loss:
    transformers' load_balancing_loss_func over every token of the batch (each layer's
    router logits of every document, concatenated), coefficient times it in the loss."""
    rows = []
    router = []   # per document: a tuple of each layer of experts' (n, E) logits
    for r, row_docs in enumerate(docs):
        parts = []
        for start, n in row_docs:
            ids = torch.as_tensor(tokens[r, start:start + n], dtype=torch.long).unsqueeze(0)
            pos = torch.arange(n, dtype=torch.long).unsqueeze(0)
            kwargs = dict(output_router_logits=True) if fx.get("moe") else {}
            out = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
            parts.append(out.logits[0])
            if fx.get("moe"):
                router.append(tuple(out.router_logits))
        rows.append(torch.cat(parts, dim=0))
    logits = torch.stack(rows).to(torch.float64)             # (R, T, V)
    loss = masked_mean_nll(logits, targets, weights)
    aux = None
    if fx.get("moe"):
        m = fx["moe"]
        module = sys.modules[type(model).__module__]
        layers = tuple(torch.cat([doc[l] for doc in router], dim=0) for l in range(len(router[0])))
        check(len(layers) == sum(sparse_layer(fx, i) for i in range(fx["sizes"]["num_hidden_layers"])),
              f"{fx['name']}: router logits of {len(layers)} layers")
        aux = module.load_balancing_loss_func(layers, m["num_experts"], m["num_experts_per_tok"], None)
        loss = loss + m["router_aux_loss_coef"] * aux
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: g.detach().clone() for name, g in canonical_views(fx, model, grads=True).items()}
    return logits.detach(), loss.detach(), grads, (aux.detach() if aux is not None else None)


# ----------------------------------------------------------------------------
# An independent float64 implementation (packed batch, block-diagonal masks)
# ----------------------------------------------------------------------------

def rope_inv_freq(theta, head_dim, scaling):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    out = torch.empty_like(inv_freq)
    for i in range(inv_freq.numel()):
        w, f = wavelen[i].item(), inv_freq[i].item()
        if w < high_freq_wavelen:
            out[i] = f
        elif w > low_freq_wavelen:
            out[i] = f / factor
        else:
            smooth = (old_ctx / w - low) / (high - low)
            out[i] = (1 - smooth) * f / factor + smooth * f
    return out


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def independent_forward(fx, P, tokens, positions, seq_ids, router_logits=None):
    """P: name -> float64 leaf tensor. Returns logits (R, T, V); each layer of experts'
    router logits (rows, E) are appended to router_logits."""
    router_logits = [] if router_logits is None else router_logits
    s = fx["sizes"]
    H, KV, D = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    eps = fx["rms_norm_eps"]
    tok = torch.as_tensor(tokens, dtype=torch.long)
    pos = torch.as_tensor(positions, dtype=torch.float64)
    sid = torch.as_tensor(seq_ids, dtype=torch.long)
    R, T = tok.shape

    ang = pos.unsqueeze(-1) * rope_inv_freq(fx["rope_theta"], D, fx["rope_scaling"])   # (R, T, D/2)
    cos = torch.cat((ang.cos(), ang.cos()), -1).unsqueeze(2)                           # (R, T, 1, D)
    sin = torch.cat((ang.sin(), ang.sin()), -1).unsqueeze(2)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    same_doc = sid.unsqueeze(2) == sid.unsqueeze(1)                                    # (R, T, T)
    allowed = (causal & same_doc).unsqueeze(1)                                         # (R, 1, T, T)

    x = P["model.embed_tokens.weight"][tok]                                            # (R, T, C)
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, P[p + "input_layernorm.weight"], eps)

        def proj(name):
            y = h @ P[p + f"self_attn.{name}.weight"].T
            if fx["attention_bias"]:
                y = y + P[p + f"self_attn.{name}.bias"]
            return y

        q = proj("q_proj").view(R, T, H, D)
        k = proj("k_proj").view(R, T, KV, D)
        v = proj("v_proj").view(R, T, KV, D)
        if fx["qk_norm"]:   # per-head RMSNorm before RoPE
            q = rms_norm(q, P[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, P[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=2)                                        # query head j uses kv head j // (H/KV)
        v = v.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("rthd,rshd->rhts", q, k) / math.sqrt(D)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        o = torch.einsum("rhts,rshd->rthd", attn, v).reshape(R, T, H * D)
        x = x + o @ P[p + "self_attn.o_proj.weight"].T

        h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)

        def swiglu(prefix, hh):
            return (torch.nn.functional.silu(hh @ P[prefix + "gate_proj.weight"].T)
                    * (hh @ P[prefix + "up_proj.weight"].T)) @ P[prefix + "down_proj.weight"].T

        if not sparse_layer(fx, i):
            x = x + swiglu(p + "mlp.", h)
            continue
        # Experts: softmax over the router's logits, the top k, their weights (renormalised
        # with norm_topk_prob), each token's weighted sum of its experts' outputs.
        m = fx["moe"]
        E, K = m["num_experts"], m["num_experts_per_tok"]
        logits_r = h @ P[p + "mlp.gate.weight"].T                                      # (R, T, E)
        router_logits.append(logits_r.reshape(-1, E))
        probs = torch.softmax(logits_r, dim=-1)
        top, chosen = torch.topk(probs, K, dim=-1)
        if m["norm_topk_prob"]:
            top = top / top.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(E):
            w = (top * (chosen == e)).sum(-1, keepdim=True)                            # 0 where not chosen
            y = y + w * swiglu(p + f"mlp.experts.{e}.", h)
        if m.get("shared_expert_intermediate_size"):
            y = y + torch.sigmoid(h @ P[p + "mlp.shared_expert_gate.weight"].T) * swiglu(p + "mlp.shared_expert.", h)
        x = x + y
    x = rms_norm(x, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if fx["tie_word_embeddings"] else P["lm_head.weight"]
    return x @ head.T


def independent_aux(fx, router_logits):
    """The load-balancing loss from its definition: E * sum over experts of (the share of
    the rows' K choices it got) * (its mean probability), over every layer's rows together."""
    m = fx["moe"]
    E, K = m["num_experts"], m["num_experts_per_tok"]
    z = torch.cat(router_logits, dim=0)
    probs = torch.softmax(z, dim=-1)
    chosen = torch.topk(probs, K, dim=-1).indices
    counts = torch.zeros(E, dtype=torch.float64)
    for e in range(E):
        counts[e] = (chosen == e).sum()
    return E * ((counts / z.shape[0]) * probs.mean(0)).sum()


def independent_check(fx, model, tokens, positions, seq_ids, targets, weights, hf_logits, hf_loss, hf_grads, hf_aux):
    P = {name: p.detach().to(torch.float64).clone().requires_grad_(True)
         for name, p in canonical_views(fx, model).items()}
    router_logits = []
    logits = independent_forward(fx, P, tokens, positions, seq_ids, router_logits)
    loss = masked_mean_nll(logits, targets, weights)
    if fx.get("moe"):
        aux = independent_aux(fx, router_logits)
        check(abs(aux.item() - hf_aux.item()) <= TOL_LOSS * abs(aux.item()),
              f"{fx['name']}: load-balancing loss {hf_aux.item()} from transformers, {aux.item()} from its definition")
        loss = loss + fx["moe"]["router_aux_loss_coef"] * aux
    loss.backward()
    errs = {"logits": rel_err(hf_logits, logits), "loss": abs(hf_loss.item() - loss.item()) / abs(loss.item())}
    check(errs["logits"] <= TOL_LOGITS, f"{fx['name']}: transformers and the independent implementation disagree "
                                        f"on logits (rel {errs['logits']:.2e} > {TOL_LOGITS})")
    check(errs["loss"] <= TOL_LOSS, f"{fx['name']}: loss disagrees (rel {errs['loss']:.2e} > {TOL_LOSS})")
    worst = ("", 0.0)
    for name, g in hf_grads.items():
        e = rel_err(g, P[name].grad)
        check(P[name].grad.norm().item() > 0, f"{fx['name']}: gradient of {name} is zero: it does not matter")
        check(e <= TOL_GRADS, f"{fx['name']}: gradient of {name} disagrees (rel {e:.2e} > {TOL_GRADS})")
        if e > worst[1]:
            worst = (name, e)
    errs["worst_grad"] = worst
    return errs


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------

def write_reference(fx, path, batch, logits, loss, grads, attn_impl, aux=None):
    tokens, positions, seq_ids, targets, weights, docs = batch
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("tokens", data=tokens.astype(np.int32))
        f.create_dataset("positions", data=positions.astype(np.int32))
        f.create_dataset("seq_ids", data=seq_ids.astype(np.int32))
        f.create_dataset("targets", data=targets.astype(np.int32))
        f.create_dataset("weights", data=weights.astype(np.float32))
        f.create_dataset("logits", data=logits.to(torch.float32).numpy())
        f.create_dataset("loss", data=np.float64(loss.item()))
        if aux is not None:   # loss = the NLL + router_aux_loss_coef * aux_loss
            f.create_dataset("aux_loss", data=np.float64(aux.item()))
            f.attrs["router_aux_loss_coef"] = fx["moe"]["router_aux_loss_coef"]
        g = f.create_group("grads")
        for name in sorted(grads):
            g.create_dataset(name, data=grads[name].to(torch.float32).numpy())
        f.attrs["fixture"] = fx["name"]
        f.attrs["model_class"] = fx["model_class"]
        f.attrs["seed"] = fx["seed"]
        f.attrs["torch_version"] = str(torch.__version__)
        f.attrs["transformers_version"] = str(transformers.__version__)
        f.attrs["h5py_version"] = str(h5py.__version__)
        f.attrs["numpy_version"] = str(np.__version__)
        f.attrs["python_version"] = str(platform.python_version())
        f.attrs["attn_implementation"] = str(attn_impl)
        f.attrs["generator"] = "tools/make_fixtures.py (see docs/fixtures.md)"
        f.attrs["row_doc_lengths"] = json.dumps(ROW_DOC_LENGTHS)
        f.attrs["loss_definition"] = ("sum over (row, t) of weights * -log softmax(logits)[targets] / sum of weights; "
                           "targets = next token in the same document, -1 at a document's last token")
        f.attrs["computed_in"] = "float64 on CPU, each document run alone by transformers; stored as float32"
    os.replace(tmp, path)

    with h5py.File(path, "r") as f:   # read back what a C++ test will read
        R = len(ROW_DOC_LENGTHS)
        for key in ("tokens", "positions", "seq_ids", "targets"):
            check(f[key].shape == (R, SEQ_LEN) and f[key].dtype == np.int32, f"{path}: {key} {f[key].shape} {f[key].dtype}")
        check(f["weights"].dtype == np.float32, f"{path}: weights dtype")
        check(f["logits"].shape == (R, SEQ_LEN, VOCAB) and f["logits"].dtype == np.float32, f"{path}: logits")
        check(f["loss"].shape == () and f["loss"].dtype == np.float64, f"{path}: loss")
        check(set(f["grads"].keys()) == set(grads), f"{path}: grads")
        for name, gr in grads.items():
            check(f["grads"][name].shape == tuple(gr.shape), f"{path}: grads/{name} shape")


def make_fixture(fx, out_root):
    print(f"== {fx['name']} ({fx['model_class']})", flush=True)
    final_dir = out_root / fx["name"]
    build_dir = out_root / (fx["name"] + ".building")
    if build_dir.exists():
        shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True)

    config = make_config(fx)
    check_rope(fx, "the config object", *effective_rope(config))
    model = build_model(fx, config)
    attn_impl = getattr(model.config, "_attn_implementation", "?")
    randomise_parameters(fx, model)
    batch = make_batch()
    tokens, positions, seq_ids, targets, weights, docs = batch

    save_model(fx, model, build_dir)
    reload_check(fx, model, build_dir, tokens)

    model = model.to(torch.float64)
    logits, loss, grads, aux = hf_reference(fx, model, tokens, docs, targets, weights)
    check(set(grads) == set(expected_parameters(fx)), f"{fx['name']}: gradient names")
    check(all(torch.isfinite(g).all() for g in grads.values()) and torch.isfinite(logits).all(),
          f"{fx['name']}: non-finite logits or gradients")
    errs = independent_check(fx, model, tokens, positions, seq_ids, targets, weights, logits, loss, grads, aux)

    write_reference(fx, build_dir / "reference.h5", batch, logits, loss, grads, attn_impl, aux)
    size = sum(p.stat().st_size for p in build_dir.iterdir())
    check(size <= MAX_DIR_BYTES, f"{fx['name']}: {size} bytes, over the {MAX_DIR_BYTES} budget")
    per_token_std = logits.std(dim=-1).mean().item()
    check(per_token_std > 0.25, f"{fx['name']}: logits nearly uniform (std over vocab {per_token_std:.3f})")
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(build_dir, final_dir)

    n_loss = int(weights.sum())
    print(f"   loss {loss.item():.10f} over {n_loss} tokens (uniform would be {math.log(VOCAB):.4f})"
          + (f"; load-balancing loss {aux.item():.10f}" if aux is not None else ""))
    print(f"   max|logits| {logits.abs().max().item():.4f}, mean std over vocab {per_token_std:.4f}")
    print(f"   grad norm {math.sqrt(sum(g.pow(2).sum().item() for g in grads.values())):.6f} "
          f"over {len(grads)} parameters")
    print(f"   independent float64 check: logits rel {errs['logits']:.2e}, loss rel {errs['loss']:.2e}, "
          f"worst grad rel {errs['worst_grad'][1]:.2e} ({errs['worst_grad'][0]})")
    print(f"   attn_implementation {attn_impl}; {size} bytes in {final_dir}: "
          f"{', '.join(sorted(p.name for p in final_dir.iterdir()))}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures", help="output directory (default tests/fixtures)")
    ap.add_argument("--only", action="append", choices=[fx["name"] for fx in FIXTURES],
                    help="make only this fixture (repeatable)")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, h5py {h5py.__version__}, "
          f"numpy {np.__version__}, python {platform.python_version()}")
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    try:
        for fx in FIXTURES:
            if args.only and fx["name"] not in args.only:
                continue
            make_fixture(fx, out_root)
    except FixtureError as e:
        print(f"make_fixtures.py: FAILED: {e}", file=sys.stderr)
        return 1
    print("all fixtures written and checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
