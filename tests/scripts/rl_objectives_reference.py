#!/usr/bin/env python3
"""rl_objectives_reference.py — random cases of shardlm's RL losses and
advantages with their reference results, computed in numpy (float64) from the
papers' formulas, for tests/unit/test_rl_objectives.cpp (run by
tests/scripts/test_rl_objectives.sh).

Usage: rl_objectives_reference.py --out FILE [--seed N]

Per loss token t of sample i (loss_mask 1, loss weight w_t > 0), with the
trainer's logp_t = log_softmax(logits_t / tau_i)[target_t], the entropy H_t of
that softmax, the inference logprob lp_inf_t (the sampler's full distribution)
and the sampling logprob lp_samp_t (the distribution sampled from), sg = stop-
gradient, r_t = exp(logp_t - lp_inf_t):

  masked   -A r [not masked], masked = (A > 0 and p - p_inf > mask_high) or
           (A <= 0 and p - p_inf < -mask_low): shardlm's masked objective.
  clipped  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A): PPO's clipped
           surrogate (Schulman et al. 2017) as GRPO uses it per token.
  gspo     s_i = exp(mean_t log r_t) over sample i's loss tokens (GSPO, Zheng et
           al. 2025, arXiv:2507.18071, eq. 7), per token as GSPO-token (eq. 13):
           s_it = sg[s_i] pi_t / sg[pi_t], loss -min(s_it A, clip(s_it) A).
  cispo    -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp_t (CISPO, MiniMax-M1,
           arXiv:2506.13585, eq. 4).
  IS       truncated importance sampling against the train/inference mismatch
           (Yao et al. 2025, "Your efficient RL framework secretly brings you
           off-policy RL training"): rho = sg(pi_train / pi_sampling) per token,
           or its product over the sample; the policy term is multiplied by
           min(rho, cap); with is_mask > 0 a token (sample) whose rho is outside
           [1 / is_mask, is_mask] is rejected (no loss). The objectives' ratio is
           then taken against the trainer's own old logprob: r = pi / sg(pi).
  ref KL   a penalty against frozen reference weights, ref_kl_coef times an
           estimator of KL(pi || pi_ref) at the sampled token, x = lp_ref - logp
           (Schulman 2020, "Approximating KL divergence",
           http://joschu.net/blog/kl-approx.html): k1 = -x, k2 = x^2 / 2,
           k3 = e^x - x - 1 (GRPO's, Shao et al. 2024, arXiv:2402.03300, eq. 4).
  loss_t = w_t (policy_t + kl (log r_t)^2 - entropy_coef H_t + ref_kl_coef k_t) - ce w_t logp_t
  normalize: "token" divides the sum by the step's loss tokens; "sequence" (the
           GRPO paper's sample mean, GSPO's 1/|y_i|) weighs sample i's tokens by
           1 / its loss tokens and divides by the samples with loss; "constant"
           (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783) divides by a constant.
  parts    several updates per rollout step (PPO's minibatches, Schulman et al.
           2017, arXiv:1707.06347, Algorithm 1): the samples split into P parts
           in order (part k: samples [S k / P, S (k + 1) / P)), each part's loss
           normalised as above over its own samples (its loss tokens, its
           samples with loss, or the constant).

Advantages (rewards in groups of n): mean_std (GRPO), mean (Dr. GRPO), rloo
(r_i - mean_{j != i} r_j, RLOO, Ahmadian et al. 2024, arXiv:2402.14740),
batch_std (the group's mean, the std of the whole batch's rewards).

The gradient d loss / d logits is written out analytically and checked here
against central differences of the loss above with its sg quantities frozen
(the definition of a stop-gradient); a case whose values fall within 1e-7 of a
mask, clip or cap boundary is drawn again.
"""
import argparse
import itertools
import sys

import numpy as np

OBJECTIVES = ["masked", "clipped", "gspo", "cispo"]
REF_KL = ["k1", "k2", "k3"]
NORMALIZE = ["token", "sequence", "constant"]
IS_LEVELS = ["none", "token", "sequence"]
ADVANTAGES = ["mean_std", "mean", "rloo", "batch_std"]


def f32(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def softmax_terms(logits, tau):
    """log softmax and softmax of logits / tau, rows."""
    z = logits / tau[:, None]
    z = z - z.max(axis=1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return logp_all, np.exp(logp_all)


class Case:
    """One step's samples, flattened to rows = the target positions of every
    sample (sample i's position j predicts its token j + 1)."""

    def __init__(self, rng, name, objective, normalize, is_level, scale, parts=1, ref_kl=None):
        self.name, self.objective, self.normalize, self.is_level = name, objective, normalize, is_level
        self.parts, self.ref_kl = parts, ref_kl
        self.V = int(rng.integers(5, 14))
        S = int(rng.integers(3, 7))
        self.samples = []
        for i in range(S):
            prompt = int(rng.integers(1, 4))
            completion = int(rng.integers(1, 7))
            T = prompt + completion
            tokens = rng.integers(0, self.V, size=T)
            mask = np.array([0] * prompt + [1] * completion, np.int64)
            weight = f32(rng.uniform(0.5, 1.5, size=T))
            weight[rng.uniform(size=T) < 0.15] = 0.0  # a completion token without loss
            if i == S - 1:
                weight[prompt:] = 0.0  # a sample without any loss token
            tau = float(f32(rng.choice([1.0, 0.7, 1.3])))
            A = float(f32(rng.normal())) if i % 4 != 3 else 0.0
            logits = rng.normal(0, 2.0, size=(T - 1, self.V))
            likely = rng.uniform(size=T - 1) < 0.4  # targets the model already favours: p ~ 0.5 to 1
            logits[likely, tokens[1:][likely]] += 4.0
            self.samples.append(dict(T=T, tokens=tokens, mask=mask, weight=weight, tau=tau, A=A, logits=logits))
        self.has_sampling = bool(rng.uniform() < 0.8)
        self.p = dict(mask_high=0.2, mask_low=0.2, kl_coef=float(rng.choice([0.0, 0.02])),
                      ce_coef=float(rng.choice([0.0, 0.1])),
                      clip_low={"gspo": 3e-4, "cispo": 1.0}.get(objective, 0.2),
                      clip_high={"gspo": 4e-4}.get(objective, 0.28),
                      is_cap=float(rng.uniform(1.2, 3.0)), is_mask=float(rng.choice([0.0, 4.0, 20.0])),
                      entropy_coef=float(rng.choice([0.0, 0.05])), normalize_constant=float(rng.integers(20, 60)))
        if objective == "gspo" and rng.uniform() < 0.5:  # the paper's bounds or wider ones
            self.p["clip_low"], self.p["clip_high"] = 0.05, 0.08
        if objective == "cispo" and normalize != "constant":  # a lower bound too (by default none)
            self.p["clip_low"] = 0.3
        self._flatten()
        # Inference and sampling logprobs near the trainer's: the log ratio's
        # spread `scale` (GSPO's tight clip wants ratios within 1e-3 of 1), a
        # shift of the whole sample by -0.2, 0 or 0.2 (sequence ratios on both
        # sides of a clip), a few extreme ones (|log r| up to 4).
        logp = self.logp_train()
        shift = rng.choice([-0.2, 0.0, 0.2], size=len(self.samples))
        delta = rng.normal(0, scale, size=self.n) + shift[self.sample_of]
        extreme = rng.uniform(size=self.n) < 0.1
        delta[extreme] = rng.uniform(-4, 4, size=extreme.sum())
        self.lp_inf = f32(np.minimum(logp - delta, -1e-4))
        if self.has_sampling:  # top-k / top-p renormalise: the sampled token's probability only rises
            self.lp_samp = f32(np.minimum(self.lp_inf + np.abs(rng.normal(0, max(scale, 0.05), size=self.n)), 0.0))
        else:
            self.lp_samp = self.lp_inf.copy()
        # The frozen reference's logprobs: the policy has drifted from them by
        # |log ratio| ~ 0.3, a tenth of the tokens by up to 4.
        self.ref_kl_coef = 0.0
        self.lp_ref = np.zeros(self.n)
        if ref_kl is not None:
            self.ref_kl_coef = float(rng.choice([0.05, 0.3]))
            drift = rng.normal(0, 0.3, size=self.n)
            far = rng.uniform(size=self.n) < 0.1
            drift[far] = rng.uniform(-4, 4, size=far.sum())
            self.lp_ref = f32(np.minimum(logp + drift, -1e-4))
        # Part of each sample (PPO minibatches in sample order) and each part's divisor.
        S = len(self.samples)
        self.part_of_sample = np.array([next(k for k in range(parts) if i < S * (k + 1) // parts) for i in range(S)])
        self.part_of = self.part_of_sample[self.sample_of]
        counts = np.bincount(self.sample_of[self.loss], minlength=S)
        self.part_divisors = []
        for k in range(parts):
            in_k = self.part_of == k
            self.part_divisors.append({"token": float((self.loss & in_k).sum()),
                                       "sequence": float(((counts > 0) & (self.part_of_sample == k)).sum()),
                                       "constant": self.p["normalize_constant"]}[self.normalize])

    def _flatten(self):
        rows = []
        for i, s in enumerate(self.samples):
            for j in range(s["T"] - 1):
                rows.append((i, j))
        self.rows = rows
        self.n = len(rows)
        self.sample_of = np.array([i for i, _ in rows])
        self.logits = np.stack([self.samples[i]["logits"][j] for i, j in rows])
        self.target = np.array([self.samples[i]["tokens"][j + 1] for i, j in rows])
        self.tau = np.array([self.samples[i]["tau"] for i, _ in rows])
        self.A = np.array([self.samples[i]["A"] for i, _ in rows])
        raw_w = np.array([self.samples[i]["weight"][j + 1] * self.samples[i]["mask"][j + 1] for i, j in rows])
        self.loss = raw_w > 0
        # normalize = "sequence": each sample's weights / its loss tokens (float32, as the file's weights).
        counts = np.bincount(self.sample_of[self.loss], minlength=len(self.samples))
        if self.normalize == "sequence":
            self.w = np.where(self.loss, f32(raw_w / np.maximum(counts[self.sample_of], 1)), 0.0)
        else:
            self.w = raw_w
        self.divisor = {"token": float(self.loss.sum()), "sequence": float((counts > 0).sum()),
                        "constant": self.p["normalize_constant"]}[self.normalize]

    def logp_train(self, logits=None):
        logits = self.logits if logits is None else logits
        logp_all, _ = softmax_terms(logits, self.tau)
        return logp_all[np.arange(self.n), self.target]

    def frozen(self):
        """The stop-gradient quantities at the case's logits."""
        logp = self.logp_train()
        L = self.loss
        log_r = logp - self.lp_inf
        fz = dict(logp=logp)
        ids = self.sample_of
        S = len(self.samples)
        # GSPO's sequence ratio: mean log r over the sample's loss tokens.
        sums = np.bincount(ids[L], weights=log_r[L], minlength=S)
        cnt = np.bincount(ids[L], minlength=S)
        fz["log_s"] = np.where(cnt[ids] > 0, sums[ids] / np.maximum(cnt[ids], 1), 0.0)
        log_rho_tok = logp - self.lp_samp
        rho_sums = np.bincount(ids[L], weights=log_rho_tok[L], minlength=S)
        fz["log_rho"] = {"none": np.zeros(self.n), "token": log_rho_tok, "sequence": rho_sums[ids]}[self.is_level]
        return fz

    def row_losses(self, logits, fz):
        """Per-row loss L_t (unnormalised) and statistics, sg quantities from fz."""
        p = self.p
        logp_all, prob = softmax_terms(logits, self.tau)
        logp = logp_all[np.arange(self.n), self.target]
        H = -(prob * logp_all).sum(axis=1)
        A = self.A
        log_r_inf = logp - self.lp_inf
        is_on = self.is_level != "none"
        # The objectives' ratio: against the inference logprob, or (IS) the trainer's own sg logprob.
        log_r = logp - fz["logp"] if is_on else log_r_inf
        r = np.exp(log_r)
        high = np.zeros(self.n, bool)
        low = np.zeros(self.n, bool)
        if self.objective == "masked":
            dp = np.exp(logp) - np.exp(self.lp_inf)
            high = (A > 0) & (dp > p["mask_high"])
            low = (A <= 0) & (dp < -p["mask_low"])
            policy = np.where(high | low, 0.0, -A * r)
        elif self.objective == "clipped":
            clipped = np.clip(r, 1 - p["clip_low"], 1 + p["clip_high"])
            policy = -np.minimum(r * A, clipped * A)
            high = (A > 0) & (r > 1 + p["clip_high"])
            low = (A < 0) & (r < 1 - p["clip_low"])
        elif self.objective == "gspo":
            s_sg = np.exp(fz["log_s"]) if not is_on else np.ones(self.n)
            s = s_sg * np.exp(logp - fz["logp"])  # GSPO-token: sg[s_i] pi_t / sg[pi_t]
            clipped = np.clip(s, 1 - p["clip_low"], 1 + p["clip_high"])
            policy = -np.minimum(s * A, clipped * A)
            high = (A > 0) & (s > 1 + p["clip_high"])
            low = (A < 0) & (s < 1 - p["clip_low"])
        else:  # cispo
            r_sg = np.exp(fz["logp"] - self.lp_inf) if not is_on else np.ones(self.n)
            weight = np.clip(r_sg, 1 - p["clip_low"], 1 + p["clip_high"])
            policy = -weight * A * logp
            high = r_sg > 1 + p["clip_high"]
            low = r_sg < 1 - p["clip_low"]
        rejected = np.zeros(self.n, bool)
        capped = np.zeros(self.n, bool)
        ratio_stat = np.zeros(self.n)
        if is_on:
            log_rho = fz["log_rho"]
            rho = np.exp(log_rho)
            if p["is_mask"] > 0:
                rejected = (rho < 1 / p["is_mask"]) | (rho > p["is_mask"])
            capped = ~rejected & (rho > p["is_cap"])
            policy = policy * np.minimum(rho, p["is_cap"])
            ratio_stat = np.exp(np.clip(log_rho, -20, 20))
        w = self.w
        ref_kl = self.ref_kl_value(logp)
        L = w * (policy + p["kl_coef"] * log_r_inf ** 2 - p["entropy_coef"] * H + self.ref_kl_coef * ref_kl) \
            - p["ce_coef"] * w * logp
        keep = self.loss & ~rejected
        L = np.where(keep, L, 0.0)
        loss_rows = self.loss
        stats = dict(loss_tokens=int(loss_rows.sum()), masked_high=int((high & keep).sum()),
                     masked_low=int((low & keep).sum()), is_capped=int((capped & loss_rows).sum()),
                     is_masked=int((rejected & loss_rows).sum()),
                     entropy_sum=float(H[loss_rows].sum()),
                     mismatch_kl_sum=float((np.exp(log_r_inf) - log_r_inf - 1)[loss_rows].sum()),
                     is_ratio_sum=float(ratio_stat[loss_rows].sum()),
                     ref_kl_sum=float(ref_kl[keep].sum()) if self.ref_kl else 0.0)
        return L, stats

    def ref_kl_value(self, logp):
        """The reference KL estimator per row (0 without the term), straight from
        its definition: x = log(pi_ref / pi) at the sampled token."""
        x = self.lp_ref - logp
        if self.ref_kl == "k1":
            return -x
        if self.ref_kl == "k2":
            return 0.5 * x ** 2
        if self.ref_kl == "k3":
            return np.exp(x) - x - 1
        return np.zeros_like(logp)

    def ref_kl_derivative(self, logp):
        """d ref_kl_value / d logp, written out by hand (checked by central differences below)."""
        x = self.lp_ref - logp
        return {"k1": np.ones_like(x), "k2": -x, "k3": 1 - np.exp(x)}.get(self.ref_kl, np.zeros_like(x))

    def analytic_grad(self, fz):
        """d (sum L_t) / d logits, from the formulas' derivatives in logp and H."""
        p = self.p
        logp_all, prob = softmax_terms(self.logits, self.tau)
        logp = logp_all[np.arange(self.n), self.target]
        H = -(prob * logp_all).sum(axis=1)
        A = self.A
        is_on = self.is_level != "none"
        log_r_inf = logp - self.lp_inf
        r = np.ones(self.n) if is_on else np.exp(log_r_inf)  # value; d r / d logp = r
        if self.objective == "masked":
            dp = np.exp(logp) - np.exp(self.lp_inf)
            masked = ((A > 0) & (dp > p["mask_high"])) | ((A <= 0) & (dp < -p["mask_low"]))
            d_policy = np.where(masked, 0.0, -A * r)
        elif self.objective in ("clipped", "gspo"):
            s = r if self.objective == "clipped" else (np.ones(self.n) if is_on else np.exp(fz["log_s"]))
            active = ((A > 0) & (s > 1 + p["clip_high"])) | ((A < 0) & (s < 1 - p["clip_low"]))
            d_policy = np.where(active, 0.0, -A * s)
        else:
            d_policy = -np.clip(r, 1 - p["clip_low"], 1 + p["clip_high"]) * A
        keep = self.loss.copy()
        if is_on:
            rho = np.exp(fz["log_rho"])
            if p["is_mask"] > 0:
                keep &= ~((rho < 1 / p["is_mask"]) | (rho > p["is_mask"]))
            d_policy = d_policy * np.minimum(rho, p["is_cap"])
        w = self.w
        d_ref = self.ref_kl_coef * self.ref_kl_derivative(logp)
        d_logp = np.where(keep, w * (d_policy + 2 * p["kl_coef"] * log_r_inf + d_ref) - p["ce_coef"] * w, 0.0)
        d_H = np.where(keep, -p["entropy_coef"] * w, 0.0)
        onehot = np.zeros_like(prob)
        onehot[np.arange(self.n), self.target] = 1.0
        # d logp / d z = onehot - p; d H / d z = -p (log p + H); z = logits / tau.
        g = d_logp[:, None] * (onehot - prob) - d_H[:, None] * prob * (logp_all + H[:, None])
        return g / self.tau[:, None]

    def near_boundary(self, fz, eps=1e-7):
        """Whether a value sits within eps of a mask, clip or cap boundary
        (where the kernel's and numpy's last bits could fall on two sides)."""
        p = self.p
        logp = fz["logp"]
        L = self.loss
        vals = []
        r = np.exp(logp - self.lp_inf)
        if self.is_level == "none":
            if self.objective == "masked":
                dp = np.exp(logp) - np.exp(self.lp_inf)
                vals += [dp - p["mask_high"], dp + p["mask_low"]]
            s = np.exp(fz["log_s"]) if self.objective == "gspo" else r
            vals += [s - 1 - p["clip_high"], s - 1 + p["clip_low"]]
        else:
            rho = np.exp(fz["log_rho"])
            vals += [rho - p["is_cap"]]
            if p["is_mask"] > 0:
                vals += [rho - p["is_mask"], rho - 1 / p["is_mask"]]
            if self.objective == "masked":
                dp = np.exp(logp) - np.exp(self.lp_inf)
                vals += [dp - p["mask_high"], dp + p["mask_low"]]
        return any(np.any(np.abs(v[L]) < eps) for v in vals)

    def reference(self):
        fz = self.frozen()
        L, stats = self.row_losses(self.logits, fz)
        grad = self.analytic_grad(fz)
        # The analytic gradient against central differences of the loss with
        # its sg quantities frozen; each row's loss depends on its own logits
        # only, so one column of every row moves at once.
        h = 1e-5
        fd = np.zeros_like(self.logits)
        for c in range(self.V):
            plus, minus = self.logits.copy(), self.logits.copy()
            plus[:, c] += h
            minus[:, c] -= h
            fd[:, c] = (self.row_losses(plus, fz)[0] - self.row_losses(minus, fz)[0]) / (2 * h)
        fd_err = np.abs(fd - grad).max() / max(np.abs(grad).max(), 1e-300)
        if fd_err > 1e-6:
            sys.exit(f"{self.name}: the analytic gradient is {fd_err:.2e} from central differences")
        # Each part's sums over its own divisor (one part: the step's); a part
        # without loss tokens has no loss and no gradient (its divisor taken as 1).
        D = np.array([d if d > 0 else 1.0 for d in self.part_divisors])
        parts = [dict(loss=L[self.part_of == k].sum() / D[k], scale=np.abs(L[self.part_of == k]).sum() / D[k],
                      divisor=self.part_divisors[k]) for k in range(self.parts)]
        return dict(parts=parts, grad=grad / D[self.part_of][:, None], stats=stats, fd_err=fd_err)

    def write(self, out, ref):
        p = self.p
        out.write(f"case {self.name}\nobjective {self.objective}\nnormalize {self.normalize}\n"
                  f"is_level {self.is_level}\nV {self.V}\nhas_sampling {int(self.has_sampling)}\n"
                  f"parts {self.parts}\nref_kl {self.ref_kl or 'none'} {self.ref_kl_coef!r}\n")
        keys = ["mask_high", "mask_low", "kl_coef", "ce_coef", "clip_low", "clip_high", "is_cap", "is_mask",
                "entropy_coef", "normalize_constant"]
        out.write("params " + " ".join(repr(float(p[k])) for k in keys) + "\n")
        out.write(f"samples {len(self.samples)}\n")
        lp_inf = np.zeros(0)
        for i, s in enumerate(self.samples):
            rows = self.sample_of == i
            T = s["T"]
            inf = np.concatenate([[0.0], self.lp_inf[rows]])
            samp = np.concatenate([[0.0], self.lp_samp[rows]])
            lp_ref = np.concatenate([[0.0], self.lp_ref[rows]])
            out.write(f"sample {T} {s['tau']!r} {s['A']!r}\n")
            out.write("tokens " + " ".join(str(int(t)) for t in s["tokens"]) + "\n")
            out.write("loss_mask " + " ".join(str(int(m)) for m in s["mask"]) + "\n")
            out.write("loss_weight " + " ".join(repr(float(w)) for w in s["weight"]) + "\n")
            out.write("lp_inf " + " ".join(repr(float(v)) for v in inf) + "\n")
            out.write("lp_sampling " + " ".join(repr(float(v)) for v in samp) + "\n")
            out.write("lp_ref " + " ".join(repr(float(v)) for v in lp_ref) + "\n")
            out.write("logits " + " ".join(repr(float(v)) for v in s["logits"].ravel()) + "\n")
            out.write("grad " + " ".join(repr(float(v)) for v in ref["grad"][rows].ravel()) + "\n")
        st = ref["stats"]
        for part in ref["parts"]:
            out.write(f"expect {part['loss']!r} {part['scale']!r} {part['divisor']!r}\n")
        out.write("stats " + " ".join(str(st[k]) for k in ["loss_tokens", "masked_high", "masked_low", "is_capped",
                                                            "is_masked"]) + " " +
                  " ".join(repr(st[k]) for k in ["entropy_sum", "mismatch_kl_sum", "is_ratio_sum", "ref_kl_sum"])
                  + "\n")
        out.write("end\n")


def advantages(kind, rewards, n):
    """Each kind straight from its definition, group by group."""
    out = np.zeros(len(rewards))
    batch_std = rewards.std()
    for g in range(0, len(rewards), n):
        r = rewards[g:g + n]
        if kind == "mean_std":
            out[g:g + n] = (r - r.mean()) / (r.std() + 1e-6)
        elif kind == "mean":
            out[g:g + n] = r - r.mean()
        elif kind == "rloo":
            out[g:g + n] = [r[i] - np.delete(r, i).mean() for i in range(n)]
        else:
            out[g:g + n] = (r - r.mean()) / (batch_std + 1e-6)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20251)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    cases = []
    for objective, normalize, is_level in itertools.product(OBJECTIVES, NORMALIZE, IS_LEVELS):
        # GSPO's default clip acts on sequence ratios within ~1e-3 of 1: small mismatch there.
        scale = 3e-4 if objective == "gspo" else 0.3
        name = f"{objective}/{normalize}/is={is_level}"
        for _ in range(100):
            c = Case(rng, name, objective, normalize, is_level, scale)
            if not c.near_boundary(c.frozen()):
                break
        else:
            sys.exit(f"{name}: no case away from the boundaries in 100 draws")
        cases.append(c)
    # Several updates per step (2 or 3 parts) with the reference KL term, each
    # estimator under every aggregation.
    for i, (objective, normalize) in enumerate(itertools.product(OBJECTIVES, NORMALIZE)):
        is_level, parts, ref_kl = IS_LEVELS[(i // 3) % 3], 2 + i % 2, REF_KL[i % 3]
        scale = 3e-4 if objective == "gspo" else 0.3
        name = f"{objective}/{normalize}/is={is_level}/parts={parts}/{ref_kl}"
        for _ in range(100):
            c = Case(rng, name, objective, normalize, is_level, scale, parts=parts, ref_kl=ref_kl)
            if not c.near_boundary(c.frozen()):
                break
        else:
            sys.exit(f"{name}: no case away from the boundaries in 100 draws")
        cases.append(c)
    refs = [c.reference() for c in cases]
    # The cases take every branch they are meant to (else the comparison proves little).
    total = {k: sum(r["stats"][k] for r in refs) for k in ["masked_high", "masked_low", "is_capped", "is_masked"]}
    for obj in OBJECTIVES:
        hi = sum(r["stats"]["masked_high"] for c, r in zip(cases, refs) if c.objective == obj)
        lo = sum(r["stats"]["masked_low"] for c, r in zip(cases, refs) if c.objective == obj)
        if hi == 0 or lo == 0:
            sys.exit(f"{obj}: the cases clip or mask on one side only (high {hi}, low {lo})")
    if total["is_capped"] == 0 or total["is_masked"] == 0:
        sys.exit(f"the importance-sampling cases never cap or never mask: {total}")
    worst_fd = max(r["fd_err"] for r in refs)
    with open(args.out, "w") as out:
        for c, r in zip(cases, refs):
            c.write(out, r)
        groups = rng.integers(0, 3, size=24).astype(np.float64)  # 6 groups of 4: ties, all-equal groups
        groups[4:8] = 1.0
        rewards = groups + np.where(rng.uniform(size=24) < 0.3, rng.normal(0, 0.5, size=24), 0.0)
        for kind in ADVANTAGES:
            out.write(f"advantage {kind} 4 {len(rewards)}\n")
            out.write("rewards " + " ".join(repr(float(v)) for v in rewards) + "\n")
            out.write("expected " + " ".join(repr(float(v)) for v in advantages(kind, rewards, 4)) + "\n")
    print(f"{len(cases)} loss cases, {len(ADVANTAGES)} advantage cases written to {args.out}; "
          f"clips/masks high {total['masked_high']} low {total['masked_low']}, IS capped {total['is_capped']} "
          f"masked {total['is_masked']}; analytic vs central-difference gradients within {worst_fd:.1e}")


if __name__ == "__main__":
    main()
