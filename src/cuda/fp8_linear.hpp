// cuda/fp8_linear.hpp — model.fp8 on the CUDA backend: a decoder layer's
// projections through cuBLASLt's FP8 GEMMs (e4m3 operands at dynamic scales,
// fp32 accumulation, bf16 activations out, fp32 weight gradients accumulated).
// The numbers are src/cpu/fp8_linear.hpp's (the CPU emulation it is checked
// against, tests/gpu/test_backend.cpp): the same three GEMMs, the same operands
// quantised along the same dimension at the same scales.
//
// Owns: Fp8Linear and the sizes of its scratch (the backend's buffer table
// allocates it). Must not know: the model's layout, MPI, NCCL, the deck.
//
// First version (issue #30): every operand is quantised by its own passes
// (amax, scale, quantise or quantise-transposed: cuda/fp8.hpp's kernels) right
// before its GEMM, so each linear reads its bf16 input once more per GEMM than
// the bf16 path. Fusing the amaxes and the quantised (and transposed) copies
// into the kernels that write the data (RMSNorm, SwiGLU, the backward
// elementwise passes) is the next step, as is keeping a weight's codes from the
// forward for the backward. Every kernel is deterministic (amaxes are maxima),
// so run.deterministic reruns stay bit-identical.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "shardlm/backend.hpp"
#include "shardlm/model_config.hpp"
#include "cuda/fp8.hpp"

namespace shardlm::cuda {

class Fp8Linear {
 public:
  // Device scratch, planned and allocated by the caller's buffer table.
  struct Buffers {
    uint8_t* a_codes = nullptr;  // (a_code_bytes) operand A's codes
    uint8_t* b_codes = nullptr;  // (b_code_bytes) operand B's codes
    float* a_scales = nullptr;   // (3 x scale_count) A's 1 / scale, amax, scale, each at a multiple of 64 floats
    float* b_scales = nullptr;   // (3 x scale_count)
  };
  struct Sizes {
    int64_t a_code_bytes, b_code_bytes, scale_count;
  };
  // For layers of model c over up to N tokens.
  static Sizes sizes(const ModelConfig& c, int64_t N);
  // n scales rounded up to 64 floats: each part of a scale block starts 256-byte aligned.
  static int64_t scale_block(int64_t n) { return (n + 63) / 64 * 64; }

  Fp8Linear(Fp8Mode mode, const Buffers& buffers, cudaStream_t stream, void* gemm_workspace, size_t workspace_bytes);

  // out (N, OC), row stride ldc = inp (N, IC) weight (OC, IC)^T + bias (OC, or
  // nullptr) [+ out's own values when accumulate: a residual]. same_input: inp
  // is the last forward's inp, unchanged (q, k and v share theirs; so do gate
  // and up): its codes and scales are still in the A buffers and are reused.
  void forward(bf16* out, int64_t ldc, const bf16* inp, const bf16* weight, const bf16* bias, int64_t N, int64_t IC,
               int64_t OC, bool accumulate = false, bool same_input = false);
  // dinp (N, IC) = dout (N, OC) weight [+= with accumulate_dinp]; dweight (OC, IC)
  // fp32 += dout^T inp; dbias (OC) fp32 += dout's column sums (unquantised;
  // nullptr: none; bias_scratch as cuda::bias_grad's).
  void backward(bf16* dinp, bool accumulate_dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                const bf16* weight, int64_t N, int64_t IC, int64_t OC, void* bias_scratch, size_t bias_scratch_bytes);

 private:
  // Quantises x (rows, cols) with scales over `scaling` into one operand's
  // codes (transposed: (cols, rows)) and its scale block.
  void quantize(const bf16* x, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format f, bool transpose,
                uint8_t* codes, float* scales);

  bool rowwise_;
  Buffers buf_;
  // What the A buffers hold after a forward (same_input checks it): the input and its shape.
  const bf16* a_input_ = nullptr;
  int64_t a_rows_ = 0, a_cols_ = 0;
  int64_t scale_count_ = 0;
  cudaStream_t stream_;
  Fp8Gemm gemm_;
};

}  // namespace shardlm::cuda
