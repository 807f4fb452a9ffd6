#!/usr/bin/env python3
"""fidelity_emulation_check.py — checks tools/fidelity_vs_hf.py's precision emulations on the CPU,
without transformers: a small model of transformers' Llama structure (embed_tokens, layers with
input_layernorm, self_attn returning a tuple, post_attention_layernorm, mlp; the two residual sums
in the layer's own forward).

  bf16-residual: the hooked model's logits and parameter gradients equal those of the same model
                 written with rounding nodes (bf16 forward and backward) producing the stream;
  bf16-params:   after training steps the model's parameters are bf16 values, the run differs from
                 plain autocast, and every variant's loss falls;
  fp32-wgrad:    under autocast a patched linear's output and input gradient equal autocast's, its
                 weight gradient equals g^T x of the bf16 operands summed in float64 (to fp32
                 rounding) where autocast's is bf16-rounded; every linear of the model is patched,
                 and the run's loss falls;
  bf16-dembed:   the logits are unchanged and the embedding's gradient is the sum of the bf16-rounded
                 gradients of its output rows.

  /usr/bin/python3 tools/fidelity_emulation_check.py      (Debian: apt-get install python3-torch)
"""
import os
import sys
import types

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fidelity_vs_hf as F  # noqa: E402


class Attn(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.q = nn.Linear(C, C, bias=False)

    def forward(self, hidden_states, **kw):
        return self.q(torch.tanh(hidden_states)), None


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.up, self.down = nn.Linear(C, 2 * C, bias=False), nn.Linear(2 * C, C, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Norm(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C) + 0.01 * torch.randn(C))

    def forward(self, x):
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()


class Layer(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.input_layernorm, self.self_attn = Norm(C), Attn(C)
        self.post_attention_layernorm, self.mlp = Norm(C), MLP(C)

    def forward(self, hidden_states, attention_mask=None):  # as transformers' decoder layers
        residual = hidden_states
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states))
        h = residual + h
        residual = h
        h = self.mlp(self.post_attention_layernorm(h))
        return residual + h


class Model(nn.Module):
    def __init__(self, V=64, C=32, L=3):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, C)
        self.model.layers = nn.ModuleList([Layer(C) for _ in range(L)])
        self.model.norm = Norm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.config = types.SimpleNamespace(use_cache=True)

    def get_input_embeddings(self):  # as transformers' models (run_hf's bf16-embed finds the table so)
        return self.model.embed_tokens

    def forward(self, input_ids, rnd=None):
        """rnd: the stream written with explicit rounding nodes (the reference of bf16-residual)."""
        r = rnd or (lambda t: t)
        h = r(self.model.embed_tokens(input_ids))
        for layer in self.model.layers:
            if rnd is None:
                h = layer(h, attention_mask=None)
                continue
            a, _ = layer.self_attn(hidden_states=layer.input_layernorm(h))
            mid = r(h + a)
            h = r(mid + layer.mlp(layer.post_attention_layernorm(mid)))
        return types.SimpleNamespace(logits=self.lm_head(self.model.norm(h)))


def fresh():
    torch.manual_seed(0)
    return Model()


def main():
    failures = []

    def check(what, ok):
        print(("PASS " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    hooked, explicit, plain = fresh(), fresh(), fresh()
    F.emulate_bf16_residual(hooked, hooked.model.layers, hooked.model.embed_tokens)
    a = hooked(ids).logits
    b = explicit(ids, rnd=F.round_bf16_fn()).logits
    c = plain(ids).logits
    for m, out in ((hooked, a), (explicit, b), (plain, c)):
        out.pow(2).sum().backward()
    rel = lambda x, y: max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
                           for p, q in zip(x.parameters(), y.parameters()))
    check(f"bf16-residual: logits equal the explicitly rounded model's (max diff {float((a - b).abs().max()):.1e})",
          torch.equal(a, b))
    check(f"bf16-residual: parameter gradients equal it (max relative diff {rel(hooked, explicit):.1e})",
          rel(hooked, explicit) == 0.0)
    check(f"bf16-residual: and differ from no rounding (max relative diff {rel(plain, explicit):.1e})",
          rel(plain, explicit) > 1e-4)

    # fp32-wgrad on one linear: the forward and dx as autocast's, dw unrounded
    torch.manual_seed(2)
    lin = nn.Linear(48, 40, bias=False)
    x = torch.randn(3, 24, 48, requires_grad=True)
    g = torch.randn(3, 24, 40)
    ys, grads = [], []
    for patch in (False, True):
        m = nn.Linear(48, 40, bias=False)
        m.load_state_dict(lin.state_dict())
        if patch:
            F.emulate_fp32_wgrad(m)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.backward(g.to(y.dtype))
        ys.append(y.detach())
        grads.append((x.grad.clone(), m.weight.grad.clone()))
    xb, gb = x.detach().to(torch.bfloat16).double(), g.to(torch.bfloat16).double()
    ref = gb.reshape(-1, 40).t() @ xb.reshape(-1, 48)
    err = lambda w: float((w.double() - ref).abs().max() / ref.abs().max())
    check("fp32-wgrad: the output is autocast's (bf16, equal)", ys[0].dtype == ys[1].dtype == torch.bfloat16 and
          torch.equal(ys[0], ys[1]))
    check(f"fp32-wgrad: the input gradient is autocast's (max diff {float((grads[0][0] - grads[1][0]).abs().max()):.1e})",
          torch.allclose(grads[0][0], grads[1][0], rtol=1e-2, atol=1e-2))
    check(f"fp32-wgrad: the weight gradient is the unrounded sum (error {err(grads[1][1]):.1e} < 1e-6; "
          f"autocast's {err(grads[0][1]):.1e} > 1e-4)", err(grads[1][1]) < 1e-6 and err(grads[0][1]) > 1e-4)
    model = fresh()
    check("fp32-wgrad: every linear of the model patched (3 layers x 3 + the lm head)", F.emulate_fp32_wgrad(model) == 10)

    # bf16-dembed: the table's gradient from bf16-rounded output gradients
    plain2, hooked2 = fresh(), fresh()
    F.emulate_bf16_dembed(hooked2.model.embed_tokens)
    captured = {}
    def capture(m, i, out):
        out.register_hook(lambda g: captured.__setitem__("g", g))

    plain2.model.embed_tokens.register_forward_hook(capture)
    la, lb = plain2(ids).logits, hooked2(ids).logits
    la.pow(2).sum().backward()
    lb.pow(2).sum().backward()
    want = torch.zeros_like(plain2.model.embed_tokens.weight).index_add_(
        0, ids.reshape(-1), captured["g"].reshape(-1, 32).to(torch.bfloat16).float())
    got = hooked2.model.embed_tokens.weight.grad
    check("bf16-dembed: the logits are unchanged", torch.equal(la, lb))
    check(f"bf16-dembed: the table's gradient sums the rounded rows (max diff {float((got - want).abs().max()):.1e}); "
          f"the plain one differs", torch.allclose(got, want, rtol=1e-6, atol=1e-7) and
          not torch.equal(plain2.model.embed_tokens.weight.grad, got))

    made = []

    def from_pretrained(directory, torch_dtype=None):
        made.append(fresh())
        return made[-1]

    sys.modules["transformers"] = types.SimpleNamespace(
        AutoModelForCausalLM=types.SimpleNamespace(from_pretrained=from_pretrained))
    args = types.SimpleNamespace(lr=1e-3, steps=12, rows=2)
    rows = (np.random.default_rng(0).integers(0, 64, size=(1, 17)) + np.arange(8)[:, None] % 3) % 64
    curves = {}
    for v in ("eager", "eager+bf16-params", "eager+bf16-residual", "eager+bf16-residual+bf16-params",
              "eager+fp32-wgrad", "eager+bf16-dembed"):
        curves[v] = F.run_hf(args, "unused", rows, v, device="cpu")
        check(f"{v}: the loss falls ({curves[v][0]:.4f} -> {curves[v][-1]:.4f})", curves[v][-1] < curves[v][0] - 0.3)
    check("bf16-params: after 12 steps the model's parameters are bf16 values",
          all(torch.equal(p, p.to(torch.bfloat16).float()) for p in made[1].parameters()))
    check("bf16-params: the curve differs from plain autocast's", curves["eager+bf16-params"] != curves["eager"])
    check("fp32-wgrad: the curve differs from plain autocast's", curves["eager+fp32-wgrad"] != curves["eager"])

    # the fidelity test's verdict on made-up curves: eager falls from 10 to 2; compile sits
    # 5e-4 above it; one shardlm curve 7e-4 above (1.4x: within 1.5x), one 8e-4 (not),
    # one within every window but 0.2% high over the last 10 steps (not).
    eager = list(np.linspace(10, 2, 150))
    made_up = {"transformers eager": eager, "transformers compile": [x * 1.0005 for x in eager],
               "shardlm near": [x * 1.0007 for x in eager], "shardlm far": [x * 1.0008 for x in eager],
               "shardlm late": [x * (1.0007 if i < 140 else 1.002) for i, x in enumerate(eager)]}
    lines, verdict = F.issue_test(made_up)
    for line in lines:
        print("   ", line)
    check("fidelity test: 1.4x compile's spread in every window holds", verdict.get("shardlm near") is True)
    check("fidelity test: 1.6x compile's spread does not", verdict.get("shardlm far") is False)
    check("fidelity test: 0.2% over the last 10 steps does not", verdict.get("shardlm late") is False)

    # the rerun bound on made-up curves: eager's rerun sits 3e-4 below it to step 40, then 2e-3
    # above; the bound is 2 x compile's 5e-4 = 1e-3 to step 40, the rerun's 2e-3 after. One
    # shardlm curve 9e-4 then 1.9e-3 above (within), one 1.1e-3 everywhere (not, in 1-10).
    made_up = {"transformers eager": eager, "transformers compile": made_up["transformers compile"],
               "transformers eager #2": [x * (0.9997 if i < 40 else 1.002) for i, x in enumerate(eager)],
               "shardlm held": [x * (1.0009 if i < 40 else 1.0019) for i, x in enumerate(eager)],
               "shardlm over": [x * 1.0011 for x in eager]}
    lines, verdict = F.bound_test(made_up)
    for line in lines:
        print("   ", line)
    check("rerun bound: 0.9x of 2x compile, then 0.95x of the rerun, holds", verdict.get("shardlm held") is True)
    check("rerun bound: 1.1x of 2x compile does not", verdict.get("shardlm over") is False)
    check("rerun bound: 2x compile sets it to step 40, the rerun after",
          "(2 × compile)" in lines[2] and "(rerun)" in lines[5] and len(lines) == 2 + 5)
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
