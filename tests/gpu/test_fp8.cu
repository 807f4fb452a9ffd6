// test_fp8.cu — FP8: the CPU emulation (src/cpu/fp8.hpp) against
// cuda_fp8.h's own conversions, then the CUDA kernels (src/cuda/fp8.hpp) against
// the emulation, then the cuBLASLt FP8 GEMM against the exact product of what it
// reads, and its speed beside the bf16 GEMM at the training shapes.
//
//   host:   every one of the 256 codes of e4m3 and e5m2 decodes to the same value;
//           2M floats (every magnitude, the midpoints between codes and their
//           neighbours, saturation, zeros, subnormals) encode to the same byte as
//           __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)  — bit-exact, no tolerance
//   kernels: amax of a tensor, of rows, of columns; scales; codes (tensor / row /
//           column scales, plain and transposed) — bit-exact against the CPU
//   GEMM:   tensorwise and rowwise, e4m3 x e4m3 and e5m2 x e4m3, bf16 and fp32 out,
//           beta = 1 accumulation; ||gpu - ref|| / ||ref|| against a double sum of
//           the dequantised codes: bf16 out 1e-2 (one rounding), fp32 out 5e-4
//           (Hopper's FP8 tensor cores add the exact products with ~14 mantissa
//           bits, not fp32's 24 — DeepSeek-V3's report, section 3.3.2: measured
//           1.2e-4 to 1.4e-4 on the H200 at every K from 128 to 2048, 2026-12-02)
//   timing: FP8 (tensorwise, fast accumulation off and on) vs bf16 TFLOP/s
//
// Usage: test_fp8 [--seed N] [--host-only] [--no-timing]
// --host-only runs without a GPU (the machine that builds it). One line per
// check; the last line "N passed, M failed"; non-zero exit status on a failure.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/fp8.hpp"
#include "cuda/check.hpp"
#include "cuda/fp8.hpp"
#include "cuda/gemm.hpp"

namespace {

namespace cpu = shardlm::cpu;
namespace gpu = shardlm::cuda;
using bf16 = __nv_bfloat16;
using cpu::Fp8Format;

int passed = 0, failed = 0;

void check(const std::string& name, double err, double tol) {
  const bool ok = err <= tol;
  std::printf("%-78s %.3e <= %.0e  %s\n", name.c_str(), err, tol, ok ? "PASS" : "FAIL");
  (ok ? passed : failed)++;
}
void check_count(const std::string& name, int64_t bad, int64_t total) {
  const bool ok = bad == 0;
  std::printf("%-78s %lld of %lld differ  %s\n", name.c_str(), (long long)bad, (long long)total, ok ? "PASS" : "FAIL");
  (ok ? passed : failed)++;
}

const char* name_of(Fp8Format f) { return f == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }
__nv_fp8_interpretation_t kind_of(Fp8Format f) { return f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2; }

float nv_value(uint8_t code, Fp8Format f) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(code, kind_of(f));
  return __half2float(__half(h));
}

// ---------------------------------------------------------------- host: emulation vs cuda_fp8.h

void host_checks(uint64_t seed) {
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    int64_t bad = 0;
    std::vector<float> values;
    for (int c = 0; c < 256; ++c) {
      const float mine = cpu::fp8_value(uint8_t(c), f), theirs = nv_value(uint8_t(c), f);
      const bool same = (std::isnan(mine) && std::isnan(theirs)) || mine == theirs;
      if (!same) {
        if (bad < 5) std::printf("  code 0x%02x: emulation %g, cuda_fp8.h %g\n", c, mine, theirs);
        ++bad;
      }
      if (std::isfinite(mine) && mine > 0) values.push_back(mine);
    }
    check_count(std::string("host ") + name_of(f) + ": the 256 codes decode alike", bad, 256);

    // Floats to encode: random magnitudes over the whole float range near the
    // format's, every midpoint between neighbouring codes and one float either
    // side of it, and the edges.
    std::sort(values.begin(), values.end());
    std::vector<float> xs = {0.0f, -0.0f, INFINITY, -INFINITY, cpu::fp8_max(f), -cpu::fp8_max(f),
                             cpu::fp8_max(f) * 1.03f, cpu::fp8_max(f) * 1.1f, 1e30f, -1e30f, 1e-30f, -1e-30f};
    for (size_t i = 0; i + 1 < values.size(); ++i) {
      const float mid = 0.5f * (values[i] + values[i + 1]);
      for (float m : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), values[i]})
        xs.push_back(m), xs.push_back(-m);
    }
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> mant(1.0f, 2.0f);
    std::uniform_int_distribution<int> ex(-30, 20);
    while (xs.size() < 2000000) xs.push_back((rng() & 1 ? -1.0f : 1.0f) * std::ldexp(mant(rng), ex(rng)));
    bad = 0;
    for (float x : xs) {
      const uint8_t mine = cpu::fp8_bits(x, f);
      const uint8_t theirs = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, kind_of(f));
      if (mine != theirs) {
        if (bad < 5) std::printf("  %a: emulation 0x%02x, cuda_fp8.h 0x%02x\n", x, mine, theirs);
        ++bad;
      }
    }
    check_count(std::string("host ") + name_of(f) + ": floats encode to the same byte (RNE, saturating)", bad,
                int64_t(xs.size()));
  }
}

// ---------------------------------------------------------------- device helpers

template <class T>
T* device_alloc(size_t n) {
  T* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)));
  return p;
}
template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
template <class T>
void upload(T* d, const std::vector<T>& h) {
  CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// Random bf16 values with a spread of magnitudes (so rows differ in amax), and
// their fp32 values.
void random_bf16(std::mt19937_64& rng, int64_t rows, int64_t cols, std::vector<bf16>& b, std::vector<float>& f) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> row_scale(-6.0f, 6.0f);
  b.resize(size_t(rows * cols));
  f.resize(b.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float s = std::exp2(row_scale(rng));
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = size_t(r * cols + c);
      b[i] = __float2bfloat16(nd(rng) * s * (c % 7 == 3 ? 8.0f : 1.0f));
      f[i] = __bfloat162float(b[i]);
    }
  }
}

// ---------------------------------------------------------------- kernels vs emulation

void kernel_checks(uint64_t seed, cudaStream_t stream) {
  std::mt19937_64 rng(seed + 1);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{5, 67}, {64, 96}, {300, 1000}, {4096, 2048}}) {
    std::vector<bf16> xb;
    std::vector<float> xf;
    random_bf16(rng, rows, cols, xb, xf);
    const int64_t n = rows * cols;
    bf16* x = device_alloc<bf16>(size_t(n));
    upload(x, xb);
    // The same values as a column block of a wider matrix (rows ld apart, as dgate inside dgate|dup).
    const int64_t ld = cols + 24;
    std::vector<bf16> wide(size_t(rows * ld), __float2bfloat16(1e4f));  // larger than any x: a stray read shows
    for (int64_t r = 0; r < rows; ++r) std::copy_n(xb.begin() + r * cols, cols, wide.begin() + r * ld);
    bf16* xw = device_alloc<bf16>(wide.size());
    upload(xw, wide);
    float* amax = device_alloc<float>(size_t(std::max(rows, cols)));
    float* scale = device_alloc<float>(size_t(std::max(rows, cols)));
    float* inv = device_alloc<float>(size_t(std::max(rows, cols)));
    uint8_t* codes = device_alloc<uint8_t>(size_t(n));
    const std::string shape = "(" + std::to_string(rows) + ", " + std::to_string(cols) + ")";

    // amaxes, CPU
    std::vector<float> ref_rows(static_cast<size_t>(rows), 0.0f), ref_cols(static_cast<size_t>(cols), 0.0f);
    float ref_all = 0.0f;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float a = std::fabs(xf[size_t(r * cols + c)]);
        ref_rows[size_t(r)] = std::max(ref_rows[size_t(r)], a);
        ref_cols[size_t(c)] = std::max(ref_cols[size_t(c)], a);
        ref_all = std::max(ref_all, a);
      }
    for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2})
      for (gpu::Fp8Scaling scaling : {gpu::Fp8Scaling::Tensor, gpu::Fp8Scaling::Rows, gpu::Fp8Scaling::Cols}) {
        const char* how = scaling == gpu::Fp8Scaling::Tensor ? "tensor" : scaling == gpu::Fp8Scaling::Rows ? "rows" : "cols";
        const std::vector<float>& ref_amax =
            scaling == gpu::Fp8Scaling::Rows ? ref_rows : scaling == gpu::Fp8Scaling::Cols ? ref_cols
                                                                                           : std::vector<float>{ref_all};
        const int64_t m = int64_t(ref_amax.size());
        if (scaling == gpu::Fp8Scaling::Tensor) gpu::fp8_amax(x, n, amax, stream);
        if (scaling == gpu::Fp8Scaling::Rows) gpu::fp8_amax_rows(x, rows, cols, amax, stream);
        if (scaling == gpu::Fp8Scaling::Cols) gpu::fp8_amax_cols(x, rows, cols, amax, stream);
        gpu::fp8_scales(amax, m, f, scale, inv, stream);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto got_amax = download(amax, size_t(m));
        const auto got_scale = download(scale, size_t(m));
        const auto got_inv = download(inv, size_t(m));
        int64_t bad = 0;
        std::vector<float> ref_scale(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i) {
          ref_scale[size_t(i)] = cpu::fp8_scale(ref_amax[size_t(i)], f);
          bad += got_amax[size_t(i)] != ref_amax[size_t(i)] || got_scale[size_t(i)] != ref_scale[size_t(i)] ||
                 got_inv[size_t(i)] != 1.0f / ref_scale[size_t(i)];
        }
        check_count(std::string("amax + scales ") + name_of(f) + " per " + how + " " + shape, bad, m);
        if (scaling == gpu::Fp8Scaling::Tensor) gpu::fp8_amax(xw, rows, cols, ld, amax, stream);
        if (scaling == gpu::Fp8Scaling::Rows) gpu::fp8_amax_rows(xw, rows, cols, amax, stream, ld);
        if (scaling == gpu::Fp8Scaling::Cols) gpu::fp8_amax_cols(xw, rows, cols, amax, stream, ld);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        check_count(std::string("amax ") + name_of(f) + " per " + how + " " + shape + ", rows " + std::to_string(ld) +
                        " apart = packed",
                    download(amax, size_t(m)) == got_amax ? 0 : m, m);
        for (bool transpose : {false, true}) {
          CUDA_CHECK(cudaMemsetAsync(codes, 0xAB, size_t(n), stream));
          gpu::fp8_quantize(x, rows, cols, scale, scaling, f, codes, transpose, stream);
          CUDA_CHECK(cudaStreamSynchronize(stream));
          const auto got = download(codes, size_t(n));
          bad = 0;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) {
              const float s = ref_scale[size_t(scaling == gpu::Fp8Scaling::Tensor ? 0 : scaling == gpu::Fp8Scaling::Rows ? r : c)];
              const uint8_t want = cpu::fp8_bits(xf[size_t(r * cols + c)] * s, f);
              bad += got[size_t(transpose ? c * rows + r : r * cols + c)] != want;
            }
          check_count(std::string("quantize ") + name_of(f) + " per " + how + (transpose ? " transposed " : " ") + shape,
                      bad, n);
          CUDA_CHECK(cudaMemsetAsync(codes, 0xAB, size_t(n), stream));
          gpu::fp8_quantize(xw, rows, cols, scale, scaling, f, codes, transpose, stream, ld);
          CUDA_CHECK(cudaStreamSynchronize(stream));
          const auto got_wide = download(codes, size_t(n));
          bad = 0;
          for (int64_t i = 0; i < n; ++i) bad += got_wide[size_t(i)] != got[size_t(i)];
          check_count(std::string("quantize ") + name_of(f) + " per " + how + (transpose ? " transposed " : " ") + shape +
                          ", rows " + std::to_string(ld) + " apart = packed",
                      bad, n);
          if (scaling == gpu::Fp8Scaling::Tensor) {
            // The scale made inside the quantise kernel (fp8_quantize_tensor): the same codes, scale and inverse.
            float* scale2 = device_alloc<float>(1);
            float* inv2 = device_alloc<float>(1);
            CUDA_CHECK(cudaMemsetAsync(codes, 0xAB, size_t(n), stream));
            gpu::fp8_amax(x, n, amax, stream);
            gpu::fp8_quantize_tensor(xw, rows, cols, amax, f, scale2, inv2, codes, transpose, stream, ld);
            CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto got_fused = download(codes, size_t(n));
            bad = 0;
            for (int64_t i = 0; i < n; ++i) bad += got_fused[size_t(i)] != got[size_t(i)];
            bad += download(scale2, 1)[0] != ref_scale[0] || download(inv2, 1)[0] != 1.0f / ref_scale[0];
            check_count(std::string("quantize ") + name_of(f) + " per tensor, scale in the kernel" +
                            (transpose ? ", transposed " : " ") + shape,
                        bad, n + 1);
            if (transpose) {
              // Both copies from one read (fp8_quantize_tensor_both): the plain
              // codes as the plain pass writes them, the transposed as above.
              uint8_t* plain = device_alloc<uint8_t>(size_t(n));
              CUDA_CHECK(cudaMemsetAsync(codes, 0xAB, size_t(n), stream));
              CUDA_CHECK(cudaMemsetAsync(plain, 0xAB, size_t(n), stream));
              gpu::fp8_quantize_tensor_both(xw, rows, cols, amax, f, scale2, inv2, plain, codes, stream, ld);
              CUDA_CHECK(cudaStreamSynchronize(stream));
              const auto got_t = download(codes, size_t(n)), got_p = download(plain, size_t(n));
              bad = 0;
              for (int64_t r = 0; r < rows; ++r)
                for (int64_t c = 0; c < cols; ++c) {
                  const uint8_t want = cpu::fp8_bits(xf[size_t(r * cols + c)] * ref_scale[0], f);
                  bad += got_p[size_t(r * cols + c)] != want;
                  bad += got_t[size_t(c * rows + r)] != want;
                }
              bad += download(scale2, 1)[0] != ref_scale[0] || download(inv2, 1)[0] != 1.0f / ref_scale[0];
              check_count(std::string("quantize ") + name_of(f) + " per tensor, plain and transposed in one pass " +
                              shape,
                          bad, 2 * n + 1);
              CUDA_CHECK(cudaFree(plain));
            }
            CUDA_CHECK(cudaFree(scale2));
            CUDA_CHECK(cudaFree(inv2));
          }
        }
      }
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(xw));
    CUDA_CHECK(cudaFree(amax));
    CUDA_CHECK(cudaFree(scale));
    CUDA_CHECK(cudaFree(inv));
    CUDA_CHECK(cudaFree(codes));
  }
}

// ---------------------------------------------------------------- GEMM vs the exact product

struct Operand {
  std::vector<uint8_t> codes;
  std::vector<float> inv;  // one, or one per row
};

Operand make_operand(std::mt19937_64& rng, int64_t rows, int64_t K, Fp8Format f, bool rowwise) {
  std::vector<bf16> b;
  std::vector<float> x;
  random_bf16(rng, rows, K, b, x);
  Operand o;
  o.codes.resize(size_t(rows * K));
  if (rowwise) {
    std::vector<float> scales(static_cast<size_t>(rows));
    cpu::quantize_fp8_rows(x.data(), rows, K, f, o.codes.data(), scales.data());
    for (float s : scales) o.inv.push_back(1.0f / s);
  } else {
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    const float s = cpu::fp8_scale(amax, f);
    cpu::quantize_fp8(x.data(), int64_t(x.size()), s, f, o.codes.data());
    o.inv = {1.0f / s};
  }
  return o;
}

void gemm_checks(uint64_t seed, cudaStream_t stream, void* workspace, size_t workspace_bytes) {
  std::mt19937_64 rng(seed + 2);
  gpu::Fp8Gemm gemm(stream, workspace, workspace_bytes);
  struct Shape { int64_t M, N, K; };
  for (Shape sh : {Shape{64, 96, 128}, Shape{256, 512, 1024}, Shape{1024, 2048, 2048}})
    for (bool rowwise : {false, true})
      for (Fp8Format fa : {Fp8Format::E4M3, Fp8Format::E5M2})
        for (gpu::GemmOut out : {gpu::GemmOut::BF16, gpu::GemmOut::F32}) {
          const Fp8Format fb = Fp8Format::E4M3;
          Operand a = make_operand(rng, sh.M, sh.K, fa, rowwise), b = make_operand(rng, sh.N, sh.K, fb, rowwise);
          std::vector<float> ref(static_cast<size_t>(sh.M * sh.N));
          cpu::matmul_fp8_reference(a.codes.data(), fa, a.inv.data(), rowwise, b.codes.data(), fb, b.inv.data(),
                                    rowwise, sh.M, sh.N, sh.K, ref.data());
          uint8_t* da = device_alloc<uint8_t>(a.codes.size());
          uint8_t* db = device_alloc<uint8_t>(b.codes.size());
          float* dai = device_alloc<float>(a.inv.size());
          float* dbi = device_alloc<float>(b.inv.size());
          upload(da, a.codes), upload(db, b.codes), upload(dai, a.inv), upload(dbi, b.inv);
          const size_t esize = out == gpu::GemmOut::BF16 ? 2 : 4;
          void* dc = device_alloc<uint8_t>(size_t(sh.M * sh.N) * esize);
          // fp32 out: beta = 1 onto C = ref, so the result must be 2 ref (the weight
          // gradient's accumulation); bf16: C poisoned with NaN, overwritten.
          if (out == gpu::GemmOut::F32) upload(static_cast<float*>(dc), ref);
          else CUDA_CHECK(cudaMemset(dc, 0xFF, size_t(sh.M * sh.N) * esize));
          const float beta = out == gpu::GemmOut::F32 ? 1.0f : 0.0f;
          std::string name = "gemm " + std::string(name_of(fa)) + " x e4m3 " + (rowwise ? "rowwise " : "tensorwise ") +
                             (out == gpu::GemmOut::BF16 ? "bf16 out " : "fp32 out, beta 1 ") + "(" +
                             std::to_string(sh.M) + ", " + std::to_string(sh.N) + ", " + std::to_string(sh.K) + ")";
          try {
            gemm.matmul(sh.M, sh.N, sh.K, da, fa, sh.K, dai, db, fb, sh.K, dbi, rowwise, dc, sh.N, out, 1.0f, beta);
            CUDA_CHECK(cudaStreamSynchronize(stream));
            std::vector<float> got(static_cast<size_t>(sh.M * sh.N));
            if (out == gpu::GemmOut::F32) {
              got = download(static_cast<float*>(dc), got.size());
            } else {
              const auto g = download(static_cast<bf16*>(dc), got.size());
              for (size_t i = 0; i < g.size(); ++i) got[i] = __bfloat162float(g[i]);
            }
            double num = 0, den = 0;
            for (size_t i = 0; i < got.size(); ++i) {
              const double want = (out == gpu::GemmOut::F32 ? 2.0 : 1.0) * ref[i];
              const double d = std::isnan(got[i]) ? 1e30 : got[i] - want;
              num += d * d, den += want * want;
            }
            check(name, std::sqrt(num / std::max(den, 1e-300)), out == gpu::GemmOut::BF16 ? 1e-2 : 5e-4);
          } catch (const std::exception& e) {
            std::printf("%-78s %s  FAIL\n", name.c_str(), e.what());
            ++failed;
          }
          for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dai), static_cast<void*>(dbi)})
            CUDA_CHECK(cudaFree(p));
          CUDA_CHECK(cudaFree(dc));
        }
}

// ---------------------------------------------------------------- timing

void timing(cudaStream_t stream, void* workspace, size_t workspace_bytes) {
  gpu::Fp8Gemm fp8(stream, workspace, workspace_bytes);
  gpu::Gemm bf(stream, workspace, workspace_bytes);
  struct Shape { int64_t M, N, K; const char* what; };
  const Shape shapes[] = {{16384, 8192, 2048, "1B up/gate (4 x 4096 tokens)"},
                          {16384, 2048, 8192, "1B down"},
                          {32768, 14336, 4096, "8B up/gate (32K tokens)"},
                          {32768, 4096, 14336, "8B down"}};
  cudaEvent_t t0, t1;
  CUDA_CHECK(cudaEventCreate(&t0));
  CUDA_CHECK(cudaEventCreate(&t1));
  for (const Shape& s : shapes) {
    const size_t a = size_t(s.M * s.K), b = size_t(s.N * s.K), c = size_t(s.M * s.N);
    uint8_t* a8 = device_alloc<uint8_t>(a);
    uint8_t* b8 = device_alloc<uint8_t>(b);
    bf16* a16 = device_alloc<bf16>(a);
    bf16* b16 = device_alloc<bf16>(b);
    bf16* out = device_alloc<bf16>(c);
    float* one = device_alloc<float>(1);
    const float h1 = 1.0f;
    CUDA_CHECK(cudaMemcpy(one, &h1, 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(a8, 0x30, a));
    CUDA_CHECK(cudaMemset(b8, 0x30, b));
    CUDA_CHECK(cudaMemset(a16, 0x3c, a * 2));
    CUDA_CHECK(cudaMemset(b16, 0x3c, b * 2));
    auto time = [&](auto&& launch) {
      for (int i = 0; i < 3; ++i) launch();
      std::vector<float> ms;
      for (int i = 0; i < 10; ++i) {
        CUDA_CHECK(cudaEventRecord(t0, stream));
        launch();
        CUDA_CHECK(cudaEventRecord(t1, stream));
        CUDA_CHECK(cudaEventSynchronize(t1));
        float t = 0;
        CUDA_CHECK(cudaEventElapsedTime(&t, t0, t1));
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      return ms[ms.size() / 2];
    };
    const double flop = 2.0 * double(s.M) * double(s.N) * double(s.K);
    const float t_bf = time([&] { bf.matmul(false, true, s.M, s.N, s.K, a16, s.K, b16, s.K, out, s.N, gpu::GemmOut::BF16, 1.0f, 0.0f); });
    const float t_f8 = time([&] {
      fp8.matmul(s.M, s.N, s.K, a8, Fp8Format::E4M3, s.K, one, b8, Fp8Format::E4M3, s.K, one, false, out, s.N,
                 gpu::GemmOut::BF16);
    });
    const float t_f8f = time([&] {
      fp8.matmul(s.M, s.N, s.K, a8, Fp8Format::E4M3, s.K, one, b8, Fp8Format::E4M3, s.K, one, false, out, s.N,
                 gpu::GemmOut::BF16, 1.0f, 0.0f, true);
    });
    std::printf("timing: (%lld, %lld, %lld) %-28s bf16 %.0f TFLOP/s, fp8 %.0f (%.2fx), fp8 fast accum %.0f (%.2fx)\n",
                (long long)s.M, (long long)s.N, (long long)s.K, s.what, flop / t_bf / 1e9, flop / t_f8 / 1e9,
                t_bf / t_f8, flop / t_f8f / 1e9, t_bf / t_f8f);
    for (void* p : {static_cast<void*>(a8), static_cast<void*>(b8), static_cast<void*>(a16), static_cast<void*>(b16),
                    static_cast<void*>(out), static_cast<void*>(one)})
      CUDA_CHECK(cudaFree(p));
  }
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = std::random_device{}();
  bool host_only = false, timed = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (std::strcmp(argv[i], "--host-only") == 0) host_only = true;
    else if (std::strcmp(argv[i], "--no-timing") == 0) timed = false;
    else {
      std::fprintf(stderr, "usage: %s [--seed N] [--host-only] [--no-timing]\n", argv[0]);
      return 2;
    }
  }
  std::printf("seed %llu\n", (unsigned long long)seed);
  host_checks(seed);
  if (!host_only) {
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));
    const size_t workspace_bytes = 32u << 20;
    void* workspace = device_alloc<uint8_t>(workspace_bytes);
    kernel_checks(seed, stream);
    gemm_checks(seed, stream, workspace, workspace_bytes);
    if (timed) timing(stream, workspace, workspace_bytes);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
