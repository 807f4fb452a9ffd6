// moe.cpp — the mixture-of-experts MLP on the CPU; see moe.hpp.
#include "cpu/moe.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/ops.hpp"

namespace shardlm::cpu {

template <class T>
void moe_route(MoeRouting<T>& r, const T* logits, int64_t N, int64_t E, int64_t K, bool norm_topk,
               const int32_t* forced, int64_t forced_stride) {
  if (forced_stride == 0) forced_stride = K;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* z = logits + n * E;
    T* p = r.probs + n * E;
    double top = z[0], sum = 0;
    for (int64_t e = 1; e < E; ++e) top = std::max(top, double(z[e]));
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double(z[e]) - top);
    for (int64_t e = 0; e < E; ++e) p[e] = T(std::exp(double(z[e]) - top) / sum);
    // Top K by probability, the lower index first among equals (a selection: K is small).
    int32_t* chosen = r.expert + n * K;
    T* w = r.weight + n * K;
    double picked = 0;
    const int32_t* replay = forced && forced[n * forced_stride] >= 0 ? forced + n * forced_stride : nullptr;
    for (int64_t j = 0; j < K; ++j) {
      if (replay) {
        chosen[j] = replay[j];
        w[j] = p[replay[j]];
        picked += double(p[replay[j]]);
        continue;
      }
      int32_t best = -1;
      for (int32_t e = 0; e < int32_t(E); ++e) {
        if (std::find(chosen, chosen + j, e) != chosen + j) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      chosen[j] = best;
      w[j] = p[best];
      picked += double(p[best]);
    }
    if (norm_topk)
      for (int64_t j = 0; j < K; ++j) w[j] = T(double(w[j]) / picked);
  }
  // The permutation: rows grouped by expert, in token order within each (serial: counts, then places).
  std::fill(r.offsets, r.offsets + E + 1, int64_t(0));
  for (int64_t s = 0; s < N * K; ++s) ++r.offsets[r.expert[s] + 1];
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] += r.offsets[e];
  std::vector<int64_t> next(r.offsets, r.offsets + E);
  for (int64_t s = 0; s < N * K; ++s) {
    const int64_t row = next[size_t(r.expert[s])]++;
    r.slot[row] = int32_t(s);
    r.row[s] = int32_t(row);
  }
}

template <class T>
void moe_gather_rows(T* xs, const T* x, const MoeRouting<T>& r, int64_t N, int64_t C, int64_t K) {
  const int64_t R = N * K;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < R; ++row) std::copy_n(x + (r.slot[row] / K) * C, C, xs + row * C);
}

template <class T>
void moe_expert_gemms_forward(T* gate, T* up, T* h, T* y, const T* xs, const int64_t* offsets, int64_t groups,
                              int64_t experts, const T* w_gate, const T* w_up, const T* w_down, int64_t stride,
                              int64_t C, int64_t I, bool rowwise) {
  const auto linear = rowwise ? &linear_rowwise_forward<T> : &linear_forward<T>;
  for (int64_t g = 0; g < groups; ++g) {  // each group's GEMMs with its expert's weights
    const int64_t first = offsets[g], rows = offsets[g + 1] - first, e = g % experts;
    if (rows == 0) continue;
    linear(gate + first * I, xs + first * C, w_gate + e * stride, static_cast<const T*>(nullptr), rows, C, I);
    linear(up + first * I, xs + first * C, w_up + e * stride, static_cast<const T*>(nullptr), rows, C, I);
    swiglu_forward(h + first * I, gate + first * I, up + first * I, rows * I);
    linear(y + first * C, h + first * I, w_down + e * stride, static_cast<const T*>(nullptr), rows, I, C);
  }
}

template <class T>
void moe_combine(T* out, const T* y, const MoeRouting<T>& r, int64_t N, int64_t C, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* o = out + n * C;
    std::fill(o, o + C, T(0));
    for (int64_t j = 0; j < K; ++j) {
      const T w = r.weight[n * K + j];
      const T* yr = y + int64_t(r.row[n * K + j]) * C;
      for (int64_t c = 0; c < C; ++c) o[c] += w * yr[c];
    }
  }
}

template <class T>
void moe_experts_forward(T* out, T* xs, T* gate, T* up, T* h, T* y, const T* x, const MoeRouting<T>& r,
                         const T* w_gate, const T* w_up, const T* w_down, int64_t N, int64_t C, int64_t I, int64_t E,
                         int64_t K, bool rowwise) {
  moe_gather_rows(xs, x, r, N, C, K);
  moe_expert_gemms_forward(gate, up, h, y, xs, r.offsets, E, E, w_gate, w_up, w_down, I * C, C, I, rowwise);
  moe_combine(out, y, r, N, C, K);
}

template <class T>
void moe_rows_backward(T* dy, T* dweight, const T* dout, const T* y, const MoeRouting<T>& r, int64_t N, int64_t C,
                       int64_t K) {
  const int64_t R = N * K;
  // Per row: dy = weight * dout of its token; d weight = dout . y.
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < R; ++row) {
    const int64_t s = r.slot[row], n = s / K;
    const T w = r.weight[s];
    const T* d = dout + n * C;
    const T* yr = y + row * C;
    double dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      dy[row * C + c] = w * d[c];
      dot += double(d[c]) * double(yr[c]);
    }
    dweight[s] = T(dot);
  }
}

template <class T>
void moe_expert_gemms_backward(T* dxs, T* dw_gate, T* dw_up, T* dw_down, T* dh, T* dgate, T* dup, const T* dy,
                               const T* xs, const T* gate, const T* up, const T* h, const int64_t* offsets,
                               int64_t groups, int64_t experts, const T* w_gate, const T* w_up, const T* w_down,
                               int64_t stride, int64_t C, int64_t I) {
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = offsets[g], rows = offsets[g + 1] - first, e = g % experts;
    if (rows == 0) continue;
    linear_backward(dh + first * I, dw_down + e * stride, static_cast<T*>(nullptr), dy + first * C, h + first * I,
                    w_down + e * stride, rows, I, C);
    swiglu_backward(dgate + first * I, dup + first * I, dh + first * I, gate + first * I, up + first * I, rows * I);
    linear_backward(dxs + first * C, dw_gate + e * stride, static_cast<T*>(nullptr), dgate + first * I,
                    xs + first * C, w_gate + e * stride, rows, C, I);
    // dxs += dup W_up: the second input-gradient term, through a scratch-free GEMM with beta = 1.
    gemm(false, false, rows, C, I, T(1), dup + first * I, I, w_up + e * stride, C, T(1), dxs + first * C, C);
    linear_backward(static_cast<T*>(nullptr), dw_up + e * stride, static_cast<T*>(nullptr), dup + first * I,
                    xs + first * C, w_up + e * stride, rows, C, I);
  }
}

template <class T>
void moe_scatter_rows(T* dx, const T* dxs, const MoeRouting<T>& r, int64_t N, int64_t C, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    T* d = dx + n * C;
    std::fill(d, d + C, T(0));
    for (int64_t j = 0; j < K; ++j) {
      const T* src = dxs + int64_t(r.row[n * K + j]) * C;
      for (int64_t c = 0; c < C; ++c) d[c] += src[c];
    }
  }
}

template <class T>
void moe_experts_backward(T* dx, T* dweight, T* dw_gate, T* dw_up, T* dw_down, T* dy, T* dh, T* dgate, T* dup,
                          T* dxs, const T* dout, const T* xs, const T* gate, const T* up, const T* h, const T* y,
                          const MoeRouting<T>& r, const T* w_gate, const T* w_up, const T* w_down, int64_t N,
                          int64_t C, int64_t I, int64_t E, int64_t K) {
  moe_rows_backward(dy, dweight, dout, y, r, N, C, K);
  moe_expert_gemms_backward(dxs, dw_gate, dw_up, dw_down, dh, dgate, dup, dy, xs, gate, up, h, r.offsets, E, E,
                            w_gate, w_up, w_down, I * C, C, I);
  moe_scatter_rows(dx, dxs, r, N, C, K);
}

template <class T>
void moe_route_backward(T* dlogits, const T* dweight, const T* dprobs, const MoeRouting<T>& r, int64_t N, int64_t E,
                        int64_t K, bool norm_topk) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* p = r.probs + n * E;
    const T* dw = dweight + n * K;
    const int32_t* chosen = r.expert + n * K;
    T* dz = dlogits + n * E;
    // d loss / d probs: the aux loss's on every expert, the chosen ones' through their weights.
    for (int64_t e = 0; e < E; ++e) dz[e] = dprobs ? dprobs[n * E + e] : T(0);
    if (norm_topk) {  // w_j = p_j / S, S = sum of the chosen p: dp_j = (dw_j - sum_i dw_i w_i) / S
      double S = 0, dot = 0;
      for (int64_t j = 0; j < K; ++j) S += double(p[chosen[j]]);
      for (int64_t j = 0; j < K; ++j) dot += double(dw[j]) * double(p[chosen[j]]) / S;
      for (int64_t j = 0; j < K; ++j) dz[chosen[j]] += T((double(dw[j]) - dot) / S);
    } else {
      for (int64_t j = 0; j < K; ++j) dz[chosen[j]] += dw[j];
    }
    // Through the softmax: dz = p * (dp - sum(dp * p)).
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += double(dz[e]) * double(p[e]);
    for (int64_t e = 0; e < E; ++e) dz[e] = T(double(p[e]) * (double(dz[e]) - dot));
  }
}

template <class T>
void moe_aux_counts(double* counts, double* prob_sums, const MoeRouting<T>& r, int64_t N, int64_t E, int64_t K) {
  for (int64_t s = 0; s < N * K; ++s) counts[r.expert[s]] += 1;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) prob_sums[e] += double(r.probs[n * E + e]);
}

double moe_aux_loss(const double* counts, const double* prob_sums, int64_t rows, int64_t E) {
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (counts[e] / double(rows)) * (prob_sums[e] / double(rows));
  return double(E) * sum;
}

template <class T>
void moe_aux_backward(T* dprobs, const double* counts, int64_t rows, int64_t N, int64_t E, double scale) {
  const double R = double(rows);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) dprobs[n * E + e] = T(scale * double(E) * counts[e] / (R * R));
}

#define SHARDLM_CPU_MOE_INSTANTIATE(T)                                                                            \
  template void moe_route<T>(MoeRouting<T>&, const T*, int64_t, int64_t, int64_t, bool, const int32_t*, int64_t); \
  template void moe_experts_forward<T>(T*, T*, T*, T*, T*, T*, const T*, const MoeRouting<T>&, const T*,          \
                                       const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, bool);   \
  template void moe_experts_backward<T>(T*, T*, T*, T*, T*, T*, T*, T*, T*, T*, const T*, const T*, const T*,     \
                                        const T*, const T*, const T*, const MoeRouting<T>&, const T*, const T*,   \
                                        const T*, int64_t, int64_t, int64_t, int64_t, int64_t);                   \
  template void moe_gather_rows<T>(T*, const T*, const MoeRouting<T>&, int64_t, int64_t, int64_t);                \
  template void moe_expert_gemms_forward<T>(T*, T*, T*, T*, const T*, const int64_t*, int64_t, int64_t, const T*,  \
                                            const T*, const T*, int64_t, int64_t, int64_t, bool);                  \
  template void moe_combine<T>(T*, const T*, const MoeRouting<T>&, int64_t, int64_t, int64_t);                    \
  template void moe_rows_backward<T>(T*, T*, const T*, const T*, const MoeRouting<T>&, int64_t, int64_t, int64_t); \
  template void moe_expert_gemms_backward<T>(T*, T*, T*, T*, T*, T*, T*, const T*, const T*, const T*, const T*,  \
                                             const T*, const int64_t*, int64_t, int64_t, const T*, const T*,        \
                                             const T*, int64_t, int64_t, int64_t);                                  \
  template void moe_scatter_rows<T>(T*, const T*, const MoeRouting<T>&, int64_t, int64_t, int64_t);               \
  template void moe_route_backward<T>(T*, const T*, const T*, const MoeRouting<T>&, int64_t, int64_t, int64_t,    \
                                      bool);                                                                      \
  template void moe_aux_counts<T>(double*, double*, const MoeRouting<T>&, int64_t, int64_t, int64_t);             \
  template void moe_aux_backward<T>(T*, const double*, int64_t, int64_t, int64_t, double);
SHARDLM_CPU_MOE_INSTANTIATE(float)
SHARDLM_CPU_MOE_INSTANTIATE(double)
#undef SHARDLM_CPU_MOE_INSTANTIATE

}  // namespace shardlm::cpu
