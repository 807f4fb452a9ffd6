// adamw.hpp — the host AdamW on flat fp32 shards: vectorised (AVX-512F, AVX2,
// scalar; chosen at run time), multithreaded (OpenMP), with an optional bf16 copy
// of the updated parameters written in the same pass.
//
// Owns: shardlm::cpu::{AdamWConsts, adamw_consts, adamw_step, CpuIsa, the ISA
// choice and SHARDLM_CPU_ISA, cast_f32_to_bf16}. Optimizer::step (optim.cpp) and
// the optimizer offload path call adamw_step; nothing else implements AdamW on the
// host.
// Must not know: the deck, the model (units, segments, weight-decay rules), MPI,
// devices. Callers pass the numbers.
//
// Numerics: every ISA performs the same IEEE operations in the same order as the
// scalar formula below (mul, add, sub, div, sqrt; no FMA, no rsqrt estimate), so
// scalar, AVX2 and AVX-512 give the same bits, and the result is the same bits at
// any thread count. adamw.cpp turns FMA contraction off for itself (GCC's C++
// default contracts whenever the target has FMA). The CUDA adamw_step
// (cuda/optim_kernels.hpp) spells the same operations with __f*_rn intrinsics.
#pragma once

#include <cmath>
#include <cstdint>

namespace shardlm::cpu {

// AdamW's per-step constants, in the float form the element loop uses. Bias
// corrections are computed in double, then rounded once.
struct AdamWConsts {
  float lr, b1, b2, step_size, inv_bc2_sqrt, eps;
};

// step is 1-based (the first update is step 1).
inline AdamWConsts adamw_consts(double lr, double beta1, double beta2, double eps, int64_t step) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return {static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(lr / bc1),
          static_cast<float>(1.0 / std::sqrt(bc2)), static_cast<float>(eps)};
}

// One AdamW update of n elements in place, element i:
//   gi = g[i] * grad_scale
//   m  = b1 * m + (1 - b1) * gi
//   v  = b2 * v + (1 - b2) * gi * gi
//   p -= lr * weight_decay * p                      (decoupled weight decay)
//   p -= step_size * m / (sqrt(v) * inv_bc2_sqrt + eps)
//   param_bf16[i] = bf16(p), round to nearest even (as __float2bfloat16); NaN stays
//                   a quiet NaN with its sign and top payload bits.
// param (n) fp32, updated; param_bf16 (n) bf16 bits, overwritten, or nullptr;
// grad (n) fp32, read; m, v (n) fp32 moments, updated. No alignment required.
// threads: OpenMP threads, 0 = OpenMP's default. Runs on the ISA adamw_isa() names.
void adamw_step(float* param, uint16_t* param_bf16, const float* grad, float* m, float* v, int64_t n,
                float grad_scale, float weight_decay, const AdamWConsts& k, int threads = 0);

// Elements per work block: threads take whole blocks (static schedule), so the
// split of the arrays into vector bodies and scalar tails is fixed by n alone.
// 64 Ki elements = 256 KiB per fp32 array, 1 MiB for the four: one block's
// working set stays in L2 while it is streamed. A bench or a caller that places
// pages by first touch uses the same blocks and schedule.
constexpr int64_t kAdamWBlock = 1 << 16;

// Zero x[0, n) in adamw_step's blocks and static schedule on `threads` threads
// (0: OpenMP's default team): the first touch that puts each page on the NUMA
// node of the thread that adamw_step(n, threads) will stream it on.
void zero_first_touch(float* x, int64_t n, int threads = 0);

// ---------------------------------------------------------------- ISA choice

enum class CpuIsa { scalar, avx2, avx512 };

const char* isa_name(CpuIsa isa);     // "scalar" | "avx2" | "avx512"
bool isa_supported(CpuIsa isa);       // this CPU can run it (scalar: always)
CpuIsa best_isa();                    // avx512 if supported, else avx2, else scalar
// What SHARDLM_CPU_ISA=request resolves to: a supported named ISA as named;
// nullptr, "", an unknown name or one this CPU lacks: best_isa(), silently.
CpuIsa resolve_isa(const char* request);
// The ISA adamw_step uses: resolve_isa(getenv("SHARDLM_CPU_ISA")), read once.
CpuIsa adamw_cpu_isa();
const char* adamw_isa();              // isa_name(adamw_cpu_isa())

// adamw_step on a given ISA (tests and benchmarks compare the paths); an ISA this
// CPU lacks runs as best_isa() instead of faulting.
void adamw_step_isa(CpuIsa isa, float* param, uint16_t* param_bf16, const float* grad, float* m, float* v,
                    int64_t n, float grad_scale, float weight_decay, const AdamWConsts& k, int threads = 0);

// out (n) bf16 bits = bf16(in (n) fp32), the conversion adamw_step writes, on one
// thread. For tests of the rounding on values an update cannot produce (+-inf).
void cast_f32_to_bf16(CpuIsa isa, uint16_t* out, const float* in, int64_t n);

}  // namespace shardlm::cpu
