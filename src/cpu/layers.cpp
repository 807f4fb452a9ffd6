// layers.cpp — decoder layer and lm-head loss on the CPU backend (fp32).
#include "cpu/layers.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "shardlm/error.hpp"

#include "cpu/ops.hpp"

namespace shardlm::cpu {
namespace {

// Typed "no bias" / "no bias gradient" for the templated kernels.
constexpr const float* kNoBias = nullptr;
constexpr float* kNoBiasGrad = nullptr;

struct Dims {
  int64_t C, I, H, KV, D, HD, KVD;
  int64_t E, K, Im, Is;  // experts, experts a token, their width, the shared expert's (0: none)
  explicit Dims(const ModelConfig& c)
      : C(c.hidden_size), I(c.intermediate_size), H(c.num_heads), KV(c.num_kv_heads), D(c.head_dim),
        HD(c.num_heads * c.head_dim), KVD(c.num_kv_heads * c.head_dim), E(c.num_experts), K(c.num_experts_per_tok),
        Im(c.moe_intermediate_size), Is(c.shared_expert_intermediate_size) {}
  // The width of gate, up and h: the dense MLP's, or a layer of experts' shared expert.
  int64_t mlp_width() const { return std::max(I, Is); }
};

// The layer's projections: in.linear's (model.fp8) or the fp32 GEMMs.
LinearFn forward_of(const TokenInputs& in) {
  if (!in.linear) return &linear_forward<float>;
  return [l = in.linear](float* out, const float* inp, const float* w, const float* b, int64_t N, int64_t IC,
                         int64_t OC) { l->forward(out, inp, w, b, N, IC, OC); };
}
void project_backward(const TokenInputs& in, float* dinp, float* dweight, float* dbias, const float* dout,
                      const float* inp, const float* weight, int64_t N, int64_t IC, int64_t OC) {
  if (in.linear) in.linear->backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
  else linear_backward(dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
}

// The expert GEMMs of a `linear` that is one of the two fp32 GEMMs: rowwise
// (each row independent of the others: decode) or not. model.fp8's projections
// do not reach the experts (the deck refuses the pair).
bool rowwise_of(const LinearFn& linear) {
  using Fn = void (*)(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t);
  const Fn* fn = linear.target<Fn>();
  SHARDLM_CHECK(fn && (*fn == &linear_forward<float> || *fn == &linear_rowwise_forward<float>),
                "internal: a layer of experts runs the fp32 GEMMs only");
  return *fn == &linear_rowwise_forward<float>;
}

// A layer of experts' MLP on xn2: out (N, C) = the routed experts' weighted sum
// (+ the shared expert times sigmoid of its gate), without the residual.
void experts_forward(const ModelConfig& c, const LayerWeights<const float>& w, int64_t N, float* out, LayerActs& a,
                     const LinearFn& linear, const int32_t* forced, int64_t forced_stride, Experts* experts) {
  const Dims d(c);
  linear(a.router_logits.data(), a.xn2.data(), w.router, kNoBias, N, d.C, d.E);
  MoeRouting<float> r = a.routing();
  moe_route(r, a.router_logits.data(), N, d.E, d.K, c.norm_topk_prob, forced, forced_stride);
  if (experts)
    experts->forward(out, a, w, N);
  else
    moe_experts_forward(out, a.xs.data(), a.e_gate.data(), a.e_up.data(), a.e_h.data(), a.y.data(), a.xn2.data(), r,
                        w.e_gate, w.e_up, w.e_down, N, d.C, d.Im, d.E, d.K, rowwise_of(linear));
  if (d.Is == 0) return;
  linear(a.gate.data(), a.xn2.data(), w.s_gate, kNoBias, N, d.C, d.Is);
  linear(a.up.data(), a.xn2.data(), w.s_up, kNoBias, N, d.C, d.Is);
  swiglu_forward(a.h.data(), a.gate.data(), a.up.data(), N * d.Is);
  linear(a.shared_out.data(), a.h.data(), w.s_down, kNoBias, N, d.Is, d.C);
  linear(a.shared_logit.data(), a.xn2.data(), w.s_weight, kNoBias, N, d.C, 1);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float g = 1.0f / (1.0f + std::exp(-a.shared_logit[n]));
    for (int64_t k = 0; k < d.C; ++k) out[n * d.C + k] += g * a.shared_out[n * d.C + k];
  }
}

// Its backward: from d_out (N, C) at the MLP's output, d_xn (N, C) overwritten
// with the gradient at xn2; parameter gradients accumulated into g.
void experts_backward(const ModelConfig& c, const LayerWeights<const float>& w, const LayerWeights<float>& g,
                      const TokenInputs& in, const LayerActs& a, const float* d_out, float* d_xn,
                      LayerGradScratch& s, const RouterAux* aux) {
  const Dims d(c);
  const int64_t N = in.N;
  const MoeRouting<float> r = a.routing();
  if (in.experts)
    in.experts->backward(d_xn, s.d_weight.data(), d_out, a, w, g, s, N);
  else
    moe_experts_backward(d_xn, s.d_weight.data(), g.e_gate, g.e_up, g.e_down, s.d_y.data(), s.d_eh.data(),
                         s.d_egate.data(), s.d_eup.data(), s.d_xs.data(), d_out, a.xs.data(), a.e_gate.data(),
                         a.e_up.data(), a.e_h.data(), a.y.data(), r, w.e_gate, w.e_up, w.e_down, N, d.C, d.Im, d.E,
                         d.K);
  const float* d_probs = nullptr;
  if (aux && aux->scale != 0 && aux->rows > 0) {
    moe_aux_backward(s.d_probs.data(), aux->counts.data(), aux->rows, N, d.E, aux->scale);
    d_probs = s.d_probs.data();
  }
  moe_route_backward(s.d_logits.data(), s.d_weight.data(), d_probs, r, N, d.E, d.K, c.norm_topk_prob);
  project_backward(in, s.d_tmp.data(), g.router, kNoBiasGrad, s.d_logits.data(), a.xn2.data(), w.router, N, d.C, d.E);
  add(d_xn, d_xn, s.d_tmp.data(), N * d.C);
  if (d.Is == 0) return;
  // out += sigmoid(z) S(xn2), z = shared_expert_gate(xn2): dS = sigmoid(z) d_out, dz = sigmoid'(z) (d_out . S).
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float sg = 1.0f / (1.0f + std::exp(-a.shared_logit[n]));
    double dot = 0;
    for (int64_t k = 0; k < d.C; ++k) {
      s.d_shared[n * d.C + k] = sg * d_out[n * d.C + k];
      dot += double(d_out[n * d.C + k]) * double(a.shared_out[n * d.C + k]);
    }
    s.d_shared_logit[n] = float(dot * sg * (1.0 - sg));
  }
  project_backward(in, s.dh.data(), g.s_down, kNoBiasGrad, s.d_shared.data(), a.h.data(), w.s_down, N, d.Is, d.C);
  swiglu_backward(s.dgate.data(), s.dup.data(), s.dh.data(), a.gate.data(), a.up.data(), N * d.Is);
  project_backward(in, s.d_tmp.data(), g.s_gate, kNoBiasGrad, s.dgate.data(), a.xn2.data(), w.s_gate, N, d.C, d.Is);
  add(d_xn, d_xn, s.d_tmp.data(), N * d.C);
  project_backward(in, s.d_tmp.data(), g.s_up, kNoBiasGrad, s.dup.data(), a.xn2.data(), w.s_up, N, d.C, d.Is);
  add(d_xn, d_xn, s.d_tmp.data(), N * d.C);
  project_backward(in, s.d_tmp.data(), g.s_weight, kNoBiasGrad, s.d_shared_logit.data(), a.xn2.data(), w.s_weight,
                   N, d.C, 1);
  add(d_xn, d_xn, s.d_tmp.data(), N * d.C);
}

}  // namespace

void LayerActs::add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows, int64_t P) {
  const Dims d(c);
  const Mem m = Mem::Activations;
  rows.push_back({"rstd1", &rstd1, N, m});
  rows.push_back({"xn1", &xn1, N * d.C, m});
  if (c.qk_norm) {
    rows.push_back({"q_raw", &q_raw, N * d.HD, m});
    rows.push_back({"k_raw", &k_raw, N * d.KVD, m});
    rows.push_back({"q_rstd", &q_rstd, N * d.H, m});
    rows.push_back({"k_rstd", &k_rstd, N * d.KV, m});
  }
  rows.push_back({"q", &q, N * d.HD, m});
  rows.push_back({"k", &k, N * d.KVD, m});
  rows.push_back({"v", &v, N * d.KVD, m});
  rows.push_back({"att", &att, N * d.HD, m});
  rows.push_back({"lse", &lse, N * d.H, m});
  rows.push_back({"x_mid", &x_mid, N * d.C, m});
  rows.push_back({"rstd2", &rstd2, N, m});
  rows.push_back({"xn2", &xn2, N * d.C, m});
  rows.push_back({"gate", &gate, N * d.mlp_width(), m});
  rows.push_back({"up", &up, N * d.mlp_width(), m});
  rows.push_back({"h", &h, N * d.mlp_width(), m});
  if (!c.moe()) return;
  const int64_t R = N * d.K;
  rows.push_back({"router_logits", &router_logits, N * d.E, m});
  rows.push_back({"probs", &probs, N * d.E, m});
  rows.push_back({"expert", nullptr, N * d.K, m, &expert});
  rows.push_back({"slot", nullptr, R, m, &slot});
  rows.push_back({"row", nullptr, R, m, &row});
  rows.push_back({"weight", &weight, N * d.K, m});
  rows.push_back({"offsets", nullptr, d.E + 1, m, nullptr, &offsets});
  // Expert parallelism: an owner may get every rank's rows (all routed to its experts).
  const int64_t Ro = P * R;
  rows.push_back({"xs", &xs, Ro * d.C, m});
  rows.push_back({"y", &y, R * d.C, m});
  rows.push_back({"e_gate", &e_gate, Ro * d.Im, m});
  rows.push_back({"e_up", &e_up, Ro * d.Im, m});
  rows.push_back({"e_h", &e_h, Ro * d.Im, m});
  if (P > 1) rows.push_back({"ep_rows", nullptr, P * d.E, m, &ep_rows});
  if (d.Is > 0) {
    rows.push_back({"shared_out", &shared_out, N * d.C, m});
    rows.push_back({"shared_logit", &shared_logit, N, m});
  }
}

MoeRouting<float> LayerActs::routing() const {
  auto& a = const_cast<LayerActs&>(*this);
  return {a.probs.data(), a.expert.data(), a.weight.data(), a.offsets.data(), a.slot.data(), a.row.data()};
}

void LayerGradScratch::add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows, int64_t P) {
  const Dims d(c);
  const Mem m = Mem::Workspace;
  rows.push_back({"d_mid", &d_mid, N * d.C, m});
  rows.push_back({"d_xn", &d_xn, N * d.C, m});
  rows.push_back({"d_tmp", &d_tmp, N * d.C, m});
  rows.push_back({"d_att", &d_att, N * d.HD, m});
  rows.push_back({"dq", &dq, N * d.HD, m});
  rows.push_back({"dk", &dk, N * d.KVD, m});
  rows.push_back({"dv", &dv, N * d.KVD, m});
  if (c.qk_norm) {
    rows.push_back({"dq_raw", &dq_raw, N * d.HD, m});
    rows.push_back({"dk_raw", &dk_raw, N * d.KVD, m});
  }
  rows.push_back({"dh", &dh, N * d.mlp_width(), m});
  rows.push_back({"dgate", &dgate, N * d.mlp_width(), m});
  rows.push_back({"dup", &dup, N * d.mlp_width(), m});
  if (!c.moe()) return;
  const int64_t Ro = P * N * d.K;  // the owner's rows (LayerActs)
  rows.push_back({"d_weight", &d_weight, N * d.K, m});
  rows.push_back({"d_y", &d_y, Ro * d.C, m});
  rows.push_back({"d_eh", &d_eh, Ro * d.Im, m});
  rows.push_back({"d_egate", &d_egate, Ro * d.Im, m});
  rows.push_back({"d_eup", &d_eup, Ro * d.Im, m});
  rows.push_back({"d_xs", &d_xs, Ro * d.C, m});
  rows.push_back({"d_logits", &d_logits, N * d.E, m});
  rows.push_back({"d_probs", &d_probs, N * d.E, m});
  if (d.Is > 0) {
    rows.push_back({"d_shared", &d_shared, N * d.C, m});
    rows.push_back({"d_shared_logit", &d_shared_logit, N, m});
  }
}

void HeadScratch::add_rows(const ModelConfig& c, int64_t N, int64_t chunk_tokens, std::vector<BufferRow>& rows) {
  chunk = std::min(chunk_tokens, N);
  const Mem m = Mem::Workspace;
  rows.push_back({"head.xf", &xf, N * c.hidden_size, m});
  rows.push_back({"head.rstd", &rstd, N, m});
  rows.push_back({"head.dxf", &dxf, N * c.hidden_size, m});
  rows.push_back({"head.logits", &logits, chunk * c.vocab_size, m});
}

void allocate_rows(const std::vector<BufferRow>& rows) {
  for (const BufferRow& r : rows) {
    if (r.slot) *r.slot = Buffer<float>(r.category, r.numel);
    if (r.index_slot) *r.index_slot = Buffer<int32_t>(r.category, r.numel);
    if (r.offset_slot) *r.offset_slot = Buffer<int64_t>(r.category, r.numel);
  }
}

int64_t rows_bytes(const std::vector<BufferRow>& rows, Mem category) {
  int64_t bytes = 0;
  for (const BufferRow& r : rows)
    if (r.category == category) bytes += r.bytes();
  return bytes;
}

void RouterAux::reset(int64_t E, double aux_scale) {
  counts.assign(size_t(E), 0.0);
  prob_sums.assign(size_t(E), 0.0);
  rows = 0;
  scale = aux_scale;
}

void RouterAux::add(const LayerActs& acts, int64_t N, int64_t E, int64_t K) {
  moe_aux_counts(counts.data(), prob_sums.data(), acts.routing(), N, E, K);
  rows += N;
}

double RouterAux::loss() const {
  return rows > 0 ? moe_aux_loss(counts.data(), prob_sums.data(), rows, int64_t(counts.size())) : 0.0;
}

void layer_qkv_forward(const ModelConfig& c, const LayerWeights<const float>& w, const TokenInputs& in,
                       const float* x_in, LayerActs& a, LinearFn linear) {
  const Dims d(c);
  const int64_t N = in.N;
  rmsnorm_forward(a.xn1.data(), a.rstd1.data(), x_in, w.input_norm, N, d.C, c.rms_norm_eps);
  // Without q/k norm the projections land directly where RoPE rotates them.
  float* q_proj = c.qk_norm ? a.q_raw.data() : a.q.data();
  float* k_proj = c.qk_norm ? a.k_raw.data() : a.k.data();
  linear(q_proj, a.xn1.data(), w.wq, w.bq, N, d.C, d.HD);
  linear(k_proj, a.xn1.data(), w.wk, w.bk, N, d.C, d.KVD);
  linear(a.v.data(), a.xn1.data(), w.wv, w.bv, N, d.C, d.KVD);
  if (c.qk_norm) {
    rmsnorm_forward(a.q.data(), a.q_rstd.data(), a.q_raw.data(), w.q_norm, N * d.H, d.D, c.rms_norm_eps);
    rmsnorm_forward(a.k.data(), a.k_rstd.data(), a.k_raw.data(), w.k_norm, N * d.KV, d.D, c.rms_norm_eps);
  }
  rope_forward(a.q.data(), in.positions, in.inv_freq, N, d.H, d.D);
  rope_forward(a.k.data(), in.positions, in.inv_freq, N, d.KV, d.D);
}

void layer_out_forward(const ModelConfig& c, const LayerWeights<const float>& w, int64_t N, const float* x_in,
                       float* x_out, LayerActs& a, LinearFn linear, const int32_t* forced,
                       int64_t forced_stride, Experts* experts) {
  const Dims d(c);
  // x_out serves as the scratch for the o_proj output before the residual add.
  linear(x_out, a.att.data(), w.wo, kNoBias, N, d.HD, d.C);
  add(a.x_mid.data(), x_in, x_out, N * d.C);
  rmsnorm_forward(a.xn2.data(), a.rstd2.data(), a.x_mid.data(), w.post_norm, N, d.C, c.rms_norm_eps);
  if (w.router) {
    experts_forward(c, w, N, x_out, a, linear, forced, forced_stride, experts);
  } else {
    linear(a.gate.data(), a.xn2.data(), w.w_gate, kNoBias, N, d.C, d.I);
    linear(a.up.data(), a.xn2.data(), w.w_up, kNoBias, N, d.C, d.I);
    swiglu_forward(a.h.data(), a.gate.data(), a.up.data(), N * d.I);
    linear(x_out, a.h.data(), w.w_down, kNoBias, N, d.I, d.C);
  }
  add(x_out, x_out, a.x_mid.data(), N * d.C);
}

void layer_forward(const ModelConfig& c, const LayerWeights<const float>& w, const TokenInputs& in,
                   const float* x_in, float* x_out, LayerActs& a, bool run_attention, const int32_t* forced,
                   int64_t forced_stride) {
  const Dims d(c);
  const LinearFn linear = forward_of(in);
  layer_qkv_forward(c, w, in, x_in, a, linear);
  if (run_attention && in.attention)
    in.attention->forward(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), in, d.H, d.KV, d.D);
  else if (run_attention)
    attention_forward(a.att.data(), a.lse.data(), a.q.data(), a.k.data(), a.v.data(), in.seq_ids, in.N, d.H, d.KV,
                      d.D);
  layer_out_forward(c, w, in.N, x_in, x_out, a, linear, forced, forced_stride, in.experts);
}

void layer_backward(const ModelConfig& c, const LayerWeights<const float>& w, const LayerWeights<float>& g,
                    const TokenInputs& in, const float* x_in, const LayerActs& a, float* d_x,
                    LayerGradScratch& s, const RouterAux* router_aux) {
  const Dims d(c);
  const int64_t N = in.N;
  if (w.router) {  // MLP branch: x_out = x_mid + experts(xn2)
    experts_backward(c, w, g, in, a, d_x, s.d_xn.data(), s, router_aux);
  } else {  // x_out = x_mid + down(silu(gate(xn2)) * up(xn2))
    project_backward(in, s.dh.data(), g.w_down, kNoBiasGrad, d_x, a.h.data(), w.w_down, N, d.I, d.C);
    swiglu_backward(s.dgate.data(), s.dup.data(), s.dh.data(), a.gate.data(), a.up.data(), N * d.I);
    project_backward(in, s.d_xn.data(), g.w_gate, kNoBiasGrad, s.dgate.data(), a.xn2.data(), w.w_gate, N, d.C, d.I);
    project_backward(in, s.d_tmp.data(), g.w_up, kNoBiasGrad, s.dup.data(), a.xn2.data(), w.w_up, N, d.C, d.I);
    add(s.d_xn.data(), s.d_xn.data(), s.d_tmp.data(), N * d.C);
  }
  rmsnorm_backward(s.d_tmp.data(), g.post_norm, s.d_xn.data(), a.x_mid.data(), w.post_norm, a.rstd2.data(), N, d.C);
  add(s.d_mid.data(), d_x, s.d_tmp.data(), N * d.C);

  // Attention branch: x_mid = x_in + o(attn(rope(norm(q)), rope(norm(k)), v)).
  project_backward(in, s.d_att.data(), g.wo, kNoBiasGrad, s.d_mid.data(), a.att.data(), w.wo, N, d.HD, d.C);
  if (in.attention)
    in.attention->backward(s.dq.data(), s.dk.data(), s.dv.data(), s.d_att.data(), a.q.data(), a.k.data(),
                           a.v.data(), a.att.data(), a.lse.data(), in, d.H, d.KV, d.D);
  else
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
  project_backward(in, s.d_xn.data(), g.wq, g.bq, dq, a.xn1.data(), w.wq, N, d.C, d.HD);
  project_backward(in, s.d_tmp.data(), g.wk, g.bk, dk, a.xn1.data(), w.wk, N, d.C, d.KVD);
  add(s.d_xn.data(), s.d_xn.data(), s.d_tmp.data(), N * d.C);
  project_backward(in, s.d_tmp.data(), g.wv, g.bv, s.dv.data(), a.xn1.data(), w.wv, N, d.C, d.KVD);
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
      stats += rl_loss_forward_backward<float>(s.logits.data(), targets + t0, weights + t0, rl->tokens.at(t0),
                                               rl->params, grad_scale, n, V);
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

void head_token_logprobs(const ModelConfig& c, const float* norm_w, const float* lm_head, const float* x,
                         const int32_t* targets, const float* temperatures, int64_t N, float* logprobs,
                         HeadScratch& s) {
  const int64_t C = c.hidden_size, V = c.vocab_size;
  rmsnorm_forward(s.xf.data(), s.rstd.data(), x, norm_w, N, C, c.rms_norm_eps);
  for (int64_t t0 = 0; t0 < N; t0 += s.chunk) {
    const int64_t n = std::min(s.chunk, N - t0);
    bool any_target = false;
    for (int64_t i = 0; i < n && !any_target; ++i) any_target = targets[t0 + i] >= 0;
    if (!any_target) {
      std::fill(logprobs + t0, logprobs + t0 + n, 0.0f);
      continue;
    }
    linear_forward(s.logits.data(), s.xf.data() + t0 * C, lm_head, kNoBias, n, C, V);
    token_logprobs<float>(logprobs + t0, s.logits.data(), targets + t0, temperatures + t0, n, V);
  }
}

void head_logits(const ModelConfig& c, const float* norm_w, const float* lm_head, const float* x, int64_t N,
                 float* logits, HeadScratch& s) {
  rmsnorm_forward(s.xf.data(), s.rstd.data(), x, norm_w, N, c.hidden_size, c.rms_norm_eps);
  linear_forward(logits, s.xf.data(), lm_head, kNoBias, N, c.hidden_size, c.vocab_size);
}

}  // namespace shardlm::cpu
