// layers.cpp — decoder layer and lm-head loss on the CPU backend (fp32).
#include "cpu/layers.hpp"

#include <algorithm>
#include <cstring>

#include "cpu/ops.hpp"

namespace shardlm::cpu {
namespace {

// Typed "no bias" / "no bias gradient" for the templated kernels.
constexpr const float* kNoBias = nullptr;
constexpr float* kNoBiasGrad = nullptr;

struct Dims {
  int64_t C, I, H, KV, D, HD, KVD;
  explicit Dims(const ModelConfig& c)
      : C(c.hidden_size), I(c.intermediate_size), H(c.num_heads), KV(c.num_kv_heads), D(c.head_dim),
        HD(c.num_heads * c.head_dim), KVD(c.num_kv_heads * c.head_dim) {}
};

}  // namespace

LayerActs::LayerActs(const ModelConfig& c, int64_t N) {
  const Dims d(c);
  const Mem m = Mem::Activations;
  rstd1 = Buffer<float>(m, N);
  xn1 = Buffer<float>(m, N * d.C);
  if (c.qk_norm) {
    q_raw = Buffer<float>(m, N * d.HD);
    k_raw = Buffer<float>(m, N * d.KVD);
    q_rstd = Buffer<float>(m, N * d.H);
    k_rstd = Buffer<float>(m, N * d.KV);
  }
  q = Buffer<float>(m, N * d.HD);
  k = Buffer<float>(m, N * d.KVD);
  v = Buffer<float>(m, N * d.KVD);
  att = Buffer<float>(m, N * d.HD);
  lse = Buffer<float>(m, N * d.H);
  x_mid = Buffer<float>(m, N * d.C);
  rstd2 = Buffer<float>(m, N);
  xn2 = Buffer<float>(m, N * d.C);
  gate = Buffer<float>(m, N * d.I);
  up = Buffer<float>(m, N * d.I);
  h = Buffer<float>(m, N * d.I);
}

int64_t LayerActs::bytes(const ModelConfig& c, int64_t N) {
  const Dims d(c);
  int64_t floats = N * (2 + 3 * d.C + 2 * d.HD + 2 * d.KVD + d.H + 3 * d.I);
  if (c.qk_norm) floats += N * (d.HD + d.KVD + d.H + d.KV);
  return floats * 4;
}

LayerGradScratch::LayerGradScratch(const ModelConfig& c, int64_t N) {
  const Dims d(c);
  const Mem m = Mem::Workspace;
  d_mid = Buffer<float>(m, N * d.C);
  d_xn = Buffer<float>(m, N * d.C);
  d_tmp = Buffer<float>(m, N * d.C);
  d_att = Buffer<float>(m, N * d.HD);
  dq = Buffer<float>(m, N * d.HD);
  dk = Buffer<float>(m, N * d.KVD);
  dv = Buffer<float>(m, N * d.KVD);
  if (c.qk_norm) {
    dq_raw = Buffer<float>(m, N * d.HD);
    dk_raw = Buffer<float>(m, N * d.KVD);
  }
  dh = Buffer<float>(m, N * d.I);
  dgate = Buffer<float>(m, N * d.I);
  dup = Buffer<float>(m, N * d.I);
}

int64_t LayerGradScratch::bytes(const ModelConfig& c, int64_t N) {
  const Dims d(c);
  int64_t floats = N * (3 * d.C + 2 * d.HD + 2 * d.KVD + 3 * d.I);
  if (c.qk_norm) floats += N * (d.HD + d.KVD);
  return floats * 4;
}

HeadScratch::HeadScratch(const ModelConfig& c, int64_t N, int64_t chunk_tokens) : chunk(std::min(chunk_tokens, N)) {
  xf = Buffer<float>(Mem::Workspace, N * c.hidden_size);
  rstd = Buffer<float>(Mem::Workspace, N);
  dxf = Buffer<float>(Mem::Workspace, N * c.hidden_size);
  logits = Buffer<float>(Mem::Workspace, chunk * c.vocab_size);
}

int64_t HeadScratch::bytes(const ModelConfig& c, int64_t N, int64_t chunk_tokens) {
  return 4 * (N * (2 * c.hidden_size + 1) + std::min(chunk_tokens, N) * c.vocab_size);
}

void layer_forward(const ModelConfig& c, const LayerWeights<const float>& w, const TokenInputs& in,
                   const float* x_in, float* x_out, LayerActs& a, bool run_attention) {
  const Dims d(c);
  const int64_t N = in.N;
  rmsnorm_forward(a.xn1.data(), a.rstd1.data(), x_in, w.input_norm, N, d.C, c.rms_norm_eps);
  // Without q/k norm the projections land directly where RoPE rotates them.
  float* q_proj = c.qk_norm ? a.q_raw.data() : a.q.data();
  float* k_proj = c.qk_norm ? a.k_raw.data() : a.k.data();
  linear_forward(q_proj, a.xn1.data(), w.wq, w.bq, N, d.C, d.HD);
  linear_forward(k_proj, a.xn1.data(), w.wk, w.bk, N, d.C, d.KVD);
  linear_forward(a.v.data(), a.xn1.data(), w.wv, w.bv, N, d.C, d.KVD);
  if (c.qk_norm) {
    rmsnorm_forward(a.q.data(), a.q_rstd.data(), a.q_raw.data(), w.q_norm, N * d.H, d.D, c.rms_norm_eps);
    rmsnorm_forward(a.k.data(), a.k_rstd.data(), a.k_raw.data(), w.k_norm, N * d.KV, d.D, c.rms_norm_eps);
  }
  rope_forward(a.q.data(), in.positions, in.inv_freq, N, d.H, d.D);
  rope_forward(a.k.data(), in.positions, in.inv_freq, N, d.KV, d.D);
  if (run_attention)
    attention_forward(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), in.seq_ids, N, d.H, d.KV, d.D);
  // x_out serves as the scratch for the o_proj output before the residual add.
  linear_forward(x_out, a.att.data(), w.wo, kNoBias, N, d.HD, d.C);
  add(a.x_mid.data(), x_in, x_out, N * d.C);
  rmsnorm_forward(a.xn2.data(), a.rstd2.data(), a.x_mid.data(), w.post_norm, N, d.C, c.rms_norm_eps);
  linear_forward(a.gate.data(), a.xn2.data(), w.w_gate, kNoBias, N, d.C, d.I);
  linear_forward(a.up.data(), a.xn2.data(), w.w_up, kNoBias, N, d.C, d.I);
  swiglu_forward(a.h.data(), a.gate.data(), a.up.data(), N * d.I);
  linear_forward(x_out, a.h.data(), w.w_down, kNoBias, N, d.I, d.C);
  add(x_out, x_out, a.x_mid.data(), N * d.C);
}

void layer_backward(const ModelConfig& c, const LayerWeights<const float>& w, const LayerWeights<float>& g,
                    const TokenInputs& in, const float* x_in, const LayerActs& a, float* d_x,
                    LayerGradScratch& s) {
  const Dims d(c);
  const int64_t N = in.N;
  // MLP branch: x_out = x_mid + down(silu(gate(xn2)) * up(xn2)).
  linear_backward(s.dh.data(), g.w_down, kNoBiasGrad, d_x, a.h.data(), w.w_down, N, d.I, d.C);
  swiglu_backward(s.dgate.data(), s.dup.data(), s.dh.data(), a.gate.data(), a.up.data(), N * d.I);
  linear_backward(s.d_xn.data(), g.w_gate, kNoBiasGrad, s.dgate.data(), a.xn2.data(), w.w_gate, N, d.C, d.I);
  linear_backward(s.d_tmp.data(), g.w_up, kNoBiasGrad, s.dup.data(), a.xn2.data(), w.w_up, N, d.C, d.I);
  add(s.d_xn.data(), s.d_xn.data(), s.d_tmp.data(), N * d.C);
  rmsnorm_backward(s.d_tmp.data(), g.post_norm, s.d_xn.data(), a.x_mid.data(), w.post_norm, a.rstd2.data(), N, d.C);
  add(s.d_mid.data(), d_x, s.d_tmp.data(), N * d.C);

  // Attention branch: x_mid = x_in + o(attn(rope(norm(q)), rope(norm(k)), v)).
  linear_backward(s.d_att.data(), g.wo, kNoBiasGrad, s.d_mid.data(), a.att.data(), w.wo, N, d.HD, d.C);
  attention_backward(s.dq.data(), s.dk.data(), s.dv.data(), s.d_att.data(), a.q.data(), a.k.data(), a.v.data(),
                     a.att.data(), a.lse.data(), in.seq_ids, N, d.H, d.KV, d.D);
  rope_backward(s.dq.data(), in.positions, in.inv_freq, N, d.H, d.D);
  rope_backward(s.dk.data(), in.positions, in.inv_freq, N, d.KV, d.D);
  const float* dq = s.dq.data();
  const float* dk = s.dk.data();
  if (c.qk_norm) {
    rmsnorm_backward(s.dq_raw.data(), g.q_norm, s.dq.data(), a.q_raw.data(), w.q_norm, a.q_rstd.data(), N * d.H, d.D);
    rmsnorm_backward(s.dk_raw.data(), g.k_norm, s.dk.data(), a.k_raw.data(), w.k_norm, a.k_rstd.data(), N * d.KV, d.D);
    dq = s.dq_raw.data();
    dk = s.dk_raw.data();
  }
  linear_backward(s.d_xn.data(), g.wq, g.bq, dq, a.xn1.data(), w.wq, N, d.C, d.HD);
  linear_backward(s.d_tmp.data(), g.wk, g.bk, dk, a.xn1.data(), w.wk, N, d.C, d.KVD);
  add(s.d_xn.data(), s.d_xn.data(), s.d_tmp.data(), N * d.C);
  linear_backward(s.d_tmp.data(), g.wv, g.bv, s.dv.data(), a.xn1.data(), w.wv, N, d.C, d.KVD);
  add(s.d_xn.data(), s.d_xn.data(), s.d_tmp.data(), N * d.C);
  rmsnorm_backward(s.d_tmp.data(), g.input_norm, s.d_xn.data(), x_in, w.input_norm, a.rstd1.data(), N, d.C);
  add(d_x, s.d_mid.data(), s.d_tmp.data(), N * d.C);
}

RlChunkStats head_loss_backward(const ModelConfig& c, const float* norm_w, const float* lm_head, float* g_norm,
                                float* g_lm, const float* x, const int32_t* targets, const float* weights,
                                float grad_scale, int64_t N, float* d_x, HeadScratch& s, const RlInputs* rl) {
  const int64_t C = c.hidden_size, V = c.vocab_size;
  rmsnorm_forward(s.xf.data(), s.rstd.data(), x, norm_w, N, C, c.rms_norm_eps);
  RlChunkStats stats;
  for (int64_t t0 = 0; t0 < N; t0 += s.chunk) {
    const int64_t n = std::min(s.chunk, N - t0);
    float* dxf = s.dxf.data() + t0 * C;
    bool any_loss = false;
    for (int64_t i = 0; i < n && !any_loss; ++i) any_loss = targets[t0 + i] >= 0 && weights[t0 + i] != 0.0f;
    if (!any_loss) {  // no loss in this chunk: its gradient is exactly zero
      std::memset(dxf, 0, sizeof(float) * n * C);
      continue;
    }
    const float* xf = s.xf.data() + t0 * C;
    linear_forward(s.logits.data(), xf, lm_head, kNoBias, n, C, V);
    if (rl) {
      stats += rl_loss_forward_backward<float>(s.logits.data(), targets + t0, weights + t0, rl->advantages + t0,
                                               rl->inference_logprobs + t0, rl->temperatures + t0, rl->params,
                                               grad_scale, n, V);
    } else {
      stats.loss += cross_entropy_forward_backward(s.logits.data(), targets + t0, weights + t0, grad_scale, n, V);
      for (int64_t i = 0; i < n; ++i) stats.loss_tokens += targets[t0 + i] >= 0 && weights[t0 + i] > 0.0f;
    }
    linear_backward(dxf, g_lm, kNoBiasGrad, s.logits.data(), xf, lm_head, n, C, V);
  }
  rmsnorm_backward(d_x, g_norm, s.dxf.data(), x, norm_w, s.rstd.data(), N, C);
  return stats;
}

RlChunkStats head_loss(const ModelConfig& c, const float* norm_w, const float* lm_head, const float* x,
                       const int32_t* targets, const float* weights, int64_t N, HeadScratch& s) {
  const int64_t C = c.hidden_size, V = c.vocab_size;
  rmsnorm_forward(s.xf.data(), s.rstd.data(), x, norm_w, N, C, c.rms_norm_eps);
  RlChunkStats stats;
  for (int64_t t0 = 0; t0 < N; t0 += s.chunk) {
    const int64_t n = std::min(s.chunk, N - t0);
    bool any_loss = false;
    for (int64_t i = 0; i < n && !any_loss; ++i) any_loss = targets[t0 + i] >= 0 && weights[t0 + i] != 0.0f;
    if (!any_loss) continue;
    linear_forward(s.logits.data(), s.xf.data() + t0 * C, lm_head, kNoBias, n, C, V);
    // grad_scale 0: the loss of the training path; the logits become zeros, unused.
    stats.loss += cross_entropy_forward_backward(s.logits.data(), targets + t0, weights + t0, 0.0f, n, V);
    for (int64_t i = 0; i < n; ++i) stats.loss_tokens += targets[t0 + i] >= 0 && weights[t0 + i] > 0.0f;
  }
  return stats;
}

void head_logits(const ModelConfig& c, const float* norm_w, const float* lm_head, const float* x, int64_t N,
                 float* logits, HeadScratch& s) {
  rmsnorm_forward(s.xf.data(), s.rstd.data(), x, norm_w, N, c.hidden_size, c.rms_norm_eps);
  linear_forward(logits, s.xf.data(), lm_head, kNoBias, N, c.hidden_size, c.vocab_size);
}

}  // namespace shardlm::cpu
