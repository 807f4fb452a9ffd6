// fp8_linear.cpp — model.fp8's projections emulated on the CPU. See src/cpu/fp8_linear.hpp.
#include "cpu/fp8_linear.hpp"

#include <algorithm>

#include "cpu/fp8.hpp"
#include "cpu/ops.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cpu {

namespace {

// C (M, N) = P (M, N) a_inv[i] b_inv[j] (+ bias[j]) — or C += that with
// accumulate — the dequantisation of an FP8 GEMM's product P (a_inv, b_inv: one
// value, or one per row of A / B when rowwise). P may be C.
void dequantise(float* C, const float* P, int64_t M, int64_t N, const float* a_inv, const float* b_inv, bool rowwise,
                const float* bias, bool accumulate) {
#pragma omp parallel for schedule(static) if (M * N >= (int64_t(1) << 16))
  for (int64_t i = 0; i < M; ++i) {
    const float ai = a_inv[rowwise ? i : 0];
    for (int64_t j = 0; j < N; ++j) {
      const float v = P[i * N + j] * (ai * b_inv[rowwise ? j : 0]) + (bias ? bias[j] : 0.0f);
      C[i * N + j] = accumulate ? C[i * N + j] + v : v;
    }
  }
}

}  // namespace

Fp8Linear::Fp8Linear(Fp8Mode mode) : rowwise_(mode == Fp8Mode::Rowwise) {
  SHARDLM_CHECK(mode != Fp8Mode::None, "internal: an FP8 linear for model.fp8 = \"none\"");
}

void Fp8Linear::add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows) {
  const int64_t C = c.hidden_size, I = c.intermediate_size, HD = c.num_heads * c.head_dim;
  const int64_t KVD = c.num_kv_heads * c.head_dim;
  const int64_t width = std::max({C, I, HD, KVD});           // the largest IC or OC
  const int64_t weight = C * std::max({I, HD, KVD});         // the largest OC x IC
  const Mem m = Mem::Workspace;
  rows.push_back({"fp8.a", &a_, N * width, m});
  rows.push_back({"fp8.b", &b_, std::max(weight, N * width), m});
  rows.push_back({"fp8.a_inv", &a_inv_, std::max(N, width), m});
  rows.push_back({"fp8.b_inv", &b_inv_, width, m});
  rows.push_back({"fp8.product", &product_, weight, m});
}

void Fp8Linear::forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t IC,
                        int64_t OC) {
  const Fp8Scaling along_k = rowwise_ ? Fp8Scaling::Rows : Fp8Scaling::Tensor;
  quantize_fp8_values(inp, N, IC, along_k, Fp8Format::E4M3, a_.data(), a_inv_.data());
  quantize_fp8_values(weight, OC, IC, along_k, Fp8Format::E4M3, b_.data(), b_inv_.data());
  gemm<float>(false, true, N, OC, IC, 1.0f, a_.data(), IC, b_.data(), IC, 0.0f, out, OC);
  dequantise(out, out, N, OC, a_inv_.data(), b_inv_.data(), rowwise_, bias, /*accumulate=*/false);
}

void Fp8Linear::backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                         const float* weight, int64_t N, int64_t IC, int64_t OC) {
  // K runs along the stored rows of dy (dinp) or across the stored matrices (W^T,
  // dy^T, x^T): under rowwise, a scale per row or per column of what is stored.
  const Fp8Scaling rows = rowwise_ ? Fp8Scaling::Rows : Fp8Scaling::Tensor;
  const Fp8Scaling cols = rowwise_ ? Fp8Scaling::Cols : Fp8Scaling::Tensor;
  if (dinp != nullptr) {
    // dx (N, IC) = dy (N, OC) W (OC, IC)
    quantize_fp8_values(dout, N, OC, rows, kFp8GradFormat, a_.data(), a_inv_.data());
    quantize_fp8_values(weight, OC, IC, cols, Fp8Format::E4M3, b_.data(), b_inv_.data());
    gemm<float>(false, false, N, IC, OC, 1.0f, a_.data(), OC, b_.data(), IC, 0.0f, dinp, IC);
    dequantise(dinp, dinp, N, IC, a_inv_.data(), b_inv_.data(), rowwise_, nullptr, /*accumulate=*/false);
  }
  // dW (OC, IC) += dy^T (OC, N) x (N, IC); the sum over tokens is the GEMM's K.
  quantize_fp8_values(dout, N, OC, cols, kFp8GradFormat, a_.data(), a_inv_.data());
  quantize_fp8_values(inp, N, IC, cols, Fp8Format::E4M3, b_.data(), b_inv_.data());
  gemm<float>(true, false, OC, IC, N, 1.0f, a_.data(), OC, b_.data(), IC, 0.0f, product_.data(), IC);
  dequantise(dweight, product_.data(), OC, IC, a_inv_.data(), b_inv_.data(), rowwise_, nullptr, /*accumulate=*/true);
  if (dbias != nullptr) bias_backward(dbias, dout, N, OC);
}

}  // namespace shardlm::cpu
