// cuda/fp8.hpp — FP8 on Hopper: amaxes, scales, quantisation (plain and
// transposed) and the FP8 GEMM through cuBLASLt (cuda/fp8_linear.hpp
// wires them into the decoder blocks' projections).
//
// Owns: shardlm::cuda::{fp8_amax, fp8_amax_rows, fp8_amax_cols, fp8_scales,
// fp8_quantize} and Fp8Gemm. The arithmetic is src/cpu/fp8.hpp's, which these
// kernels are checked against bit for bit (tests/gpu/test_fp8.cu): the
// quantised codes equal cpu::fp8_bits(x * scale), scales equal cpu::fp8_scale.
// Must not know: the model, MPI, NCCL, the deck. Kernels allocate nothing and
// never synchronise the host; every launch goes on the caller's stream.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>

#include "cpu/fp8.hpp"
#include "cuda/gemm.hpp"

namespace shardlm::cuda {

using Fp8Format = cpu::Fp8Format;

// amax (1) = max |x| over x (n); overwritten. Deterministic (a max in any order).
void fp8_amax(const bf16* x, int64_t n, float* amax, cudaStream_t stream);
// The same over x (rows, cols) whose rows lie ld >= cols elements apart (a
// column block of a wider matrix: dgate and dup inside dgate|dup).
void fp8_amax(const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* amax, cudaStream_t stream);
// amax (rows) = max |x[r, :]| of x (rows, cols); amax (cols) = max |x[:, c]|.
// ld: x's row stride (0: cols), in these and in fp8_quantize.
void fp8_amax_rows(const bf16* x, int64_t rows, int64_t cols, float* amax, cudaStream_t stream, int64_t ld = 0);
void fp8_amax_cols(const bf16* x, int64_t rows, int64_t cols, float* amax, cudaStream_t stream, int64_t ld = 0);
// scale[i] = cpu::fp8_scale(amax[i], f), inv_scale[i] = 1 / scale[i] (the GEMM's dequantisation scale).
void fp8_scales(const float* amax, int64_t n, Fp8Format f, float* scale, float* inv_scale, cudaStream_t stream);

// What the scales of fp8_quantize are indexed by: one for the tensor, one per row
// of x, one per column of x (cpu/fp8.hpp's).
using Fp8Scaling = cpu::Fp8Scaling;
// codes = cpu::fp8_bits(x[r, c] * scale[.], f) of x (rows, cols) bf16, written
// (rows, cols) or, with transpose, (cols, rows): the K-major copy the backward's
// GEMMs read (cuBLASLt's FP8 kernels take both operands with K contiguous).
void fp8_quantize(const bf16* x, int64_t rows, int64_t cols, const float* scale, Fp8Scaling scaling, Fp8Format f,
                  uint8_t* codes, bool transpose, cudaStream_t stream, int64_t ld = 0);
// One tensor scale: fp8_scales(amax, 1, f, scale, inv_scale) and fp8_quantize(...,
// scale, Tensor, ...) in one launch (the kernel computes the scale from amax as
// fp8_scales does and writes it and its inverse): the same codes and scales.
void fp8_quantize_tensor(const bf16* x, int64_t rows, int64_t cols, const float* amax, Fp8Format f, float* scale,
                         float* inv_scale, uint8_t* codes, bool transpose, cudaStream_t stream, int64_t ld = 0);
// Both copies at one tensor scale: plain (rows, cols) and transposed (cols, rows)
// codes, as fp8_quantize_tensor writes each, from one read of x where the 64 x 64
// transpose kernel takes it (rows and cols multiples of 64, aligned; else two passes).
void fp8_quantize_tensor_both(const bf16* x, int64_t rows, int64_t cols, const float* amax, Fp8Format f,
                              float* scale, float* inv_scale, uint8_t* plain, uint8_t* transposed,
                              cudaStream_t stream, int64_t ld = 0);

// C (M, N) = alpha (a_inv A) (b_inv B)^T + beta C_in, row-major: A (M, K) and B (N, K)
// FP8 codes with K contiguous (row strides lda, ldb), a_inv / b_inv device fp32
// dequantisation scales, one each (rowwise = false) or one per row of A (M) and of
// B (N); C bf16 or fp32 (ldc). fp32 accumulation, promoted periodically (cuBLASLt's
// FAST_ACCUM off) unless fast_accum. bias (N) bf16 or nullptr: added in the
// epilogue (bf16 C only), as Gemm's. C_in (C's shape and ldc; nullptr: C itself)
// is what beta scales: a residual added without first copying it into C.
// Plans cached per shape like Gemm's.
class Fp8Gemm {
 public:
  Fp8Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  void matmul(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format fa, int64_t lda, const float* a_inv,
              const uint8_t* B, Fp8Format fb, int64_t ldb, const float* b_inv, bool rowwise, void* C, int64_t ldc,
              GemmOut out, float alpha = 1.0f, float beta = 0.0f, bool fast_accum = false,
              const bf16* bias = nullptr, const void* C_in = nullptr);

 private:
  struct Key {
    int64_t M, N, K, lda, ldb, ldc;
    Fp8Format fa, fb;
    bool rowwise, fast_accum, bias;
    GemmOut out;
    uint32_t align_a, align_b, align_c, align_c_in, align_bias;  // alignment_of each pointer (C: a view into a larger buffer)
    auto operator<=>(const Key&) const = default;
  };
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Plan& plan(const Key& key, const float* a_inv, const float* b_inv, const bf16* bias);

  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  cublasLtHandle_t handle_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace shardlm::cuda
