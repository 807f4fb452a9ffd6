// test_sdpa_fp8.cu — cuDNN's FP8 attention graphs (CudnnSdpa::forward_fp8 and
// backward_fp8) against cuDNN's bf16 attention on the same values.
//
// Q, K, V and dO are drawn, coded as e4m3 with power-of-two scales and decoded
// again: the bf16 graphs get exactly the values the FP8 graphs read, so what
// differs is only what FP8 adds (P, dP and the outputs coded as e4m3). Checks:
//   forward   lse within 1e-3 (the scores are the same fp32 products); out
//             decoded within e4m3's rounding (RMS 8% of the bf16 out's RMS,
//             worst element 15% of its largest); amax_o = max |out| within 10%,
//             0 < amax_s <= 1.
//   backward  (documents of one length; out and lse the FP8 forward's, decoded
//             for the bf16 reference) run once with unit scales to get dP's,
//             dq's, dk's and dv's amaxes, then again with scales from them
//             (delayed scaling, as a training step would use the previous
//             step's): dq, dk, dv decoded within RMS 12% of the reference's.
// Documents of different lengths are refused by both FP8 passes (CudnnSdpa
// takes a ragged batch in bf16 only), and on Hopper cuDNN refuses the FP8
// backward at head dim 64: those cases check that nothing was written.
//
//   bash tests/gpu/build_sdpa_fp8.sh                  the checks (make test-gpu runs them)
//   build-gpu/test_sdpa_fp8 --bench 4096 32768 ...    the graphs' speed, no checks
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/fp8_attention.hpp"
#include "cuda/sdpa.hpp"

namespace sc = shardlm::cuda;

#define CHECK_CUDA(x)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

namespace {

int g_checks = 0, g_failures = 0;

void check(bool ok, const char* what, double value, double bound) {
  ++g_checks;
  g_failures += !ok;
  std::printf("  %-66s %10.3e <= %.1e  %s\n", what, value, bound, ok ? "PASS" : "FAIL");
}

// A check's name with one %s filled.
const char* fmt_what(const char* pattern, const char* arg) {
  static char buf[4][160];
  static int next = 0;
  char* b = buf[next++ % 4];
  std::snprintf(b, 160, pattern, arg);
  return b;
}

float decode(uint8_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
}
uint8_t encode(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// The largest power of two s with amax * s <= 448 (e4m3's largest finite value).
float pow2_scale(float amax) { return std::exp2(std::floor(std::log2(448.0f / std::max(amax, 1e-30f)))); }

// x coded with a power-of-two scale: the codes, the scale and the decoded values.
struct Coded {
  std::vector<uint8_t> codes;
  float scale = 1.0f;
  std::vector<float> values;  // codes / scale: exact in bf16
};
Coded code(const std::vector<float>& x) {
  Coded c;
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  c.scale = pow2_scale(amax);
  for (float v : x) {
    c.codes.push_back(encode(v * c.scale));
    c.values.push_back(decode(c.codes.back()) / c.scale);
  }
  return c;
}

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) { CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T))); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void up(const std::vector<T>& h) { CHECK_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> down() const {
    std::vector<T> h(n);
    CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void fill(unsigned char byte) { CHECK_CUDA(cudaMemset(p, byte, n * sizeof(T))); }
};

std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> y;
  for (float v : x) y.push_back(__float2bfloat16(v));
  return y;
}
std::vector<float> from_bf16(const std::vector<__nv_bfloat16>& x) {
  std::vector<float> y;
  for (auto v : x) y.push_back(__bfloat162float(v));
  return y;
}
std::vector<float> decoded(const std::vector<uint8_t>& codes, float scale) {
  std::vector<float> y;
  for (uint8_t c : codes) y.push_back(decode(c) / scale);
  return y;
}
float amax_of(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}
// sqrt(sum (a - b)^2 / sum b^2), and max |a - b| / max |b|.
double rel_rms(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += double(a[i] - b[i]) * (a[i] - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, 1e-300));
}
double rel_max(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m / std::max(double(amax_of(b)), 1e-300);
}

struct Case {
  const char* name;
  int64_t H, KV, D;
  std::vector<int32_t> docs;
};

void run(const Case& c, std::mt19937& rng) {
  const int64_t N = std::accumulate(c.docs.begin(), c.docs.end(), int64_t(0));
  const int64_t nq = N * c.H * c.D, nkv = N * c.KV * c.D;
  std::printf("%s: N %lld, H %lld, KV %lld, D %lld, %zu documents\n", c.name, (long long)N, (long long)c.H,
              (long long)c.KV, (long long)c.D, c.docs.size());
  std::vector<int32_t> seq_id;
  for (size_t d = 0; d < c.docs.size(); ++d) seq_id.insert(seq_id.end(), size_t(c.docs[d]), int32_t(d));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto draw = [&](int64_t n, float sd) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = sd * normal(rng);
    return x;
  };
  const Coded q = code(draw(nq, 1.0f)), k = code(draw(nkv, 1.0f)), v = code(draw(nkv, 1.0f)),
              dout = code(draw(nq, 0.01f));

  Dev<char> workspace(sc::CudnnSdpa::workspace_bytes(N, c.H, c.KV, c.D));
  sc::CudnnSdpa sdpa(N, c.H, c.KV, c.D, workspace.p + sc::CudnnSdpa::backward_buffer_bytes(N, c.H, c.KV, c.D),
                     cudaStream_t(0));
  sdpa.set_documents(seq_id.data(), N);

  // ---- the bf16 forward on the decoded values
  Dev<__nv_bfloat16> q16(nq), k16(nkv), v16(nkv), o16(nq), do16(nq), dq16(nq), dk16(nkv), dv16(nkv);
  Dev<float> lse16(N * c.H), lse8(N * c.H), scalars(64);
  q16.up(to_bf16(q.values)), k16.up(to_bf16(k.values)), v16.up(to_bf16(v.values)), do16.up(to_bf16(dout.values));
  if (!sdpa.forward(o16.p, lse16.p, q16.p, k16.p, v16.p)) {
    std::printf("  cuDNN refused the bf16 forward: %s\n", sdpa.last_plan_note().c_str());
    ++g_failures;
    return;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<float> out_ref = from_bf16(o16.down()), lse_ref = lse16.down();

  // ---- the FP8 forward; scalars: [0, 32) scales and descales, [32, 64) amaxes
  enum { kDq, kDk, kDv, kDo, kDdo, kDs, kDdp, kSs, kSo, kSdp, kSdq, kSdk, kSdv, kAmax = 32 };
  const float scale_s = 448.0f, scale_o = pow2_scale(amax_of(v.values));
  std::vector<float> host(64, 0.0f);
  host[kDq] = 1 / q.scale, host[kDk] = 1 / k.scale, host[kDv] = 1 / v.scale, host[kDs] = 1 / scale_s;
  host[kSs] = scale_s, host[kSo] = scale_o;
  host[kDo] = 1 / scale_o, host[kDdo] = 1 / dout.scale;
  host[kSdp] = host[kSdq] = host[kSdk] = host[kSdv] = 1.0f, host[kDdp] = 1.0f;
  scalars.up(host);
  float* sp = scalars.p;
  float* am = sp + kAmax;  // amax_s, amax_o, amax_dp, amax_dq, amax_dk, amax_dv
  const sc::CudnnSdpa::Fp8Scales scales{sp + kDq,  sp + kDk,  sp + kDv,  sp + kDo,  sp + kDdo, sp + kDs,  sp + kDdp,
                                        sp + kSs,  sp + kSo,  sp + kSdp, sp + kSdq, sp + kSdk, sp + kSdv, am,
                                        am + 1,    am + 2,    am + 3,    am + 4,    am + 5};
  Dev<uint8_t> q8(nq), k8(nkv), v8(nkv), o8(nq), do8(nq), dq8(nq), dk8(nkv), dv8(nkv);
  Dev<char> fp8_ws(sc::CudnnSdpa::fp8_backward_workspace_bytes(N, c.H, c.D));
  q8.up(q.codes), k8.up(k.codes), v8.up(v.codes), do8.up(dout.codes);
  o8.fill(0xAB), lse8.fill(0xFF);
  const bool uniform = std::all_of(c.docs.begin(), c.docs.end(), [&](int32_t l) { return l == c.docs[0]; });
  if (!sdpa.forward_fp8(o8.p, lse8.p, q8.p, k8.p, v8.p, scales)) {
    std::printf("  the FP8 forward refused (%s)\n", uniform ? sdpa.last_plan_note().c_str() : "ragged documents");
    const std::vector<uint8_t> untouched = o8.down();
    const bool same = std::all_of(untouched.begin(), untouched.end(), [](uint8_t b) { return b == 0xAB; });
    check(same && !uniform, "forward refused (ragged only): out untouched (changed or uniform)", same && !uniform ? 0 : 1, 0);
    return;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::printf("  plan %s\n", sdpa.last_plan_note().c_str());
  const std::vector<float> out8 = decoded(o8.down(), scale_o), lse = lse8.down();
  std::vector<float> amax = scalars.down();
  double lse_err = 0;
  for (size_t i = 0; i < lse.size(); ++i) lse_err = std::max(lse_err, double(std::fabs(lse[i] - lse_ref[i])));
  check(lse_err <= 1e-3, "forward: lse = the bf16 graph's (max abs difference)", lse_err, 1e-3);
  check(rel_rms(out8, out_ref) <= 0.08, "forward: out decoded against bf16 (relative RMS)", rel_rms(out8, out_ref), 0.08);
  check(rel_max(out8, out_ref) <= 0.15, "forward: out decoded against bf16 (worst / largest)", rel_max(out8, out_ref),
        0.15);
  const double amax_o_err = std::fabs(amax[kAmax + 1] - amax_of(out_ref)) / amax_of(out_ref);
  check(amax_o_err <= 0.10, "forward: amax_o against max |out| (relative)", amax_o_err, 0.10);
  const bool amax_s_ok = amax[kAmax] > 0.0f && amax[kAmax] <= 1.0f;
  check(amax_s_ok, "forward: 0 < amax_s <= 1 (|1 - amax_s| shown)", std::fabs(1.0 - amax[kAmax]), 1.0);

  // ---- the backward: the bf16 reference on the FP8 forward's out (decoded) and lse
  o16.up(to_bf16(out8));
  if (!sdpa.backward(dq16.p, dk16.p, dv16.p, do16.p, q16.p, k16.p, v16.p, o16.p, lse8.p, workspace.p)) {
    std::printf("  cuDNN refused the bf16 backward: %s\n", sdpa.last_plan_note().c_str());
    ++g_failures;
    return;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<float> dq_ref = from_bf16(dq16.down()), dk_ref = from_bf16(dk16.down()),
                           dv_ref = from_bf16(dv16.down());
  dq8.fill(0xAB), dk8.fill(0xAB), dv8.fill(0xAB);
  if (!sdpa.backward_fp8(dq8.p, dk8.p, dv8.p, do8.p, q8.p, k8.p, v8.p, o8.p, lse8.p, scales, fp8_ws.p)) {
    std::printf("  cuDNN refused the FP8 backward (%s)\n", sdpa.last_plan_note().c_str());
    const std::vector<uint8_t> untouched = dq8.down();
    const bool same = std::all_of(untouched.begin(), untouched.end(), [](uint8_t b) { return b == 0xAB; });
    check(same, "backward refused: dq untouched (bytes changed)", same ? 0.0 : 1.0, 0.0);
    return;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::printf("  plan %s\n", sdpa.last_plan_note().c_str());
  // Delayed scaling: the first run's amaxes (unit scales) give the second's scales.
  amax = scalars.down();
  const float s_dp = pow2_scale(amax[kAmax + 2]), s_dq = pow2_scale(amax[kAmax + 3]),
              s_dk = pow2_scale(amax[kAmax + 4]), s_dv = pow2_scale(amax[kAmax + 5]);
  host[kSdp] = s_dp, host[kDdp] = 1 / s_dp, host[kSdq] = s_dq, host[kSdk] = s_dk, host[kSdv] = s_dv;
  scalars.up(host);
  if (!sdpa.backward_fp8(dq8.p, dk8.p, dv8.p, do8.p, q8.p, k8.p, v8.p, o8.p, lse8.p, scales, fp8_ws.p)) {
    ++g_failures;
    return;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<float> dq = decoded(dq8.down(), s_dq), dk = decoded(dk8.down(), s_dk), dv = decoded(dv8.down(), s_dv);
  check(rel_rms(dq, dq_ref) <= 0.12, "backward: dq decoded against bf16 (relative RMS)", rel_rms(dq, dq_ref), 0.12);
  check(rel_rms(dk, dk_ref) <= 0.12, "backward: dk decoded against bf16 (relative RMS)", rel_rms(dk, dk_ref), 0.12);
  check(rel_rms(dv, dv_ref) <= 0.12, "backward: dv decoded against bf16 (relative RMS)", rel_rms(dv, dv_ref), 0.12);
  amax = scalars.down();
  const double amax_dv_err = std::fabs(amax[kAmax + 5] - amax_of(dv_ref)) / amax_of(dv_ref);
  check(amax_dv_err <= 0.15, "backward: amax_dv against max |dv| (relative)", amax_dv_err, 0.15);
}

// cuda::Fp8Attention, the training step's building block: bf16 q, k, v, dout in
// (not pre-coded), bf16 out, lse and gradients, against the bf16 graphs on the
// same bf16 inputs. FP8 now also codes q, k, v and dout, so the bounds are wider
// than the graphs' own: out within RMS 10%, lse within 0.25, dq, dk, dv within
// RMS 15%. The backward runs twice on one layer: the first call (no history:
// three graph runs for its delayed scales) and the second (the first's amaxes).
void run_layer(std::mt19937& rng) {
  const int64_t H = 8, KV = 2, D = 128, N = 1024, nq = N * H * D, nkv = N * KV * D;
  std::printf("Fp8Attention, bf16 in and out: N %lld, H %lld, KV %lld, D %lld, 2 documents\n", (long long)N,
              (long long)H, (long long)KV, (long long)D);
  std::vector<int32_t> seq_id(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) seq_id[size_t(i)] = int32_t(i / 512);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto draw = [&](int64_t n, float sd) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = sd * normal(rng);
    return to_bf16(x);
  };
  Dev<char> workspace(sc::CudnnSdpa::workspace_bytes(N, H, KV, D));
  sc::CudnnSdpa sdpa(N, H, KV, D, workspace.p + sc::CudnnSdpa::backward_buffer_bytes(N, H, KV, D), cudaStream_t(0));
  sdpa.set_documents(seq_id.data(), N);
  Dev<char> fa_state(sc::Fp8Attention::state_bytes(2)), fa_scratch(sc::Fp8Attention::scratch_bytes(N, H, KV, D));
  sc::Fp8Attention fa(sdpa, N, H, KV, D, 2, fa_state.p, cudaStream_t(0));
  Dev<__nv_bfloat16> q(nq), k(nkv), v(nkv), dout(nq), o16(nq), o8(nq), dq16(nq), dk16(nkv), dv16(nkv), dq(nq),
      dk(nkv), dv(nkv);
  Dev<float> lse16(N * H), lse8(N * H);
  q.up(draw(nq, 1.0f)), k.up(draw(nkv, 1.0f)), v.up(draw(nkv, 1.0f)), dout.up(draw(nq, 0.01f));
  const bool ok16 = sdpa.forward(o16.p, lse16.p, q.p, k.p, v.p) &&
                    sdpa.backward(dq16.p, dk16.p, dv16.p, dout.p, q.p, k.p, v.p, o16.p, lse16.p, workspace.p);
  if (!ok16 || !fa.forward(1, o8.p, lse8.p, q.p, k.p, v.p, N, fa_scratch.p)) {
    std::printf("  refused: %s\n", sdpa.last_plan_note().c_str());
    ++g_failures;
    return;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<float> out = from_bf16(o8.down()), out_ref = from_bf16(o16.down()), lse = lse8.down(),
                           lse_ref = lse16.down();
  double lse_err = 0;
  for (size_t i = 0; i < lse.size(); ++i) lse_err = std::max(lse_err, double(std::fabs(lse[i] - lse_ref[i])));
  check(rel_rms(out, out_ref) <= 0.10, "Fp8Attention forward: out against bf16 (relative RMS)", rel_rms(out, out_ref),
        0.10);
  check(lse_err <= 0.25, "Fp8Attention forward: lse against bf16 (max abs difference)", lse_err, 0.25);
  const std::vector<float> dq_ref = from_bf16(dq16.down()), dk_ref = from_bf16(dk16.down()),
                           dv_ref = from_bf16(dv16.down());
  for (int call = 1; call <= 2; ++call) {
    dq.fill(0xFF), dk.fill(0xFF), dv.fill(0xFF);
    if (!fa.backward(1, dq.p, dk.p, dv.p, dout.p, q.p, k.p, v.p, o8.p, lse8.p, N, fa_scratch.p)) {
      std::printf("  backward refused: %s\n", sdpa.last_plan_note().c_str());
      ++g_failures;
      return;
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<float> gq = from_bf16(dq.down()), gk = from_bf16(dk.down()), gv = from_bf16(dv.down());
    const char* which = call == 1 ? "first backward (3 graph runs)" : "second backward (delayed scales)";
    check(rel_rms(gq, dq_ref) <= 0.15, fmt_what("Fp8Attention %s: dq (relative RMS)", which), rel_rms(gq, dq_ref), 0.15);
    check(rel_rms(gk, dk_ref) <= 0.15, fmt_what("Fp8Attention %s: dk (relative RMS)", which), rel_rms(gk, dk_ref), 0.15);
    check(rel_rms(gv, dv_ref) <= 0.15, fmt_what("Fp8Attention %s: dv (relative RMS)", which), rel_rms(gv, dv_ref), 0.15);
  }
}

// --bench S...: shardlm's own FP8 graphs timed against its bf16 ones (one
// document of S tokens, the 8B shape's attention: 32 q heads over 8, head dim
// 128; median of 5 runs, 3 from 65,536 tokens). No checks: a benchmark
// (docs/benchmarks.md).
void bench(int64_t S) {
  const int64_t H = 32, KV = 8, D = 128, nq = S * H * D, nkv = S * KV * D;
  std::vector<int32_t> seq_id(static_cast<size_t>(S), 0);
  Dev<char> workspace(sc::CudnnSdpa::workspace_bytes(S, H, KV, D));
  sc::CudnnSdpa sdpa(S, H, KV, D, workspace.p + sc::CudnnSdpa::backward_buffer_bytes(S, H, KV, D), cudaStream_t(0));
  sdpa.set_documents(seq_id.data(), S);
  Dev<__nv_bfloat16> q16(nq), k16(nkv), v16(nkv), o16(nq), do16(nq), dq16(nq), dk16(nkv), dv16(nkv);
  Dev<uint8_t> q8(nq), k8(nkv), v8(nkv), o8(nq), do8(nq), dq8(nq), dk8(nkv), dv8(nkv);
  Dev<float> lse(S * H), scalars(64);
  Dev<char> fp8_ws(sc::CudnnSdpa::fp8_backward_workspace_bytes(S, H, D));
  for (auto* b : {&q16, &k16, &v16, &do16}) b->fill(0x3c);  // bf16 0x3c3c ~ 0.0115
  for (auto* b : {&q8, &k8, &v8, &do8}) b->fill(0x30);      // e4m3 0x30 = 0.5
  scalars.up(std::vector<float>(64, 1.0f));
  float* sp = scalars.p;
  const sc::CudnnSdpa::Fp8Scales ones{sp, sp, sp, sp, sp, sp, sp, sp, sp, sp, sp, sp, sp,
                                      sp + 32, sp + 33, sp + 34, sp + 35, sp + 36, sp + 37};
  const int runs = S >= 65536 ? 3 : 5;
  auto time = [&](auto&& pass) {
    if (!pass()) return std::nan("");
    CHECK_CUDA(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int i = 0; i < runs; ++i) {
      CHECK_CUDA(cudaEventRecord(a));
      pass();
      CHECK_CUDA(cudaEventRecord(b));
      CHECK_CUDA(cudaEventSynchronize(b));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
  };
  const double f16 = time([&] { return sdpa.forward(o16.p, lse.p, q16.p, k16.p, v16.p); });
  const double b16 = time([&] {
    return sdpa.backward(dq16.p, dk16.p, dv16.p, do16.p, q16.p, k16.p, v16.p, o16.p, lse.p, workspace.p);
  });
  const double f8 = time([&] { return sdpa.forward_fp8(o8.p, lse.p, q8.p, k8.p, v8.p, ones); });
  const double b8 = time([&] {
    return sdpa.backward_fp8(dq8.p, dk8.p, dv8.p, do8.p, q8.p, k8.p, v8.p, o8.p, lse.p, ones, fp8_ws.p);
  });
  std::printf("S %6lld (H 32, KV 8, D 128): forward bf16 %8.3f ms, FP8 %8.3f ms (%.2fx); backward bf16 %8.3f ms, "
              "FP8 %8.3f ms (%.2fx)\n",
              (long long)S, f16, f8, f16 / f8, b16, b8, b16 / b8);
  // cuda::Fp8Attention: the graphs with its coding and decoding passes (bf16 in and out).
  Dev<char> fa_state(sc::Fp8Attention::state_bytes(1)), fa_scratch(sc::Fp8Attention::scratch_bytes(S, H, KV, D));
  sc::Fp8Attention fa(sdpa, S, H, KV, D, 1, fa_state.p, cudaStream_t(0));
  const double ff = time([&] { return fa.forward(0, o16.p, lse.p, q16.p, k16.p, v16.p, S, fa_scratch.p); });
  const double fb = time([&] {
    return fa.backward(0, dq16.p, dk16.p, dv16.p, do16.p, q16.p, k16.p, v16.p, o16.p, lse.p, S, fa_scratch.p);
  });
  std::printf("  Fp8Attention (bf16 in and out): forward %8.3f ms (%.2fx bf16), backward %8.3f ms (%.2fx)\n", ff,
              f16 / ff, fb, b16 / fb);
  std::printf("  last plan: %s\n", sdpa.last_plan_note().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--bench") {
    std::printf("%s\n", sc::cudnn_sdpa_version().c_str());
    for (int i = 2; i < argc; ++i) bench(std::atoll(argv[i]));
    return 0;
  }
  std::string why;
  if (!sc::cudnn_sdpa_available(&why)) {
    std::printf("cuDNN attention unavailable: %s\n", why.c_str());
    return 1;
  }
  std::printf("%s\n", sc::cudnn_sdpa_version().c_str());
  std::mt19937 rng(20261204);
  const std::vector<Case> cases = {
      {"head dim 128, documents of one length", 8, 2, 128, {512, 512}},
      {"head dim 128, ragged documents", 8, 2, 128, {300, 500, 224}},
      {"head dim 64, documents of one length", 8, 2, 64, {256, 256}},
  };
  for (const Case& c : cases) run(c, rng);
  run_layer(rng);
  std::printf("%d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
