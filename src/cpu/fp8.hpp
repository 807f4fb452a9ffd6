// fp8.hpp — FP8 quantisation as Hopper's tensor cores see it, emulated in fp32:
// the reference the CUDA FP8 kernels (src/cuda/fp8.hpp) are checked against,
// and what the CPU backend computes with model.fp8 (src/cpu/fp8_linear.hpp).
//
// Owns: shardlm::cpu::{fp8_round, fp8_bits, fp8_value, fp8_scale,
// quantize_fp8, quantize_fp8_rows, quantize_fp8_values, matmul_fp8_reference},
// the two formats' constants and the format of gradients (kFp8GradFormat).
// Must not know: CUDA, MPI, the model, the deck.
//
// Formats (OCP FP8, as cuda_fp8.h): e4m3 ("fn": 4 exponent bits, bias 7, 3
// mantissa bits, no infinities, largest finite 448, smallest subnormal 2^-9)
// for weights and activations; e5m2 (bias 15, 2 mantissa bits, largest finite
// 57344, smallest subnormal 2^-16) for gradients.
// Rounding: to nearest, ties to even; values beyond the largest finite one
// (and infinities) saturate to it, keeping their sign (cuda_fp8.h's
// __NV_SATFINITE); NaN stays NaN.
// Scaling (tensorwise or per row): q = round(x * s) with s = max_finite /
// amax, so the largest |x| lands on the format's largest value; the GEMM
// multiplies by 1 / s (the "dequantisation scale" cuBLASLt takes). amax = 0
// (an all-zero tensor) gives s = 1. s is a power of two only by chance: the
// products are exact in fp32 whatever s is, because the quantised values carry
// at most 4 significant bits.
#pragma once

#include <cstdint>

namespace shardlm::cpu {

enum class Fp8Format { E4M3, E5M2 };

constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8E5M2Max = 57344.0f;
inline float fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? kFp8E4M3Max : kFp8E5M2Max; }

// The format of the output gradient in model.fp8's backward GEMMs (the one place
// that says it; the CPU emulation and the CUDA linears both read it). e4m3: its
// 3 mantissa bits against e5m2's 2, and with a scale per
// tensor or row from the current amax, e5m2's wider range is not needed to
// avoid overflow (torchao's and Megatron's current scaling do the same).
constexpr Fp8Format kFp8GradFormat = Fp8Format::E4M3;

// What a tensor's scales are indexed by: one for the whole tensor, one per row,
// one per column (of the matrix as stored, (rows, cols) row-major).
enum class Fp8Scaling { Tensor, Rows, Cols };

// x rounded to the format (nearest, ties to even, saturating), as an fp32 value.
float fp8_round(float x, Fp8Format f);
// The format's 8-bit code of fp8_round(x, f) (sign, exponent, mantissa), as cuda_fp8.h stores it.
uint8_t fp8_bits(float x, Fp8Format f);
// The value an 8-bit code stands for (NaN codes give NaN).
float fp8_value(uint8_t bits, Fp8Format f);
// The quantisation scale for a tensor (or row) whose largest magnitude is amax.
float fp8_scale(float amax, Fp8Format f);

// codes (n) = fp8_bits(x * scale): the product is rounded to fp32 first, as on the GPU.
void quantize_fp8(const float* x, int64_t n, float scale, Fp8Format f, uint8_t* codes);
// Per row of x (rows, cols): scales[r] = fp8_scale(amax of row r), codes (rows, cols).
void quantize_fp8_rows(const float* x, int64_t rows, int64_t cols, Fp8Format f, uint8_t* codes, float* scales);

// values (rows, cols) = fp8_round(x * scale, f) as fp32 values (exact in fp32),
// with the scale from the amax of the whole tensor, of x's row or of x's column
// (scaling); inv_scales (1, rows or cols) = 1 / scale, the dequantisation scale.
// The same numbers as quantize_fp8 / quantize_fp8_rows, kept as floats for a BLAS GEMM.
void quantize_fp8_values(const float* x, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format f, float* values,
                         float* inv_scales);

// C (M, N) = (A (M, K) dequantised) (B (N, K) dequantised)^T in double, rounded to
// float: the exact product of what an FP8 GEMM reads. a_inv / b_inv: dequantisation
// scales, one (a_rows = false) or one per row of A / B.
void matmul_fp8_reference(const uint8_t* A, Fp8Format fa, const float* a_inv, bool a_rows, const uint8_t* B,
                          Fp8Format fb, const float* b_inv, bool b_rows, int64_t M, int64_t N, int64_t K, float* C);

}  // namespace shardlm::cpu
