// test_cuda_ops.cu — the CUDA kernels (cuda/ops.hpp, cuda/optim_kernels.hpp) and the cuBLASLt GEMMs
// (cuda/gemm.hpp) against the CPU reference kernels (cpu/ops.hpp, in fp32 on the same
// bf16-rounded inputs) on fresh random inputs, at tiny odd sizes and at the
// Llama-3.2-1B shapes; determinism (two runs, bitwise equal); then timings of every
// kernel at the 1B shapes. One line per check: name, ||gpu - ref|| / ||ref||,
// threshold, PASS/FAIL. Returns non-zero on any failure. tests/gpu/README.md says
// how to build and run it and why each threshold is what it is.
//
// Usage: test_cuda_ops [--seed N] [--no-timing]
#include <cblas.h>  // tests/gpu/cblas_shim: the naive CBLAS defined below
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/ops.hpp"
#include "cuda/gemm.hpp"
#include "cuda/ops.hpp"
#include "cuda/optim_kernels.hpp"

namespace {

namespace cpu = shardlm::cpu;
namespace gpu = shardlm::cuda;
using bf16 = __nv_bfloat16;
using shardlm::fmt;

// ---------------------------------------------------------------- naive CBLAS

// src/cpu/ops.cpp calls cblas_{s,d}gemm; the test links no BLAS library, so the
// calls land here. Only row-major is needed.
template <class T>
void naive_gemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K,
                T alpha, const T* A, int lda, const T* B, int ldb, T beta, T* C, int ldc) {
  if (order != CblasRowMajor) {
    std::fprintf(stderr, "cblas shim: only row-major is implemented\n");
    std::abort();
  }
#pragma omp parallel for schedule(static)
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      T s = 0;
      for (int k = 0; k < K; ++k)
        s += (ta == CblasNoTrans ? A[int64_t(i) * lda + k] : A[int64_t(k) * lda + i]) *
             (tb == CblasNoTrans ? B[int64_t(k) * ldb + j] : B[int64_t(j) * ldb + k]);
      T& c = C[int64_t(i) * ldc + j];
      c = alpha * s + (beta == T(0) ? T(0) : beta * c);
    }
}

}  // namespace

extern "C" void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M,
                            int N, int K, float alpha, const float* A, int lda, const float* B,
                            int ldb, float beta, float* C, int ldc) {
  naive_gemm<float>(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
extern "C" void cblas_dgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M,
                            int N, int K, double alpha, const double* A, int lda,
                            const double* B, int ldb, double beta, double* C, int ldc) {
  naive_gemm<double>(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

namespace {

// ---------------------------------------------------------------- thresholds

// ||gpu - ref|| / ||ref|| limits; the reasons are in tests/gpu/README.md.
constexpr double kTolBf16Out = 1e-2;   // a bf16-rounded output (expected ~1.5e-3)
constexpr double kTolF32Acc = 1e-5;    // fp32 sums in another order (expected ~1e-7)
constexpr double kTolF32Stat = 1e-5;   // rstd: fp32 vs the CPU's double-then-float sum
constexpr double kTolLoss = 1e-4;      // per-row CE loss (expected ~1e-6)
constexpr double kTolGemmF32 = 1e-4;   // bf16 products, fp32 accumulation, fp32 out
constexpr double kTolDouble = 1e-12;   // double sums in another order
constexpr double kExact = 0.0;         // bitwise-identical by construction

// Peak numbers the timings are compared with (measured on the H100 of this
// workplace: device-to-device copy, 8192^3 bf16 GEMM).
constexpr double kPeakGBs = 3000.0;
constexpr double kPeakTflops = 800.0;

// ---------------------------------------------------------------- report

struct Report {
  int passed = 0, failed = 0;
  void line(const std::string& name, double rel, double thr, bool ok, const std::string& note) {
    std::printf("%-66s %10.3e %9.1e  %s%s%s\n", name.c_str(), rel, thr, ok ? "PASS" : "FAIL",
                note.empty() ? "" : "  ", note.c_str());
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
  // rel <= thr and every element finite (a NaN left from the poison is unwritten).
  void check(const std::string& name, double rel, double thr, int64_t nonfinite = 0) {
    const bool ok = std::isfinite(rel) && rel <= thr && nonfinite == 0;
    line(name, rel, thr, ok, nonfinite ? fmt("(%lld non-finite: unwritten or NaN)", (long long)nonfinite) : "");
  }
  void check_true(const std::string& name, bool ok, const std::string& why = "") {
    line(name, ok ? 0.0 : 1.0, 0.0, ok, ok ? "" : why);
  }
} report;

// ---------------------------------------------------------------- random inputs

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
double unit(uint64_t h) { return (double(h >> 11) + 0.5) * 0x1.0p-53; }  // (0, 1)

// Counter-based, so the large arrays fill in parallel and the same seed gives the
// same inputs at any thread count.
struct Rng {
  uint64_t seed;
  uint64_t streams = 0;
  uint64_t next() { return splitmix64(seed ^ splitmix64(++streams * 0x632be59bd9b4e019ull)); }

  std::vector<float> normal(int64_t n, double sigma, double mean = 0.0) {
    const uint64_t s = next();
    std::vector<float> v(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const double u1 = unit(splitmix64(s + 2 * uint64_t(i)));
      const double u2 = unit(splitmix64(s + 2 * uint64_t(i) + 1));
      v[size_t(i)] = float(mean + sigma * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
    }
    return v;
  }
  std::vector<float> uniform(int64_t n, double lo, double hi) {
    const uint64_t s = next();
    std::vector<float> v(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float(lo + (hi - lo) * unit(splitmix64(s + uint64_t(i))));
    return v;
  }
  std::vector<int32_t> ints(int64_t n, int64_t lo, int64_t hi) {  // [lo, hi)
    const uint64_t s = next();
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      v[size_t(i)] = int32_t(lo + int64_t(splitmix64(s + uint64_t(i)) % uint64_t(hi - lo)));
    return v;
  }
};

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < int64_t(x.size()); ++i) y[size_t(i)] = __float2bfloat16_rn(x[size_t(i)]);
  return y;
}
std::vector<float> to_f32(const std::vector<bf16>& x) {
  std::vector<float> y(x.size());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < int64_t(x.size()); ++i) y[size_t(i)] = __bfloat162float(x[size_t(i)]);
  return y;
}
// The value a bf16 tensor holds: the CPU reference runs on exactly these.
std::vector<float> round_bf16(const std::vector<float>& x) { return to_f32(to_bf16(x)); }

// ---------------------------------------------------------------- device buffers

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(int64_t count) : n(size_t(count)) {
    CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  size_t bytes() const { return n * sizeof(T); }
  void upload(const std::vector<T>& h) {
    if (h.size() != n) throw shardlm::Error(fmt("upload: %zu elements into a buffer of %zu", h.size(), n));
    CUDA_CHECK(cudaMemcpy(ptr, h.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), ptr, bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
  // All bits set: NaN for bf16, fp32 and fp64, so an unwritten element shows.
  void poison() { CUDA_CHECK(cudaMemset(ptr, 0xff, bytes())); }
  void zero() { CUDA_CHECK(cudaMemset(ptr, 0, bytes())); }
};

void sync() { CUDA_CHECK(cudaDeviceSynchronize()); }

// ---------------------------------------------------------------- comparisons

template <class T> double as_double(T x) { return double(x); }
template <> double as_double<bf16>(bf16 x) { return double(__bfloat162float(x)); }

// ||gpu - ref|| / ||ref|| in double over n elements; non-finite gpu values counted.
template <class G, class R>
double rel_err(const G* g, const R* r, int64_t n, int64_t* nonfinite = nullptr) {
  double num = 0, den = 0;
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : num, den, bad) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double gv = as_double(g[i]), rv = as_double(r[i]);
    if (!std::isfinite(gv)) {
      ++bad;
      continue;
    }
    num += (gv - rv) * (gv - rv);
    den += rv * rv;
  }
  if (nonfinite) *nonfinite = bad;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
template <class G, class R>
double rel_err(const std::vector<G>& g, const std::vector<R>& r, int64_t* nonfinite = nullptr) {
  if (g.size() != r.size()) throw shardlm::Error("rel_err: size mismatch");
  return rel_err(g.data(), r.data(), int64_t(g.size()), nonfinite);
}

// For += outputs: the error of the accumulated part, ||gpu - ref|| / ||ref - init||.
double rel_err_delta(const std::vector<float>& g, const std::vector<float>& r,
                     const std::vector<float>& init, int64_t* nonfinite) {
  double num = 0, den = 0;
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : num, den, bad) schedule(static)
  for (int64_t i = 0; i < int64_t(g.size()); ++i) {
    if (!std::isfinite(g[size_t(i)])) {
      ++bad;
      continue;
    }
    const double d = double(g[size_t(i)]) - double(r[size_t(i)]);
    const double a = double(r[size_t(i)]) - double(init[size_t(i)]);
    num += d * d;
    den += a * a;
  }
  *nonfinite = bad;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

template <class T>
void check_bitwise(const std::string& name, const std::vector<T>& a, const std::vector<T>& b) {
  int64_t diff = 0;
  if (a.size() != b.size()) {
    diff = -1;
  } else {
    const auto* pa = reinterpret_cast<const unsigned char*>(a.data());
    const auto* pb = reinterpret_cast<const unsigned char*>(b.data());
    for (size_t i = 0; i < a.size(); ++i)
      if (std::memcmp(pa + i * sizeof(T), pb + i * sizeof(T), sizeof(T)) != 0) ++diff;
  }
  report.line(name, diff == 0 ? 0.0 : 1.0, 0.0, diff == 0,
              diff == 0 ? "" : fmt("(%lld elements differ)", (long long)diff));
}

std::string shape(const char* tag, const std::string& dims) { return fmt("%s %s", tag, dims.c_str()); }

// ---------------------------------------------------------------- embedding

void test_embedding(Rng& rng, const char* tag, int64_t N, int64_t V, int64_t C, int64_t id_range,
                    bool bad_id) {
  const std::string dims = fmt("%s (N=%lld V=%lld C=%lld)", tag, (long long)N, (long long)V, (long long)C);
  const auto table = to_bf16(rng.normal(V * C, 1.0));
  auto ids = rng.ints(N, 0, id_range);
  // A frequent token: one id's run of sorted tokens crosses many 32-token tiles.
  for (int64_t t = 0; t < N; t += 3) ids[size_t(t)] = 7;
  const int64_t bad = bad_id ? 2 : -1;
  if (bad_id) ids[size_t(bad)] = int32_t(V);  // outside the vocabulary

  DeviceBuffer<bf16> d_table(V * C), d_out(N * C), d_dout(N * C);
  DeviceBuffer<int32_t> d_ids(N);
  d_table.upload(table);
  d_ids.upload(ids);

  // forward: a copy, so bit-exact
  std::vector<bf16> out[2];
  for (auto& o : out) {
    d_out.poison();
    gpu::embedding_forward(d_out.ptr, d_ids.ptr, d_table.ptr, N, V, C, nullptr);
    sync();
    o = d_out.download();
  }
  std::vector<bf16> ref(static_cast<size_t>(N * C)), got(static_cast<size_t>(N * C));
  int64_t nan_rows_ok = 0;
  for (int64_t t = 0; t < N; ++t) {
    if (t == bad) {
      bool all_nan = true;
      for (int64_t c = 0; c < C; ++c) all_nan &= std::isnan(__bfloat162float(out[0][size_t(t * C + c)]));
      nan_rows_ok += all_nan;
      for (int64_t c = 0; c < C; ++c) ref[size_t(t * C + c)] = got[size_t(t * C + c)] = __float2bfloat16_rn(0.0f);
      continue;
    }
    std::memcpy(&ref[size_t(t * C)], &table[size_t(ids[size_t(t)] * C)], size_t(C) * sizeof(bf16));
    std::memcpy(&got[size_t(t * C)], &out[0][size_t(t * C)], size_t(C) * sizeof(bf16));
  }
  int64_t nf = 0;
  const double e = rel_err(got, ref, &nf);
  report.check(shape("embedding_forward", dims) + " vs cpu", e, kExact, nf);
  if (bad_id) report.check_true(shape("embedding_forward", dims) + " id >= V gives a NaN row", nan_rows_ok == 1);
  check_bitwise(shape("embedding_forward", dims) + " deterministic", out[0], out[1]);

  // backward: dtable += in token order per id
  const auto init = rng.normal(V * C, 0.01);
  const auto dout = to_bf16(rng.normal(N * C, 1.0));
  d_dout.upload(dout);
  auto dout_ref = to_f32(dout);
  auto ids_ref = ids;
  if (bad_id) {  // the GPU skips it: the reference adds a zero row to id 0 instead
    ids_ref[size_t(bad)] = 0;
    std::fill(dout_ref.begin() + bad * C, dout_ref.begin() + (bad + 1) * C, 0.0f);
  }
  std::vector<float> dref = init;
  cpu::embedding_backward<float>(dref.data(), dout_ref.data(), ids_ref.data(), N, V, C);

  const size_t scratch_bytes = gpu::embedding_backward_scratch_bytes(N, C);
  DeviceBuffer<char> scratch(static_cast<int64_t>(scratch_bytes));
  DeviceBuffer<float> d_dtable(V * C);
  std::vector<float> dt[2];
  for (auto& d : dt) {
    d_dtable.upload(init);
    scratch.poison();
    gpu::embedding_backward(d_dtable.ptr, d_dout.ptr, d_ids.ptr, N, V, C, scratch.ptr, scratch_bytes, nullptr);
    sync();
    d = d_dtable.download();
  }
  const double eb = rel_err_delta(dt[0], dref, init, &nf);
  report.check(shape("embedding_backward", dims) + " dtable += vs cpu", eb, kTolF32Acc, nf);
  check_bitwise(shape("embedding_backward", dims) + " deterministic", dt[0], dt[1]);
}

// ---------------------------------------------------------------- RMSNorm

void test_rmsnorm(Rng& rng, const char* tag, int64_t rows, int64_t C) {
  const std::string dims = fmt("%s(rows=%lld C=%lld)", tag, (long long)rows, (long long)C);
  const double eps = 1e-5;
  const int64_t n = rows * C;
  const auto a = to_bf16(rng.normal(n, 1.0));
  const auto b = to_bf16(rng.normal(n, 0.5));
  const auto w = to_bf16(rng.normal(C, 0.1, 1.0));
  const auto w_f = to_f32(w);

  DeviceBuffer<bf16> d_a(n), d_b(n), d_w(C), d_out(n), d_res(n);
  DeviceBuffer<float> d_rstd(rows);
  d_a.upload(a);
  d_b.upload(b);
  d_w.upload(w);
  // rmsnorm_forward twice on a bf16 or fp32 input: both outputs (for determinism), the last rstd
  std::vector<bf16> out[2];
  std::vector<float> rstd;
  auto forward_twice = [&](const auto* input) {
    for (auto& o : out) {
      d_out.poison();
      d_rstd.poison();
      gpu::rmsnorm_forward(d_out.ptr, d_rstd.ptr, input, d_w.ptr, rows, C, eps, nullptr);
      sync();
      o = d_out.download();
      rstd = d_rstd.download();
    }
  };

  // forward
  {
    std::vector<float> ref(static_cast<size_t>(n)), rstd_ref(static_cast<size_t>(rows));
    const auto x = to_f32(a);
    cpu::rmsnorm_forward<float>(ref.data(), rstd_ref.data(), x.data(), w_f.data(), rows, C, eps);
    forward_twice(d_a.ptr);
    int64_t nf = 0;
    double e = rel_err(out[0], ref, &nf);
    report.check("rmsnorm_forward " + dims + " out", e, kTolBf16Out, nf);
    e = rel_err(rstd, rstd_ref, &nf);
    report.check("rmsnorm_forward " + dims + " rstd", e, kTolF32Stat, nf);
    check_bitwise("rmsnorm_forward " + dims + " deterministic", out[0], out[1]);
  }
  // fused residual add + norm: the norm of the rounded sum
  {
    std::vector<bf16> sum(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      sum[size_t(i)] = __float2bfloat16_rn(__bfloat162float(a[size_t(i)]) + __bfloat162float(b[size_t(i)]));
    const auto sum_f = to_f32(sum);
    std::vector<float> ref(static_cast<size_t>(n)), rstd_ref(static_cast<size_t>(rows));
    cpu::rmsnorm_forward<float>(ref.data(), rstd_ref.data(), sum_f.data(), w_f.data(), rows, C, eps);
    d_out.poison();
    d_res.poison();
    d_rstd.poison();
    gpu::residual_rmsnorm_forward(d_res.ptr, d_out.ptr, d_rstd.ptr, d_a.ptr, d_b.ptr, d_w.ptr, rows, C, eps, nullptr);
    sync();
    int64_t nf = 0;
    double e = rel_err(d_res.download(), sum, &nf);
    report.check("residual_rmsnorm_forward " + dims + " a+b", e, kExact, nf);
    e = rel_err(d_out.download(), ref, &nf);
    report.check("residual_rmsnorm_forward " + dims + " out", e, kTolBf16Out, nf);
    e = rel_err(d_rstd.download(), rstd_ref, &nf);
    report.check("residual_rmsnorm_forward " + dims + " rstd", e, kTolF32Stat, nf);
  }
  // backward, without and with the fused residual gradient
  {
    const auto x = to_f32(a);
    std::vector<float> fwd(static_cast<size_t>(n)), rstd(static_cast<size_t>(rows));
    cpu::rmsnorm_forward<float>(fwd.data(), rstd.data(), x.data(), w_f.data(), rows, C, eps);
    const auto dout = to_bf16(rng.normal(n, 1.0));
    const auto dres = to_bf16(rng.normal(n, 1.0));
    const auto dw_init = rng.normal(C, 0.01);
    const auto dout_f = to_f32(dout), dres_f = to_f32(dres);
    std::vector<float> dinp_ref(static_cast<size_t>(n)), dw_ref = dw_init;
    cpu::rmsnorm_backward<float>(dinp_ref.data(), dw_ref.data(), dout_f.data(), x.data(), w_f.data(),
                                 rstd.data(), rows, C);
    DeviceBuffer<bf16> d_dout(n), d_dres(n), d_dinp(n);
    DeviceBuffer<float> d_dw(C), d_rstd_in(rows);
    d_dout.upload(dout);
    d_dres.upload(dres);
    d_rstd_in.upload(rstd);
    const size_t sb = gpu::rmsnorm_backward_scratch_bytes(rows, C);
    DeviceBuffer<char> scratch(static_cast<int64_t>(std::max<size_t>(sb, 1)));
    for (bool with_res : {false, true}) {
      std::vector<bf16> dinp[2];
      std::vector<float> dw[2];
      for (int run = 0; run < 2; ++run) {
        d_dw.upload(dw_init);
        d_dinp.poison();
        scratch.poison();
        gpu::rmsnorm_backward(d_dinp.ptr, d_dw.ptr, d_dout.ptr, d_a.ptr, d_w.ptr, d_rstd_in.ptr,
                              with_res ? d_dres.ptr : nullptr, rows, C, scratch.ptr, sb, nullptr);
        sync();
        dinp[run] = d_dinp.download();
        dw[run] = d_dw.download();
      }
      std::vector<float> ref = dinp_ref;
      if (with_res)
        for (int64_t i = 0; i < n; ++i) ref[size_t(i)] += dres_f[size_t(i)];
      const std::string name = std::string(with_res ? "rmsnorm_backward+dres " : "rmsnorm_backward ") + dims;
      int64_t nf = 0;
      double e = rel_err(dinp[0], ref, &nf);
      report.check(name + " dinp", e, kTolBf16Out, nf);
      e = rel_err_delta(dw[0], dw_ref, dw_init, &nf);
      report.check(name + " dweight +=", e, kTolF32Acc, nf);
      check_bitwise(name + " deterministic dinp", dinp[0], dinp[1]);
      check_bitwise(name + " deterministic dweight", dw[0], dw[1]);
    }
    // In place on the residual gradient (dinp aliases dresidual).
    d_dw.upload(dw_init);
    gpu::rmsnorm_backward(d_dres.ptr, d_dw.ptr, d_dout.ptr, d_a.ptr, d_w.ptr, d_rstd_in.ptr, d_dres.ptr,
                          rows, C, scratch.ptr, sb, nullptr);
    sync();
    std::vector<float> ref = dinp_ref;
    for (int64_t i = 0; i < n; ++i) ref[size_t(i)] += dres_f[size_t(i)];
    int64_t nf = 0;
    const double e = rel_err(d_dres.download(), ref, &nf);
    report.check("rmsnorm_backward " + dims + " in place on dresidual", e, kTolBf16Out, nf);
  }
  // model.norm_dtype = "fp32": weights given in fp32. On bf16's grid they give
  // the bf16 weights' bits exactly (forward, fused residual, backward); off it
  // they match the fp32 reference with those weights.
  {
    const auto x = to_f32(a);
    const auto dout = to_bf16(rng.normal(n, 1.0));
    const auto dout_f = to_f32(dout);
    const auto w_off = rng.normal(C, 0.01, 1.0);  // 1 + 1e-2 noise: mostly not bf16-representable
    DeviceBuffer<float> d_w32(C), d_rstd32(rows), d_dw(C), d_dw32(C);
    DeviceBuffer<bf16> d_out32(n), d_res32(n), d_dout(n), d_dinp(n), d_dinp32(n);
    d_dout.upload(dout);
    const size_t sb = gpu::rmsnorm_backward_scratch_bytes(rows, C);
    DeviceBuffer<char> scratch(static_cast<int64_t>(std::max<size_t>(sb, 1)));
    d_w32.upload(w_f);
    gpu::rmsnorm_forward(d_out.ptr, d_rstd.ptr, d_a.ptr, d_w.ptr, rows, C, eps, nullptr);
    gpu::rmsnorm_forward(d_out32.ptr, d_rstd32.ptr, d_a.ptr, d_w32.ptr, rows, C, eps, nullptr);
    sync();
    check_bitwise("rmsnorm_forward fp32 weights on bf16's grid " + dims, d_out.download(), d_out32.download());
    gpu::residual_rmsnorm_forward(d_res.ptr, d_out.ptr, d_rstd.ptr, d_a.ptr, d_b.ptr, d_w.ptr, rows, C, eps, nullptr);
    gpu::residual_rmsnorm_forward(d_res32.ptr, d_out32.ptr, d_rstd32.ptr, d_a.ptr, d_b.ptr, d_w32.ptr, rows, C, eps,
                                  nullptr);
    sync();
    check_bitwise("residual_rmsnorm_forward fp32 weights on bf16's grid " + dims, d_out.download(),
                  d_out32.download());
    gpu::rmsnorm_forward(d_out.ptr, d_rstd.ptr, d_a.ptr, d_w.ptr, rows, C, eps, nullptr);  // rstd of `a` again
    d_dw.zero();
    d_dw32.zero();
    gpu::rmsnorm_backward(d_dinp.ptr, d_dw.ptr, d_dout.ptr, d_a.ptr, d_w.ptr, d_rstd.ptr, nullptr, rows, C,
                          scratch.ptr, sb, nullptr);
    gpu::rmsnorm_backward(d_dinp32.ptr, d_dw32.ptr, d_dout.ptr, d_a.ptr, d_w32.ptr, d_rstd.ptr, nullptr, rows, C,
                          scratch.ptr, sb, nullptr);
    sync();
    check_bitwise("rmsnorm_backward fp32 weights on bf16's grid " + dims + " dinp", d_dinp.download(),
                  d_dinp32.download());
    check_bitwise("rmsnorm_backward fp32 weights on bf16's grid " + dims + " dweight", d_dw.download(),
                  d_dw32.download());

    d_w32.upload(w_off);
    std::vector<float> ref(static_cast<size_t>(n)), rstd_ref(static_cast<size_t>(rows));
    cpu::rmsnorm_forward<float>(ref.data(), rstd_ref.data(), x.data(), w_off.data(), rows, C, eps);
    d_out32.poison();
    gpu::rmsnorm_forward(d_out32.ptr, d_rstd32.ptr, d_a.ptr, d_w32.ptr, rows, C, eps, nullptr);
    sync();
    int64_t nf = 0;
    report.check("rmsnorm_forward fp32 weights " + dims + " out", rel_err(d_out32.download(), ref, &nf), kTolBf16Out,
                 nf);
    std::vector<float> dinp_ref(static_cast<size_t>(n)), dw_ref(static_cast<size_t>(C), 0.0f);
    cpu::rmsnorm_backward<float>(dinp_ref.data(), dw_ref.data(), dout_f.data(), x.data(), w_off.data(),
                                 rstd_ref.data(), rows, C);
    d_dw32.zero();
    d_dinp32.poison();
    gpu::rmsnorm_backward(d_dinp32.ptr, d_dw32.ptr, d_dout.ptr, d_a.ptr, d_w32.ptr, d_rstd32.ptr, nullptr, rows, C,
                          scratch.ptr, sb, nullptr);
    sync();
    report.check("rmsnorm_backward fp32 weights " + dims + " dinp", rel_err(d_dinp32.download(), dinp_ref, &nf),
                 kTolBf16Out, nf);
    report.check("rmsnorm_backward fp32 weights " + dims + " dweight", rel_err(d_dw32.download(), dw_ref, &nf),
                 kTolF32Acc, nf);
  }
  // model.residual_dtype = "fp32": the stream (input, residual, their gradients) in fp32
  {
    const auto a32 = rng.normal(n, 1.0);  // not bf16-representable
    const auto b_f = to_f32(b);
    DeviceBuffer<float> d_a32(n), d_res32(n);
    d_a32.upload(a32);
    std::vector<float> ref(static_cast<size_t>(n)), rstd_ref(static_cast<size_t>(rows));
    cpu::rmsnorm_forward<float>(ref.data(), rstd_ref.data(), a32.data(), w_f.data(), rows, C, eps);
    forward_twice(d_a32.ptr);
    int64_t nf = 0;
    report.check("rmsnorm_forward fp32-in " + dims + " out", rel_err(out[0], ref, &nf), kTolBf16Out, nf);
    report.check("rmsnorm_forward fp32-in " + dims + " rstd", rel_err(rstd, rstd_ref, &nf), kTolF32Stat, nf);
    check_bitwise("rmsnorm_forward fp32-in " + dims + " deterministic", out[0], out[1]);

    // residual_out = a + b unrounded (one fp32 add: the host's bits), the norm of it
    std::vector<float> sum(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) sum[size_t(i)] = a32[size_t(i)] + b_f[size_t(i)];
    cpu::rmsnorm_forward<float>(ref.data(), rstd_ref.data(), sum.data(), w_f.data(), rows, C, eps);
    d_out.poison();
    d_res32.poison();
    d_rstd.poison();
    gpu::residual_rmsnorm_forward(d_res32.ptr, d_out.ptr, d_rstd.ptr, d_a32.ptr, d_b.ptr, d_w.ptr, rows, C, eps,
                                  nullptr);
    sync();
    report.check("residual_rmsnorm_forward fp32 " + dims + " a+b", rel_err(d_res32.download(), sum, &nf), kExact, nf);
    report.check("residual_rmsnorm_forward fp32 " + dims + " out", rel_err(d_out.download(), ref, &nf),
                 kTolBf16Out, nf);
    report.check("residual_rmsnorm_forward fp32 " + dims + " rstd", rel_err(d_rstd.download(), rstd_ref, &nf),
                 kTolF32Stat, nf);

    // backward on the fp32 stream: dinp in fp32 (to fp32 tolerance, not bf16's),
    // its bf16 copy the rounding of what was stored, bit for bit
    std::vector<float> fwd(static_cast<size_t>(n)), rstd(static_cast<size_t>(rows));
    cpu::rmsnorm_forward<float>(fwd.data(), rstd.data(), a32.data(), w_f.data(), rows, C, eps);
    const auto dout = to_bf16(rng.normal(n, 1.0));
    const auto dres = rng.normal(n, 1.0);
    const auto dw_init = rng.normal(C, 0.01);
    const auto dout_f = to_f32(dout);
    std::vector<float> dinp_ref(static_cast<size_t>(n)), dw_ref = dw_init;
    cpu::rmsnorm_backward<float>(dinp_ref.data(), dw_ref.data(), dout_f.data(), a32.data(), w_f.data(), rstd.data(),
                                 rows, C);
    DeviceBuffer<bf16> d_dout(n), d_copy(n);
    DeviceBuffer<float> d_dres(n), d_dinp(n), d_dw(C), d_rstd_in(rows);
    d_dout.upload(dout);
    d_dres.upload(dres);
    d_rstd_in.upload(rstd);
    const size_t sb = gpu::rmsnorm_backward_scratch_bytes(rows, C);
    DeviceBuffer<char> scratch(static_cast<int64_t>(std::max<size_t>(sb, 1)));
    for (bool with_res : {false, true}) {
      std::vector<float> dinp[2], dw[2];
      std::vector<bf16> copy;
      for (int run = 0; run < 2; ++run) {
        d_dw.upload(dw_init);
        d_dinp.poison();
        d_copy.poison();
        scratch.poison();
        gpu::rmsnorm_backward(d_dinp.ptr, d_copy.ptr, d_dw.ptr, d_dout.ptr, d_a32.ptr, d_w.ptr, d_rstd_in.ptr,
                              with_res ? d_dres.ptr : nullptr, rows, C, scratch.ptr, sb, nullptr);
        sync();
        dinp[run] = d_dinp.download();
        dw[run] = d_dw.download();
        if (run == 0) copy = d_copy.download();
      }
      std::vector<float> want = dinp_ref;
      if (with_res)
        for (int64_t i = 0; i < n; ++i) want[size_t(i)] += dres[size_t(i)];
      const std::string name = std::string(with_res ? "rmsnorm_backward fp32+dres " : "rmsnorm_backward fp32 ") + dims;
      report.check(name + " dinp", rel_err(dinp[0], want, &nf), kTolF32Stat, nf);
      report.check(name + " dinp's bf16 copy", rel_err(copy, to_bf16(dinp[0]), &nf), kExact, nf);
      report.check(name + " dweight +=", rel_err_delta(dw[0], dw_ref, dw_init, &nf), kTolF32Acc, nf);
      check_bitwise(name + " deterministic dinp", dinp[0], dinp[1]);
      check_bitwise(name + " deterministic dweight", dw[0], dw[1]);
    }
  }
}

// ---------------------------------------------------------------- RoPE

void test_rope(Rng& rng, const char* tag, int64_t N, int64_t heads, int64_t D, int64_t row_stride) {
  const int64_t stride = row_stride ? row_stride : heads * D;
  const std::string dims = fmt("%s(N=%lld heads=%lld D=%lld stride=%lld)", tag, (long long)N, (long long)heads,
                               (long long)D, (long long)stride);
  shardlm::RopeScaling scaling;  // Llama-3.2: theta 500000, llama3 scaling
  scaling.type = "llama3";
  scaling.factor = 32.0;
  scaling.low_freq_factor = 1.0;
  scaling.high_freq_factor = 4.0;
  scaling.original_max_position_embeddings = 8192;
  const std::vector<double> inv_freq = cpu::rope_inv_freq(D, 500000.0, scaling);
  std::vector<float> inv_freq_f(inv_freq.begin(), inv_freq.end());
  auto pos = rng.ints(N, 0, 32768);
  pos[0] = 0;
  if (N > 1) pos[size_t(N - 1)] = 32767;

  const auto x = to_bf16(rng.normal(N * stride, 1.0));
  DeviceBuffer<bf16> d_x(N * stride);
  DeviceBuffer<int32_t> d_pos(N);
  DeviceBuffer<float> d_inv(D / 2);
  d_pos.upload(pos);
  d_inv.upload(inv_freq_f);

  for (bool forward : {true, false}) {
    // Reference on the rotated part, compacted to (N, heads, D).
    std::vector<float> ref(static_cast<size_t>(N * heads * D));
    for (int64_t t = 0; t < N; ++t)
      for (int64_t e = 0; e < heads * D; ++e) ref[size_t(t * heads * D + e)] = __bfloat162float(x[size_t(t * stride + e)]);
    if (forward) cpu::rope_forward<float>(ref.data(), pos.data(), inv_freq.data(), N, heads, D);
    else cpu::rope_backward<float>(ref.data(), pos.data(), inv_freq.data(), N, heads, D);
    std::vector<bf16> out[2];
    for (auto& o : out) {
      d_x.upload(x);
      if (forward) gpu::rope_forward(d_x.ptr, d_pos.ptr, d_inv.ptr, N, heads, D, row_stride, nullptr);
      else gpu::rope_backward(d_x.ptr, d_pos.ptr, d_inv.ptr, N, heads, D, row_stride, nullptr);
      sync();
      o = d_x.download();
    }
    std::vector<float> got(ref.size());
    bool untouched = true;
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t e = 0; e < heads * D; ++e) got[size_t(t * heads * D + e)] = __bfloat162float(out[0][size_t(t * stride + e)]);
      for (int64_t e = heads * D; e < stride; ++e)
        untouched &= std::memcmp(&out[0][size_t(t * stride + e)], &x[size_t(t * stride + e)], sizeof(bf16)) == 0;
    }
    const std::string name = std::string(forward ? "rope_forward " : "rope_backward ") + dims;
    int64_t nf = 0;
    const double e = rel_err(got, ref, &nf);
    report.check(name, e, kTolBf16Out, nf);
    if (stride > heads * D) report.check_true(name + " rest of row untouched", untouched);
    check_bitwise(name + " deterministic", out[0], out[1]);
  }
}

// ---------------------------------------------------------------- SwiGLU

void test_swiglu(Rng& rng, const char* tag, int64_t rows, int64_t I, bool fused) {
  const std::string dims = fmt("%s(rows=%lld I=%lld%s)", tag, (long long)rows, (long long)I, fused ? " fused gate|up" : "");
  const int64_t n = rows * I;
  const auto gate = to_bf16(rng.normal(n, 2.0));
  const auto up = to_bf16(rng.normal(n, 1.0));
  const auto dh = to_bf16(rng.normal(n, 1.0));
  const auto gate_f = to_f32(gate), up_f = to_f32(up), dh_f = to_f32(dh);
  std::vector<float> h_ref(static_cast<size_t>(n)), dg_ref(static_cast<size_t>(n)), du_ref(static_cast<size_t>(n));
  cpu::swiglu_forward<float>(h_ref.data(), gate_f.data(), up_f.data(), n);
  cpu::swiglu_backward<float>(dg_ref.data(), du_ref.data(), dh_f.data(), gate_f.data(), up_f.data(), n);

  // fused: one (rows, 2I) buffer [gate | up], as the gate_up GEMM writes it
  const int64_t ld = fused ? 2 * I : I;
  std::vector<bf16> gu(static_cast<size_t>(rows * (fused ? 2 * I : I)));
  DeviceBuffer<bf16> d_g(fused ? rows * 2 * I : n), d_u(fused ? 1 : n), d_h(n), d_dh(n), d_dg(n), d_du(n);
  auto upload_inputs = [&] {
    if (fused) {
      std::vector<bf16> buf(static_cast<size_t>(rows * 2 * I));
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(&buf[size_t(r * 2 * I)], &gate[size_t(r * I)], size_t(I) * sizeof(bf16));
        std::memcpy(&buf[size_t(r * 2 * I + I)], &up[size_t(r * I)], size_t(I) * sizeof(bf16));
      }
      d_g.upload(buf);
    } else {
      d_g.upload(gate);
      d_u.upload(up);
    }
  };
  bf16* g_ptr = d_g.ptr;
  bf16* u_ptr = fused ? d_g.ptr + I : d_u.ptr;
  d_dh.upload(dh);
  upload_inputs();

  std::vector<bf16> h[2];
  for (auto& o : h) {
    d_h.poison();
    gpu::swiglu_forward(d_h.ptr, I, g_ptr, ld, u_ptr, ld, rows, I, nullptr);
    sync();
    o = d_h.download();
  }
  int64_t nf = 0;
  double e = rel_err(h[0], h_ref, &nf);
  report.check("swiglu_forward " + dims, e, kTolBf16Out, nf);
  check_bitwise("swiglu_forward " + dims + " deterministic", h[0], h[1]);

  // backward; fused: in place, dgate over gate and dup over up
  std::vector<bf16> dg[2], du[2];
  for (int run = 0; run < 2; ++run) {
    upload_inputs();
    if (fused) {
      gpu::swiglu_backward(g_ptr, ld, u_ptr, ld, d_dh.ptr, I, g_ptr, ld, u_ptr, ld, rows, I, nullptr);
      sync();
      const auto buf = d_g.download();
      dg[run].resize(size_t(n));
      du[run].resize(size_t(n));
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(&dg[run][size_t(r * I)], &buf[size_t(r * 2 * I)], size_t(I) * sizeof(bf16));
        std::memcpy(&du[run][size_t(r * I)], &buf[size_t(r * 2 * I + I)], size_t(I) * sizeof(bf16));
      }
    } else {
      d_dg.poison();
      d_du.poison();
      gpu::swiglu_backward(d_dg.ptr, I, d_du.ptr, I, d_dh.ptr, I, g_ptr, I, u_ptr, I, rows, I, nullptr);
      sync();
      dg[run] = d_dg.download();
      du[run] = d_du.download();
    }
  }
  e = rel_err(dg[0], dg_ref, &nf);
  report.check("swiglu_backward " + dims + (fused ? " dgate (in place)" : " dgate"), e, kTolBf16Out, nf);
  e = rel_err(du[0], du_ref, &nf);
  report.check("swiglu_backward " + dims + (fused ? " dup (in place)" : " dup"), e, kTolBf16Out, nf);
  check_bitwise("swiglu_backward " + dims + " deterministic", dg[0], dg[1]);
}

// ---------------------------------------------------------------- fused FP8 amaxes

// model.fp8's amaxes written by the kernels that produce the operands (the
// CUDA backend's, under tensorwise scaling): each kernel with an amax gives the
// same output bits as without, and an amax equal bit for bit to max |output|
// over what it wrote (the bf16 values), which is what cuda::fp8_amax reads back
// otherwise.
void test_fused_amax(Rng& rng, const char* tag, int64_t rows, int64_t C, int64_t I) {
  const std::string dims = fmt("%s(rows=%lld C=%lld I=%lld)", tag, (long long)rows, (long long)C, (long long)I);
  const double eps = 1e-5;
  const int64_t n = rows * C;
  auto host_amax = [](const std::vector<bf16>& x) {
    float m = 0.0f;
    for (const bf16& v : x) m = std::max(m, std::fabs(__bfloat162float(v)));
    return std::vector<float>{m};
  };
  DeviceBuffer<float> d_amax(2);
  // out0: the kernel without an amax; out1 and the amax: with one (poisoned first).
  auto compare = [&](const std::string& what, const std::vector<bf16>& out0, const std::vector<bf16>& out1,
                     const std::vector<float>& amax) {
    check_bitwise("fused amax " + what + " " + dims + ": the same output", out0, out1);
    check_bitwise("fused amax " + what + " " + dims + ": amax = max |output|", amax, host_amax(out1));
  };
  const auto a = to_bf16(rng.normal(n, 1.0));
  const auto b = to_bf16(rng.normal(n, 0.5));
  const auto w = to_bf16(rng.normal(C, 0.1, 1.0));
  const auto a32 = rng.normal(n, 1.0);
  DeviceBuffer<bf16> d_a(n), d_b(n), d_w(C), d_out(n), d_res(n);
  DeviceBuffer<float> d_a32(n), d_res32(n), d_rstd(rows);
  d_a.upload(a);
  d_b.upload(b);
  d_w.upload(w);
  d_a32.upload(a32);
  for (int stream32 = 0; stream32 < 2; ++stream32) {
    const char* kind = stream32 ? " (fp32 stream)" : "";
    for (int residual = 0; residual < 2; ++residual) {
      std::vector<bf16> out[2];
      for (int with = 0; with < 2; ++with) {
        float* amax = with ? d_amax.ptr : nullptr;
        d_out.poison();
        d_amax.poison();
        if (residual && stream32)
          gpu::residual_rmsnorm_forward(d_res32.ptr, d_out.ptr, d_rstd.ptr, d_a32.ptr, d_b.ptr, d_w.ptr, rows, C, eps,
                                        nullptr, amax);
        else if (residual)
          gpu::residual_rmsnorm_forward(d_res.ptr, d_out.ptr, d_rstd.ptr, d_a.ptr, d_b.ptr, d_w.ptr, rows, C, eps,
                                        nullptr, amax);
        else if (stream32)
          gpu::rmsnorm_forward(d_out.ptr, d_rstd.ptr, d_a32.ptr, d_w.ptr, rows, C, eps, nullptr, amax);
        else
          gpu::rmsnorm_forward(d_out.ptr, d_rstd.ptr, d_a.ptr, d_w.ptr, rows, C, eps, nullptr, amax);
        sync();
        out[with] = d_out.download();
      }
      compare(std::string(residual ? "residual_rmsnorm_forward" : "rmsnorm_forward") + kind, out[0], out[1],
              std::vector<float>{d_amax.download()[0]});
    }
    // the norm's backward: the amax of the bf16 gradient the next projection reads
    const auto dout = to_bf16(rng.normal(n, 1.0));
    DeviceBuffer<bf16> d_dout(n), d_dinp(n), d_copy(n);
    DeviceBuffer<float> d_dinp32(n), d_dw(C);
    d_dout.upload(dout);
    const size_t sb = gpu::rmsnorm_backward_scratch_bytes(rows, C);
    DeviceBuffer<char> scratch(static_cast<int64_t>(std::max<size_t>(sb, 1)));
    gpu::rmsnorm_forward(d_out.ptr, d_rstd.ptr, d_a.ptr, d_w.ptr, rows, C, eps, nullptr);  // rstd
    std::vector<bf16> grad[2];
    for (int with = 0; with < 2; ++with) {
      float* amax = with ? d_amax.ptr : nullptr;
      d_amax.poison();
      d_dw.zero();
      if (stream32) {
        d_copy.poison();
        gpu::rmsnorm_backward(d_dinp32.ptr, d_copy.ptr, d_dw.ptr, d_dout.ptr, d_a32.ptr, d_w.ptr, d_rstd.ptr, nullptr,
                              rows, C, scratch.ptr, sb, nullptr, amax);
        sync();
        grad[with] = d_copy.download();
      } else {
        d_dinp.poison();
        gpu::rmsnorm_backward(d_dinp.ptr, d_dw.ptr, d_dout.ptr, d_a.ptr, d_w.ptr, d_rstd.ptr, d_b.ptr, rows, C,
                              scratch.ptr, sb, nullptr, amax);
        sync();
        grad[with] = d_dinp.download();
      }
    }
    compare(std::string("rmsnorm_backward") + kind, grad[0], grad[1], std::vector<float>{d_amax.download()[0]});
  }
  // SwiGLU on gate|up (rows, 2I), as the training step lays it out; the backward in place
  const int64_t m = rows * I;
  const auto gu = to_bf16(rng.normal(2 * m, 2.0));
  const auto dh = to_bf16(rng.normal(m, 1.0));
  DeviceBuffer<bf16> d_gu(2 * m), d_h(m), d_dh(m);
  d_dh.upload(dh);
  std::vector<bf16> h[2], dgu[2];
  std::vector<float> amaxes;
  for (int with = 0; with < 2; ++with) {
    d_gu.upload(gu);
    d_h.poison();
    d_amax.poison();
    gpu::swiglu_forward(d_h.ptr, I, d_gu.ptr, 2 * I, d_gu.ptr + I, 2 * I, rows, I, nullptr, with ? d_amax.ptr : nullptr);
    sync();
    h[with] = d_h.download();
    if (with) amaxes = {d_amax.download()[0]};
  }
  compare("swiglu_forward", h[0], h[1], amaxes);
  for (int with = 0; with < 2; ++with) {
    d_gu.upload(gu);
    d_amax.poison();
    gpu::swiglu_backward(d_gu.ptr, 2 * I, d_gu.ptr + I, 2 * I, d_dh.ptr, I, d_gu.ptr, 2 * I, d_gu.ptr + I, 2 * I, rows,
                         I, nullptr, with ? d_amax.ptr : nullptr, with ? d_amax.ptr + 1 : nullptr);
    sync();
    dgu[with] = d_gu.download();
    if (with) amaxes = d_amax.download();
  }
  check_bitwise("fused amax swiglu_backward " + dims + ": the same dgate|dup", dgu[0], dgu[1]);
  std::vector<bf16> dg, du;
  for (int64_t r = 0; r < rows; ++r) {
    dg.insert(dg.end(), dgu[1].begin() + r * 2 * I, dgu[1].begin() + r * 2 * I + I);
    du.insert(du.end(), dgu[1].begin() + r * 2 * I + I, dgu[1].begin() + (r + 1) * 2 * I);
  }
  check_bitwise("fused amax swiglu_backward " + dims + ": amaxes = max |dgate|, max |dup|", amaxes,
                std::vector<float>{host_amax(dg)[0], host_amax(du)[0]});
}

// ---------------------------------------------------------------- cross-entropy

void test_cross_entropy(Rng& rng, const char* tag, int64_t n, int64_t V, int64_t check_rows,
                        bool bad_target) {
  const std::string dims = fmt("%s(n=%lld V=%lld)", tag, (long long)n, (long long)V);
  const auto logits = to_bf16(rng.normal(n * V, 3.0));
  auto targets = rng.ints(n, 0, V);
  auto weights = rng.uniform(n, 0.5, 1.5);
  if (n >= 4) {
    targets[1] = -1;     // ignored row
    weights[2] = 0.0f;   // zero-weight row
  }
  if (bad_target) targets[3] = int32_t(V);  // CPU throws; GPU: NaN loss, zero gradient
  const float grad_scale = 1.0f / 1024.0f;

  DeviceBuffer<bf16> d_logits(n * V);
  DeviceBuffer<int32_t> d_targets(n);
  DeviceBuffer<float> d_weights(n), d_loss(n);
  d_targets.upload(targets);
  d_weights.upload(weights);
  std::vector<bf16> dl[2];
  std::vector<float> loss[2];
  for (int run = 0; run < 2; ++run) {
    d_logits.upload(logits);
    d_loss.poison();
    gpu::cross_entropy_forward_backward(d_logits.ptr, d_loss.ptr, d_targets.ptr, d_weights.ptr, grad_scale, n, V, nullptr);
    sync();
    dl[run] = d_logits.download();
    loss[run] = d_loss.download();
  }

  std::vector<int64_t> rows;
  if (check_rows >= n) {
    for (int64_t r = 0; r < n; ++r) rows.push_back(r);
  } else {
    rows = {0, 1, 2, n - 1};
    const auto extra = rng.ints(check_rows - 4, 3, n - 1);
    rows.insert(rows.end(), extra.begin(), extra.end());
  }
  std::vector<float> g_sel, r_sel;
  std::vector<double> loss_g, loss_r;
  for (int64_t r : rows) {
    if (targets[size_t(r)] >= V) continue;
    std::vector<float> x(static_cast<size_t>(V));
    for (int64_t c = 0; c < V; ++c) x[size_t(c)] = __bfloat162float(logits[size_t(r * V + c)]);
    const double l = cpu::cross_entropy_forward_backward<float>(x.data(), &targets[size_t(r)], &weights[size_t(r)],
                                                                grad_scale, 1, V);
    loss_r.push_back(l);
    loss_g.push_back(loss[0][size_t(r)]);
    r_sel.insert(r_sel.end(), x.begin(), x.end());
    for (int64_t c = 0; c < V; ++c) g_sel.push_back(__bfloat162float(dl[0][size_t(r * V + c)]));
  }
  int64_t nf = 0;
  double e = rel_err(g_sel, r_sel, &nf);
  report.check(fmt("cross_entropy %s dlogits (%zu rows)", dims.c_str(), loss_r.size()), e, kTolBf16Out, nf);
  e = rel_err(loss_g, loss_r, &nf);
  report.check(fmt("cross_entropy %s loss (%zu rows)", dims.c_str(), loss_r.size()), e, kTolLoss, nf);
  // Every row written: no NaN left anywhere but the bad-target row's loss.
  int64_t unwritten = 0;
#pragma omp parallel for reduction(+ : unwritten)
  for (int64_t i = 0; i < n * V; ++i) unwritten += std::isnan(__bfloat162float(dl[0][size_t(i)])) ? 1 : 0;
  for (int64_t r = 0; r < n; ++r) unwritten += (targets[size_t(r)] < V && !std::isfinite(loss[0][size_t(r)])) ? 1 : 0;
  report.check_true("cross_entropy " + dims + " every element written", unwritten == 0,
                    fmt("%lld NaN", (long long)unwritten));
  if (bad_target) {
    bool zero = true;
    for (int64_t c = 0; c < V; ++c) zero &= __bfloat162float(dl[0][size_t(3 * V + c)]) == 0.0f;
    report.check_true("cross_entropy " + dims + " target >= V: NaN loss, zero grad", std::isnan(loss[0][3]) && zero);
  }
  check_bitwise("cross_entropy " + dims + " deterministic dlogits", dl[0], dl[1]);
  check_bitwise("cross_entropy " + dims + " deterministic loss", loss[0], loss[1]);

  if (!bad_target) {  // sum_rows on the per-row losses
    DeviceBuffer<double> d_sum(1);
    d_sum.poison();
    gpu::sum_rows(d_sum.ptr, d_loss.ptr, n, false, nullptr);
    sync();
    const double s1 = d_sum.download()[0];
    gpu::sum_rows(d_sum.ptr, d_loss.ptr, n, true, nullptr);
    sync();
    const double s2 = d_sum.download()[0];
    double host = 0;
    for (float l : loss[0]) host += double(l);
    report.check("sum_rows " + dims + " vs host double sum", std::abs(s1 - host) / std::abs(host), kTolDouble,
                 std::isfinite(s1) ? 0 : 1);
    report.check("sum_rows " + dims + " accumulate", std::abs(s2 - 2 * s1) / std::abs(2 * s1), kExact,
                 std::isfinite(s2) ? 0 : 1);
  }
}

// ---------------------------------------------------------------- optimizer

// Optimizer::step (src/train/optim.cpp) for one shard, segment by segment, verbatim.
void cpu_adamw(float* p, float* m, float* v, const float* g, const std::vector<gpu::OptimSegment>& segs,
               const gpu::AdamWConfig& c, float grad_scale) {
  const double b1 = c.beta1, b2 = c.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(c.step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(c.step));
  const float eps = static_cast<float>(c.eps);
  for (const auto& seg : segs) {
    const float wd = seg.weight_decay;
    const int64_t o = seg.offset, n = seg.count;
    float* ms = m + o;
    float* vs = v + o;
    const float lr_f = static_cast<float>(c.lr), b1f = static_cast<float>(b1), b2f = static_cast<float>(b2);
    const float step_size = static_cast<float>(c.lr / bc1), inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[o + i] * grad_scale;
      float* pi = p + o + i;
      ms[i] = b1f * ms[i] + (1.0f - b1f) * gi;
      vs[i] = b2f * vs[i] + (1.0f - b2f) * gi * gi;
      *pi -= lr_f * wd * *pi;
      *pi -= step_size * ms[i] / (std::sqrt(vs[i]) * inv_bc2_sqrt + eps);
    }
  }
}

void cpu_sgd(float* p, float* buf, const float* g, const std::vector<gpu::OptimSegment>& segs,
             const gpu::SgdConfig& c, float grad_scale) {
  for (const auto& seg : segs) {
    const float wd = seg.weight_decay;
    const int64_t o = seg.offset, n = seg.count;
    const float lr_f = static_cast<float>(c.lr), mu = static_cast<float>(c.momentum);
    float* b = buf ? buf + o : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      float d = g[o + i] * grad_scale + wd * p[o + i];
      if (b) d = b[i] = mu * b[i] + d;
      p[o + i] -= lr_f * d;
    }
  }
}

void test_optimizer(Rng& rng, int64_t n) {
  const std::string dims = fmt("(n=%lld)", (long long)n);
  const auto p0 = rng.normal(n, 0.02);
  const auto g = rng.normal(n, 1e-2);
  const auto m0 = rng.normal(n, 1e-3);
  auto v0 = rng.normal(n, 1e-5);
  for (auto& x : v0) x = std::abs(x);
  gpu::AdamWConfig cfg;
  cfg.lr = 3e-4;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.1;
  cfg.step = 7;
  cfg.grad_scale = 0.8f;
  // A unit's table: decayed weight, a norm (no decay), padding, a decayed weight, tail.
  const std::vector<gpu::OptimSegment> segs = {
      {0, 1000, 0.1f}, {1000, 5000, 0.0f}, {7001, n - 7001 - 5, 0.1f}};

  DeviceBuffer<float> d_p(n), d_g(n), d_m(n), d_v(n), d_scale(1);
  DeviceBuffer<bf16> d_pb(n);
  DeviceBuffer<gpu::OptimSegment> d_segs(static_cast<int64_t>(segs.size()));
  d_g.upload(g);
  d_segs.upload(segs);
  auto reset = [&] {
    d_p.upload(p0);
    d_m.upload(m0);
    d_v.upload(v0);
    d_pb.poison();
  };
  auto compare = [&](const std::string& name, const std::vector<float>& p, const std::vector<float>& m,
                     const std::vector<float>& v, bool check_bf16) {
    int64_t nf = 0;
    const auto gp = d_p.download(), gm = d_m.download(), gv = d_v.download();
    report.check(name + " param (bitwise expected)", rel_err(gp, p, &nf), 1e-6, nf);
    report.check(name + " m", rel_err(gm, m, &nf), 1e-6, nf);
    report.check(name + " v", rel_err(gv, v, &nf), 1e-6, nf);
    if (check_bf16) report.check(name + " bf16 shard = bf16(param)", rel_err(d_pb.download(), to_bf16(gp), &nf), kExact, nf);
    return gp;
  };

  {  // one segment covering everything
    auto p = p0, m = m0, v = v0;
    cpu_adamw(p.data(), m.data(), v.data(), g.data(), {{0, n, float(cfg.weight_decay)}}, cfg, cfg.grad_scale);
    reset();
    gpu::adamw_step(d_p.ptr, d_pb.ptr, d_g.ptr, d_m.ptr, d_v.ptr, n, cfg, nullptr, nullptr);
    sync();
    compare("adamw_step " + dims, p, m, v, true);
  }
  {  // segment table: padding and tail untouched
    auto p = p0, m = m0, v = v0;
    cpu_adamw(p.data(), m.data(), v.data(), g.data(), segs, cfg, cfg.grad_scale);
    reset();
    gpu::adamw_step_segments(d_p.ptr, d_pb.ptr, d_g.ptr, d_m.ptr, d_v.ptr, n, d_segs.ptr, int(segs.size()), cfg,
                             nullptr, nullptr);
    sync();
    compare("adamw_step_segments " + dims, p, m, v, true);
  }
  {  // device scale 0.5 with grad_scale 1 == host grad_scale 0.5
    auto p = p0, m = m0, v = v0;
    cpu_adamw(p.data(), m.data(), v.data(), g.data(), segs, cfg, 0.5f);
    reset();
    d_scale.upload({0.5f});
    gpu::AdamWConfig c1 = cfg;
    c1.grad_scale = 1.0f;
    gpu::adamw_step_segments(d_p.ptr, nullptr, d_g.ptr, d_m.ptr, d_v.ptr, n, d_segs.ptr, int(segs.size()), c1,
                             d_scale.ptr, nullptr);
    sync();
    compare("adamw_step_segments device_scale " + dims, p, m, v, false);
  }
  {  // non-finite device scale: the step is skipped
    reset();
    d_scale.upload({std::numeric_limits<float>::quiet_NaN()});
    gpu::adamw_step(d_p.ptr, nullptr, d_g.ptr, d_m.ptr, d_v.ptr, n, cfg, d_scale.ptr, nullptr);
    sync();
    const bool same = d_p.download() == p0 && d_m.download() == m0 && d_v.download() == v0;
    report.check_true("adamw_step device_scale NaN skips the update " + dims, same);
  }
  {  // SGD with momentum over the segment table, and plain SGD
    gpu::SgdConfig sc;
    sc.lr = 1e-2;
    sc.momentum = 0.9;
    sc.weight_decay = 0.0;
    sc.grad_scale = 0.8f;
    auto p = p0, buf = m0;
    cpu_sgd(p.data(), buf.data(), g.data(), segs, sc, sc.grad_scale);
    reset();
    gpu::sgd_step_segments(d_p.ptr, d_pb.ptr, d_g.ptr, d_m.ptr, n, d_segs.ptr, int(segs.size()), sc, nullptr, nullptr);
    sync();
    int64_t nf = 0;
    const auto gp = d_p.download();
    report.check("sgd_step_segments momentum " + dims + " param", rel_err(gp, p, &nf), 1e-6, nf);
    report.check("sgd_step_segments momentum " + dims + " buffer", rel_err(d_m.download(), buf, &nf), 1e-6, nf);
    report.check("sgd_step_segments " + dims + " bf16 shard", rel_err(d_pb.download(), to_bf16(gp), &nf), kExact, nf);
    sc.momentum = 0.0;
    sc.weight_decay = 0.01;
    p = p0;
    cpu_sgd(p.data(), nullptr, g.data(), {{0, n, 0.01f}}, sc, sc.grad_scale);
    reset();
    gpu::sgd_step(d_p.ptr, nullptr, d_g.ptr, nullptr, n, sc, nullptr, nullptr);
    sync();
    report.check("sgd_step " + dims + " param", rel_err(d_p.download(), p, &nf), 1e-6, nf);
  }
}

// ---------------------------------------------------------------- helpers

void test_helpers(Rng& rng, int64_t n) {
  const std::string dims = fmt("(n=%lld)", (long long)n);
  const auto x = rng.normal(n, 1.0), y = rng.normal(n, 1.0);
  DeviceBuffer<float> d_x(n), d_y(n);
  DeviceBuffer<bf16> d_b(n);
  d_x.upload(x);
  int64_t nf = 0;
  // aligned (vector path) and offset by one element (scalar path)
  for (int off : {0, 1}) {
    const int64_t m = n - off;
    const std::string tag = off ? " (unaligned)" : "";
    d_b.poison();
    gpu::cast_f32_to_bf16(d_b.ptr + off, d_x.ptr + off, m, nullptr);
    sync();
    auto got = d_b.download();
    got.erase(got.begin(), got.begin() + off);
    std::vector<float> xs(x.begin() + off, x.end());
    report.check("cast_f32_to_bf16 " + dims + tag, rel_err(got, to_bf16(xs), &nf), kExact, nf);

    d_y.upload(y);
    gpu::accumulate_f32(d_y.ptr + off, d_x.ptr + off, m, nullptr);
    sync();
    auto acc = y;
    for (int64_t i = off; i < n; ++i) acc[size_t(i)] += x[size_t(i)];
    report.check("accumulate_f32 " + dims + tag, rel_err(d_y.download(), acc, &nf), kExact, nf);

    // the fp32 residual stream's add of a bf16 projection output, and its cast (a = nullptr)
    d_b.upload(to_bf16(x));
    const auto xb = to_f32(to_bf16(x));
    for (bool with_a : {true, false}) {
      d_y.upload(y);
      gpu::add_bf16_to_f32(d_y.ptr + off, with_a ? d_y.ptr + off : nullptr, d_b.ptr + off, m, nullptr);
      sync();
      auto sum = y;
      for (int64_t i = off; i < n; ++i) sum[size_t(i)] = (with_a ? y[size_t(i)] : 0.0f) + xb[size_t(i)];
      report.check(std::string(with_a ? "add_bf16_to_f32 " : "add_bf16_to_f32 (cast) ") + dims + tag,
                   rel_err(d_y.download(), sum, &nf), kExact, nf);
    }

    d_y.upload(y);
    gpu::scale_f32(d_y.ptr + off, 0.37f, m, nullptr);
    sync();
    auto sc = y;
    for (int64_t i = off; i < n; ++i) sc[size_t(i)] *= 0.37f;
    report.check("scale_f32 " + dims + tag, rel_err(d_y.download(), sc, &nf), kExact, nf);

    DeviceBuffer<double> d_out(1);
    DeviceBuffer<char> scratch(static_cast<int64_t>(gpu::sum_squares_scratch_bytes()));
    double s[2];
    for (double& si : s) {
      d_out.poison();
      gpu::sum_squares(d_out.ptr, d_x.ptr + off, m, false, scratch.ptr, gpu::sum_squares_scratch_bytes(), nullptr);
      sync();
      si = d_out.download()[0];
    }
    const double ref = cpu::sum_squares<float>(x.data() + off, m);
    report.check("sum_squares " + dims + tag + " vs cpu", std::abs(s[0] - ref) / ref, kTolDouble, std::isfinite(s[0]) ? 0 : 1);
    report.check_true("sum_squares " + dims + tag + " deterministic", std::memcmp(&s[0], &s[1], sizeof(double)) == 0);
    gpu::sum_squares(d_out.ptr, d_x.ptr + off, m, true, scratch.ptr, gpu::sum_squares_scratch_bytes(), nullptr);
    sync();
    report.check("sum_squares " + dims + tag + " accumulate", std::abs(d_out.download()[0] - 2 * s[0]) / (2 * s[0]), kExact);
  }
  // clip_scale, exactly train.cpp's formula
  DeviceBuffer<double> d_ss(1);
  DeviceBuffer<float> d_sc(1);
  const double inf = std::numeric_limits<double>::infinity();
  bool ok = true;
  for (double ss : {4.0, 0.25, inf, std::nan("")}) {
    for (double max_norm : {1.0, 0.0}) {
      d_ss.upload({ss});
      gpu::clip_scale(d_sc.ptr, d_ss.ptr, max_norm, nullptr);
      sync();
      const float got = d_sc.download()[0];
      const double norm = std::sqrt(ss);
      const float want = !std::isfinite(norm) ? std::numeric_limits<float>::quiet_NaN()
                         : (max_norm > 0 && norm > max_norm) ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.0f;
      ok &= (std::isnan(want) && std::isnan(got)) || got == want;
    }
  }
  report.check_true("clip_scale matches train.cpp (and NaN for a non-finite norm)", ok);
}

// ---------------------------------------------------------------- GEMM

// ref rows of C = op(A) op(B) (+ bias) in double; A, B as floats (the bf16 values).
std::vector<double> ref_gemm_rows(bool ta, bool tb, int64_t N, int64_t K, const std::vector<float>& A, int64_t lda,
                                  const std::vector<float>& B, int64_t ldb, const std::vector<int64_t>& rows,
                                  const std::vector<float>* bias) {
  std::vector<double> out(rows.size() * size_t(N));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t ri = 0; ri < int64_t(rows.size()); ++ri)
    for (int64_t j = 0; j < N; ++j) {
      const int64_t i = rows[size_t(ri)];
      double s = bias ? double((*bias)[size_t(j)]) : 0.0;
      for (int64_t k = 0; k < K; ++k)
        s += double(ta ? A[size_t(k * lda + i)] : A[size_t(i * lda + k)]) * double(tb ? B[size_t(j * ldb + k)] : B[size_t(k * ldb + j)]);
      out[size_t(ri * N + j)] = s;
    }
  return out;
}

std::vector<int64_t> all_rows(int64_t M) {
  std::vector<int64_t> r(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i) r[size_t(i)] = i;
  return r;
}
std::vector<int64_t> some_rows(Rng& rng, int64_t M, int64_t k) {
  if (k >= M) return all_rows(M);
  std::vector<int64_t> r = {0, M - 1};
  for (int32_t x : rng.ints(k - 2, 1, M - 1)) r.push_back(x);
  return r;
}

template <class T>
std::vector<double> pick_rows(const std::vector<T>& C, int64_t ldc, int64_t N, const std::vector<int64_t>& rows) {
  std::vector<double> out(rows.size() * size_t(N));
  for (size_t ri = 0; ri < rows.size(); ++ri)
    for (int64_t j = 0; j < N; ++j) out[ri * size_t(N) + size_t(j)] = as_double(C[size_t(rows[ri] * ldc + j)]);
  return out;
}

// One matmul on fresh inputs, checked on `nrows` rows of C: bf16 out (beta 0,
// optional bias) or fp32 out accumulated onto a random C (beta 1).
void gemm_case(gpu::Gemm& gemm, Rng& rng, const char* tag, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
               int64_t pad, gpu::GemmOut out, bool bias, int64_t nrows) {
  const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
  const std::string name = fmt("gemm %s%s%s M=%lld N=%lld K=%lld%s %s%s", tag, ta ? "T" : "N", tb ? "T" : "N",
                               (long long)M, (long long)N, (long long)K, pad ? " padded ld" : "",
                               out == gpu::GemmOut::BF16 ? "bf16 out" : "fp32 out beta=1", bias ? " +bias" : "");
  const auto A = round_bf16(rng.normal((ta ? K : M) * lda, 1.0));
  const auto B = round_bf16(rng.normal((tb ? N : K) * ldb, 1.0));
  const auto bias_f = round_bf16(rng.normal(N, 1.0));
  DeviceBuffer<bf16> d_A(static_cast<int64_t>(A.size())), d_B(static_cast<int64_t>(B.size())), d_bias(N);
  d_A.upload(to_bf16(A));
  d_B.upload(to_bf16(B));
  d_bias.upload(to_bf16(bias_f));
  const auto rows = some_rows(rng, M, nrows);
  auto ref = ref_gemm_rows(ta, tb, N, K, A, lda, B, ldb, rows, bias ? &bias_f : nullptr);
  int64_t nf = 0;
  if (out == gpu::GemmOut::BF16) {
    DeviceBuffer<bf16> d_C(M * ldc);
    d_C.poison();
    gemm.matmul(ta, tb, M, N, K, d_A.ptr, lda, d_B.ptr, ldb, d_C.ptr, ldc, out, 1.0f, 0.0f, bias ? d_bias.ptr : nullptr);
    sync();
    const auto got = pick_rows(d_C.download(), ldc, N, rows);
    report.check(name, rel_err(got, ref, &nf), kTolBf16Out, nf);
  } else {
    const auto C0 = rng.normal(M * ldc, 1.0);
    DeviceBuffer<float> d_C(M * ldc);
    d_C.upload(C0);
    gemm.matmul(ta, tb, M, N, K, d_A.ptr, lda, d_B.ptr, ldb, d_C.ptr, ldc, out, 1.0f, 1.0f);
    sync();
    const auto got = pick_rows(d_C.download(), ldc, N, rows);
    const auto c0 = pick_rows(C0, ldc, N, rows);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += c0[i];
    report.check(name, rel_err(got, ref, &nf), kTolGemmF32, nf);
  }
}

// linear_forward / linear_backward at one shape, checked on sampled rows.
void test_linear(gpu::Gemm& gemm, Rng& rng, const char* tag, int64_t N, int64_t IC, int64_t OC, int64_t nrows) {
  const std::string dims = fmt("%s(N=%lld IC=%lld OC=%lld)", tag, (long long)N, (long long)IC, (long long)OC);
  const auto inp = round_bf16(rng.normal(N * IC, 1.0));
  const auto W = round_bf16(rng.normal(OC * IC, 0.02));
  const auto bias = round_bf16(rng.normal(OC, 0.1));
  const auto dout = round_bf16(rng.normal(N * OC, 1.0));
  const auto dW0 = rng.normal(OC * IC, 0.01);
  const auto db0 = rng.normal(OC, 0.01);
  DeviceBuffer<bf16> d_inp(N * IC), d_W(OC * IC), d_bias(OC), d_dout(N * OC), d_out(N * OC), d_dinp(N * IC);
  DeviceBuffer<float> d_dW(OC * IC), d_db(OC);
  d_inp.upload(to_bf16(inp));
  d_W.upload(to_bf16(W));
  d_bias.upload(to_bf16(bias));
  d_dout.upload(to_bf16(dout));
  int64_t nf = 0;

  d_out.poison();
  gpu::linear_forward(gemm, d_out.ptr, d_inp.ptr, d_W.ptr, d_bias.ptr, N, IC, OC);
  sync();
  const auto out = d_out.download();
  const auto rows_n = some_rows(rng, N, nrows);
  {
    const auto ref = ref_gemm_rows(false, true, OC, IC, inp, IC, W, IC, rows_n, &bias);
    report.check("linear_forward " + dims + " +bias", rel_err(pick_rows(out, OC, OC, rows_n), ref, &nf), kTolBf16Out, nf);
    int64_t unwritten = 0;
    for (const bf16& v : out) unwritten += std::isnan(__bfloat162float(v)) ? 1 : 0;
    report.check_true("linear_forward " + dims + " every element written", unwritten == 0);
  }
  // A residual added in the epilogue: from another buffer, and in place (out holds it).
  {
    const auto R = round_bf16(rng.normal(N * OC, 1.0));
    DeviceBuffer<bf16> d_res(N * OC);
    d_res.upload(to_bf16(R));
    auto ref = ref_gemm_rows(false, true, OC, IC, inp, IC, W, IC, rows_n, &bias);
    const auto r = pick_rows(R, OC, OC, rows_n);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += r[i];
    d_out.poison();
    gpu::linear_forward(gemm, d_out.ptr, d_inp.ptr, d_W.ptr, d_bias.ptr, N, IC, OC, d_res.ptr);
    sync();
    report.check("linear_forward " + dims + " +bias +residual", rel_err(pick_rows(d_out.download(), OC, OC, rows_n), ref, &nf),
                 kTolBf16Out, nf);
    gpu::linear_forward(gemm, d_res.ptr, d_inp.ptr, d_W.ptr, d_bias.ptr, N, IC, OC, d_res.ptr);
    sync();
    report.check("linear_forward " + dims + " +bias +residual in place",
                 rel_err(pick_rows(d_res.download(), OC, OC, rows_n), ref, &nf), kTolBf16Out, nf);
  }

  const size_t sb = gpu::linear_backward_scratch_bytes(N, OC);
  DeviceBuffer<char> scratch(static_cast<int64_t>(std::max<size_t>(sb, 1)));
  std::vector<bf16> dinp[2];
  std::vector<float> dW[2], db[2];
  for (int run = 0; run < 2; ++run) {
    d_dW.upload(dW0);
    d_db.upload(db0);
    d_dinp.poison();
    gpu::linear_backward(gemm, d_dinp.ptr, d_dW.ptr, d_db.ptr, d_dout.ptr, d_inp.ptr, d_W.ptr, N, IC, OC, scratch.ptr, sb);
    sync();
    dinp[run] = d_dinp.download();
    dW[run] = d_dW.download();
    db[run] = d_db.download();
  }
  {
    const auto ref = ref_gemm_rows(false, false, IC, OC, dout, OC, W, IC, rows_n, nullptr);
    report.check("linear_backward " + dims + " dinp", rel_err(pick_rows(dinp[0], IC, IC, rows_n), ref, &nf), kTolBf16Out, nf);
  }
  {
    const auto rows_o = some_rows(rng, OC, nrows);
    auto ref = ref_gemm_rows(true, false, IC, N, dout, OC, inp, IC, rows_o, nullptr);
    const auto w0 = pick_rows(dW0, IC, IC, rows_o);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += w0[i];
    report.check("linear_backward " + dims + " dweight +=", rel_err(pick_rows(dW[0], IC, IC, rows_o), ref, &nf), kTolGemmF32, nf);
  }
  {
    std::vector<double> ref(static_cast<size_t>(OC));
    for (int64_t o = 0; o < OC; ++o) {
      double s = 0;
      for (int64_t t = 0; t < N; ++t) s += dout[size_t(t * OC + o)];
      ref[size_t(o)] = db0[size_t(o)] + s;
    }
    report.check("linear_backward " + dims + " dbias +=", rel_err(db[0], ref, &nf), kTolF32Acc, nf);
  }
  // Dinp::Accumulate: the input gradient added to what dinp holds (k's and v's onto q's).
  {
    const auto D0 = round_bf16(rng.normal(N * IC, 1.0));
    d_dinp.upload(to_bf16(D0));
    d_dW.upload(dW0);
    d_db.upload(db0);
    gpu::linear_backward(gemm, d_dinp.ptr, d_dW.ptr, d_db.ptr, d_dout.ptr, d_inp.ptr, d_W.ptr, N, IC, OC, scratch.ptr, sb,
                         gpu::Dinp::Accumulate);
    sync();
    auto ref = ref_gemm_rows(false, false, IC, OC, dout, OC, W, IC, rows_n, nullptr);
    const auto d0 = pick_rows(D0, IC, IC, rows_n);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += d0[i];
    report.check("linear_backward " + dims + " dinp +=", rel_err(pick_rows(d_dinp.download(), IC, IC, rows_n), ref, &nf),
                 kTolBf16Out, nf);
  }
  check_bitwise("linear_backward " + dims + " deterministic dinp", dinp[0], dinp[1]);
  check_bitwise("linear_backward " + dims + " deterministic dweight", dW[0], dW[1]);
  check_bitwise("linear_backward " + dims + " deterministic dbias", db[0], db[1]);
}

void test_gemm(Rng& rng, void* workspace, size_t workspace_bytes) {
  gpu::Gemm gemm(nullptr, workspace, workspace_bytes);
  using gpu::GemmOut;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      gemm_case(gemm, rng, "tiny ", ta, tb, 5, 72, 40, 0, GemmOut::BF16, false, 5);
      gemm_case(gemm, rng, "tiny ", ta, tb, 5, 72, 40, 8, GemmOut::F32, false, 5);
    }
  gemm_case(gemm, rng, "tiny ", false, true, 5, 72, 40, 0, GemmOut::BF16, true, 5);
  gemm_case(gemm, rng, "odd ", false, false, 5, 67, 33, 0, GemmOut::BF16, false, 5);
  gemm_case(gemm, rng, "odd ", true, false, 7, 67, 33, 0, GemmOut::F32, false, 7);
  test_linear(gemm, rng, "tiny ", 5, 72, 24, 5);
  test_linear(gemm, rng, "1B qkv ", 4096, 2048, 3072, 16);
  gemm_case(gemm, rng, "1B lm_head ", false, true, 4096, 128256, 2048, 0, GemmOut::BF16, false, 4);
  // The plan cache: repeating shapes adds no plans.
  const size_t plans = gemm.plans_cached();
  test_linear(gemm, rng, "1B qkv (again) ", 4096, 2048, 3072, 4);
  report.check_true(fmt("gemm plan cache: %zu plans, none added by repeated shapes", plans), gemm.plans_cached() == plans,
                    fmt("%zu plans after the repeat", gemm.plans_cached()));
}

// ---------------------------------------------------------------- timing

__global__ void fill_normal_bf16(bf16* x, int64_t n, uint64_t seed, float sigma) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t h = seed ^ (uint64_t(i) * 0x9e3779b97f4a7c15ull);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    const float u1 = (float(h >> 40) + 0.5f) * 0x1.0p-24f, u2 = (float(h & 0xffffff) + 0.5f) * 0x1.0p-24f;
    x[i] = __float2bfloat16_rn(sigma * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}
__global__ void fill_normal_f32(float* x, int64_t n, uint64_t seed, float sigma, bool absolute) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t h = seed ^ (uint64_t(i) * 0x9e3779b97f4a7c15ull);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    const float u1 = (float(h >> 40) + 0.5f) * 0x1.0p-24f, u2 = (float(h & 0xffffff) + 0.5f) * 0x1.0p-24f;
    const float v = sigma * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    x[i] = absolute ? fabsf(v) : v;
  }
}

struct Timer {
  DeviceBuffer<char> flush;  // larger than L2: every timed run starts from HBM
  cudaEvent_t start{}, stop{};
  explicit Timer(int64_t flush_bytes) : flush(flush_bytes) {
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  // Median of 20 timed runs after 3 warm-ups, in microseconds.
  double median_us(const std::function<void()>& launch) {
    for (int i = 0; i < 3; ++i) launch();
    std::vector<float> ms;
    for (int i = 0; i < 20; ++i) {
      CUDA_CHECK(cudaMemsetAsync(flush.ptr, i, flush.bytes(), nullptr));
      CUDA_CHECK(cudaEventRecord(start, nullptr));
      launch();
      CUDA_CHECK(cudaEventRecord(stop, nullptr));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return 1000.0 * 0.5 * (ms[9] + ms[10]);
  }
};

void print_time(const char* kernel, const std::string& dims, double us, double bytes, double flops) {
  if (flops > 0) {
    const double tf = flops / (us * 1e-6) / 1e12;
    std::printf("%-26s %-34s %10.1f %10s %7s %9.1f %6.1f%%\n", kernel, dims.c_str(), us, "", "", tf, 100 * tf / kPeakTflops);
  } else {
    const double gbs = bytes / (us * 1e-6) / 1e9;
    std::printf("%-26s %-34s %10.1f %10.1f %6.1f%% %9s %7s\n", kernel, dims.c_str(), us, gbs, 100 * gbs / kPeakGBs, "", "");
  }
  std::fflush(stdout);
}

void run_timings(void* workspace, size_t workspace_bytes, int64_t l2_bytes) {
  const int64_t N = 4096, C = 2048, V = 128256, H = 32, KV = 8, D = 64, I = 8192, QKV = (H + 2 * KV) * D;
  const int64_t n_opt = int64_t(64) << 20;
  std::printf("\ntimings at the Llama-3.2-1B shape (N=%lld tokens), median of 20 after 3 warm-ups, L2 flushed before each;\n"
              "GB/s counts the fewest bytes each kernel must move (each input read once, each output written once)\n",
              (long long)N);
  std::printf("%-26s %-34s %10s %10s %7s %9s %7s\n", "kernel", "shape", "time_us", "GB/s", "%3000", "TFLOP/s", "%800");
  Timer timer(std::max<int64_t>(2 * l2_bytes, 128 << 20));
  uint64_t seed = 1;
  auto randn_bf16 = [&](DeviceBuffer<bf16>& b, float sigma) {
    fill_normal_bf16<<<1024, 256>>>(b.ptr, int64_t(b.n), ++seed * 0x2545f4914f6cdd1dull, sigma);
    CUDA_CHECK(cudaGetLastError());
  };
  auto randn_f32 = [&](DeviceBuffer<float>& b, float sigma, bool absolute = false) {
    fill_normal_f32<<<1024, 256>>>(b.ptr, int64_t(b.n), ++seed * 0x2545f4914f6cdd1dull, sigma, absolute);
    CUDA_CHECK(cudaGetLastError());
  };
  Rng rng{12345};
  const double bf = 2.0, f4 = 4.0;

  // embedding
  {
    DeviceBuffer<bf16> table(V * C), out(N * C), dout(N * C);
    DeviceBuffer<float> dtable(V * C);
    DeviceBuffer<int32_t> ids(N);
    randn_bf16(table, 1.0f);
    randn_bf16(dout, 1.0f);
    randn_f32(dtable, 0.01f);
    const auto h_ids = rng.ints(N, 0, V);
    ids.upload(h_ids);
    std::vector<int32_t> u = h_ids;
    std::sort(u.begin(), u.end());
    const double unique = double(std::unique(u.begin(), u.end()) - u.begin());
    const size_t sb = gpu::embedding_backward_scratch_bytes(N, C);
    DeviceBuffer<char> scratch(static_cast<int64_t>(sb));
    const std::string dims = fmt("N=%lld C=%lld V=%lld", (long long)N, (long long)C, (long long)V);
    double us = timer.median_us([&] { gpu::embedding_forward(out.ptr, ids.ptr, table.ptr, N, V, C, nullptr); });
    print_time("embedding_forward", dims, us, 2 * N * C * bf + N * 4.0, 0);
    us = timer.median_us([&] { gpu::embedding_backward(dtable.ptr, dout.ptr, ids.ptr, N, V, C, scratch.ptr, sb, nullptr); });
    print_time("embedding_backward", dims, us, N * C * bf + 2 * unique * C * f4 + N * 4.0, 0);
  }
  // RMSNorm (hidden), fused residual, backward with dresidual; Qwen3 q norm
  for (auto [rows, c, tag] : {std::tuple<int64_t, int64_t, const char*>{N, C, "hidden"},
                              std::tuple<int64_t, int64_t, const char*>{N * H, D, "q-norm"}}) {
    const int64_t n = rows * c;
    DeviceBuffer<bf16> a(n), b(n), out(n), res(n), w(c), dout(n), dres(n);
    DeviceBuffer<float> rstd(rows), dw(c);
    randn_bf16(a, 1.0f);
    randn_bf16(b, 1.0f);
    randn_bf16(w, 1.0f);
    randn_bf16(dout, 1.0f);
    randn_bf16(dres, 1.0f);
    randn_f32(dw, 0.01f);
    const size_t sb = gpu::rmsnorm_backward_scratch_bytes(rows, c);
    DeviceBuffer<char> scratch(static_cast<int64_t>(std::max<size_t>(sb, 1)));
    gpu::rmsnorm_forward(out.ptr, rstd.ptr, a.ptr, w.ptr, rows, c, 1e-5, nullptr);
    const std::string dims = fmt("%s rows=%lld C=%lld", tag, (long long)rows, (long long)c);
    double us = timer.median_us([&] { gpu::rmsnorm_forward(out.ptr, rstd.ptr, a.ptr, w.ptr, rows, c, 1e-5, nullptr); });
    print_time("rmsnorm_forward", dims, us, 2 * n * bf + rows * f4, 0);
    if (c == C) {
      us = timer.median_us([&] { gpu::residual_rmsnorm_forward(res.ptr, out.ptr, rstd.ptr, a.ptr, b.ptr, w.ptr, rows, c, 1e-5, nullptr); });
      print_time("residual_rmsnorm_forward", dims, us, 4 * n * bf + rows * f4, 0);
      us = timer.median_us([&] {
        gpu::rmsnorm_backward(out.ptr, dw.ptr, dout.ptr, a.ptr, w.ptr, rstd.ptr, dres.ptr, rows, c, scratch.ptr, sb, nullptr);
      });
      print_time("rmsnorm_backward +dres", dims, us, 4 * n * bf + rows * f4, 0);
    } else {
      us = timer.median_us([&] {
        gpu::rmsnorm_backward(out.ptr, dw.ptr, dout.ptr, a.ptr, w.ptr, rstd.ptr, nullptr, rows, c, scratch.ptr, sb, nullptr);
      });
      print_time("rmsnorm_backward", dims, us, 3 * n * bf + rows * f4, 0);
    }
  }
  // RoPE: q alone, and q|k inside the fused qkv buffer
  {
    DeviceBuffer<bf16> q(N * H * D), qkv(N * QKV);
    DeviceBuffer<int32_t> pos(N);
    DeviceBuffer<float> inv(D / 2);
    randn_bf16(q, 1.0f);
    randn_bf16(qkv, 1.0f);
    pos.upload(rng.ints(N, 0, 4096));
    const auto f = cpu::rope_inv_freq(D, 500000.0, shardlm::RopeScaling{});
    inv.upload(std::vector<float>(f.begin(), f.end()));
    double us = timer.median_us([&] { gpu::rope_forward(q.ptr, pos.ptr, inv.ptr, N, H, D, 0, nullptr); });
    print_time("rope_forward", fmt("q N=%lld H=%lld D=%lld", (long long)N, (long long)H, (long long)D), us, 2 * N * H * D * bf, 0);
    us = timer.median_us([&] { gpu::rope_forward(qkv.ptr, pos.ptr, inv.ptr, N, H + KV, D, QKV, nullptr); });
    print_time("rope_forward", fmt("q|k in qkv N=%lld heads=%lld", (long long)N, (long long)(H + KV)), us, 2 * N * (H + KV) * D * bf, 0);
  }
  // SwiGLU on the fused gate|up buffer
  {
    DeviceBuffer<bf16> gu(N * 2 * I), h(N * I), dh(N * I);
    randn_bf16(gu, 2.0f);
    randn_bf16(dh, 1.0f);
    const std::string dims = fmt("fused N=%lld I=%lld", (long long)N, (long long)I);
    double us = timer.median_us([&] { gpu::swiglu_forward(h.ptr, I, gu.ptr, 2 * I, gu.ptr + I, 2 * I, N, I, nullptr); });
    print_time("swiglu_forward", dims, us, 3 * N * I * bf, 0);
    us = timer.median_us([&] {
      gpu::swiglu_backward(gu.ptr, 2 * I, gu.ptr + I, 2 * I, dh.ptr, I, gu.ptr, 2 * I, gu.ptr + I, 2 * I, N, I, nullptr);
    });
    print_time("swiglu_backward (in place)", dims, us, 5 * N * I * bf, 0);
  }
  // cross-entropy over the full vocabulary
  DeviceBuffer<bf16> logits(N * V);
  {
    DeviceBuffer<int32_t> targets(N);
    DeviceBuffer<float> weights(N), loss(N);
    DeviceBuffer<double> sum(1);
    targets.upload(rng.ints(N, 0, V));
    weights.upload(rng.uniform(N, 0.5, 1.5));
    randn_bf16(logits, 3.0f);
    double us = timer.median_us([&] {
      gpu::cross_entropy_forward_backward(logits.ptr, loss.ptr, targets.ptr, weights.ptr, 1e-3f, N, V, nullptr);
    });
    print_time("cross_entropy", fmt("n=%lld V=%lld", (long long)N, (long long)V), us, 2 * N * V * bf + N * 12.0, 0);
    us = timer.median_us([&] { gpu::sum_rows(sum.ptr, loss.ptr, N, false, nullptr); });
    print_time("sum_rows", fmt("n=%lld", (long long)N), us, N * f4, 0);
  }
  // optimizer and helpers on a 64M-element shard
  {
    DeviceBuffer<float> p(n_opt), g(n_opt), m(n_opt), v(n_opt);
    DeviceBuffer<bf16> pb(n_opt);
    DeviceBuffer<double> out(1);
    DeviceBuffer<char> scratch(static_cast<int64_t>(gpu::sum_squares_scratch_bytes()));
    randn_f32(p, 0.02f);
    randn_f32(g, 0.01f);
    randn_f32(m, 1e-3f);
    randn_f32(v, 1e-5f, true);
    const std::vector<gpu::OptimSegment> segs = {{0, n_opt / 2, 0.1f}, {n_opt / 2, 4096, 0.0f}, {n_opt / 2 + 4096, n_opt / 2 - 4096, 0.1f}};
    DeviceBuffer<gpu::OptimSegment> d_segs(3);
    d_segs.upload(segs);
    gpu::AdamWConfig cfg;
    cfg.lr = 1e-4;
    cfg.weight_decay = 0.1;
    const std::string dims = fmt("n=%lldM", (long long)(n_opt >> 20));
    double us = timer.median_us([&] {
      gpu::adamw_step_segments(p.ptr, pb.ptr, g.ptr, m.ptr, v.ptr, n_opt, d_segs.ptr, 3, cfg, nullptr, nullptr);
    });
    print_time("adamw_step_segments +bf16", dims, us, n_opt * (4 * f4 + 3 * f4 + bf), 0);
    gpu::SgdConfig sc;
    sc.lr = 1e-3;
    sc.momentum = 0.9;
    us = timer.median_us([&] { gpu::sgd_step(p.ptr, pb.ptr, g.ptr, m.ptr, n_opt, sc, nullptr, nullptr); });
    print_time("sgd_step momentum +bf16", dims, us, n_opt * (3 * f4 + 2 * f4 + bf), 0);
    us = timer.median_us([&] {
      gpu::sum_squares(out.ptr, g.ptr, n_opt, false, scratch.ptr, gpu::sum_squares_scratch_bytes(), nullptr);
    });
    print_time("sum_squares", dims, us, n_opt * f4, 0);
    us = timer.median_us([&] { gpu::cast_f32_to_bf16(pb.ptr, p.ptr, n_opt, nullptr); });
    print_time("cast_f32_to_bf16", dims, us, n_opt * (f4 + bf), 0);
    us = timer.median_us([&] { gpu::accumulate_f32(m.ptr, g.ptr, n_opt, nullptr); });
    print_time("accumulate_f32", dims, us, n_opt * 3 * f4, 0);
    us = timer.median_us([&] { gpu::scale_f32(m.ptr, 0.999f, n_opt, nullptr); });
    print_time("scale_f32", dims, us, n_opt * 2 * f4, 0);
  }
  // bias gradient of the fused qkv projection
  {
    DeviceBuffer<bf16> dout(N * QKV);
    DeviceBuffer<float> db(QKV);
    randn_bf16(dout, 1.0f);
    randn_f32(db, 0.01f);
    const size_t sb = gpu::bias_grad_scratch_bytes(N, QKV);
    DeviceBuffer<char> scratch(static_cast<int64_t>(sb));
    const double us = timer.median_us([&] { gpu::bias_grad(db.ptr, dout.ptr, N, QKV, scratch.ptr, sb, nullptr); });
    print_time("bias_grad", fmt("N=%lld OC=%lld", (long long)N, (long long)QKV), us, N * QKV * bf, 0);
  }
  // GEMMs of one layer and the lm-head
  {
    gpu::Gemm gemm(nullptr, workspace, workspace_bytes);
    DeviceBuffer<bf16> x(N * 2 * I), w(V * C), y(N * 2 * I), bias(QKV);
    DeviceBuffer<float> dw(2 * I * C);
    randn_bf16(x, 1.0f);
    randn_bf16(w, 0.02f);
    randn_bf16(bias, 0.1f);
    randn_f32(dw, 0.01f);
    struct G {
      const char* name;
      bool ta, tb;
      int64_t M, Nn, K;
      gpu::GemmOut out;
      bool bias;
    };
    using gpu::GemmOut;
    const G cases[] = {
        {"gemm qkv fwd +bias", false, true, N, QKV, C, GemmOut::BF16, true},
        {"gemm o_proj fwd", false, true, N, C, H * D, GemmOut::BF16, false},
        {"gemm gate_up fwd", false, true, N, 2 * I, C, GemmOut::BF16, false},
        {"gemm down fwd", false, true, N, C, I, GemmOut::BF16, false},
        {"gemm lm_head fwd", false, true, N, V, C, GemmOut::BF16, false},
        {"gemm down dinp", false, false, N, I, C, GemmOut::BF16, false},
        {"gemm gate_up dW fp32 +=", true, false, 2 * I, C, N, GemmOut::F32, false},
    };
    for (const G& c : cases) {
      void* out = c.out == GemmOut::F32 ? static_cast<void*>(dw.ptr) : (c.Nn == V ? static_cast<void*>(logits.ptr) : static_cast<void*>(y.ptr));
      const int64_t lda = c.ta ? c.M : c.K, ldb = c.tb ? c.K : c.Nn;
      const double us = timer.median_us([&] {
        gemm.matmul(c.ta, c.tb, c.M, c.Nn, c.K, x.ptr, lda, w.ptr, ldb, out, c.Nn, c.out, 1.0f,
                    c.out == GemmOut::F32 ? 1.0f : 0.0f, c.bias ? bias.ptr : nullptr);
      });
      print_time(c.name, fmt("M=%lld N=%lld K=%lld", (long long)c.M, (long long)c.Nn, (long long)c.K), us, 0,
                 2.0 * double(c.M) * double(c.Nn) * double(c.K));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = uint64_t(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  bool timing = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (std::strcmp(argv[i], "--no-timing") == 0) timing = false;
    else {
      std::fprintf(stderr, "usage: %s [--seed N] [--no-timing]\n", argv[0]);
      return 2;
    }
  }
  try {
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    std::printf("test_cuda_ops: %s, %d SMs, %.0f MB L2, compute %d.%d; seed %llu (rerun with --seed %llu); %d CPU threads\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.major, prop.minor,
                (unsigned long long)seed, (unsigned long long)seed, omp_get_max_threads());
    if (prop.major < 9) {
      std::printf("FAIL: needs a Hopper GPU (compute capability 9.0; the cross-entropy uses thread block clusters)\n");
      return 1;
    }
    std::printf("%-66s %10s %9s  %s\n", "check", "rel_err", "threshold", "result");
    const auto t0 = std::chrono::steady_clock::now();
    Rng rng{seed};
    const size_t workspace_bytes = size_t(32) << 20;
    DeviceBuffer<char> workspace(static_cast<int64_t>(workspace_bytes));

    test_embedding(rng, "tiny", 5, 1000, 72, 4, true);
    test_embedding(rng, "odd", 77, 1000, 67, 30, false);
    test_embedding(rng, "1B", 4096, 128256, 2048, 128256, false);
    test_embedding(rng, "repeats", 4096, 2048, 2048, 64, false);

    test_rmsnorm(rng, "tiny ", 5, 72);
    test_rmsnorm(rng, "odd ", 5, 67);
    test_rmsnorm(rng, "1B ", 4096, 2048);
    test_rmsnorm(rng, "q-norm ", 4096 * 32, 64);
    test_rmsnorm(rng, "wide ", 33, 8192);

    test_rope(rng, "tiny ", 5, 3, 72, 0);
    test_rope(rng, "1B q ", 4096, 32, 64, 0);
    test_rope(rng, "1B q|k in qkv ", 4096, 40, 64, 48 * 64);

    test_swiglu(rng, "tiny ", 5, 72, false);
    test_swiglu(rng, "odd ", 5, 67, false);
    test_swiglu(rng, "tiny ", 5, 72, true);
    test_swiglu(rng, "1B ", 4096, 8192, true);
    test_fused_amax(rng, "tiny ", 5, 72, 72);
    test_fused_amax(rng, "odd ", 5, 67, 67);
    test_fused_amax(rng, "1B ", 4096, 2048, 8192);

    test_cross_entropy(rng, "tiny ", 6, 1000, 6, true);
    test_cross_entropy(rng, "odd ", 5, 1001, 5, false);
    test_cross_entropy(rng, "1B ", 4096, 128256, 24, false);
    test_cross_entropy(rng, "qwen ", 8, 151936, 8, false);

    test_optimizer(rng, (int64_t(1) << 20) + 3);
    test_helpers(rng, (int64_t(1) << 20) + 3);
    test_gemm(rng, workspace.ptr, workspace_bytes);

    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("checks: %d passed, %d failed (%.1f s)\n", report.passed, report.failed, secs);
    if (timing) run_timings(workspace.ptr, workspace_bytes, prop.l2CacheSize);
    CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    std::printf("%d passed, %d failed\n", report.passed, report.failed + 1);
    return 1;
  }
  std::printf("%d passed, %d failed\n", report.passed, report.failed);
  return report.failed == 0 ? 0 : 1;
}
