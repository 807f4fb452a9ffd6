// ring_attention.cpp — the context-parallel ring on the CPU backend (fp32).
#include "cpu/ring_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "shardlm/error.hpp"

namespace shardlm::cpu {
namespace {

constexpr float kNegInf = -INFINITY;

inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// One rank's block inside a RingScratch buffer: k (N, KV, D) | v (N, KV, D) |
// token_index (N) | seq_id (N), the two int32 arrays in float-sized slots.
struct Block {
  float* k;
  float* v;
  int32_t* index;
  int32_t* seq;
};
int64_t block_floats(int64_t N, int64_t KVD) { return N * (2 * KVD + 2); }
Block block_at(float* base, int64_t N, int64_t KVD) {
  return {base, base + N * KVD, reinterpret_cast<int32_t*>(base + 2 * N * KVD),
          reinterpret_cast<int32_t*>(base + 2 * N * KVD + N)};
}

// Query i sees key j: same document, not later in the group's micro-batch.
inline bool visible(const Block& b, int64_t j, int32_t q_index, int32_t q_seq) {
  return b.seq[j] == q_seq && b.index[j] <= q_index;
}

// Attends this rank's N queries to the block's N keys and merges the result
// into (out, lse) by log-sum-exp: lse' = log(e^lse + e^lse_block), out' =
// out * e^(lse - lse') + sum_j e^(s_j - lse') v_j. Each (i, h) is one task in a
// fixed order, so the bits do not depend on the thread count.
void block_forward(float* out, float* lse, const float* q, const TokenInputs& in, const Block& b, int64_t H,
                   int64_t KV, int64_t D) {
  const int64_t N = in.N, group = H / KV;
  const float scale = 1.0f / std::sqrt(float(D));
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t i = 0; i < N; ++i) {
    const int32_t qi_index = in.token_index[i], qi_seq = in.seq_ids[i];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const float* qi = q + (i * H + h) * D;  // (D)
      float* oi = out + (i * H + h) * D;      // (D)
      float m = kNegInf;
      double l = 0;
      for (int64_t j = 0; j < N; ++j) {
        if (!visible(b, j, qi_index, qi_seq)) continue;
        const float s = dot(qi, b.k + (j * KV + g) * D, D) * scale;
        if (s > m) {
          l *= std::exp(double(m) - double(s));
          m = s;
        }
        l += double(std::exp(s - m));
      }
      if (l == 0) continue;  // nothing of this block is visible to (i, h)
      const double lse_block = double(m) + std::log(l), lse_held = lse[i * H + h];
      const double hi = std::max(lse_block, lse_held);
      const float lse_new = lse_held == double(kNegInf)
                                ? float(lse_block)
                                : float(hi + std::log1p(std::exp(std::min(lse_block, lse_held) - hi)));
      const float keep = lse_held == double(kNegInf) ? 0.0f : std::exp(float(lse_held) - lse_new);
      for (int64_t d = 0; d < D; ++d) oi[d] *= keep;
      for (int64_t j = 0; j < N; ++j) {
        if (!visible(b, j, qi_index, qi_seq)) continue;
        const float p = std::exp(dot(qi, b.k + (j * KV + g) * D, D) * scale - lse_new);
        const float* vj = b.v + (j * KV + g) * D;
        for (int64_t d = 0; d < D; ++d) oi[d] += p * vj[d];
      }
      lse[i * H + h] = lse_new;
    }
  }
}

// The block's share of the FlashAttention-2 backward with the final (out, lse):
// dq (N, H, D) += over the block's keys; the block's dk, dv (N, KV, D) += over
// this rank's queries. Pass 1 owns dq rows, pass 2 the block's dk/dv rows.
void block_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* lse,
                    const float* delta, const TokenInputs& in, const Block& b, int64_t H, int64_t KV, int64_t D) {
  const int64_t N = in.N, group = H / KV;
  const float scale = 1.0f / std::sqrt(float(D));
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const float* qi = q + (i * H + h) * D;
      const float* doi = dout + (i * H + h) * D;
      float* dqi = dq + (i * H + h) * D;
      for (int64_t j = 0; j < N; ++j) {
        if (!visible(b, j, in.token_index[i], in.seq_ids[i])) continue;
        const float* kj = b.k + (j * KV + g) * D;
        const float p = std::exp(dot(qi, kj, D) * scale - lse[i * H + h]);
        const float ds = p * (dot(doi, b.v + (j * KV + g) * D, D) - delta[i * H + h]);
        for (int64_t d = 0; d < D; ++d) dqi[d] += ds * scale * kj[d];
      }
    }
  }
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t j = 0; j < N; ++j) {
    for (int64_t g = 0; g < KV; ++g) {
      const float* kj = b.k + (j * KV + g) * D;
      const float* vj = b.v + (j * KV + g) * D;
      float* dkj = dk + (j * KV + g) * D;
      float* dvj = dv + (j * KV + g) * D;
      for (int64_t i = 0; i < N; ++i) {
        if (!visible(b, j, in.token_index[i], in.seq_ids[i])) continue;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qi = q + (i * H + h) * D;
          const float* doi = dout + (i * H + h) * D;
          const float p = std::exp(dot(qi, kj, D) * scale - lse[i * H + h]);
          const float ds = p * (dot(doi, vj, D) - delta[i * H + h]);
          for (int64_t d = 0; d < D; ++d) {
            dvj[d] += p * doi[d];
            dkj[d] += ds * scale * qi[d];
          }
        }
      }
    }
  }
}

void check_inputs(const TokenInputs& in, int64_t H, int64_t KV, int64_t capacity) {
  SHARDLM_CHECK(in.token_index && in.seq_ids, "internal: ring attention without token indices or sequence ids");
  SHARDLM_CHECK(KV > 0 && H % KV == 0, "attention: num_heads %lld is not a multiple of num_kv_heads %lld",
                (long long)H, (long long)KV);
  SHARDLM_CHECK(in.N <= capacity, "internal: ring attention over %lld tokens, its buffers hold %lld", (long long)in.N,
                (long long)capacity);
}

// This rank's own block, the first the ring attends to.
void pack_own(float* base, const float* k, const float* v, const TokenInputs& in, int64_t KVD) {
  const Block b = block_at(base, in.N, KVD);
  std::memcpy(b.k, k, sizeof(float) * size_t(in.N * KVD));
  std::memcpy(b.v, v, sizeof(float) * size_t(in.N * KVD));
  std::memcpy(b.index, in.token_index, sizeof(int32_t) * size_t(in.N));
  std::memcpy(b.seq, in.seq_ids, sizeof(int32_t) * size_t(in.N));
}

}  // namespace

void RingScratch::add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows) {
  const int64_t KVD = c.num_kv_heads * c.head_dim;
  tokens = N;
  for (auto& b : block) rows.push_back({"ring.block", &b, block_floats(N, KVD), Mem::Workspace});
  for (auto& g : grad) rows.push_back({"ring.grad", &g, 2 * N * KVD, Mem::Workspace});
  rows.push_back({"ring.delta", &delta, N * c.num_heads, Mem::Workspace});
}

void RingAttention::forward(float* out, float* lse, const float* q, const float* k, const float* v,
                            const TokenInputs& in, int64_t H, int64_t KV, int64_t D) {
  check_inputs(in, H, KV, s_.tokens);
  const int64_t N = in.N, KVD = KV * D;
  const int64_t bytes = int64_t(sizeof(float)) * block_floats(N, KVD);
  std::fill(out, out + N * H * D, 0.0f);
  std::fill(lse, lse + N * H, kNegInf);
  pack_own(s_.block[0].data(), k, v, in, KVD);
  // Step s attends to rank (r - s)'s block while rank (r - s - 1)'s arrives.
  int held = 0;
  for (int step = 0; step < group_.size(); ++step) {
    CommRequest arriving;
    if (step + 1 < group_.size())
      arriving = group_.ring_exchange(s_.block[held].data(), s_.block[1 - held].data(), bytes);
    block_forward(out, lse, q, in, block_at(s_.block[held].data(), N, KVD), H, KV, D);
    arriving.wait();
    held = 1 - held;
  }
}

void RingAttention::backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                             const float* v, const float* out, const float* lse, const TokenInputs& in, int64_t H,
                             int64_t KV, int64_t D) {
  check_inputs(in, H, KV, s_.tokens);
  const int64_t N = in.N, KVD = KV * D;
  const int64_t bytes = int64_t(sizeof(float)) * block_floats(N, KVD), grad_bytes = int64_t(sizeof(float)) * 2 * N * KVD;
  float* delta = s_.delta.data();  // (N, H)
#pragma omp parallel for schedule(static)
  for (int64_t ih = 0; ih < N * H; ++ih) delta[ih] = dot(dout + ih * D, out + ih * D, D);
  std::fill(dq, dq + N * H * D, 0.0f);
  pack_own(s_.block[0].data(), k, v, in, KVD);
  std::fill(s_.grad[0].data(), s_.grad[0].data() + 2 * N * KVD, 0.0f);
  // Step s: rank (r - s)'s block and its dk/dv accumulators; the block moves on
  // while it is used, the accumulators once this rank has added to them. After
  // C hops the accumulators are back with their owner.
  int held = 0;
  for (int step = 0; step < group_.size(); ++step) {
    CommRequest arriving;
    if (step + 1 < group_.size())
      arriving = group_.ring_exchange(s_.block[held].data(), s_.block[1 - held].data(), bytes);
    float* grad = s_.grad[held].data();
    block_backward(dq, grad, grad + N * KVD, dout, q, lse, delta, in, block_at(s_.block[held].data(), N, KVD), H, KV,
                   D);
    arriving.wait();
    group_.ring_exchange(grad, s_.grad[1 - held].data(), grad_bytes).wait();
    held = 1 - held;
  }
  std::memcpy(dk, s_.grad[held].data(), sizeof(float) * size_t(N * KVD));
  std::memcpy(dv, s_.grad[held].data() + N * KVD, sizeof(float) * size_t(N * KVD));
}

}  // namespace shardlm::cpu
