// fp8_linear.cu — model.fp8's projections on the GPU. See src/cuda/fp8_linear.hpp.
#include "cuda/fp8_linear.hpp"

#include <algorithm>

#include "cuda/check.hpp"
#include "cuda/ops.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cuda {

namespace {

// The largest input or output width of a projection, and the largest weight.
int64_t widest(const ModelConfig& c) {
  return std::max({c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim});
}
int64_t largest_weight(const ModelConfig& c) {
  return c.hidden_size * std::max({c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim});
}

}  // namespace

Fp8Linear::Sizes Fp8Linear::sizes(const ModelConfig& c, int64_t N) {
  const int64_t width = widest(c);
  // A: x (N, IC), dout (N, OC), dout^T (OC, N). B: W (OC, IC), W^T (IC, OC). X: x^T (IC, N).
  // Scales: A's rows are N tokens or OC channels; B's OC or IC channels; X's IC channels.
  return {N * width, std::max(largest_weight(c), N * width), N * width, scale_block(std::max(N, width))};
}

Fp8Linear::Fp8Linear(Fp8Mode mode, const Buffers& buffers, cudaStream_t stream, void* gemm_workspace,
                     size_t workspace_bytes)
    : rowwise_(mode == Fp8Mode::Rowwise), buf_(buffers), stream_(stream), gemm_(stream, gemm_workspace, workspace_bytes) {
  SHARDLM_CHECK(mode != Fp8Mode::None, "internal: an FP8 linear for model.fp8 = \"none\"");
}

void Fp8Linear::quantize(const bf16* x, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format f, bool transpose,
                         uint8_t* codes, float* scales, int64_t ld, bool reuse_scales) {
  const int64_t n = scaling == Fp8Scaling::Tensor ? 1 : scaling == Fp8Scaling::Rows ? rows : cols;
  // The inverse scales cuBLASLt reads first, at the block's (256-byte aligned)
  // start: at an offset of 2n floats (8 bytes for one scale) it refused the
  // GEMM ("not supported") on the H200 where separately allocated scales ran.
  float* inv = scales;
  float* amax = scales + scale_block(n);
  float* scale = scales + 2 * scale_block(n);
  if (reuse_scales) return fp8_quantize(x, rows, cols, scale, scaling, f, codes, transpose, stream_, ld);
  if (scaling == Fp8Scaling::Tensor) {  // the scale made inside the quantise kernel: one launch fewer
    fp8_amax(x, rows, cols, ld ? ld : cols, amax, stream_);
    return fp8_quantize_tensor(x, rows, cols, amax, f, scale, inv, codes, transpose, stream_, ld);
  }
  if (scaling == Fp8Scaling::Rows) fp8_amax_rows(x, rows, cols, amax, stream_, ld);
  else fp8_amax_cols(x, rows, cols, amax, stream_, ld);
  fp8_scales(amax, n, f, scale, inv, stream_);
  fp8_quantize(x, rows, cols, scale, scaling, f, codes, transpose, stream_, ld);
}

void Fp8Linear::forward(bf16* out, int64_t ldc, const bf16* inp, const bf16* weight, const bf16* bias, int64_t N,
                        int64_t IC, int64_t OC, const bf16* residual, bool same_input) {
  const Fp8Scaling along_k = rowwise_ ? Fp8Scaling::Rows : Fp8Scaling::Tensor;
  if (same_input) {
    SHARDLM_CHECK(a_held_.is(inp, N, IC), "internal: an FP8 forward reusing input codes of another input or shape");
  } else {
    quantize(inp, N, IC, along_k, Fp8Format::E4M3, false, buf_.a_codes, buf_.a_scales);
    a_held_ = {inp, N, IC};
  }
  quantize(weight, OC, IC, along_k, Fp8Format::E4M3, false, buf_.b_codes, buf_.b_scales);
  gemm_.matmul(N, OC, IC, buf_.a_codes, Fp8Format::E4M3, IC, buf_.a_scales, buf_.b_codes, Fp8Format::E4M3,
               IC, buf_.b_scales, rowwise_, out, ldc, GemmOut::BF16, 1.0f, residual ? 1.0f : 0.0f,
               /*fast_accum=*/false, bias, residual);
}

void Fp8Linear::backward(bf16* dinp, bool accumulate_dinp, float* dweight, float* dbias, const bf16* dout, int64_t ldo,
                         const bf16* inp, const bf16* weight, int64_t N, int64_t IC, int64_t OC, void* bias_scratch,
                         size_t bias_scratch_bytes, bool same_input) {
  // K runs along dout's rows (dinp) or across the stored matrices (W^T, dout^T,
  // inp^T, the transposed copies): under rowwise a scale per row or per column.
  a_held_ = {};  // the A buffers are overwritten below
  if (ldo == 0) ldo = OC;
  SHARDLM_CHECK(ldo >= OC && (dbias == nullptr || ldo == OC), "internal: FP8 backward with dout rows %lld apart",
                static_cast<long long>(ldo));
  const Fp8Scaling rows = rowwise_ ? Fp8Scaling::Rows : Fp8Scaling::Tensor;
  const Fp8Scaling cols = rowwise_ ? Fp8Scaling::Cols : Fp8Scaling::Tensor;
  if (dinp != nullptr) {
    // dinp (N, IC) = dout (N, OC) W (OC, IC): A = dout, B = W^T (IC, OC).
    quantize(dout, N, OC, rows, cpu::kFp8GradFormat, false, buf_.a_codes, buf_.a_scales, ldo);
    quantize(weight, OC, IC, cols, Fp8Format::E4M3, true, buf_.b_codes, buf_.b_scales);
    gemm_.matmul(N, IC, OC, buf_.a_codes, cpu::kFp8GradFormat, OC, buf_.a_scales, buf_.b_codes, Fp8Format::E4M3,
                 OC, buf_.b_scales, rowwise_, dinp, IC, GemmOut::BF16, 1.0f, accumulate_dinp ? 1.0f : 0.0f);
  }
  // dweight (OC, IC) += dout^T (OC, N) inp (N, IC): A = dout^T, B = inp^T (IC, N).
  // One tensor scale serves dout's two copies: the amax above is dout's whole.
  quantize(dout, N, OC, cols, cpu::kFp8GradFormat, true, buf_.a_codes, buf_.a_scales, ldo,
           /*reuse_scales=*/dinp != nullptr && !rowwise_);
  if (same_input) {
    SHARDLM_CHECK(x_held_.is(inp, N, IC), "internal: an FP8 backward reusing input codes of another input or shape");
  } else {
    quantize(inp, N, IC, cols, Fp8Format::E4M3, true, buf_.x_codes, buf_.x_scales);
    x_held_ = {inp, N, IC};
  }
  gemm_.matmul(OC, IC, N, buf_.a_codes, cpu::kFp8GradFormat, N, buf_.a_scales, buf_.x_codes, Fp8Format::E4M3, N,
               buf_.x_scales, rowwise_, dweight, IC, GemmOut::F32, 1.0f, 1.0f);
  if (dbias != nullptr) bias_grad(dbias, dout, N, OC, bias_scratch, bias_scratch_bytes, stream_);
}

}  // namespace shardlm::cuda
