// test_ring_attention.cu — the context-parallel ring's masked kernels
// (shardlm::cuda::attention_masked_*, ring_attention.hpp) against the CPU reference.
//
// Standalone (no doctest, no MPI): tests/gpu/build_ring_attention.sh builds and runs
// it; exit status 0 only when every check passed. Each case is a micro-batch of
// `rows` rows of seq_len tokens with packed documents (ids unique per document, as
// the data pipeline makes them). The reference is shardlm::cpu::attention_forward /
// attention_backward<double> (src/cpu/ops.cpp) over the whole micro-batch: what the
// ring must reproduce, since context parallelism is the same attention split over
// ranks. The GPU side splits the micro-batch as train/context_split.cpp does (rank c
// keeps chunks c and 2C-1-c of every row) and runs the ring's steps in its order:
// rank r attends to block (r - s) mod C at step s, forward merging into fp32
// accumulators (first block overwrites), backward adding dq into rank r's fp32
// accumulator and dk/dv into the block's, which travel. The ring class itself
// (cuda/ring_walk.cu) is exercised by tests/gpu/test_context_parallel.sh.
//
// Checks per case: ||gpu - ref|| / ||ref|| of out (bf16, 5e-3), dq, dk, dv (bf16
// rounding of the fp32 accumulators, 1e-2), max |lse - ref| (fp32, 1e-4): the
// bounds of tests/gpu/test_attention.cu, whose kernels these share (P and dS are
// rounded to bf16 for the tensor cores, as FlashAttention does). Backward is
// referenced on the GPU's own out and lse (as test_attention.cu), so its error is
// backward's alone. Outputs are poisoned with NaN first; every case runs twice and
// must give the same bits. A block wholly in the queries' future must leave out 0
// and lse -inf (first = true) and change nothing when merged (first = false).
#include <cblas.h>  // tests/gpu/cblas_shim: src/cpu/ops.cpp needs the symbols, this test no GEMM
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/ops.hpp"
#include "cuda/attention.hpp"
#include "cuda/ring_attention.hpp"

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    cudaError_t status_ = (call);                                                        \
    if (status_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #call, __FILE__, __LINE__,        \
                   cudaGetErrorString(status_));                                         \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

extern "C" void cblas_sgemm(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, int, int, int, float, const float*,
                            int, const float*, int, float, float*, int) {
  std::fprintf(stderr, "cblas_sgemm: not used by this test\n");
  std::abort();
}
extern "C" void cblas_dgemm(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, int, int, int, double, const double*,
                            int, const double*, int, double, double*, int) {
  std::fprintf(stderr, "cblas_dgemm: not used by this test\n");
  std::abort();
}

namespace {

using bf16 = __nv_bfloat16;
namespace sc = shardlm::cuda;

constexpr double kTolOut = 5e-3, kTolGrad = 1e-2, kTolLse = 1e-4;
int g_failures = 0, g_checks = 0;

struct Case {
  std::string name;
  int64_t rows, seq_len, C, H, KV, D;
  std::vector<int> doc_lens;  // packed in turn, cut at each row's end
  bool generic = false;       // force the SIMT fallback (attention_set_kernel(kGeneric))
};

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, sizeof(T) * std::max<size_t>(1, h.size())));
  CHECK_CUDA(cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, sizeof(T) * n, cudaMemcpyDeviceToHost));
  return h;
}
template <class T>
void poison(T* d, size_t n) {
  CHECK_CUDA(cudaMemset(d, 0xff, sizeof(T) * n));  // NaN in fp32 and bf16
}

void report(const std::string& what, double err, double tol, bool finite) {
  ++g_checks;
  const bool ok = finite && err <= tol;
  if (!ok) ++g_failures;
  std::printf("%-78s %10.3e  (tol %.0e)%s  %s\n", what.c_str(), err, tol, finite ? "" : " NaN", ok ? "PASS" : "FAIL");
}
void report_exact(const std::string& what, bool ok) {
  ++g_checks;
  if (!ok) ++g_failures;
  std::printf("%-78s %10s  %s\n", what.c_str(), ok ? "bitwise" : "differs", ok ? "PASS" : "FAIL");
}

// ||a - b|| / max(||b||, 1e-2 * sqrt(n)) over float views.
template <class A>
double rel_l2(const std::vector<A>& got, const std::vector<double>& ref, bool* finite) {
  double num = 0, den = 0;
  *finite = true;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = double(got[i]);
    if (!std::isfinite(g)) *finite = false;
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-2 * std::sqrt(double(ref.size())));
}

// The indices rank c keeps, as train/context_split.cpp's context_share_indices.
std::vector<int32_t> share(int64_t rows, int64_t seq_len, int c, int C) {
  const int64_t chunk = seq_len / (2 * C);
  std::vector<int32_t> idx;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t part : {int64_t(c), int64_t(2 * C - 1 - c)})
      for (int64_t t = 0; t < chunk; ++t) idx.push_back(int32_t(r * seq_len + part * chunk + t));
  return idx;
}

// One rank's tokens on the device: index, seq, tile bounds, and its q/k/v/dout rows.
struct Rank {
  std::vector<int32_t> idx;
  int64_t n = 0;
  int32_t *index = nullptr, *seq = nullptr, *bounds = nullptr;
  bf16 *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr, *out = nullptr;
  float *out_acc = nullptr, *lse = nullptr, *delta = nullptr, *dq_acc = nullptr, *dk_acc = nullptr,
        *dv_acc = nullptr;
  sc::AttentionTokens tokens() const { return {index, seq, bounds, n}; }
};

template <class T>
std::vector<T> gather(const std::vector<T>& full, const std::vector<int32_t>& idx, int64_t width) {
  std::vector<T> out(idx.size() * width);
  for (size_t i = 0; i < idx.size(); ++i)
    std::memcpy(&out[i * width], &full[size_t(idx[i]) * width], sizeof(T) * width);
  return out;
}

struct GpuResult {
  std::vector<bf16> out;        // (M, H, D) scattered back to micro-batch order
  std::vector<float> lse;       // (M, H)
  std::vector<bf16> dq, dk, dv; // bf16 roundings of the accumulators, micro-batch order
};

// The ring's steps for every rank, in ring order, on one GPU.
GpuResult run_ring(const Case& c, std::vector<Rank>& ranks, int64_t M, cudaStream_t s) {
  const int C = int(c.C);
  const int64_t H = c.H, KV = c.KV, D = c.D, HD = H * D, KVD = KV * D;
  for (auto& r : ranks) {
    poison(r.out_acc, r.n * HD);
    poison(r.lse, r.n * H);
  }
  for (int step = 0; step < C; ++step)
    for (int r = 0; r < C; ++r) {
      const Rank& b = ranks[size_t((r - step + C) % C)];
      sc::attention_masked_forward(ranks[r].out_acc, ranks[r].lse, step == 0, ranks[r].q, ranks[r].tokens(), b.k, b.v,
                                   b.tokens(), H, KV, D, s);
    }
  GpuResult g;
  g.out.resize(M * HD), g.lse.resize(M * H), g.dq.resize(M * HD), g.dk.resize(M * KVD), g.dv.resize(M * KVD);
  for (auto& r : ranks) {
    CHECK_CUDA(cudaStreamSynchronize(s));
    const std::vector<float> acc = to_host(r.out_acc, r.n * HD), lse = to_host(r.lse, r.n * H);
    std::vector<bf16> out(acc.size());
    for (size_t i = 0; i < acc.size(); ++i) out[i] = __float2bfloat16(acc[i]);  // the ring's one rounding
    CHECK_CUDA(cudaMemcpy(r.out, out.data(), 2 * out.size(), cudaMemcpyHostToDevice));
    for (int64_t i = 0; i < r.n; ++i) {
      std::memcpy(&g.out[size_t(r.idx[i]) * HD], &out[i * HD], 2 * HD);
      std::memcpy(&g.lse[size_t(r.idx[i]) * H], &lse[i * H], 4 * H);
    }
    poison(r.delta, r.n * H);
    sc::attention_masked_delta(r.delta, r.dout, r.out, r.n, H, D, s);
    CHECK_CUDA(cudaMemsetAsync(r.dq_acc, 0, 4 * r.n * HD, s));
    CHECK_CUDA(cudaMemsetAsync(r.dk_acc, 0, 4 * r.n * KVD, s));
    CHECK_CUDA(cudaMemsetAsync(r.dv_acc, 0, 4 * r.n * KVD, s));
  }
  // Block b's accumulators are added to by ranks b, b+1, ... as they travel.
  for (int step = 0; step < C; ++step)
    for (int r = 0; r < C; ++r) {
      Rank& b = ranks[size_t((r - step + C) % C)];
      const Rank& q = ranks[r];
      sc::attention_masked_backward(nullptr, b.dk_acc, b.dv_acc, q.dout, q.q, q.lse, q.delta, q.tokens(), b.k, b.v,
                                    b.tokens(), H, KV, D, s);
      sc::attention_masked_backward(q.dq_acc, nullptr, nullptr, q.dout, q.q, q.lse, q.delta, q.tokens(), b.k, b.v,
                                    b.tokens(), H, KV, D, s);
    }
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK_CUDA(cudaGetLastError());
  for (auto& r : ranks) {
    const std::vector<float> dq = to_host(r.dq_acc, r.n * HD), dk = to_host(r.dk_acc, r.n * KVD),
                             dv = to_host(r.dv_acc, r.n * KVD);
    for (int64_t i = 0; i < r.n; ++i) {
      for (int64_t e = 0; e < HD; ++e) g.dq[size_t(r.idx[i]) * HD + e] = __float2bfloat16(dq[i * HD + e]);
      for (int64_t e = 0; e < KVD; ++e) {
        g.dk[size_t(r.idx[i]) * KVD + e] = __float2bfloat16(dk[i * KVD + e]);
        g.dv[size_t(r.idx[i]) * KVD + e] = __float2bfloat16(dv[i * KVD + e]);
      }
    }
  }
  return g;
}

void run_case(const Case& c, std::mt19937_64& rng) {
  sc::attention_set_kernel(c.generic ? sc::AttentionKernel::kGeneric : sc::AttentionKernel::kAuto);
  const int C = int(c.C);
  const int64_t M = c.rows * c.seq_len, H = c.H, KV = c.KV, D = c.D, HD = H * D, KVD = KV * D;
  // Documents packed in turn, cut at each row's end, a fresh id for each.
  std::vector<int32_t> seq(M);
  int32_t id = 0;
  size_t doc = 0;
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t t = 0; t < c.seq_len;) {
      const int64_t len = std::min<int64_t>(c.doc_lens[doc++ % c.doc_lens.size()], c.seq_len - t);
      for (int64_t e = 0; e < len; ++e) seq[r * c.seq_len + t + e] = id;
      ++id, t += len;
    }
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random_bf16 = [&](int64_t n, std::vector<bf16>& b, std::vector<double>& f) {
    b.resize(n), f.resize(n);
    for (int64_t i = 0; i < n; ++i) b[i] = __float2bfloat16(normal(rng)), f[i] = double(__bfloat162float(b[i]));
  };
  std::vector<bf16> q, k, v, dout;
  std::vector<double> qf, kf, vf, doutf;
  random_bf16(M * HD, q, qf), random_bf16(M * KVD, k, kf), random_bf16(M * KVD, v, vf);
  random_bf16(M * HD, dout, doutf);

  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  std::vector<Rank> ranks(C);
  for (int r = 0; r < C; ++r) {
    Rank& x = ranks[r];
    x.idx = share(c.rows, c.seq_len, r, C);
    x.n = int64_t(x.idx.size());
    x.index = to_device(x.idx);
    x.seq = to_device(gather(seq, x.idx, 1));
    CHECK_CUDA(cudaMalloc(&x.bounds, sc::attention_tile_bounds_bytes(x.n)));
    sc::attention_tile_bounds(x.bounds, x.index, x.seq, x.n, s);
    x.q = to_device(gather(q, x.idx, HD)), x.k = to_device(gather(k, x.idx, KVD));
    x.v = to_device(gather(v, x.idx, KVD)), x.dout = to_device(gather(dout, x.idx, HD));
    CHECK_CUDA(cudaMalloc(&x.out, 2 * x.n * HD));
    for (float** p : {&x.out_acc, &x.dq_acc}) CHECK_CUDA(cudaMalloc(p, 4 * x.n * HD));
    for (float** p : {&x.lse, &x.delta}) CHECK_CUDA(cudaMalloc(p, 4 * x.n * H));
    for (float** p : {&x.dk_acc, &x.dv_acc}) CHECK_CUDA(cudaMalloc(p, 4 * x.n * KVD));
  }

  const GpuResult g = run_ring(c, ranks, M, s);
  const GpuResult again = run_ring(c, ranks, M, s);

  // The reference over the whole micro-batch; backward on the GPU's out and lse.
  std::vector<double> out_ref(M * HD), lse_ref(M * H), dq_ref(M * HD), dk_ref(M * KVD), dv_ref(M * KVD);
  shardlm::cpu::attention_forward<double>(out_ref.data(), lse_ref.data(), qf.data(), kf.data(), vf.data(), seq.data(),
                                          M, H, KV, D);
  std::vector<double> out_gpu(M * HD), lse_gpu(M * H);
  for (int64_t i = 0; i < M * HD; ++i) out_gpu[i] = double(__bfloat162float(g.out[i]));
  for (int64_t i = 0; i < M * H; ++i) lse_gpu[i] = double(g.lse[i]);
  shardlm::cpu::attention_backward<double>(dq_ref.data(), dk_ref.data(), dv_ref.data(), doutf.data(), qf.data(),
                                           kf.data(), vf.data(), out_gpu.data(), lse_gpu.data(), seq.data(), M, H, KV,
                                           D);

  const std::string tag = c.name + (c.generic ? " [generic]" : "");
  bool finite = true;
  auto f32 = [](const std::vector<bf16>& b) {
    std::vector<float> f(b.size());
    for (size_t i = 0; i < b.size(); ++i) f[i] = __bfloat162float(b[i]);
    return f;
  };
  report(tag + ": out", rel_l2(f32(g.out), out_ref, &finite), kTolOut, finite);
  double lse_err = 0;
  bool lse_finite = true;
  for (int64_t i = 0; i < M * H; ++i) {
    if (!std::isfinite(g.lse[i])) lse_finite = false;
    lse_err = std::max(lse_err, std::fabs(double(g.lse[i]) - lse_ref[i]));
  }
  report(tag + ": lse (max abs)", lse_err, kTolLse, lse_finite);
  report(tag + ": dq", rel_l2(f32(g.dq), dq_ref, &finite), kTolGrad, finite);
  report(tag + ": dk", rel_l2(f32(g.dk), dk_ref, &finite), kTolGrad, finite);
  report(tag + ": dv", rel_l2(f32(g.dv), dv_ref, &finite), kTolGrad, finite);
  auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  report_exact(tag + ": rerun gives the same bits (out, lse, dq, dk, dv)",
               same(g.out, again.out) && same(g.lse, again.lse) && same(g.dq, again.dq) && same(g.dk, again.dk) &&
                   same(g.dv, again.dv));

  // A block wholly in rank 0's early chunk's future: rank C-1's block seen from
  // rank 0 has keys later than rank 0's first chunk, so those rows see none.
  if (C > 1) {
    Rank& r0 = ranks[0];
    const Rank& late = ranks[size_t(C - 1)];
    const int64_t chunk = c.seq_len / (2 * C);
    poison(r0.out_acc, r0.n * HD), poison(r0.lse, r0.n * H);
    sc::attention_masked_forward(r0.out_acc, r0.lse, true, r0.q, r0.tokens(), late.k, late.v, late.tokens(), H, KV, D,
                                 s);
    const std::vector<float> acc = to_host(r0.out_acc, r0.n * HD), lse = to_host(r0.lse, r0.n * H);
    bool ok = true;
    for (int64_t i = 0; i < chunk; ++i) {  // row 0's early chunk
      for (int64_t e = 0; e < HD; ++e) ok = ok && acc[i * HD + e] == 0.f;
      for (int64_t h = 0; h < H; ++h) ok = ok && lse[i * H + h] == -INFINITY;
    }
    report_exact(tag + ": first block invisible to a row: out 0, lse -inf", ok);
    // Merged (first = false) after the own block: the invisible block changes nothing.
    sc::attention_masked_forward(r0.out_acc, r0.lse, true, r0.q, r0.tokens(), r0.k, r0.v, r0.tokens(), H, KV, D, s);
    const std::vector<float> own = to_host(r0.out_acc, r0.n * HD), own_lse = to_host(r0.lse, r0.n * H);
    sc::attention_masked_forward(r0.out_acc, r0.lse, false, r0.q, r0.tokens(), late.k, late.v, late.tokens(), H, KV,
                                 D, s);
    const std::vector<float> merged = to_host(r0.out_acc, r0.n * HD), merged_lse = to_host(r0.lse, r0.n * H);
    bool unchanged = true;
    for (int64_t i = 0; i < chunk; ++i) {
      unchanged = unchanged && std::memcmp(&own[i * HD], &merged[i * HD], 4 * HD) == 0;
      unchanged = unchanged && std::memcmp(&own_lse[i * H], &merged_lse[i * H], 4 * H) == 0;
    }
    report_exact(tag + ": merging an invisible block leaves those rows' bits", unchanged);
  }

  for (auto& x : ranks)
    for (void* p : {(void*)x.index, (void*)x.seq, (void*)x.bounds, (void*)x.q, (void*)x.k, (void*)x.v,
                    (void*)x.dout, (void*)x.out, (void*)x.out_acc, (void*)x.lse, (void*)x.delta, (void*)x.dq_acc,
                    (void*)x.dk_acc, (void*)x.dv_acc})
      CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaStreamDestroy(s));
  sc::attention_set_kernel(sc::AttentionKernel::kAuto);
}

// The 1B shape at 32K tokens over C = 2 (one document), the long-context GPU case: one
// rank's forward and backward over both blocks, timed (median of 5 after 2 warm-ups),
// against the local kernels over the whole 32K on one GPU. No reference (O(N^2) on the
// CPU); its correctness is the cases above at smaller N.
void time_1b(std::mt19937_64& rng) {
  const int C = 2;
  const int64_t seq_len = 32768, H = 32, KV = 8, D = 64, HD = H * D, KVD = KV * D;
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  std::vector<Rank> ranks(C);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random_device = [&](int64_t n) {
    std::vector<bf16> h(n);
    for (auto& x : h) x = __float2bfloat16(normal(rng));
    return to_device(h);
  };
  for (int r = 0; r < C; ++r) {
    Rank& x = ranks[r];
    x.idx = share(1, seq_len, r, C);
    x.n = int64_t(x.idx.size());
    x.index = to_device(x.idx);
    x.seq = to_device(std::vector<int32_t>(x.n, 0));
    CHECK_CUDA(cudaMalloc(&x.bounds, sc::attention_tile_bounds_bytes(x.n)));
    sc::attention_tile_bounds(x.bounds, x.index, x.seq, x.n, s);
    x.q = random_device(x.n * HD), x.k = random_device(x.n * KVD), x.v = random_device(x.n * KVD);
    x.dout = random_device(x.n * HD), x.out = random_device(x.n * HD);
    for (float** p : {&x.out_acc, &x.dq_acc}) CHECK_CUDA(cudaMalloc(p, 4 * x.n * HD));
    for (float** p : {&x.lse, &x.delta}) CHECK_CUDA(cudaMalloc(p, 4 * x.n * H));
    for (float** p : {&x.dk_acc, &x.dv_acc}) CHECK_CUDA(cudaMalloc(p, 4 * x.n * KVD));
  }
  auto median_ms = [&](auto&& body) {
    std::vector<float> ms;
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    for (int it = 0; it < 7; ++it) {
      CHECK_CUDA(cudaEventRecord(a, s));
      body();
      CHECK_CUDA(cudaEventRecord(b, s));
      CHECK_CUDA(cudaEventSynchronize(b));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
      if (it >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
  };
  // Rank 1 (chunks 1 and 2: the middle of the sequence) does the same causal work as rank 0.
  Rank& me = ranks[1];
  const double fwd = median_ms([&] {
    for (int step = 0; step < C; ++step) {
      const Rank& b = ranks[size_t((1 - step + C) % C)];
      sc::attention_masked_forward(me.out_acc, me.lse, step == 0, me.q, me.tokens(), b.k, b.v, b.tokens(), H, KV, D, s);
    }
  });
  sc::attention_masked_delta(me.delta, me.dout, me.out, me.n, H, D, s);
  const double bwd = median_ms([&] {
    for (int step = 0; step < C; ++step) {
      Rank& b = ranks[size_t((1 - step + C) % C)];
      sc::attention_masked_backward(me.dq_acc, b.dk_acc, b.dv_acc, me.dout, me.q, me.lse, me.delta, me.tokens(), b.k,
                                    b.v, b.tokens(), H, KV, D, s);
    }
  });
  CHECK_CUDA(cudaGetLastError());
  // Causal FLOPs of one rank's share: half of the 32K x 32K attention, split over C ranks.
  const double causal_fwd = 4.0 * double(seq_len) * double(seq_len) / 2 * H * D / C;
  std::printf("timing 1B shape, 32K tokens, C = 2, one rank: forward %.2f ms (%.0f TFLOP/s causal), backward "
              "%.2f ms (%.0f TFLOP/s causal, 2.5x forward's FLOPs)\n",
              fwd, causal_fwd / fwd * 1e-9, bwd, 2.5 * causal_fwd / bwd * 1e-9);
  for (auto& x : ranks)
    for (void* p : {(void*)x.index, (void*)x.seq, (void*)x.bounds, (void*)x.q, (void*)x.k, (void*)x.v,
                    (void*)x.dout, (void*)x.out, (void*)x.out_acc, (void*)x.lse, (void*)x.delta, (void*)x.dq_acc,
                    (void*)x.dk_acc, (void*)x.dv_acc})
      CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaStreamDestroy(s));
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = std::random_device{}();
  bool timing = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--no-timing")) timing = false;
  }
  std::printf("seed %llu\n", (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  const std::vector<Case> cases = {
      {"one document, C=2, H=4 KV=2 D=64", 1, 512, 2, 4, 2, 64, {512}},
      {"packed docs across chunks, C=2, 2 rows, H=8 KV=2 D=64", 2, 1024, 2, 8, 2, 64, {100, 333, 17, 600, 1, 250}},
      {"packed docs, C=4, H=4 KV=1 D=128", 1, 2048, 4, 4, 1, 128, {700, 900, 448}},
      {"odd chunks (111 tokens), C=3, 2 rows, H=4 KV=4 D=128", 2, 666, 3, 4, 4, 128, {50, 300, 7, 129}},
      {"odd chunks (37 tokens), C=3, H=6 KV=2 D=64", 1, 222, 3, 6, 2, 64, {222}},
      {"1B heads, C=2, one document, H=32 KV=8 D=64", 1, 2048, 2, 32, 8, 64, {2048}},
      {"packed docs, C=2, 2 rows, H=8 KV=2 D=64", 2, 1024, 2, 8, 2, 64, {100, 333, 17, 600, 1, 250}, true},
      {"tiny-sft shape, C=2, 2 rows, H=4 KV=2 D=16", 2, 64, 2, 4, 2, 16, {9, 40, 30}},
      {"tiny, C=4, H=4 KV=2 D=16 (chunks of 8)", 1, 64, 4, 4, 2, 16, {64}},
  };
  for (const Case& c : cases) run_case(c, rng);
  if (timing) time_1b(rng);
  std::printf("%d passed, %d failed\n", g_checks - g_failures, g_failures);
  return g_failures == 0 ? 0 : 1;
}
