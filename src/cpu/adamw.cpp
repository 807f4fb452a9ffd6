// adamw.cpp — the host AdamW; see src/cpu/adamw.hpp for the contract.
#include "cpu/adamw.hpp"

#include <omp.h>

// GCC 12's AVX-512 intrinsics seed their unused merge source with a self-initialised
// "undefined" vector, which -Wmaybe-uninitialized reports (GCC bug 105593); the
// warning points into immintrin.h, so it is silenced before that is read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

// GCC contracts a * b + c into an FMA in C++ at any -std (-ffp-contract=fast is
// its C++ default; only ISO C modes turn it off), and target("avx512f") makes FMA
// available, so without this the AVX-512 path rounds differently from the others.
// The intrinsics are plain vector arithmetic to GCC and are contracted too.
#pragma GCC optimize("fp-contract=off")

namespace shardlm::cpu {

namespace {

// The loop constants, hoisted: each is the same float the scalar formula forms per
// element ((1 - b1), lr * wd), so hoisting changes no bits.
struct Coeffs {
  float b1, one_minus_b1, b2, one_minus_b2, lr_wd, step_size, inv_bc2_sqrt, eps, grad_scale;
};

Coeffs coeffs(const AdamWConsts& k, float grad_scale, float weight_decay) {
  return {k.b1, 1.0f - k.b1, k.b2, 1.0f - k.b2, k.lr * weight_decay, k.step_size, k.inv_bc2_sqrt, k.eps, grad_scale};
}

// Round to nearest even by integer arithmetic: adding 0x7fff (+1 when the kept lsb
// is odd) carries into the kept half exactly when the dropped half is above the
// tie, or at the tie with an odd lsb; a carry out of the largest finite value gives
// inf, which is what RNE gives. NaN: that carry could turn a NaN into inf or flip
// its sign, so NaNs keep their top bits with the quiet bit forced instead. The
// vector paths below do the same integer steps lane by lane.
inline uint16_t bf16_rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The reference element loop, also every vector path's tail. Built for baseline
// x86-64, it has no FMA to be contracted into, so the bitwise tests against it
// would catch a vector path that the compiler contracted.
template <bool kBf16>
void adamw_scalar(float* p, uint16_t* pb, const float* g, float* m, float* v, int64_t n, const Coeffs& c) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * c.grad_scale;
    const float mi = c.b1 * m[i] + c.one_minus_b1 * gi;
    const float vi = c.b2 * v[i] + c.one_minus_b2 * gi * gi;
    float pi = p[i];
    pi -= c.lr_wd * pi;
    pi -= c.step_size * mi / (std::sqrt(vi) * c.inv_bc2_sqrt + c.eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if constexpr (kBf16) pb[i] = bf16_rne(pi);
  }
}

void cast_scalar(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_rne(in[i]);
}

// ---------------------------------------------------------------- AVX-512F

// Plain (cached) stores on purpose: non-temporal stores of p, m, v and the bf16
// copy were slower on a 16-core host (256M parameters, 16 threads: 70-73 ms a step
// against 64-70 ms; 8 threads: 117-123 against 75-106), since every line written
// was just read and is in cache anyway.

__attribute__((target("avx512f"))) inline __m256i bf16_rne_avx512(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i quiet_nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x0040));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  // Every lane holds at most 0xffff, so the truncating narrow is exact.
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
}

template <bool kBf16>
__attribute__((target("avx512f"))) void adamw_avx512(float* p, uint16_t* pb, const float* g, float* m, float* v,
                                                    int64_t n, const Coeffs& c) {
  const __m512 b1 = _mm512_set1_ps(c.b1), one_minus_b1 = _mm512_set1_ps(c.one_minus_b1);
  const __m512 b2 = _mm512_set1_ps(c.b2), one_minus_b2 = _mm512_set1_ps(c.one_minus_b2);
  const __m512 lr_wd = _mm512_set1_ps(c.lr_wd), step_size = _mm512_set1_ps(c.step_size);
  const __m512 inv_bc2_sqrt = _mm512_set1_ps(c.inv_bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), grad_scale);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_loadu_ps(m + i)), _mm512_mul_ps(one_minus_b1, gi));
    const __m512 vi =
        _mm512_add_ps(_mm512_mul_ps(b2, _mm512_loadu_ps(v + i)), _mm512_mul_ps(_mm512_mul_ps(one_minus_b2, gi), gi));
    __m512 pi = _mm512_loadu_ps(p + i);
    pi = _mm512_sub_ps(pi, _mm512_mul_ps(lr_wd, pi));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), inv_bc2_sqrt), eps);
    pi = _mm512_sub_ps(pi, _mm512_div_ps(_mm512_mul_ps(step_size, mi), denom));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm512_storeu_ps(p + i, pi);
    if constexpr (kBf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + i), bf16_rne_avx512(pi));
  }
  adamw_scalar<kBf16>(p + i, kBf16 ? pb + i : nullptr, g + i, m + i, v + i, n - i, c);
}

__attribute__((target("avx512f"))) void cast_avx512(uint16_t* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bf16_rne_avx512(_mm512_loadu_ps(in + i)));
  cast_scalar(out + i, in + i, n - i);
}

// ---------------------------------------------------------------- AVX2

__attribute__((target("avx2"))) inline __m128i bf16_rne_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i quiet_nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // packus narrows within each 128-bit lane (lanes hold 0..0xffff, so it never
  // saturates): [r0-3 r0-3 | r4-7 r4-7]; the permute brings r0-3 r4-7 together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_castsi256_si128(packed);
}

template <bool kBf16>
__attribute__((target("avx2"))) void adamw_avx2(float* p, uint16_t* pb, const float* g, float* m, float* v,
                                                int64_t n, const Coeffs& c) {
  const __m256 b1 = _mm256_set1_ps(c.b1), one_minus_b1 = _mm256_set1_ps(c.one_minus_b1);
  const __m256 b2 = _mm256_set1_ps(c.b2), one_minus_b2 = _mm256_set1_ps(c.one_minus_b2);
  const __m256 lr_wd = _mm256_set1_ps(c.lr_wd), step_size = _mm256_set1_ps(c.step_size);
  const __m256 inv_bc2_sqrt = _mm256_set1_ps(c.inv_bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), grad_scale);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(one_minus_b1, gi));
    const __m256 vi =
        _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + i)), _mm256_mul_ps(_mm256_mul_ps(one_minus_b2, gi), gi));
    __m256 pi = _mm256_loadu_ps(p + i);
    pi = _mm256_sub_ps(pi, _mm256_mul_ps(lr_wd, pi));
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), inv_bc2_sqrt), eps);
    pi = _mm256_sub_ps(pi, _mm256_div_ps(_mm256_mul_ps(step_size, mi), denom));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pi);
    if constexpr (kBf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(pb + i), bf16_rne_avx2(pi));
  }
  adamw_scalar<kBf16>(p + i, kBf16 ? pb + i : nullptr, g + i, m + i, v + i, n - i, c);
}

__attribute__((target("avx2"))) void cast_avx2(uint16_t* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bf16_rne_avx2(_mm256_loadu_ps(in + i)));
  cast_scalar(out + i, in + i, n - i);
}

// ---------------------------------------------------------------- dispatch

using AdamWKernel = void (*)(float*, uint16_t*, const float*, float*, float*, int64_t, const Coeffs&);

template <bool kBf16>
AdamWKernel kernel_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512: return adamw_avx512<kBf16>;
    case CpuIsa::avx2: return adamw_avx2<kBf16>;
    case CpuIsa::scalar: break;
  }
  return adamw_scalar<kBf16>;
}

CpuIsa runnable(CpuIsa isa) { return isa_supported(isa) ? isa : best_isa(); }

}  // namespace

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::scalar: break;
  }
  return "scalar";
}

bool isa_supported(CpuIsa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case CpuIsa::avx512: return __builtin_cpu_supports("avx512f");
    case CpuIsa::avx2: return __builtin_cpu_supports("avx2");
    case CpuIsa::scalar: break;
  }
  return true;
}

CpuIsa best_isa() {
  if (isa_supported(CpuIsa::avx512)) return CpuIsa::avx512;
  if (isa_supported(CpuIsa::avx2)) return CpuIsa::avx2;
  return CpuIsa::scalar;
}

CpuIsa resolve_isa(const char* request) {
  if (request)
    for (CpuIsa isa : {CpuIsa::scalar, CpuIsa::avx2, CpuIsa::avx512})
      if (std::strcmp(request, isa_name(isa)) == 0 && isa_supported(isa)) return isa;
  return best_isa();
}

CpuIsa adamw_cpu_isa() {
  static const CpuIsa chosen = resolve_isa(std::getenv("SHARDLM_CPU_ISA"));
  return chosen;
}

const char* adamw_isa() { return isa_name(adamw_cpu_isa()); }

void adamw_step_isa(CpuIsa isa, float* param, uint16_t* param_bf16, const float* grad, float* m, float* v,
                    int64_t n, float grad_scale, float weight_decay, const AdamWConsts& k, int threads) {
  if (n <= 0) return;
  const Coeffs c = coeffs(k, grad_scale, weight_decay);
  const AdamWKernel kernel = param_bf16 ? kernel_for<true>(runnable(isa)) : kernel_for<false>(runnable(isa));
  const int64_t blocks = (n + kAdamWBlock - 1) / kAdamWBlock;
  const int nthreads = threads > 0 ? threads : omp_get_max_threads();
  // Static schedule over whole blocks: thread t gets one contiguous run of blocks
  // (prefetch-friendly, and the same pages a first-touch pass with the same
  // schedule placed on t's NUMA node). A one-block call stays on this thread.
#pragma omp parallel for schedule(static) num_threads(nthreads) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t o = b * kAdamWBlock, len = std::min(kAdamWBlock, n - o);
    kernel(param + o, param_bf16 ? param_bf16 + o : nullptr, grad + o, m + o, v + o, len, c);
  }
}

void zero_first_touch(float* x, int64_t n, int threads) {
  if (n <= 0) return;
  const int64_t blocks = (n + kAdamWBlock - 1) / kAdamWBlock;
  const int nthreads = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nthreads) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t o = b * kAdamWBlock, len = std::min(kAdamWBlock, n - o);
    std::memset(x + o, 0, sizeof(float) * size_t(len));
  }
}

void adamw_step(float* param, uint16_t* param_bf16, const float* grad, float* m, float* v, int64_t n,
                float grad_scale, float weight_decay, const AdamWConsts& k, int threads) {
  adamw_step_isa(adamw_cpu_isa(), param, param_bf16, grad, m, v, n, grad_scale, weight_decay, k, threads);
}

void cast_f32_to_bf16(CpuIsa isa, uint16_t* out, const float* in, int64_t n) {
  if (n <= 0) return;
  switch (runnable(isa)) {
    case CpuIsa::avx512: return cast_avx512(out, in, n);
    case CpuIsa::avx2: return cast_avx2(out, in, n);
    case CpuIsa::scalar: break;
  }
  cast_scalar(out, in, n);
}

}  // namespace shardlm::cpu
