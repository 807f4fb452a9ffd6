// ops.cpp — CPU reference kernels; see src/cpu/ops.hpp for the contract.
#include "cpu/ops.hpp"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <numbers>
#include <type_traits>

#include "shardlm/error.hpp"

namespace shardlm::cpu {

namespace {

// Column block for reductions over tokens (dweight, dbias, dtable): each task owns
// kColBlock columns and walks the tokens in order, accumulating on the stack.
constexpr int64_t kColBlock = 16;

// Fixed number of partial sums for scalar reductions (losses, norms). The split of
// the input into blocks does not depend on the thread count, and the partials are
// added in block order, so the result is the same bits at any thread count.
constexpr int64_t kReduceBlocks = 256;

// Elementwise loops smaller than this run on one thread (fork cost > work).
constexpr int64_t kParallelMin = 1 << 14;
// Rows of C per BLAS call in gemm(): fixed, so the split never depends on the threads.
constexpr int64_t kGemmRows = 64;

// The run of equal seq_id around token i: [start, i] for queries, [j, end) for keys.
inline int64_t doc_start(const int32_t* seq_id, int64_t i) {
  int64_t s = i;
  while (s > 0 && seq_id[s - 1] == seq_id[i]) --s;
  return s;
}
inline int64_t doc_end(const int32_t* seq_id, int64_t j, int64_t N) {
  int64_t e = j + 1;
  while (e < N && seq_id[e] == seq_id[j]) ++e;
  return e;
}

template <class T>
inline T dot(const T* a, const T* b, int64_t D) {
  T s = 0;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

void check_blas_int(int64_t v, const char* what) {
  SHARDLM_CHECK(v >= 0 && v <= INT_MAX,
                "gemm: %s = %lld does not fit the BLAS integer type", what,
                static_cast<long long>(v));
}

}  // namespace

// ---------------------------------------------------------------- GEMM / linear

template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  check_blas_int(M, "M");
  check_blas_int(N, "N");
  check_blas_int(K, "K");
  check_blas_int(lda, "lda");
  check_blas_int(ldb, "ldb");
  check_blas_int(ldc, "ldc");
  // Row-major: A is stored (M, K), or (K, M) when transposed; likewise B.
  SHARDLM_CHECK(lda >= std::max<int64_t>(1, trans_a ? M : K), "gemm: lda %lld too small",
                static_cast<long long>(lda));
  SHARDLM_CHECK(ldb >= std::max<int64_t>(1, trans_b ? K : N), "gemm: ldb %lld too small",
                static_cast<long long>(ldb));
  SHARDLM_CHECK(ldc >= std::max<int64_t>(1, N), "gemm: ldc %lld too small",
                static_cast<long long>(ldc));
  if (M == 0 || N == 0) return;
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  // C in blocks of kGemmRows rows, one single-threaded BLAS call each (OpenBLAS
  // runs single-threaded inside an OpenMP region), so the bits of C do not depend
  // on the thread count: left to itself, OpenBLAS picks other kernels for one
  // thread than for several on some CPUs (an AMD EPYC gave different last bits for
  // 1 and 4 threads, tests/unit/test_cpu_ops.cpp).
  const int64_t blocks = (M + kGemmRows - 1) / kGemmRows;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r0 = b * kGemmRows, rows = std::min(kGemmRows, M - r0);
    const T* a_block = trans_a ? A + r0 : A + r0 * lda;  // (K, M) storage: columns r0..; else rows r0..
    if constexpr (std::is_same_v<T, float>) {
      cblas_sgemm(CblasRowMajor, ta, tb, int(rows), int(N), int(K), alpha, a_block, int(lda), B, int(ldb), beta,
                  C + r0 * ldc, int(ldc));
    } else {
      cblas_dgemm(CblasRowMajor, ta, tb, int(rows), int(N), int(K), alpha, a_block, int(lda), B, int(ldb), beta,
                  C + r0 * ldc, int(ldc));
    }
  }
}

template <class T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias,
                    int64_t N, int64_t IC, int64_t OC) {
  // out (N, OC) = inp (N, IC) @ weight (OC, IC)^T
  gemm<T>(false, true, N, OC, IC, T(1), inp, IC, weight, IC, T(0), out, OC);
  if (bias == nullptr) return;
#pragma omp parallel for schedule(static) if (N * OC >= kParallelMin)
  for (int64_t t = 0; t < N; ++t) {
    T* out_t = out + t * OC;  // (OC)
    for (int64_t o = 0; o < OC; ++o) out_t[o] += bias[o];
  }
}

template <class T>
void linear_rowwise_forward(T* out, const T* inp, const T* weight, const T* bias,
                            int64_t N, int64_t IC, int64_t OC) {
  constexpr int64_t kLanes = 8;
#pragma omp parallel for schedule(static) if (N * IC * OC >= kParallelMin)
  for (int64_t o = 0; o < OC; ++o) {
    const T* w = weight + o * IC;  // (IC)
    for (int64_t t = 0; t < N; ++t) {
      const T* x = inp + t * IC;   // (IC)
      T acc[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= IC; k += kLanes)
        for (int64_t u = 0; u < kLanes; ++u) acc[u] += x[k + u] * w[k + u];
      T tail = 0;
      for (; k < IC; ++k) tail += x[k] * w[k];
      const T sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
      out[t * OC + o] = bias ? sum + bias[o] : sum;
    }
  }
}

template <class T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, int64_t N, int64_t IC, int64_t OC) {
  // dinp (N, IC) = dout (N, OC) @ weight (OC, IC)
  if (dinp != nullptr) gemm<T>(false, false, N, IC, OC, T(1), dout, OC, weight, IC, T(0), dinp, IC);
  // dweight (OC, IC) += dout^T (OC, N) @ inp (N, IC); the sum over tokens is GEMM's K.
  gemm<T>(true, false, OC, IC, N, T(1), dout, OC, inp, IC, T(1), dweight, IC);
  if (dbias != nullptr) bias_backward(dbias, dout, N, OC);
}

template <class T>
void bias_backward(T* dbias, const T* dout, int64_t N, int64_t OC) {
  const int64_t nblocks = (OC + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (N * OC >= kParallelMin)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t o0 = blk * kColBlock, o1 = std::min(OC, o0 + kColBlock);
    double acc[kColBlock] = {};
    for (int64_t t = 0; t < N; ++t)
      for (int64_t o = o0; o < o1; ++o) acc[o - o0] += dout[t * OC + o];
    for (int64_t o = o0; o < o1; ++o) dbias[o] += T(acc[o - o0]);
  }
}

// ---------------------------------------------------------------- embedding

namespace {
void check_ids(const int32_t* ids, int64_t N, int64_t V, const char* what) {
  for (int64_t t = 0; t < N; ++t)
    SHARDLM_CHECK(ids[t] >= 0 && ids[t] < V,
                  "%s: token id %d at position %lld is outside the vocabulary [0, %lld)",
                  what, ids[t], static_cast<long long>(t), static_cast<long long>(V));
}
}  // namespace

template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* table,
                       int64_t N, int64_t V, int64_t C) {
  check_ids(ids, N, V, "embedding_forward");
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t t = 0; t < N; ++t)
    std::memcpy(out + t * C, table + int64_t(ids[t]) * C, size_t(C) * sizeof(T));
}

template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids,
                        int64_t N, int64_t V, int64_t C) {
  check_ids(ids, N, V, "embedding_backward");
  // Parallel over column blocks; within a block tokens are added in index order, so
  // repeated ids accumulate in the same order at any thread count.
  const int64_t nblocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t c0 = blk * kColBlock, c1 = std::min(C, c0 + kColBlock);
    for (int64_t t = 0; t < N; ++t) {
      T* row = dtable + int64_t(ids[t]) * C;  // (C)
      const T* g = dout + t * C;               // (C)
      for (int64_t c = c0; c < c1; ++c) row[c] += g[c];
    }
  }
}

// ---------------------------------------------------------------- RMSNorm

template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight,
                     int64_t rows, int64_t C, double eps) {
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = inp + r * C;  // (C)
    T* y = out + r * C;        // (C)
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(x[c]) * double(x[c]);
    // HF: variance (T) + eps, rsqrt in T, then weight * (x * rstd).
    const T s = T(1) / std::sqrt(T(ss / double(C)) + T(eps));
    rstd[r] = s;
    for (int64_t c = 0; c < C; ++c) y[c] = weight[c] * (x[c] * s);
  }
}

template <class T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp,
                      const T* weight, const T* rstd, int64_t rows, int64_t C) {
  // y = w * x * r, r = (mean(x^2) + eps)^-1/2:
  // dx = r * (w * dy) - x * r^3 / C * sum(w * dy * x)
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = inp + r * C;    // (C)
    const T* dy = dout + r * C;  // (C)
    T* dx = dinp + r * C;        // (C)
    const T s = rstd[r];
    double dot_wdy_x = 0;
    for (int64_t c = 0; c < C; ++c) dot_wdy_x += double(weight[c] * dy[c]) * double(x[c]);
    const T coef = T(dot_wdy_x / double(C)) * s * s * s;
    for (int64_t c = 0; c < C; ++c) dx[c] = s * (weight[c] * dy[c]) - x[c] * coef;
  }
  // dweight[c] += sum_r dy[r, c] * x[r, c] * rstd[r], rows in order per column block.
  const int64_t nblocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t c0 = blk * kColBlock, c1 = std::min(C, c0 + kColBlock);
    double acc[kColBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = inp + r * C;
      const T* dy = dout + r * C;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += double(dy[c] * (x[c] * rstd[r]));
    }
    for (int64_t c = c0; c < c1; ++c) dweight[c] += T(acc[c - c0]);
  }
}

// ---------------------------------------------------------------- RoPE

std::vector<double> rope_inv_freq(int64_t head_dim, double rope_theta,
                                  const RopeScaling& scaling) {
  SHARDLM_CHECK(head_dim > 0 && head_dim % 2 == 0,
                "rope: head_dim must be even and positive, got %lld",
                static_cast<long long>(head_dim));
  SHARDLM_CHECK(rope_theta > 0, "rope: rope_theta must be positive, got %g", rope_theta);
  const int64_t half = head_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));  // (D/2)
  for (int64_t i = 0; i < half; ++i)
    inv_freq[size_t(i)] = 1.0 / std::pow(rope_theta, double(2 * i) / double(head_dim));
  if (scaling.type == "none") return inv_freq;
  SHARDLM_CHECK(scaling.type == "llama3",
                "rope: rope_scaling type '%s' is not supported; use \"none\" or \"llama3\"",
                scaling.type.c_str());
  SHARDLM_CHECK(scaling.factor > 0 && scaling.low_freq_factor > 0 &&
                    scaling.high_freq_factor > scaling.low_freq_factor &&
                    scaling.original_max_position_embeddings > 0,
                "rope: llama3 scaling needs factor > 0, 0 < low_freq_factor < "
                "high_freq_factor and original_max_position_embeddings > 0");
  // HF _compute_llama3_parameters, element by element.
  const double old_ctx = double(scaling.original_max_position_embeddings);
  const double low_freq_wavelen = old_ctx / scaling.low_freq_factor;
  const double high_freq_wavelen = old_ctx / scaling.high_freq_factor;
  for (double& f : inv_freq) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen > low_freq_wavelen) {
      f = f / scaling.factor;
    } else if (wavelen >= high_freq_wavelen) {  // medium band: interpolate
      const double smooth = (old_ctx / wavelen - scaling.low_freq_factor) /
                            (scaling.high_freq_factor - scaling.low_freq_factor);
      f = (1.0 - smooth) * f / scaling.factor + smooth * f;
    }  // wavelen < high_freq_wavelen: unchanged
  }
  return inv_freq;
}

namespace {
// sign = +1: forward rotation; sign = -1: the inverse (transpose).
template <class T>
void rope_rotate(T* x, const int32_t* position_ids, const double* inv_freq, int64_t N,
                 int64_t heads, int64_t D, T sign) {
  SHARDLM_CHECK(D > 0 && D % 2 == 0, "rope: head dim must be even, got %lld",
                static_cast<long long>(D));
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (N * heads * D >= kParallelMin)
  for (int64_t t = 0; t < N; ++t) {
    const T pos = T(position_ids[t]);
    T* xt = x + t * heads * D;  // (heads, D)
    for (int64_t i = 0; i < half; ++i) {
      // HF: freqs = inv_freq (float32) * position (float32), cos/sin in float32.
      const T angle = pos * T(inv_freq[i]);
      const T c = std::cos(angle);
      const T s = sign * std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = xt + h * D;  // (D)
        const T x1 = xh[i], x2 = xh[i + half];
        xh[i] = x1 * c - x2 * s;         // q * cos + rotate_half(q) * sin, first half
        xh[i + half] = x2 * c + x1 * s;  // second half
      }
    }
  }
}
}  // namespace

template <class T>
void rope_forward(T* x, const int32_t* position_ids, const double* inv_freq,
                  int64_t N, int64_t heads, int64_t D) {
  rope_rotate(x, position_ids, inv_freq, N, heads, D, T(1));
}

template <class T>
void rope_backward(T* dx, const int32_t* position_ids, const double* inv_freq,
                   int64_t N, int64_t heads, int64_t D) {
  rope_rotate(dx, position_ids, inv_freq, N, heads, D, T(-1));
}

// ---------------------------------------------------------------- SwiGLU

template <class T>
void swiglu_forward(T* h, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t e = 0; e < n; ++e) {
    const T g = gate[e];
    h[e] = g / (T(1) + std::exp(-g)) * up[e];  // silu as torch: x / (1 + exp(-x))
  }
}

template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up,
                     int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t e = 0; e < n; ++e) {
    const T g = gate[e];
    const T sig = T(1) / (T(1) + std::exp(-g));
    const T silu = g * sig;
    // d silu / dg = sig * (1 + g * (1 - sig))
    dgate[e] = dh[e] * up[e] * sig * (T(1) + g * (T(1) - sig));
    dup[e] = dh[e] * silu;
  }
}

// ---------------------------------------------------------------- attention

template <class T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                       const int32_t* seq_id, int64_t N, int64_t H, int64_t KV,
                       int64_t D) {
  SHARDLM_CHECK(KV > 0 && H % KV == 0, "attention: num_heads %lld is not a multiple of "
                "num_kv_heads %lld", static_cast<long long>(H), static_cast<long long>(KV));
  const int64_t group = H / KV;
  const T scale = T(1) / std::sqrt(T(D));
  // Tokens later in a document cost more: dynamic schedule. Each (i, h) is written
  // by one task with a fixed loop order, so the schedule does not change any bit.
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t i = 0; i < N; ++i) {
    const int64_t j0 = doc_start(seq_id, i);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const T* qi = q + (i * H + h) * D;  // (D)
      T* oi = out + (i * H + h) * D;      // (D)
      // Pass 1: online max and sum of exp over keys j0..i.
      T m = -INFINITY;
      double l = 0;
      for (int64_t j = j0; j <= i; ++j) {
        const T s = dot(qi, k + (j * KV + g) * D, D) * scale;
        if (s > m) {
          l *= std::exp(double(m) - double(s));
          m = s;
        }
        l += double(std::exp(s - m));
      }
      const T lse_ih = m + T(std::log(l));
      lse[i * H + h] = lse_ih;
      // Pass 2: out = sum_j p_ij v_j with p = exp(s - lse), the same p backward uses.
      std::fill(oi, oi + D, T(0));
      for (int64_t j = j0; j <= i; ++j) {
        const T p = std::exp(dot(qi, k + (j * KV + g) * D, D) * scale - lse_ih);
        const T* vj = v + (j * KV + g) * D;  // (D)
        for (int64_t d = 0; d < D; ++d) oi[d] += p * vj[d];
      }
    }
  }
}

template <class T>
void attention_decode_forward(T* out, const T* q, const T* k_cache, const T* v_cache, const KvPages& pages,
                              const int32_t* seq, const int32_t* len, int64_t B, int64_t H, int64_t KV, int64_t D) {
  SHARDLM_CHECK(KV > 0 && H % KV == 0, "attention: num_heads %lld is not a multiple of "
                "num_kv_heads %lld", static_cast<long long>(H), static_cast<long long>(KV));
  for (int64_t b = 0; b < B; ++b)
    SHARDLM_CHECK(len[b] >= 1 && len[b] <= pages.capacity(), "attention_decode: row %lld attends to %d cached "
                  "tokens, outside [1, %lld]", static_cast<long long>(b), len[b],
                  static_cast<long long>(pages.capacity()));
  const int64_t group = H / KV;
  const T scale = T(1) / std::sqrt(T(D));
#pragma omp parallel for collapse(2) schedule(dynamic, 4)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group, n = len[b];
      // Position j's (KV, D) row: kv_cache_row of (seq[b], j).
      const auto row = [&](int64_t j) { return kv_cache_row(pages, seq[b], j) * KV * D; };
      const T* qi = q + (b * H + h) * D;  // (D)
      T* oi = out + (b * H + h) * D;      // (D)
      // attention_forward's two passes with j0 = 0, i = n - 1.
      T m = -INFINITY;
      double l = 0;
      for (int64_t j = 0; j < n; ++j) {
        const T s = dot(qi, k_cache + row(j) + g * D, D) * scale;
        if (s > m) {
          l *= std::exp(double(m) - double(s));
          m = s;
        }
        l += double(std::exp(s - m));
      }
      const T lse_ih = m + T(std::log(l));
      std::fill(oi, oi + D, T(0));
      for (int64_t j = 0; j < n; ++j) {
        const T p = std::exp(dot(qi, k_cache + row(j) + g * D, D) * scale - lse_ih);
        const T* vj = v_cache + row(j) + g * D;  // (D)
        for (int64_t d = 0; d < D; ++d) oi[d] += p * vj[d];
      }
    }
  }
}

template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                        const T* v, const T* out, const T* lse,
                        const int32_t* seq_id, int64_t N, int64_t H, int64_t KV,
                        int64_t D) {
  SHARDLM_CHECK(KV > 0 && H % KV == 0, "attention: num_heads %lld is not a multiple of "
                "num_kv_heads %lld", static_cast<long long>(H), static_cast<long long>(KV));
  const int64_t group = H / KV;
  const T scale = T(1) / std::sqrt(T(D));

  // Pass 1: dq_i = scale * sum_j ds_ij k_j, one task per query token.
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t i = 0; i < N; ++i) {
    const int64_t j0 = doc_start(seq_id, i);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const T* qi = q + (i * H + h) * D;     // (D)
      const T* doi = dout + (i * H + h) * D;  // (D)
      const T delta = dot(doi, out + (i * H + h) * D, D);
      const T lse_ih = lse[i * H + h];
      T* dqi = dq + (i * H + h) * D;  // (D)
      std::fill(dqi, dqi + D, T(0));
      for (int64_t j = j0; j <= i; ++j) {
        const T* kj = k + (j * KV + g) * D;  // (D)
        const T p = std::exp(dot(qi, kj, D) * scale - lse_ih);
        const T ds = p * (dot(doi, v + (j * KV + g) * D, D) - delta);
        for (int64_t d = 0; d < D; ++d) dqi[d] += ds * scale * kj[d];
      }
    }
  }

  // Pass 2: dk_j, dv_j summed over queries i >= j of the document and over the
  // group's query heads, in that order, one task per key token.
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t j = 0; j < N; ++j) {
    const int64_t i1 = doc_end(seq_id, j, N);
    for (int64_t g = 0; g < KV; ++g) {
      const T* kj = k + (j * KV + g) * D;  // (D)
      const T* vj = v + (j * KV + g) * D;  // (D)
      T* dkj = dk + (j * KV + g) * D;      // (D)
      T* dvj = dv + (j * KV + g) * D;      // (D)
      std::fill(dkj, dkj + D, T(0));
      std::fill(dvj, dvj + D, T(0));
      for (int64_t i = j; i < i1; ++i) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const T* qi = q + (i * H + h) * D;      // (D)
          const T* doi = dout + (i * H + h) * D;  // (D)
          // delta is recomputed here rather than stored: O(N*H) scratch saved for
          // one extra dot product per (i, j) pair.
          const T delta = dot(doi, out + (i * H + h) * D, D);
          const T p = std::exp(dot(qi, kj, D) * scale - lse[i * H + h]);
          const T ds = p * (dot(doi, vj, D) - delta);
          for (int64_t d = 0; d < D; ++d) {
            dvj[d] += p * doi[d];
            dkj[d] += ds * scale * qi[d];
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- cross-entropy

template <class T>
double cross_entropy_forward_backward(T* logits, const int32_t* targets,
                                      const T* weights, T grad_scale, int64_t n,
                                      int64_t V) {
  for (int64_t r = 0; r < n; ++r)
    SHARDLM_CHECK(targets[r] < V, "cross_entropy: target %d at row %lld is outside the "
                  "vocabulary [0, %lld)", targets[r], static_cast<long long>(r),
                  static_cast<long long>(V));
  double partial[kReduceBlocks] = {};
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t blk = 0; blk < kReduceBlocks; ++blk) {
    const int64_t r0 = n * blk / kReduceBlocks, r1 = n * (blk + 1) / kReduceBlocks;
    double loss = 0;
    for (int64_t r = r0; r < r1; ++r) {
      T* x = logits + r * V;  // (V) logits in, dlogits out
      const T w = weights ? weights[r] : T(1);
      if (targets[r] < 0 || w == T(0)) {
        std::fill(x, x + V, T(0));
        continue;
      }
      const T x_target = x[targets[r]];
      T m = x[0];
      for (int64_t c = 1; c < V; ++c) m = std::max(m, x[c]);
      double sum = 0;  // x becomes exp(x - m), the unnormalised softmax
      for (int64_t c = 0; c < V; ++c) {
        x[c] = std::exp(x[c] - m);
        sum += double(x[c]);
      }
      loss += double(w) * (double(m) + std::log(sum) - double(x_target));
      const T coef = T(double(w) * double(grad_scale) / sum);
      for (int64_t c = 0; c < V; ++c) x[c] *= coef;
      x[targets[r]] -= w * grad_scale;
    }
    partial[blk] = loss;
  }
  double total = 0;
  for (int64_t blk = 0; blk < kReduceBlocks; ++blk) total += partial[blk];
  return total;
}

// ---------------------------------------------------------------- helpers

template <class T>
void add(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t e = 0; e < n; ++e) out[e] = a[e] + b[e];
}

template <class T>
void accumulate(T* y, const T* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t e = 0; e < n; ++e) y[e] += x[e];
}

template <class T>
void copy(T* dst, const T* src, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;  // elements per task: whole cache lines, many per thread
#pragma omp parallel for schedule(static) if (n >= 4 * kChunk)
  for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c)
    std::memcpy(dst + c * kChunk, src + c * kChunk, sizeof(T) * std::min(kChunk, n - c * kChunk));
}

template <class T>
void scale(T* x, T alpha, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t e = 0; e < n; ++e) x[e] *= alpha;
}

template <class T>
double sum_squares(const T* x, int64_t n) {
  double partial[kReduceBlocks] = {};
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t blk = 0; blk < kReduceBlocks; ++blk) {
    const int64_t e0 = n * blk / kReduceBlocks, e1 = n * (blk + 1) / kReduceBlocks;
    double s = 0;
    for (int64_t e = e0; e < e1; ++e) s += double(x[e]) * double(x[e]);
    partial[blk] = s;
  }
  double total = 0;
  for (int64_t blk = 0; blk < kReduceBlocks; ++blk) total += partial[blk];
  return total;
}

// ---------------------------------------------------------------- instantiations

#define SHARDLM_CPU_OPS_INSTANTIATE(T)                                                   \
  template void gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t,     \
                        const T*, int64_t, T, T*, int64_t);                              \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t,    \
                                  int64_t);                                              \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t,    \
                                   int64_t, int64_t);                                    \
  template void bias_backward<T>(T*, const T*, int64_t, int64_t);                        \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t,     \
                                     int64_t);                                           \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t,    \
                                      int64_t);                                          \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double); \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*,      \
                                    int64_t, int64_t);                                   \
  template void rope_forward<T>(T*, const int32_t*, const double*, int64_t, int64_t,     \
                                int64_t);                                                \
  template void rope_backward<T>(T*, const int32_t*, const double*, int64_t, int64_t,    \
                                 int64_t);                                               \
  template void swiglu_forward<T>(T*, const T*, const T*, int64_t);                      \
  template void swiglu_backward<T>(T*, T*, const T*, const T*, const T*, int64_t);       \
  template void attention_forward<T>(T*, T*, const T*, const T*, const T*,               \
                                     const int32_t*, int64_t, int64_t, int64_t, int64_t); \
  template void linear_rowwise_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);          \
  template void attention_decode_forward<T>(T*, const T*, const T*, const T*, const KvPages&, const int32_t*,  \
                                            const int32_t*, int64_t, int64_t, int64_t, int64_t);             \
  template void attention_backward<T>(T*, T*, T*, const T*, const T*, const T*,          \
                                      const T*, const T*, const T*, const int32_t*,      \
                                      int64_t, int64_t, int64_t, int64_t);               \
  template double cross_entropy_forward_backward<T>(T*, const int32_t*, const T*, T,     \
                                                    int64_t, int64_t);                   \
  template void add<T>(T*, const T*, const T*, int64_t);                                 \
  template void accumulate<T>(T*, const T*, int64_t);                                    \
  template void scale<T>(T*, T, int64_t);                                                \
  template double sum_squares<T>(const T*, int64_t);                                   \
  template void copy<T>(T*, const T*, int64_t);

SHARDLM_CPU_OPS_INSTANTIATE(float)
SHARDLM_CPU_OPS_INSTANTIATE(double)

#undef SHARDLM_CPU_OPS_INSTANTIATE

}  // namespace shardlm::cpu
