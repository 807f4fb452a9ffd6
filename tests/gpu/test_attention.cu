// test_attention.cu — shardlm::cuda::attention_* against a float64 CPU reference.
//
// Standalone (no doctest, no MPI): tests/gpu/build_attention.sh builds and runs it;
// exit status 0 only when every check passed. The reference is the formula of
// shardlm::cpu::attention_forward/backward (src/cpu/ops.cpp) evaluated in double
// per row, so sampled rows of large shapes can be checked without O(N^2) work.
// Backward is referenced on the GPU's own out and lse (the CPU contract: backward
// takes them as inputs), so its error is backward's alone.
//
// Every run: fresh random inputs, outputs poisoned with NaN first (an unwritten
// element fails the finiteness check), errors as ||got - ref|| / ||ref|| over the
// checked rows (the norm of the reference floored at an RMS of 1e-2, so an exactly
// zero reference, as dq of a one-token document, is judged by absolute error).
// Tolerances (bf16 outputs, bf16-rounded P and dS as in FlashAttention): out 5e-3,
// dq/dk/dv 1e-2 relative L2; lse (fp32) 1e-4 absolute.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention.hpp"
#include "cuda/sdpa.hpp"

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    cudaError_t status_ = (call);                                                        \
    if (status_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #call, __FILE__, __LINE__,        \
                   cudaGetErrorString(status_));                                         \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

namespace {

using bf16 = __nv_bfloat16;
namespace sc = shardlm::cuda;

// Measured on an H100 (2026-11-29): at most 2.0e-3 (out), 2.5e-3 (dq, dk, dv)
// and 3e-6 (lse): the tolerances leave at least a 2.5x margin.
constexpr double kTolOut = 5e-3, kTolGrad = 1e-2, kTolLse = 1e-4;
constexpr double kPeakTflops = 800.0;  // bf16 dense, measured on an H100

int g_failures = 0, g_checks = 0;
// While set, forward()/backward() run cuDNN's attention (cuda/sdpa.hpp) instead of
// shardlm's kernels; a shape cuDNN refuses is a failure.
sc::CudnnSdpa* g_sdpa = nullptr;
void* g_sdpa_buffers = nullptr;  // its backward buffers

struct Problem {
  std::string name;
  int64_t N = 0, H = 0, KV = 0, D = 0;
  std::vector<int> doc_lens;
  float q_scale = 1.f;     // > 1 sharpens the softmax
  int sample = 0;          // 0: check every row; else rows checked per tensor
};

// Inputs on host (bf16 and their float values) and device.
struct Inputs {
  std::vector<int32_t> seq_id, doc_start, doc_end;
  std::vector<bf16> q, k, v, dout;
  std::vector<float> qf, kf, vf, doutf;
};

template <class V>
bool same_bits(const V& a, const V& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
}

struct Outputs {
  std::vector<bf16> out, dq, dk, dv;
  std::vector<float> lse;
  bool operator==(const Outputs& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(out, o.out) && same(dq, o.dq) && same(dk, o.dk) && same(dv, o.dv) &&
           same(lse, o.lse);
  }
};

struct Device {
  bf16 *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
  bf16 *out = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *lse = nullptr, *delta = nullptr;
  int32_t *seq_id = nullptr, *doc_start = nullptr;
  size_t bytes = 0;
};

template <class T>
T* dev_alloc(size_t n, size_t& total) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  total += n * sizeof(T);
  return p;
}

Inputs make_inputs(const Problem& P, uint64_t seed) {
  Inputs in;
  const int64_t N = P.N;
  for (size_t d = 0; d < P.doc_lens.size(); ++d)
    for (int t = 0; t < P.doc_lens[d]; ++t) in.seq_id.push_back(int32_t(d * 7 + 3));
  if (int64_t(in.seq_id.size()) != N) {
    std::fprintf(stderr, "%s: documents sum to %zu tokens, not N = %lld\n", P.name.c_str(),
                 in.seq_id.size(), (long long)N);
    std::exit(2);
  }
  in.doc_start.resize(N);
  in.doc_end.resize(N);
  for (int64_t i = 0; i < N; ++i)
    in.doc_start[i] = (i > 0 && in.seq_id[i] == in.seq_id[i - 1]) ? in.doc_start[i - 1] : int32_t(i);
  for (int64_t i = N - 1; i >= 0; --i)
    in.doc_end[i] = (i + 1 < N && in.seq_id[i] == in.seq_id[i + 1]) ? in.doc_end[i + 1] : int32_t(i + 1);
  // Chunks of 2^20 values, each from its own generator (seed, tensor, chunk), on
  // every core: the same inputs at any thread count, and 131K-token cases
  // (1.3e9 values) in seconds instead of most of a call's time.
  auto fill = [&](std::vector<bf16>& b, std::vector<float>& f, size_t n, float scale, uint64_t tensor) {
    b.resize(n);
    f.resize(n);
    const size_t chunk = size_t(1) << 20, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic)
    for (size_t c = 0; c < chunks; ++c) {
      std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + tensor * 1000003ull + c);
      std::normal_distribution<float> normal(0.f, 1.f);
      for (size_t e = c * chunk; e < std::min(n, (c + 1) * chunk); ++e) {
        b[e] = __float2bfloat16(normal(rng) * scale);
        f[e] = __bfloat162float(b[e]);
      }
    }
  };
  fill(in.q, in.qf, size_t(N * P.H * P.D), P.q_scale, 0);
  fill(in.k, in.kf, size_t(N * P.KV * P.D), 1.f, 1);
  fill(in.v, in.vf, size_t(N * P.KV * P.D), 1.f, 2);
  fill(in.dout, in.doutf, size_t(N * P.H * P.D), 1.f, 3);
  return in;
}

Device upload(const Problem& P, const Inputs& in) {
  Device d;
  const size_t nq = size_t(P.N * P.H * P.D), nk = size_t(P.N * P.KV * P.D);
  d.q = dev_alloc<bf16>(nq, d.bytes);
  d.k = dev_alloc<bf16>(nk, d.bytes);
  d.v = dev_alloc<bf16>(nk, d.bytes);
  d.dout = dev_alloc<bf16>(nq, d.bytes);
  d.out = dev_alloc<bf16>(nq, d.bytes);
  d.dq = dev_alloc<bf16>(nq, d.bytes);
  d.dk = dev_alloc<bf16>(nk, d.bytes);
  d.dv = dev_alloc<bf16>(nk, d.bytes);
  d.lse = dev_alloc<float>(size_t(P.N * P.H), d.bytes);
  d.delta = dev_alloc<float>(sc::attention_backward_scratch_bytes(P.N, P.H, P.KV, P.D) /
                                 sizeof(float), d.bytes);
  d.seq_id = dev_alloc<int32_t>(size_t(P.N), d.bytes);
  d.doc_start = dev_alloc<int32_t>(size_t(P.N), d.bytes);
  CHECK_CUDA(cudaMemcpy(d.q, in.q.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.k, in.k.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.v, in.v.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.dout, in.dout.data(), nq * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d.seq_id, in.seq_id.data(), size_t(P.N) * 4, cudaMemcpyHostToDevice));
  return d;
}

void release(Device& d) {
  for (void* p : {(void*)d.q, (void*)d.k, (void*)d.v, (void*)d.dout, (void*)d.out, (void*)d.dq,
                  (void*)d.dk, (void*)d.dv, (void*)d.lse, (void*)d.delta, (void*)d.seq_id,
                  (void*)d.doc_start})
    CHECK_CUDA(cudaFree(p));
}

// NaN bits everywhere an output goes (bf16 0xFFFF, fp32 0xFFFFFFFF), and in the
// scratch, so a read of something never written shows.
void poison(const Problem& P, const Device& d) {
  const size_t nq = size_t(P.N * P.H * P.D), nk = size_t(P.N * P.KV * P.D);
  CHECK_CUDA(cudaMemset(d.out, 0xFF, nq * 2));
  CHECK_CUDA(cudaMemset(d.dq, 0xFF, nq * 2));
  CHECK_CUDA(cudaMemset(d.dk, 0xFF, nk * 2));
  CHECK_CUDA(cudaMemset(d.dv, 0xFF, nk * 2));
  CHECK_CUDA(cudaMemset(d.lse, 0xFF, size_t(P.N * P.H) * 4));
  CHECK_CUDA(cudaMemset(d.delta, 0xFF, size_t(P.N * P.H) * 4));
  CHECK_CUDA(cudaMemset(d.doc_start, 0xFF, size_t(P.N) * 4));
}

void refused(const char* pass) {
  ++g_checks;
  ++g_failures;
  std::printf("  FAIL: cuDNN refused the %s shape: %s\n", pass, g_sdpa->last_plan_note().c_str());
}
void forward(const Problem& P, const Device& d) {
  if (g_sdpa) {
    if (!g_sdpa->forward(d.out, d.lse, d.q, d.k, d.v)) refused("forward");
    return;
  }
  sc::attention_forward(d.out, d.lse, d.q, d.k, d.v, d.seq_id, d.doc_start, P.N, P.H, P.KV,
                        P.D, 0);
}
void backward(const Problem& P, const Device& d) {
  if (g_sdpa) {
    if (!g_sdpa->backward(d.dq, d.dk, d.dv, d.dout, d.q, d.k, d.v, d.out, d.lse, g_sdpa_buffers))
      refused("backward");
    return;
  }
  sc::attention_backward(d.dq, d.dk, d.dv, d.dout, d.q, d.k, d.v, d.out, d.lse, d.seq_id,
                         d.doc_start, d.delta, P.N, P.H, P.KV, P.D, 0);
}

Outputs download(const Problem& P, const Device& d) {
  Outputs o;
  const size_t nq = size_t(P.N * P.H * P.D), nk = size_t(P.N * P.KV * P.D);
  o.out.resize(nq);
  o.dq.resize(nq);
  o.dk.resize(nk);
  o.dv.resize(nk);
  o.lse.resize(size_t(P.N * P.H));
  CHECK_CUDA(cudaMemcpy(o.out.data(), d.out, nq * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o.dq.data(), d.dq, nq * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o.dk.data(), d.dk, nk * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o.dv.data(), d.dv, nk * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o.lse.data(), d.lse, o.lse.size() * 4, cudaMemcpyDeviceToHost));
  return o;
}

// ---------------------------------------------------------------- reference (double)

double dot(const float* a, const float* b, int64_t D) {
  double s = 0;
  for (int64_t d = 0; d < D; ++d) s += double(a[d]) * double(b[d]);
  return s;
}

// out[i, h, :] and lse[i, h] (two passes, like cpu::attention_forward).
void ref_forward_row(const Problem& P, const Inputs& in, int64_t i, int64_t h, double* out_row,
                     double* lse) {
  const int64_t D = P.D, g = h / (P.H / P.KV);
  const double scale = 1.0 / std::sqrt(double(D));
  const float* qi = &in.qf[size_t((i * P.H + h) * D)];
  double m = -INFINITY;
  for (int64_t j = in.doc_start[i]; j <= i; ++j)
    m = std::max(m, dot(qi, &in.kf[size_t((j * P.KV + g) * D)], D) * scale);
  double l = 0;
  for (int64_t j = in.doc_start[i]; j <= i; ++j)
    l += std::exp(dot(qi, &in.kf[size_t((j * P.KV + g) * D)], D) * scale - m);
  *lse = m + std::log(l);
  std::fill(out_row, out_row + D, 0.0);
  for (int64_t j = in.doc_start[i]; j <= i; ++j) {
    const double p = std::exp(dot(qi, &in.kf[size_t((j * P.KV + g) * D)], D) * scale - *lse);
    const float* vj = &in.vf[size_t((j * P.KV + g) * D)];
    for (int64_t d = 0; d < D; ++d) out_row[d] += p * vj[d];
  }
}

// dq[i, h, :] from the given out (as float) and lse.
void ref_dq_row(const Problem& P, const Inputs& in, const std::vector<float>& outf,
                const std::vector<float>& lse, int64_t i, int64_t h, double* dq_row) {
  const int64_t D = P.D, g = h / (P.H / P.KV);
  const double scale = 1.0 / std::sqrt(double(D));
  const size_t ih = size_t(i * P.H + h);
  const float* qi = &in.qf[ih * D];
  const float* doi = &in.doutf[ih * D];
  const double delta = dot(doi, &outf[ih * D], D);
  std::fill(dq_row, dq_row + D, 0.0);
  for (int64_t j = in.doc_start[i]; j <= i; ++j) {
    const float* kj = &in.kf[size_t((j * P.KV + g) * D)];
    const double p = std::exp(dot(qi, kj, D) * scale - lse[ih]);
    const double ds = p * (dot(doi, &in.vf[size_t((j * P.KV + g) * D)], D) - delta);
    for (int64_t d = 0; d < D; ++d) dq_row[d] += ds * scale * kj[d];
  }
}

// dk[j, g, :], dv[j, g, :] summed over queries of j's document and the group's heads.
void ref_dkdv_row(const Problem& P, const Inputs& in, const std::vector<float>& outf,
                  const std::vector<float>& lse, int64_t j, int64_t g, double* dk_row,
                  double* dv_row) {
  const int64_t D = P.D, group = P.H / P.KV;
  const double scale = 1.0 / std::sqrt(double(D));
  const float* kj = &in.kf[size_t((j * P.KV + g) * D)];
  const float* vj = &in.vf[size_t((j * P.KV + g) * D)];
  std::fill(dk_row, dk_row + D, 0.0);
  std::fill(dv_row, dv_row + D, 0.0);
  for (int64_t i = j; i < in.doc_end[j]; ++i)
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const size_t ih = size_t(i * P.H + h);
      const float* qi = &in.qf[ih * D];
      const float* doi = &in.doutf[ih * D];
      const double delta = dot(doi, &outf[ih * D], D);
      const double p = std::exp(dot(qi, kj, D) * scale - lse[ih]);
      const double ds = p * (dot(doi, vj, D) - delta);
      for (int64_t d = 0; d < D; ++d) {
        dv_row[d] += p * doi[d];
        dk_row[d] += ds * scale * qi[d];
      }
    }
}

// ---------------------------------------------------------------- checks

struct Err {
  double se = 0, sr = 0, max_abs = 0;
  int64_t worst = -1, nonfinite = 0, count = 0;
  double worst_got = 0, worst_ref = 0;
  void add(double got, double ref, int64_t idx) {
    if (!std::isfinite(got)) {
      if (nonfinite++ == 0) worst = idx, worst_got = got, worst_ref = ref;
      return;
    }
    const double e = got - ref;
    ++count;
    se += e * e;
    sr += ref * ref;
    if (std::fabs(e) > max_abs && nonfinite == 0)
      max_abs = std::fabs(e), worst = idx, worst_got = got, worst_ref = ref;
  }
  double rel() const {
    return nonfinite ? INFINITY : std::sqrt(se / std::max(sr, 1e-4 * double(count) + 1e-300));
  }
};

// Rows to check: all, or `count` spread over [0, n) with both ends and document
// edges (first and last token of the first documents) included.
std::vector<int64_t> pick_rows(int64_t n, int count, const Inputs& in, uint64_t seed) {
  std::vector<int64_t> rows;
  if (count == 0 || count >= n) {
    for (int64_t i = 0; i < n; ++i) rows.push_back(i);
    return rows;
  }
  rows = {0, n - 1};
  for (int64_t i = 1; i < n && int(rows.size()) < count / 2; ++i)
    if (in.seq_id[i] != in.seq_id[i - 1]) rows.push_back(i), rows.push_back(i - 1);
  std::mt19937_64 rng(seed);
  while (int(rows.size()) < count) rows.push_back(int64_t(rng() % uint64_t(n)));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

void report(const char* what, const std::string& label, const Err& e, double tol, bool abs_err,
            int64_t D) {
  const double val = abs_err ? e.max_abs : e.rel();
  const bool ok = e.nonfinite == 0 && val <= tol;
  ++g_checks;
  if (!ok) ++g_failures;
  std::printf("  %-4s %-10s rel_l2 %.2e  max_abs %.2e  %s", what, ok ? "ok" : "FAIL", e.rel(),
              e.max_abs, ok ? "" : "<-- ");
  if (!ok && e.worst >= 0)
    std::printf("worst elem %lld (row %lld, col %lld): got %.5g ref %.5g, nonfinite %lld",
                (long long)e.worst, (long long)(e.worst / D), (long long)(e.worst % D),
                e.worst_got, e.worst_ref, (long long)e.nonfinite);
  std::printf("%s\n", label.c_str());
}

// Every element of every output finite (outputs were poisoned with NaN).
int64_t count_nonfinite(const Outputs& o) {
  int64_t bad = 0;
  for (auto* vec : {&o.out, &o.dq, &o.dk, &o.dv})
    for (bf16 x : *vec) bad += !std::isfinite(__bfloat162float(x));
  for (float x : o.lse) bad += !std::isfinite(x);
  return bad;
}

void check(const Problem& P, const Inputs& in, const Outputs& o, uint64_t seed) {
  const int64_t D = P.D;
  const int64_t bad = count_nonfinite(o);
  ++g_checks;
  if (bad) {
    ++g_failures;
    std::printf("  FAIL: %lld output elements not finite (unwritten or NaN)\n", (long long)bad);
  }
  std::vector<float> outf(o.out.size());
  for (size_t e = 0; e < outf.size(); ++e) outf[e] = __bfloat162float(o.out[e]);

  // Forward and dq on query rows (every head).
  const auto qrows = pick_rows(P.N, P.sample, in, seed);
  const int64_t nqr = int64_t(qrows.size()) * P.H;
  std::vector<double> ref_out(static_cast<size_t>(nqr * D)), ref_lse(static_cast<size_t>(nqr)),
      ref_dq(static_cast<size_t>(nqr * D));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < nqr; ++r) {
    const int64_t i = qrows[size_t(r / P.H)], h = r % P.H;
    ref_forward_row(P, in, i, h, &ref_out[size_t(r * D)], &ref_lse[size_t(r)]);
    ref_dq_row(P, in, outf, o.lse, i, h, &ref_dq[size_t(r * D)]);
  }
  Err e_out, e_lse, e_dq;
  for (int64_t r = 0; r < nqr; ++r) {
    const int64_t ih = qrows[size_t(r / P.H)] * P.H + r % P.H;
    e_lse.add(o.lse[size_t(ih)], ref_lse[size_t(r)], ih * D);
    for (int64_t d = 0; d < D; ++d) {
      e_out.add(__bfloat162float(o.out[size_t(ih * D + d)]), ref_out[size_t(r * D + d)], ih * D + d);
      e_dq.add(__bfloat162float(o.dq[size_t(ih * D + d)]), ref_dq[size_t(r * D + d)], ih * D + d);
    }
  }

  // dk, dv on key rows (every kv head).
  const auto krows = pick_rows(P.N, P.sample, in, seed + 1);
  const int64_t nkr = int64_t(krows.size()) * P.KV;
  std::vector<double> ref_dk(static_cast<size_t>(nkr * D)), ref_dv(static_cast<size_t>(nkr * D));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < nkr; ++r)
    ref_dkdv_row(P, in, outf, o.lse, krows[size_t(r / P.KV)], r % P.KV, &ref_dk[size_t(r * D)],
                 &ref_dv[size_t(r * D)]);
  Err e_dk, e_dv;
  for (int64_t r = 0; r < nkr; ++r) {
    const int64_t jg = krows[size_t(r / P.KV)] * P.KV + r % P.KV;
    for (int64_t d = 0; d < D; ++d) {
      e_dk.add(__bfloat162float(o.dk[size_t(jg * D + d)]), ref_dk[size_t(r * D + d)], jg * D + d);
      e_dv.add(__bfloat162float(o.dv[size_t(jg * D + d)]), ref_dv[size_t(r * D + d)], jg * D + d);
    }
  }
  const std::string rows_label = P.sample ? "  (" + std::to_string(qrows.size()) + " sampled rows)" : "";
  report("out", rows_label, e_out, kTolOut, false, D);
  report("lse", "", e_lse, kTolLse, true, D);
  report("dq", "", e_dq, kTolGrad, false, D);
  report("dk", "", e_dk, kTolGrad, false, D);
  report("dv", "", e_dv, kTolGrad, false, D);
}

// ---------------------------------------------------------------- timing

template <class F>
double median_ms(F&& f, int reps = 20) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int w = 0; w < 3; ++w) f();
  std::vector<float> ms(static_cast<size_t>(reps));
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(a, 0));
    f();
    CHECK_CUDA(cudaEventRecord(b, 0));
    CHECK_CUDA(cudaEventSynchronize(b));
    CHECK_CUDA(cudaEventElapsedTime(&ms[size_t(r)], a, b));
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Timing {
  std::string name, kernel;
  double fwd_ms, bwd_ms, fwd_tflops, bwd_tflops;
};
std::vector<Timing> g_timings;

// Causal FLOPs of the useful work: 4 * L^2 * H * D / 2 per document of L tokens
// (forward); backward counts 2.5 times that.
double causal_flops(const Problem& P) {
  double f = 0;
  for (int L : P.doc_lens) f += 4.0 * double(L) * double(L) * double(P.H) * double(P.D) / 2.0;
  return f;
}

// ---------------------------------------------------------------- cases

struct RunOpts {
  std::vector<sc::AttentionKernel> kernels{sc::AttentionKernel::kAuto};
  bool time_it = false;
  bool determinism = false;
  bool memory = false;
  bool cudnn = false;  // also run cuDNN's attention on the case (when it loads)
  // false: a timing case only. The float64 reference of dk/dv needs every query's
  // softmax, O(N^2 H D): at 131K tokens hours of this host's cores.
  bool check_outputs = true;
};
bool g_cudnn_ok = false;  // cudnn_sdpa_available() at start-up

const char* kernel_label(sc::AttentionKernel k) {
  switch (k) {
    case sc::AttentionKernel::kAuto: return "auto";
    case sc::AttentionKernel::kGeneric: return "generic";
    case sc::AttentionKernel::kVariant1: return "variant1";
    case sc::AttentionKernel::kVariant2: return "variant2";
    case sc::AttentionKernel::kVariant3: return "variant3";
    case sc::AttentionKernel::kVariant4: return "variant4";
  }
  return "?";
}

void run_case(const Problem& P, const RunOpts& opt, uint64_t seed) {
  const Inputs in = make_inputs(P, seed);
  Device d = upload(P, in);
  // The kernels to run: shardlm's (each of opt.kernels), then cuDNN's (kernel index -1).
  std::vector<int> runs;
  for (size_t r = 0; r < opt.kernels.size(); ++r) runs.push_back(int(r));
  if (opt.cudnn && g_cudnn_ok) runs.push_back(-1);
  void* sdpa_workspace = nullptr;
  std::unique_ptr<sc::CudnnSdpa> sdpa;
  for (int run : runs) {
    const bool cudnn = run < 0;
    const sc::AttentionKernel kern = cudnn ? sc::AttentionKernel::kAuto : opt.kernels[size_t(run)];
    sc::attention_set_kernel(kern);
    if (cudnn) {
      CHECK_CUDA(cudaMalloc(&sdpa_workspace, sc::CudnnSdpa::workspace_bytes(P.N, P.H, P.KV, P.D)));
      sdpa = std::make_unique<sc::CudnnSdpa>(
          P.N, P.H, P.KV, P.D,
          static_cast<char*>(sdpa_workspace) + sc::CudnnSdpa::backward_buffer_bytes(P.N, P.H, P.KV, P.D),
          cudaStream_t(0));
      g_sdpa_buffers = sdpa_workspace;
      sdpa->set_documents(in.seq_id.data(), P.N);
      g_sdpa = sdpa.get();
    }
    const char* label = cudnn ? "cudnn" : kernel_label(kern);
    std::printf("%s  N=%lld H=%lld KV=%lld D=%lld docs=%zu  [%s: %s]\n", P.name.c_str(),
                (long long)P.N, (long long)P.H, (long long)P.KV, (long long)P.D,
                P.doc_lens.size(), label, cudnn ? sc::cudnn_sdpa_version().c_str() : sc::attention_kernel_name(P.D));
    std::fflush(stdout);
    size_t free_before = 0, free_after = 0, total = 0;
    if (cudnn) {  // build the plans first: their one-time device memory is cuDNN's, not per call
      forward(P, d);
      backward(P, d);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemGetInfo(&free_before, &total));
    poison(P, d);
    forward(P, d);
    backward(P, d);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemGetInfo(&free_after, &total));
    const Outputs o = download(P, d);
    if (opt.check_outputs) check(P, in, o, seed * 31 + uint64_t(kern));
    else std::printf("  not checked against the reference (a timing case; the same graph is checked at 32K)\n");
    if (cudnn) std::printf("  plan %s\n", sdpa->last_plan_note().c_str());
    if (opt.memory) {
      const bool ok = free_after == free_before;
      ++g_checks;
      if (!ok) ++g_failures;
      std::printf("  mem  %-10s all buffers %.1f MiB (inputs, outputs, lse, delta, doc_start; "
                  "an N x N fp32 score matrix per head would be %.1f GiB); free memory %s "
                  "across forward + backward\n",
                  ok ? "ok" : "FAIL", double(d.bytes) / (1 << 20),
                  double(P.N) * double(P.N) * 4.0 / (1 << 30),
                  ok ? "unchanged" : "CHANGED");
    }
    if (cudnn) {
      // cuDNN's forward must be bitwise reproducible; its backward sums dq with
      // atomics on Hopper (why run.deterministic keeps shardlm's kernels): reported.
      poison(P, d);
      forward(P, d);
      backward(P, d);
      CHECK_CUDA(cudaDeviceSynchronize());
      const Outputs again = download(P, d);
      const bool fwd_same = same_bits(again.out, o.out) && same_bits(again.lse, o.lse);
      ++g_checks;
      if (!fwd_same) ++g_failures;
      std::printf("  det  %-10s forward rerun %s; backward rerun %s (not required)\n", fwd_same ? "ok" : "FAIL",
                  fwd_same ? "bitwise equal" : "DIFFERS",
                  same_bits(again.dq, o.dq) && same_bits(again.dk, o.dk) && same_bits(again.dv, o.dv)
                      ? "bitwise equal"
                      : "differs");
    }
    if (opt.determinism && !cudnn) {
      poison(P, d);
      forward(P, d);
      backward(P, d);
      CHECK_CUDA(cudaDeviceSynchronize());
      const bool same = download(P, d) == o;
      ++g_checks;
      if (!same) ++g_failures;
      std::printf("  det  %-10s second run %s\n", same ? "ok" : "FAIL",
                  same ? "bitwise equal" : "DIFFERS");
    }
    if (opt.time_it) {
      const double fwd = median_ms([&] { forward(P, d); });
      const double bwd = median_ms([&] { backward(P, d); });
      CHECK_CUDA(cudaGetLastError());
      const double flops = causal_flops(P);
      Timing t{P.name, label, fwd, bwd, flops / (fwd * 1e9), 2.5 * flops / (bwd * 1e9)};
      std::printf("  time fwd %.3f ms %.1f TFLOP/s | bwd %.3f ms %.1f TFLOP/s\n", fwd,
                  t.fwd_tflops, bwd, t.bwd_tflops);
      g_timings.push_back(t);
    }
    std::fflush(stdout);
    if (cudnn) {
      g_sdpa = nullptr;
      sdpa.reset();
      CHECK_CUDA(cudaFree(sdpa_workspace));
    }
  }
  sc::attention_set_kernel(sc::AttentionKernel::kAuto);
  release(d);
}

// The doc_start scan on its own, over a length that spans several scan chunks
// (8192 tokens each) with a document that crosses chunk edges.
void check_doc_start() {
  const int64_t N = 20000;
  std::vector<int32_t> seq(N), want(N), got(N);
  std::mt19937_64 rng(7);
  int32_t id = 0;
  for (int64_t i = 0; i < N; ++i) {
    // Long documents around the chunk edges, short ones elsewhere.
    const bool long_doc = (i > 5000 && i < 17000);
    if (i > 0 && !long_doc && rng() % 13 == 0) ++id;
    if (i == 5001 || i == 17000) ++id;
    seq[i] = id;
    want[i] = (i > 0 && seq[i] == seq[i - 1]) ? want[i - 1] : int32_t(i);
  }
  int32_t *d_seq = nullptr, *d_ds = nullptr;
  CHECK_CUDA(cudaMalloc(&d_seq, N * 4));
  CHECK_CUDA(cudaMalloc(&d_ds, N * 4));
  CHECK_CUDA(cudaMemcpy(d_seq, seq.data(), N * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(d_ds, 0xFF, N * 4));
  sc::attention_doc_start(d_ds, d_seq, N, 0);
  CHECK_CUDA(cudaMemcpy(got.data(), d_ds, N * 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < N; ++i)
    if (got[i] != want[i]) bad++, first = first < 0 ? i : first;
  ++g_checks;
  if (bad) ++g_failures;
  std::printf("doc_start scan N=%lld: %s", (long long)N, bad ? "FAIL" : "ok");
  if (bad)
    std::printf(" (%lld wrong, first at %lld: got %d want %d)", (long long)bad, (long long)first,
                got[first], want[first]);
  std::printf("\n");
  CHECK_CUDA(cudaFree(d_seq));
  CHECK_CUDA(cudaFree(d_ds));
}

std::vector<int> equal_docs(int count, int len) { return std::vector<int>(size_t(count), len); }

std::vector<int> random_docs(int64_t N, int max_len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> docs;
  int64_t left = N;
  while (left > 0) {
    const int len = int(std::min<int64_t>(left, 1 + int64_t(rng() % uint64_t(max_len))));
    docs.push_back(len);
    left -= len;
  }
  return docs;
}

}  // namespace

int main(int argc, char** argv) {
  // Groups: tiny (every row checked), race (two tiny cases, for racecheck), big
  // (1B shape, sampled rows, timing), long (32k tokens), cudnn (cuDNN's attention on
  // the tiny shapes), cmp (shardlm vs cuDNN at the benchmark shapes, timed), profile
  // (one forward and backward of the 1B and long shapes, unchecked, for ncu).
  // Default: tiny, big, long, cudnn.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a case killed by a time limit still shows where it was
  std::string only = "all";
  for (int a = 1; a + 1 < argc; ++a)
    if (std::string(argv[a]) == "--only") only = argv[a + 1];
  auto want = [&](const std::string& group) {
    return only == group ||
           (only == "all" && group != "race" && group != "profile" && group != "cmp" && group != "cmp131k");
  };
  int dev = 0;
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs, cc %d.%d; OpenMP threads %d; group %s\n", prop.name,
              prop.multiProcessorCount, prop.major, prop.minor, omp_get_max_threads(),
              only.c_str());
  std::string why;
  g_cudnn_ok = sc::cudnn_sdpa_available(&why);
  std::printf("cuDNN attention: %s\n", g_cudnn_ok ? sc::cudnn_sdpa_version().c_str() : why.c_str());
  using K = sc::AttentionKernel;
  const std::vector<K> all_mma{K::kAuto, K::kVariant1, K::kVariant2, K::kVariant3, K::kVariant4};
  std::vector<K> all = all_mma;
  all.push_back(K::kGeneric);
  uint64_t seed = 1000;

  if (want("race")) {
    run_case({"race D64", 138, 4, 2, 64, {1, 7, 130}}, {all_mma}, ++seed);
    run_case({"race D128", 150, 2, 1, 128, {20, 130}}, {all_mma}, ++seed);
  }
  if (want("tiny")) {
    check_doc_start();
    // Tiny and odd shapes: every row checked.
    run_case({"docs 1,7,130 GQA 4:1 D64", 138, 8, 2, 64, {1, 7, 130}}, {all}, ++seed);
    run_case({"docs 1,7,130 MHA D128", 138, 2, 2, 128, {1, 7, 130}}, {all}, ++seed);
    run_case({"docs 1,7,130 GQA 4:1 D32", 138, 4, 1, 32, {1, 7, 130}}, {all}, ++seed);
    run_case({"docs 1,7,130 GQA 2:1 D16 (generic)", 138, 4, 2, 16, {1, 7, 130}}, {}, ++seed);
    run_case({"docs 60,140 D80 (generic)", 200, 2, 1, 80, {60, 140}}, {}, ++seed);
    run_case({"one token", 1, 2, 1, 64, {1}}, {{K::kAuto, K::kGeneric}}, ++seed);
    run_case({"docs 100,1,50,182 GQA 2:1 D64 sharp q*4", 333, 4, 2, 64, {100, 1, 50, 182}, 4.f},
             {all}, ++seed);
    run_case({"one doc N=1000 GQA 4:1 D128", 1000, 4, 1, 128, {1000}}, {all_mma}, ++seed);
    run_case({"random docs <=40 N=700 D64", 700, 4, 2, 64, random_docs(700, 40, 5)}, {all},
             ++seed);
    run_case({"random docs <=300 N=1500 D128", 1500, 4, 2, 128, random_docs(1500, 300, 6)},
             {all_mma}, ++seed);
  }
  if (want("big")) {
    // The Llama-3.2-1B attention shape (and D = 128): sampled rows, determinism, timing.
    RunOpts big{all_mma, true, true, false};
    run_case({"1B 1 doc", 4096, 32, 8, 64, {4096}, 1.f, 96}, big, ++seed);
    run_case({"1B 8 docs x 512", 4096, 32, 8, 64, equal_docs(8, 512), 1.f, 96}, big, ++seed);
    run_case({"D128 1 doc", 4096, 32, 8, 128, {4096}, 1.f, 64}, big, ++seed);
    run_case({"D128 8 docs x 512", 4096, 32, 8, 128, equal_docs(8, 512), 1.f, 64}, big, ++seed);
  }
  if (want("cudnn") && g_cudnn_ok) {
    // cuDNN's attention (cuda/sdpa.hpp) on tiny and odd shapes, every row checked:
    // documents of 1 token, padding entries (3 documents run as a batch of 4),
    // MHA and GQA, D 32 / 64 / 128.
    const RunOpts c{{}, false, false, false, true};
    run_case({"docs 1,7,130 GQA 4:1 D64", 138, 8, 2, 64, {1, 7, 130}}, c, ++seed);
    run_case({"docs 1,7,130 MHA D128", 138, 2, 2, 128, {1, 7, 130}}, c, ++seed);
    run_case({"docs 1,7,130 GQA 4:1 D32", 138, 4, 1, 32, {1, 7, 130}}, c, ++seed);
    run_case({"one token", 1, 2, 1, 64, {1}}, c, ++seed);
    run_case({"docs 100,1,50,182 GQA 2:1 D64 sharp q*4", 333, 4, 2, 64, {100, 1, 50, 182}, 4.f}, c, ++seed);
    run_case({"one doc N=1000 GQA 4:1 D128", 1000, 4, 1, 128, {1000}}, c, ++seed);
    run_case({"random docs <=40 N=700 D64", 700, 4, 2, 64, random_docs(700, 40, 5)}, c, ++seed);
    run_case({"random docs <=300 N=1500 D128", 1500, 4, 2, 128, random_docs(1500, 300, 6)}, c, ++seed);
  }
  if (want("cmp")) {
    // The shapes of docs/benchmarks.md's attention table (GQA 32:8): shardlm's
    // kernels and cuDNN's, checked on sampled rows and timed in the same run.
    const RunOpts t{{K::kAuto}, true, false, false, true};
    const RunOpts tm{{K::kAuto}, true, false, true, true};
    run_case({"N4096 D64", 4096, 32, 8, 64, {4096}, 1.f, 48}, t, ++seed);
    run_case({"N4096 D128", 4096, 32, 8, 128, {4096}, 1.f, 48}, t, ++seed);
    run_case({"N4096 D64 8x512", 4096, 32, 8, 64, equal_docs(8, 512), 1.f, 48}, t, ++seed);
    run_case({"N4096 D128 8x512", 4096, 32, 8, 128, equal_docs(8, 512), 1.f, 48}, t, ++seed);
    run_case({"N4096 D128 mixed", 4096, 32, 8, 128, random_docs(4096, 1500, 9), 1.f, 48}, t, ++seed);
    run_case({"N32768 D64", 32768, 32, 8, 64, {32768}, 1.f, 12}, tm, ++seed);
    run_case({"N32768 D128", 32768, 32, 8, 128, {32768}, 1.f, 12}, tm, ++seed);
    run_case({"N32768 D128 64x512", 32768, 32, 8, 128, equal_docs(64, 512), 1.f, 12}, t, ++seed);
    // packing against the same documents run alone: 8 x 512 vs one document of 512
    run_case({"N512 D128", 512, 32, 8, 128, {512}, 1.f, 48}, t, ++seed);
  }
  if (want("cmp") || want("cmp131k")) {
    // 131K tokens: cuDNN only (shardlm's kernels take 2.4 s a pass here; measured
    // 274.6 / 187.3 TFLOP/s on the H200, docs/benchmarks.md).
    RunOpts tm_cudnn{{}, true, false, true, true};
    tm_cudnn.check_outputs = !want("cmp131k");  // cmp131k: the timing alone
    run_case({"N131072 D128", 131072, 32, 8, 128, {131072}, 1.f, 4}, tm_cudnn, ++seed);
  }
  if (want("profile")) {
    for (const Problem& P : {Problem{"1B 1 doc", 4096, 32, 8, 64, {4096}},
                             Problem{"long D128", 32768, 16, 8, 128, {32768}}}) {
      const Inputs in = make_inputs(P, ++seed);
      Device d = upload(P, in);
      for (K kern : {K::kAuto, K::kVariant1}) {
        sc::attention_set_kernel(kern);
        forward(P, d);
        backward(P, d);
      }
      sc::attention_set_kernel(K::kAuto);
      CHECK_CUDA(cudaDeviceSynchronize());
      release(d);
    }
  }
  if (want("long")) {
    // Long sequences: O(N) memory, determinism, timing.
    RunOpts long_opt{{K::kAuto}, true, true, true};
    run_case({"long D64", 32768, 16, 8, 64, {32768}, 1.f, 24}, long_opt, ++seed);
    run_case({"long D128", 32768, 16, 8, 128, {32768}, 1.f, 24}, long_opt, ++seed);
    RunOpts long_docs{{K::kAuto}, true, false, false};
    run_case({"long D64 64 docs x 512", 32768, 16, 8, 64, equal_docs(64, 512), 1.f, 24},
             long_docs, ++seed);
  }

  if (g_timings.empty()) {
    std::printf("\n%d passed, %d failed\n", g_checks - g_failures, g_failures);
    return g_failures ? 1 : 0;
  }
  std::printf("\nperformance (median of 20, cudaEvents; causal FLOPs of the documents: fwd "
              "4*L^2*H*D/2 per doc, bwd 2.5x; peak %.0f TFLOP/s)\n", kPeakTflops);
  std::printf("%-24s %-9s %9s %9s %6s %9s %9s %6s\n", "case", "kernel", "fwd ms", "TFLOP/s",
              "%peak", "bwd ms", "TFLOP/s", "%peak");
  for (const Timing& t : g_timings)
    std::printf("%-24s %-9s %9.3f %9.1f %5.1f%% %9.3f %9.1f %5.1f%%\n", t.name.c_str(),
                t.kernel.c_str(), t.fwd_ms, t.fwd_tflops, 100 * t.fwd_tflops / kPeakTflops,
                t.bwd_ms, t.bwd_tflops, 100 * t.bwd_tflops / kPeakTflops);
  std::printf("\n%d passed, %d failed\n", g_checks - g_failures, g_failures);
  return g_failures ? 1 : 0;
}
