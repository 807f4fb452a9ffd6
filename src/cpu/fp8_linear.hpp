// fp8_linear.hpp — model.fp8 on the CPU backend: a decoder layer's projections
// with e4m3 operands at dynamic scales and fp32 accumulation, emulated in fp32.
// The reference the CUDA backend's FP8 linears (cuBLASLt, src/cuda/fp8.hpp) are
// checked against.
//
// Owns: Fp8Linear (a cpu::Linear) and its scratch rows in the backend's table.
// Must not know: MPI, shards, the deck (the backend hands it the mode).
//
// The three GEMMs of y (N, OC) = x (N, IC) W (OC, IC)^T, each C = A B^T with
// both operands quantised along the reduction dimension K:
//   forward  y  = x W^T          A = x (N, IC),      B = W (OC, IC)
//   dinp     dx = dy W           A = dy (N, OC),     B = W^T (IC, OC)
//   dweight  dW += dy^T x        A = dy^T (OC, N),   B = x^T (IC, N)
// tensorwise: one scale per operand tensor (from its amax); rowwise: one per row
// of A and of B (torchao's rowwise recipe), which for the transposed operands is
// one per column of the stored matrix. x and W are e4m3; dy is kFp8GradFormat.
// The GEMM multiplies the quantised values (exact in fp32) with fp32
// accumulation (BLAS), then each product by its two dequantisation scales, as
// cuBLASLt applies them. Bias gradients are the fp32 sums of dy, unquantised.
//
// World-size invariance: the engine hands the linears gathered (full) weights,
// so a weight's scales do not depend on the sharding; an activation's are its
// micro-batch's (tensorwise) or its token's (rowwise), and a micro-batch's rows
// are the same at every world size. Context parallelism splits rows, and the
// scales over tokens (tensorwise's, rowwise's weight-gradient columns) with them:
// the deck refuses model.fp8 with it until those amaxes are all-reduced.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/model.hpp"
#include "cpu/layers.hpp"

namespace shardlm::cpu {

class Fp8Linear final : public Linear {
 public:
  explicit Fp8Linear(Fp8Mode mode);
  // Its scratch for layers of model c over up to N tokens, one row per buffer.
  void add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows);

  void forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t IC,
               int64_t OC) override;
  void backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp, const float* weight,
                int64_t N, int64_t IC, int64_t OC) override;

 private:
  bool rowwise_;
  Buffer<float> a_, b_;           // the quantised operands as fp32 values: (max M K), (max N K)
  Buffer<float> a_inv_, b_inv_;   // their dequantisation scales: (1 or M), (1 or N)
  Buffer<float> product_;         // (OC, IC) the weight gradient's product before it is added
};

}  // namespace shardlm::cpu
