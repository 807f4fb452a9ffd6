// moe.cu — a layer of experts on the GPU; see moe.hpp.
#include "cuda/moe.hpp"

#include <cfloat>
#include <climits>

#include "cuda/kernel_common.cuh"

namespace shardlm::cuda {

using dev::block_reduce;
using dev::f32;
using dev::kFullMask;
using dev::SumOp;
using dev::to_bf16;
using dev::warp_max;
using dev::warp_sum;

// ---------------------------------------------------------------- grouped GEMM

GroupedGemm::GroupedGemm(cudaStream_t stream, void** pointers, int64_t max_products)
    : stream_(stream), pointers_(pointers), max_products_(max_products) {
  CUBLAS_CHECK(cublasCreate(&handle_));
  CUBLAS_CHECK(cublasSetStream(handle_, stream_));
}

GroupedGemm::~GroupedGemm() {
  if (handle_) cublasDestroy(handle_);
}

// gemm.cu's mapping: the row-major C (M, N) is the column-major C^T = op(B)^T
// op(A)^T, so the library's A is our B and its B is our A, m = N, n = M.
bool GroupedGemm::run(bool trans_a, bool trans_b, const std::vector<Product>& products, float beta, GemmOut out) {
  if (out == GemmOut::F32 && !f32_out_) return false;
  std::vector<int64_t> m, n, k, lda, ldb, ldc, size;
  std::vector<cublasOperation_t> op_a, op_b;
  std::vector<float> alpha, betas;
  std::vector<const void*> a, b, c;
  for (const Product& p : products) {
    if (p.M == 0 || p.N == 0 || p.K == 0) continue;
    m.push_back(p.N), n.push_back(p.M), k.push_back(p.K);
    op_a.push_back(trans_b ? CUBLAS_OP_T : CUBLAS_OP_N), op_b.push_back(trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    a.push_back(p.B), lda.push_back(p.ldb);
    b.push_back(p.A), ldb.push_back(p.lda);
    c.push_back(p.C), ldc.push_back(p.ldc);
    alpha.push_back(1.0f), betas.push_back(beta), size.push_back(1);
  }
  const int64_t count = int64_t(m.size());
  if (count == 0) return true;
  SHARDLM_CHECK(count <= max_products_, "internal: %lld grouped products, planned for %lld", (long long)count,
                (long long)max_products_);
  host_pointers_.assign(a.begin(), a.end());
  host_pointers_.insert(host_pointers_.end(), b.begin(), b.end());
  host_pointers_.insert(host_pointers_.end(), c.begin(), c.end());
  // Pageable to device: staged before the call returns, ordered after the
  // stream's earlier grouped GEMMs that read the same array.
  CUDA_CHECK(cudaMemcpyAsync(pointers_, host_pointers_.data(), sizeof(void*) * host_pointers_.size(),
                             cudaMemcpyHostToDevice, stream_));
  const void* const* dev_a = const_cast<const void* const*>(pointers_);
  const void* const* dev_b = const_cast<const void* const*>(pointers_ + count);
  void* const* dev_c = pointers_ + 2 * count;
  const cublasStatus_t status = cublasGemmGroupedBatchedEx_64(
      handle_, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alpha.data(), dev_a, CUDA_R_16BF, lda.data(),
      dev_b, CUDA_R_16BF, ldb.data(), betas.data(), dev_c, out == GemmOut::F32 ? CUDA_R_32F : CUDA_R_16BF, ldc.data(),
      count, size.data(), CUBLAS_COMPUTE_32F);
  if (out == GemmOut::F32 && (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)) {
    f32_out_ = false;
    return false;
  }
  CUBLAS_CHECK(status);
  return true;
}

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

unsigned blocks(int64_t n, int64_t per_block) { return unsigned((n + per_block - 1) / per_block); }


// ---------------------------------------------------------------- routing

// One warp a token: softmax over the E logits, then the K most probable (the
// lower index first among equals, as the CPU's selection), or the forced ones.
__global__ void route_kernel(float* __restrict__ probs, int32_t* __restrict__ expert, float* __restrict__ weight,
                             const float* __restrict__ logits, int64_t N, int E, int K, bool norm_topk,
                             const int32_t* __restrict__ forced, int64_t forced_stride) {
  const int64_t n = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= N) return;
  const float* z = logits + n * E;
  float* p = probs + n * E;
  float top = -FLT_MAX;
  for (int e = lane; e < E; e += 32) top = fmaxf(top, z[e]);
  top = warp_max(top);
  float sum = 0;
  for (int e = lane; e < E; e += 32) sum += expf(z[e] - top);
  sum = warp_sum(sum);
  for (int e = lane; e < E; e += 32) p[e] = expf(z[e] - top) / sum;
  __syncwarp();
  int32_t* chosen = expert + n * K;
  float* w = weight + n * K;
  const int32_t* replay = forced && forced[n * forced_stride] >= 0 ? forced + n * forced_stride : nullptr;
  float picked = 0;
  for (int j = 0; j < K; ++j) {
    int best;
    if (replay) {
      best = replay[j];
    } else {
      float bv = -1.0f;
      best = INT_MAX;
      for (int e = lane; e < E; e += 32) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken |= chosen[i] == e;
        if (!taken && p[e] > bv) bv = p[e], best = e;  // e rises: the first of equals stays
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, bv, o);
        const int oi = __shfl_xor_sync(kFullMask, best, o);
        if (ov > bv || (ov == bv && oi < best)) bv = ov, best = oi;
      }
    }
    if (best >= E) best = j % E;  // NaN probabilities: an index in range (the loss shows the NaN)
    const float pb = p[best];
    picked += pb;
    if (lane == 0) chosen[j] = best, w[j] = pb;
    __syncwarp();
  }
  if (norm_topk)
    for (int j = lane; j < K; j += 32) w[j] = w[j] / picked;
}

// counts[e] (into offsets[e + 1]) = the slots routed to e: one block an expert.
__global__ void count_kernel(int64_t* __restrict__ offsets, const int32_t* __restrict__ expert, int64_t R) {
  __shared__ float red[kWarps];
  const int e = blockIdx.x;
  float c = 0;  // counts below 2^24 a thread stay exact in fp32
  for (int64_t s = threadIdx.x; s < R; s += kThreads) c += expert[s] == e ? 1.0f : 0.0f;
  const float total = block_reduce<kThreads>(c, SumOp{}, red);
  if (threadIdx.x == 0) offsets[e + 1] = int64_t(total);
}

__global__ void scan_kernel(int64_t* offsets, int E) {
  offsets[0] = 0;
  for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
}

// Expert e's rows in token order: one block an expert walks the slots in tiles
// of kThreads, each tile's matches numbered by a block-wide prefix count.
__global__ void place_kernel(int32_t* __restrict__ slot, int32_t* __restrict__ row, const int32_t* __restrict__ expert,
                             const int64_t* __restrict__ offsets, int64_t R) {
  __shared__ int warp_counts[kWarps];
  const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t next = offsets[e];
  for (int64_t base = 0; base < R; base += kThreads) {
    const int64_t s = base + threadIdx.x;
    const bool match = s < R && expert[s] == e;
    const unsigned ballot = __ballot_sync(kFullMask, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) before += w < warp ? warp_counts[w] : 0, total += warp_counts[w];
    if (match) {
      const int64_t r = next + before + __popc(ballot & ((1u << lane) - 1));
      slot[r] = int32_t(s);
      row[s] = int32_t(r);
    }
    next += total;
    __syncthreads();
  }
}

// ---------------------------------------------------------------- rows

// rows[r] = x[slot[r] / K]: one block a row, 16-byte copies (C % 8 == 0).
__global__ void gather_kernel(bf16* __restrict__ rows, const bf16* __restrict__ x, const int32_t* __restrict__ slot,
                              int64_t C, int K) {
  const int64_t r = blockIdx.x, n = slot[r] / K;
  const uint4* src = reinterpret_cast<const uint4*>(x + n * C);
  uint4* dst = reinterpret_cast<uint4*>(rows + r * C);
  for (int64_t i = threadIdx.x; i < C / 8; i += blockDim.x) dst[i] = src[i];
}

// Eight channels of a row moved as one 16-byte access of bf16 (C % 8 == 0), two of fp32.
constexpr int kVec = 8;
using Bf16x8 = dev::Pack<bf16, kVec>;
using F32x4 = dev::Pack<float, 4>;
__device__ __forceinline__ void load8(const bf16* p, float (&v)[kVec]) {
  const Bf16x8 x = Bf16x8::load(p);
  for (int i = 0; i < kVec; ++i) v[i] = f32(x.v[i]);
}
__device__ __forceinline__ void load8(const float* p, float (&v)[kVec]) {
  const F32x4 a = F32x4::load(p), b = F32x4::load(p + 4);
  for (int i = 0; i < 4; ++i) v[i] = a.v[i], v[i + 4] = b.v[i];
}
__device__ __forceinline__ void store8(bf16* p, const float (&v)[kVec]) {
  Bf16x8 x;
  for (int i = 0; i < kVec; ++i) x.v[i] = to_bf16(v[i]);
  x.store(p);
}
__device__ __forceinline__ void store8(float* p, const float (&v)[kVec]) {
  F32x4 a, b;
  for (int i = 0; i < 4; ++i) a.v[i] = v[i], b.v[i] = v[i + 4];
  a.store(p), b.store(p + 4);
}

// out[n] = residual[n] + sum_j weight[n, j] y[row[n, j]] (+ sigmoid(z[n]) shared[n]):
// the K terms in the order j = 0 .. K - 1, in fp32, rounded once. One block a
// token, eight channels a thread.
template <class S>
__global__ void combine_kernel(S* out, const S* residual, const bf16* __restrict__ y,
                               const float* __restrict__ weight, const int32_t* __restrict__ row,
                               const bf16* __restrict__ shared, const float* __restrict__ shared_logit, int64_t C,
                               int K) {
  const int64_t n = blockIdx.x;
  const float g = shared ? 1.0f / (1.0f + expf(-shared_logit[n])) : 0.0f;
  for (int64_t c = kVec * int64_t(threadIdx.x); c < C; c += kVec * int64_t(blockDim.x)) {
    float acc[kVec] = {}, v[kVec];
    for (int j = 0; j < K; ++j) {
      const float w = weight[n * K + j];
      load8(y + int64_t(row[n * K + j]) * C + c, v);
      for (int i = 0; i < kVec; ++i) acc[i] += w * v[i];
    }
    if (shared) {
      load8(shared + n * C + c, v);
      for (int i = 0; i < kVec; ++i) acc[i] += g * v[i];
    }
    load8(residual + n * C + c, v);
    for (int i = 0; i < kVec; ++i) v[i] += acc[i];
    store8(out + n * C + c, v);
  }
}

// Per row r (slot s, token n): dy[r] = weight[s] dout[n]; dweight[s] = dout[n] . y[r].
__global__ void combine_backward_kernel(bf16* __restrict__ dy, float* __restrict__ dweight,
                                        const bf16* __restrict__ dout, const bf16* __restrict__ y,
                                        const float* __restrict__ weight, const int32_t* __restrict__ slot,
                                        int64_t C, int K) {
  __shared__ float red[kWarps];
  const int64_t r = blockIdx.x, s = slot[r], n = s / K;
  const float w = weight[s];
  float dot = 0, d[kVec], v[kVec];
  for (int64_t c = kVec * int64_t(threadIdx.x); c < C; c += kVec * kThreads) {
    load8(dout + n * C + c, d);
    load8(y + r * C + c, v);
    for (int i = 0; i < kVec; ++i) dot += d[i] * v[i], d[i] *= w;
    store8(dy + r * C + c, d);
  }
  dot = block_reduce<kThreads>(dot, SumOp{}, red);
  if (threadIdx.x == 0) dweight[s] = dot;
}

// The shared expert's gate: d shared = sigmoid(z) dout, dz = sigmoid'(z) (dout . shared).
__global__ void shared_backward_kernel(bf16* __restrict__ d_shared, bf16* __restrict__ d_logit,
                                       const bf16* __restrict__ dout, const bf16* __restrict__ shared,
                                       const float* __restrict__ logit, int64_t C) {
  __shared__ float red[kWarps];
  const int64_t n = blockIdx.x;
  const float g = 1.0f / (1.0f + expf(-logit[n]));
  float dot = 0, d[kVec], v[kVec];
  for (int64_t c = kVec * int64_t(threadIdx.x); c < C; c += kVec * kThreads) {
    load8(dout + n * C + c, d);
    load8(shared + n * C + c, v);
    for (int i = 0; i < kVec; ++i) dot += d[i] * v[i], d[i] *= g;
    store8(d_shared + n * C + c, d);
  }
  dot = block_reduce<kThreads>(dot, SumOp{}, red);
  if (threadIdx.x == 0) d_logit[n] = to_bf16(dot * g * (1.0f - g));
}

// dx[n] = sum_j drows[row[n, j]], j = 0 .. K - 1. One block a token, eight channels a thread.
__global__ void scatter_kernel(bf16* __restrict__ dx, const bf16* __restrict__ drows, const int32_t* __restrict__ row,
                               int64_t C, int K) {
  const int64_t n = blockIdx.x;
  for (int64_t c = kVec * int64_t(threadIdx.x); c < C; c += kVec * int64_t(blockDim.x)) {
    float acc[kVec] = {}, v[kVec];
    for (int j = 0; j < K; ++j) {
      load8(drows + int64_t(row[n * K + j]) * C + c, v);
      for (int i = 0; i < kVec; ++i) acc[i] += v[i];
    }
    store8(dx + n * C + c, acc);
  }
}

// d router logits, one warp a token: the chosen experts' weight gradients
// (through the renormalisation with norm_topk) and the aux loss's gradient on
// every probability, then through the softmax: dz = p (dp - sum(dp p)).
__global__ void route_backward_kernel(bf16* __restrict__ dlogits, const float* __restrict__ dweight,
                                      const float* __restrict__ probs, const int32_t* __restrict__ expert,
                                      const double* __restrict__ aux_counts, double aux_coef, int64_t N, int E,
                                      int K, bool norm_topk) {
  const int64_t n = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= N) return;
  const float* p = probs + n * E;
  const int32_t* chosen = expert + n * K;
  const float* dw = dweight + n * K;
  // The chosen experts' d p: g_j.
  float S = 0, dotw = 0;
  if (norm_topk) {
    for (int j = 0; j < K; ++j) S += p[chosen[j]];
    for (int j = 0; j < K; ++j) dotw += dw[j] * p[chosen[j]] / S;
  }
  auto chosen_grad = [&](int e) {
    float g = 0;
    for (int j = 0; j < K; ++j)
      if (chosen[j] == e) g += norm_topk ? (dw[j] - dotw) / S : dw[j];
    return g;
  };
  auto dprob = [&](int e) {
    const float aux = aux_counts ? float(aux_coef * aux_counts[e]) : 0.0f;
    return aux + chosen_grad(e);
  };
  float dot = 0;
  for (int e = lane; e < E; e += 32) dot += dprob(e) * p[e];
  dot = warp_sum(dot);
  for (int e = lane; e < E; e += 32) dlogits[n * E + e] = to_bf16(p[e] * (dprob(e) - dot));
}

// aux counts: one block an expert, its rows from the offsets and its column of probs.
__global__ void aux_add_kernel(double* __restrict__ counts, double* __restrict__ prob_sums,
                               const int64_t* __restrict__ offsets, const float* __restrict__ probs, int64_t N, int E) {
  __shared__ float red[kWarps];
  const int e = blockIdx.x;
  float sum = 0;
  for (int64_t n = threadIdx.x; n < N; n += kThreads) sum += probs[n * E + e];
  sum = block_reduce<kThreads>(sum, SumOp{}, red);
  if (threadIdx.x == 0) {
    counts[e] += double(offsets[e + 1] - offsets[e]);
    prob_sums[e] += double(sum);
  }
}

// The groups of rows the experts' GEMMs run over: group g is rows
// [first[g], first[g + 1]) of expert g % experts (its index in MoeWeights).
// Every expert's rows on one rank (count = experts = E), or under expert
// parallelism source rank q's rows of owned expert j (g = q Ep + j).
struct RowGroups {
  const int64_t* first;
  int64_t count, experts;
  int64_t rows(int64_t g) const { return first[g + 1] - first[g]; }
  int64_t expert(int64_t g) const { return g % experts; }
  int64_t total() const { return first[count]; }
  int64_t sources() const { return count / experts; }
};

// One kind of the experts' weight gradients, g (expert e at g + e stride,
// (P, Q) fp32) +=, one grouped launch per source so that no launch adds twice
// into one expert: straight from the grouped GEMM (fp32 C, beta 1) where cuBLAS
// takes it; else written in bf16 into wgrad (E, P, Q) and added.
void expert_wgrad(GroupedGemm& grouped, float* g, int64_t stride, bf16* wgrad, const RowGroups& x, int64_t P,
                  int64_t Q, const bf16* dout, int64_t ld_dout, const bf16* inp, int64_t ld_inp, cudaStream_t stream) {
  for (int64_t q = 0; q < x.sources(); ++q) {
    const int64_t g0 = q * x.experts, g1 = g0 + x.experts;
    // (P, Q) = dout_e^T (P x rows) inp_e (rows x Q)
    auto products = [&](bool f32) {
      std::vector<GroupedGemm::Product> out;
      for (int64_t i = g0; i < g1; ++i) {
        const int64_t e = x.expert(i);
        if (x.rows(i) > 0)
          out.push_back({P, Q, x.rows(i), dout + x.first[i] * ld_dout, ld_dout, inp + x.first[i] * ld_inp, ld_inp,
                         f32 ? static_cast<void*>(g + e * stride) : static_cast<void*>(wgrad + e * P * Q), Q});
      }
      return out;
    };
    if (grouped.run(/*trans_a=*/true, /*trans_b=*/false, products(true), 1.0f, GemmOut::F32)) continue;
    grouped.run(true, false, products(false), 0.0f);
    for (int64_t i = g0; i < g1; ++i)
      if (x.rows(i) > 0) add_bf16_to_f32(g + x.expert(i) * stride, g + x.expert(i) * stride,
                                         wgrad + x.expert(i) * P * Q, P * Q, stream);
  }
}

// The plan of the exchange from a.host_ep_rows (the backward: the forward's rows).
void replan_exchange(MoeExpertParallel& ep, const MoeLayerActs& a, int64_t E, int64_t C) {
  // Rows of C bf16 channels: the plan's counts in bytes.
  cpu::plan_expert_exchange(ep.plan, a.host_ep_rows->data(), ep.group->rank(), ep.group->size(), E, 2 * C);
}
// Expert parallelism's exchange of a layer: every rank's rows per expert
// (all-reduced on the host from the offsets) into a.host_ep_rows, then the plan.
void plan_exchange(MoeExpertParallel& ep, const MoeLayerActs& a, int64_t E, int64_t C) {
  Comm& group = *ep.group;
  const int P = group.size(), rank = group.rank();
  std::vector<int64_t> rows(size_t(P * E), 0);
  const std::vector<int64_t>& offsets = *a.host_offsets;
  for (int64_t e = 0; e < E; ++e) rows[size_t(rank * E + e)] = offsets[size_t(e) + 1] - offsets[size_t(e)];
  group.all_reduce_sum(rows.data(), P * E);
  a.host_ep_rows->assign(rows.begin(), rows.end());
  replan_exchange(ep, a, E, C);
}
// Rows to their owners: owned <- every rank's rows of this rank's experts.
void to_owners(MoeExpertParallel& ep, const bf16* local, bf16* owned) {
  const cpu::ExpertExchange& x = ep.plan;
  ep.group->all_to_all_v_device(local, x.send_counts.data(), x.send_displs.data(), owned, x.recv_counts.data(),
                                x.recv_displs.data());
}
// And back: local <- the owners' rows, in the order to_owners sent them.
void from_owners(MoeExpertParallel& ep, const bf16* owned, bf16* local) {
  const cpu::ExpertExchange& x = ep.plan;
  ep.group->all_to_all_v_device(owned, x.recv_counts.data(), x.recv_displs.data(), local, x.send_counts.data(),
                                x.send_displs.data());
}
// The groups the GEMMs run over: this rank's rows per expert, or the received (source, expert) groups.
RowGroups row_groups(const MoeExpertParallel& ep, const MoeLayerActs& a, int64_t E) {
  if (!ep.group) return {a.host_offsets->data(), E, E};
  const int64_t Ep = E / ep.group->size();
  return {ep.plan.groups.data(), int64_t(ep.plan.groups.size()) - 1, Ep};
}

}  // namespace

template <class S>
void moe_forward(S* out, const S* residual, const bf16* xn, const MoeWeights& w, MoeLayerActs& a,
                 const MoeScratch& s, const MoeDims& d, const int32_t* forced, int64_t forced_stride,
                 MoeExpertParallel& ep, Gemm& gemm, GroupedGemm& grouped, cudaStream_t stream) {
  SHARDLM_CHECK(d.C % 8 == 0, "a layer of experts on the GPU needs hidden_size a multiple of 8 (it is %lld)",
                (long long)d.C);
  const int64_t N = d.N, C = d.C, E = d.E, K = d.K, Im = d.Im, R = d.rows();
  if (N == 0) return;
  gemm.matmul(false, true, N, E, C, xn, C, w.router, C, s.logits, E, GemmOut::F32, 1.0f, 0.0f);
  route_kernel<<<blocks(N, kWarps), kThreads, 0, stream>>>(a.probs, a.expert, a.weight, s.logits, N, int(E), int(K),
                                                           d.norm_topk, forced, forced_stride);
  count_kernel<<<unsigned(E), kThreads, 0, stream>>>(a.offsets, a.expert, R);
  scan_kernel<<<1, 1, 0, stream>>>(a.offsets, int(E));
  place_kernel<<<unsigned(E), kThreads, 0, stream>>>(a.slot, a.row, a.expert, a.offsets, R);
  CUDA_CHECK(cudaGetLastError());
  a.host_offsets->resize(size_t(E + 1));
  CUDA_CHECK(cudaMemcpyAsync(a.host_offsets->data(), a.offsets, 8 * size_t(E + 1), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // the grouped GEMMs' sizes
  gather_kernel<<<unsigned(R), 128, 0, stream>>>(s.rows, xn, a.slot, C, int(K));
  // The experts' inputs: this rank's rows, or every rank's rows of its own experts.
  const bf16* in = s.rows;
  if (ep.group) {
    plan_exchange(ep, a, E, C);
    to_owners(ep, s.rows, ep.owned);
    in = ep.owned;
  }
  const RowGroups x = row_groups(ep, a, E);
  bf16* y = ep.group ? ep.owned : a.y;  // the inputs are dead once gate | up is formed
  std::vector<GroupedGemm::Product> gate_up, down;
  for (int64_t g = 0; g < x.count; ++g) {
    const int64_t m = x.rows(g), o = x.first[g], e = x.expert(g);
    gate_up.push_back({m, Im, C, in + o * C, C, w.gate + e * w.stride, C, a.gu + o * 2 * Im, 2 * Im});
    gate_up.push_back({m, Im, C, in + o * C, C, w.up + e * w.stride, C, a.gu + o * 2 * Im + Im, 2 * Im});
    down.push_back({m, C, Im, a.h + o * Im, Im, w.down + e * w.stride, Im, y + o * C, C});
  }
  grouped.run(false, true, gate_up, 0.0f);
  swiglu_forward(a.h, Im, a.gu, 2 * Im, a.gu + Im, 2 * Im, x.total(), Im, stream);
  grouped.run(false, true, down, 0.0f);
  if (ep.group) from_owners(ep, ep.owned, a.y);
  if (d.Is > 0) {
    const int64_t Is = d.Is;
    linear_forward(gemm, a.shared_gu, xn, w.s_gate_up, nullptr, N, C, 2 * Is);
    swiglu_forward(a.shared_h, Is, a.shared_gu, 2 * Is, a.shared_gu + Is, 2 * Is, N, Is, stream);
    linear_forward(gemm, a.shared_out, a.shared_h, w.s_down, nullptr, N, Is, C);
    gemm.matmul(false, true, N, 1, C, xn, C, w.s_weight, C, a.shared_logit, 1, GemmOut::F32, 1.0f, 0.0f);
  }
  combine_kernel<S><<<unsigned(N), kThreads, 0, stream>>>(out, residual, a.y, a.weight, a.row,
                                                          d.Is > 0 ? a.shared_out : nullptr, a.shared_logit, C,
                                                          int(K));
  CUDA_CHECK(cudaGetLastError());
}

void moe_aux_add(const MoeLayerActs& a, const MoeScratch& s, const MoeDims& d, cudaStream_t stream) {
  if (d.N == 0) return;
  aux_add_kernel<<<unsigned(d.E), kThreads, 0, stream>>>(s.aux_counts, s.aux_prob_sums, a.offsets, a.probs, d.N,
                                                         int(d.E));
  CUDA_CHECK(cudaGetLastError());
}

void moe_backward(bf16* d_xn, const bf16* dout, const bf16* xn, const MoeWeights& w, const MoeGrads& g,
                  MoeLayerActs& a, const MoeScratch& s, const MoeDims& d, double aux_scale, int64_t aux_rows,
                  MoeExpertParallel& ep, Gemm& gemm, GroupedGemm& grouped, void* scratch, size_t scratch_bytes,
                  cudaStream_t stream) {
  const int64_t N = d.N, C = d.C, E = d.E, K = d.K, Im = d.Im, R = d.rows();
  if (N == 0) return;
  combine_backward_kernel<<<unsigned(R), kThreads, 0, stream>>>(s.rows, s.dweight, dout, a.y, a.weight, a.slot, C,
                                                                int(K));
  // dy at the experts: this rank's rows, or every rank's rows of its own experts.
  const bf16* dy = s.rows;
  if (ep.group) {
    replan_exchange(ep, a, E, C);
    to_owners(ep, s.rows, ep.owned);
    dy = ep.owned;
  }
  const RowGroups x = row_groups(ep, a, E);
  // d h = dy W_down (rows x C)(C x Im); W_down's gradient dy^T h.
  std::vector<GroupedGemm::Product> dh;
  for (int64_t g = 0; g < x.count; ++g)
    dh.push_back({x.rows(g), Im, C, dy + x.first[g] * C, C, w.down + x.expert(g) * w.stride, Im,
                  s.dh + x.first[g] * Im, Im});
  grouped.run(false, false, dh, 0.0f);
  expert_wgrad(grouped, g.down, g.stride, s.wgrad, x, C, Im, dy, C, a.h, Im, stream);
  // dgate | dup in place of gate | up.
  const int64_t rows = x.total();
  swiglu_backward(a.gu, 2 * Im, a.gu + Im, 2 * Im, s.dh, Im, a.gu, 2 * Im, a.gu + Im, 2 * Im, rows, Im, stream);
  // d rows = dgate W_gate + dup W_up, where dy was (dead now).
  bf16* drows = ep.group ? ep.owned : s.rows;
  std::vector<GroupedGemm::Product> from_gate, from_up;
  for (int64_t g = 0; g < x.count; ++g) {
    const int64_t m = x.rows(g), o = x.first[g], e = x.expert(g);
    from_gate.push_back({m, C, Im, a.gu + o * 2 * Im, 2 * Im, w.gate + e * w.stride, C, drows + o * C, C});
    from_up.push_back({m, C, Im, a.gu + o * 2 * Im + Im, 2 * Im, w.up + e * w.stride, C, drows + o * C, C});
  }
  grouped.run(false, false, from_gate, 0.0f);
  grouped.run(false, false, from_up, 1.0f);
  if (ep.group) from_owners(ep, ep.owned, s.rows);
  scatter_kernel<<<unsigned(N), kThreads, 0, stream>>>(d_xn, s.rows, a.row, C, int(K));
  // The gate and up weights' gradients need the inputs again: gathered anew (and sent again).
  gather_kernel<<<unsigned(R), 128, 0, stream>>>(s.rows, xn, a.slot, C, int(K));
  const bf16* in = s.rows;
  if (ep.group) {
    to_owners(ep, s.rows, ep.owned);
    in = ep.owned;
  }
  expert_wgrad(grouped, g.gate, g.stride, s.wgrad, x, Im, C, a.gu, 2 * Im, in, C, stream);
  expert_wgrad(grouped, g.up, g.stride, s.wgrad, x, Im, C, a.gu + Im, 2 * Im, in, C, stream);
  // The router: aux loss E sum_e f_e P_e with f_e = counts_e / rows, P_e = sum_n p_ne / rows,
  // so d aux / d p_ne = E counts_e / rows^2.
  const double aux_coef = aux_scale != 0 && aux_rows > 0 ? aux_scale * double(E) / (double(aux_rows) * aux_rows) : 0;
  route_backward_kernel<<<blocks(N, kWarps), kThreads, 0, stream>>>(
      s.dlogits, s.dweight, a.probs, a.expert, aux_coef != 0 ? s.aux_counts : nullptr, aux_coef, N, int(E), int(K),
      d.norm_topk);
  CUDA_CHECK(cudaGetLastError());
  linear_backward(gemm, d_xn, g.router, nullptr, s.dlogits, xn, w.router, N, C, E, scratch, scratch_bytes,
                  Dinp::Accumulate);
  if (d.Is == 0) return;
  const int64_t Is = d.Is;
  shared_backward_kernel<<<unsigned(N), kThreads, 0, stream>>>(s.d_shared, s.d_shared_logit, dout, a.shared_out,
                                                               a.shared_logit, C);
  CUDA_CHECK(cudaGetLastError());
  linear_backward(gemm, s.dh, g.s_down, nullptr, s.d_shared, a.shared_h, w.s_down, N, Is, C, scratch, scratch_bytes);
  swiglu_backward(a.shared_gu, 2 * Is, a.shared_gu + Is, 2 * Is, s.dh, Is, a.shared_gu, 2 * Is, a.shared_gu + Is,
                  2 * Is, N, Is, stream);
  linear_backward(gemm, d_xn, g.s_gate_up, nullptr, a.shared_gu, xn, w.s_gate_up, N, C, 2 * Is, scratch,
                  scratch_bytes, Dinp::Accumulate);
  linear_backward(gemm, d_xn, g.s_weight, nullptr, s.d_shared_logit, xn, w.s_weight, N, C, 1, scratch,
                  scratch_bytes, Dinp::Accumulate);
}

template void moe_forward<bf16>(bf16*, const bf16*, const bf16*, const MoeWeights&, MoeLayerActs&, const MoeScratch&,
                                const MoeDims&, const int32_t*, int64_t, MoeExpertParallel&, Gemm&, GroupedGemm&,
                                cudaStream_t);
template void moe_forward<float>(float*, const float*, const bf16*, const MoeWeights&, MoeLayerActs&,
                                 const MoeScratch&, const MoeDims&, const int32_t*, int64_t, MoeExpertParallel&, Gemm&,
                                 GroupedGemm&, cudaStream_t);

}  // namespace shardlm::cuda
