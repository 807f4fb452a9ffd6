// gemm.hpp — bf16 GEMMs through cuBLASLt, with row-major semantics, and the
// linear layer built on them.
//
// Owns: shardlm::cuda::Gemm (a cuBLASLt handle, its workspace, and the cache of
// matmul descriptors, layouts and chosen algorithms, one entry per shape), the
// CUBLAS_CHECK macro, linear_forward / linear_backward on the GPU.
// Must not know: MPI, NCCL, the model, the deck. Included only by .cu files and the
// GPU tests.
//
// Semantics are cpu::gemm's: row-major C (M, N) = alpha * op(A) op(B) + beta * C,
// op(A) = A^T when trans_a (A stored (K, M)), likewise B. Operands bf16, accumulation
// and scaling fp32 (CUBLAS_COMPUTE_32F), C bf16 or fp32; beta = 1 with an fp32 C
// accumulates weight gradients. Deterministic: cuBLASLt gives the same bits for the
// same algorithm on the same GPU, and the cache fixes the algorithm per shape.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "cuda/ops.hpp"
#include "shardlm/error.hpp"

#define CUBLAS_CHECK(call)                                                                 \
  do {                                                                                     \
    const cublasStatus_t cublas_status_ = (call);                                          \
    if (cublas_status_ != CUBLAS_STATUS_SUCCESS)                                           \
      throw ::shardlm::Error(::shardlm::fmt("cuBLAS error: %s failed at %s:%d: %s", #call, \
                                            __FILE__, __LINE__,                            \
                                            cublasLtGetStatusString(cublas_status_)));     \
  } while (0)

namespace shardlm::cuda {

enum class GemmOut { BF16, F32 };

// The largest power of two (at most 256, cuBLASLt's default assumption) dividing
// the address (256 for nullptr). The GEMM plans key on it and hand it to the
// heuristic, which must not pick a kernel that needs more than an operand has.
uint32_t alignment_of(const void* p);

class Gemm {
 public:
  // One Gemm per stream: the workspace is used by every matmul issued on `stream`
  // (32 MiB is what cuBLASLt asks for on Hopper; 0 works with fewer algorithms).
  Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // C (M, N) = alpha op(A) op(B) + beta C_in [+ bias broadcast over rows], row-major.
  //   A: (M, K) with row stride lda, or (K, M) when trans_a; B: (K, N) / (N, K).
  //   C: (M, N) with row stride ldc, bf16 or fp32 (`out`); with beta == 0 it is only
  //   written. C_in: a matrix laid out like C that is read in its place (nullptr: C
  //   itself), so a residual is added in the epilogue and rounded once with the
  //   product. bias (N) bf16 or nullptr: added in the epilogue (bf16 C only).
  // The first call of a shape (sizes, strides, types, epilogue, pointer alignments)
  // builds its descriptors and asks the heuristic for an algorithm; later calls
  // reuse them (only the bias pointer is set per call).
  void matmul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
              int64_t lda, const bf16* B, int64_t ldb, void* C, int64_t ldc, GemmOut out,
              float alpha, float beta, const bf16* bias = nullptr, const void* C_in = nullptr);
  // `batch` products of that shape in one call (beta 0, no bias): product i reads
  // A + i stride_a and B + i stride_b and writes C + i stride_c (elements). With
  // strides along K it is a split-K whose fp32 parts the caller reduces
  // (the decoder's down projection: the reduction fused with the residual add and
  // the next norm).
  void matmul_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                      int64_t lda, int64_t stride_a, const bf16* B, int64_t ldb, int64_t stride_b, void* C,
                      int64_t ldc, int64_t stride_c, int batch, GemmOut out);

  cudaStream_t stream() const { return stream_; }
  size_t plans_cached() const { return plans_.size(); }  // distinct shapes seen

 private:
  struct Key {
    bool trans_a, trans_b;
    int64_t M, N, K, lda, ldb, ldc;
    GemmOut out;
    bool bias;
    uint32_t align_a, align_b, align_c, align_bias;
    int batch = 1;
    int64_t stride_a = 0, stride_b = 0, stride_c = 0;
    auto operator<=>(const Key&) const = default;
  };
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // bias: the call's bias pointer (the heuristic reads its alignment), or nullptr.
  Plan& plan(const Key& key, const void* bias);

  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  cublasLtHandle_t handle_ = nullptr;
  std::map<Key, Plan> plans_;
};

// torch.nn.Linear on the GPU, mirroring cpu::linear_forward / linear_backward:
//   out (N, OC) bf16 overwritten = inp (N, IC) W^T + bias [+ residual]; W (OC, IC);
//   bias (OC) or nullptr; residual (N, OC) bf16 or nullptr (it may be `out`). Both
//   are added in the GEMM epilogue: no extra pass, one rounding to bf16.
void linear_forward(Gemm& gemm, bf16* out, const bf16* inp, const bf16* weight,
                    const bf16* bias, int64_t N, int64_t IC, int64_t OC,
                    const bf16* residual = nullptr);

//   dinp (N, IC) bf16 = dout W (nullptr: skip), overwritten, or with Dinp::Accumulate
//   added to what dinp holds in the GEMM epilogue (the sum of several projections'
//   input gradients without a separate add); dweight (OC, IC) fp32 +=; dbias (OC)
//   fp32 += (nullptr: no bias; deterministic column sum through scratch of
//   linear_backward_scratch_bytes(N, OC)); dout (N, OC) bf16.
enum class Dinp { Overwrite, Accumulate };
size_t linear_backward_scratch_bytes(int64_t N, int64_t OC);
void linear_backward(Gemm& gemm, bf16* dinp, float* dweight, float* dbias, const bf16* dout,
                     const bf16* inp, const bf16* weight, int64_t N, int64_t IC, int64_t OC,
                     void* scratch, size_t scratch_bytes, Dinp dinp_mode = Dinp::Overwrite);

}  // namespace shardlm::cuda
