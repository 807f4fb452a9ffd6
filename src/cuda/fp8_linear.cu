// fp8_linear.cu — model.fp8's projections on the GPU. See src/cuda/fp8_linear.hpp.
#include "cuda/fp8_linear.hpp"

#include <algorithm>
#include <utility>

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

std::pair<int64_t, int64_t> Fp8Linear::weight_shape(const ModelConfig& c, Weight w) {
  const int64_t C = c.hidden_size, I = c.intermediate_size, HD = c.num_heads * c.head_dim;
  const int64_t KVD = c.num_kv_heads * c.head_dim;
  switch (w) {
    case Q: return {HD, C};
    case K: case V: return {KVD, C};
    case O: return {C, HD};
    case Gate: case Up: return {I, C};
    case Down: return {C, I};
    default: break;
  }
  SHARDLM_FAIL("internal: no FP8 weight %d", int(w));
}

bool Fp8Linear::dout_one_pass(Fp8Mode mode, const ModelConfig& c, int64_t N) {
  return mode == Fp8Mode::Tensorwise && N * widest(c) <= kOnePassBytes;
}

Fp8Linear::Sizes Fp8Linear::sizes(const ModelConfig& c, int64_t N, bool cache, bool one_pass) {
  const int64_t width = widest(c);
  // A: x (N, IC), dout (N, OC), dout^T (OC, N). B: W (OC, IC), W^T (IC, OC). X: x^T (IC, N).
  // T: dout^T (OC, N) beside dout in A (one_pass).
  // Scales: A's rows are N tokens or OC channels; B's OC or IC channels; X's IC channels.
  Sizes s{N * width, largest_weight(c), N * width, scale_block(std::max(N, width))};
  if (one_pass) s.t_code_bytes = N * width;
  if (cache)
    for (int w = 0; w < kWeights; ++w) {  // per layer: both orientations' codes and scale blocks
      const auto [oc, ic] = weight_shape(c, Weight(w));
      s.cache_code_bytes += 2 * ((oc * ic + 255) / 256 * 256) * c.num_layers;
      s.cache_scale_count += 3 * (scale_block(oc) + scale_block(ic)) * c.num_layers;
    }
  return s;
}

Fp8Linear::Fp8Linear(Fp8Mode mode, const Buffers& buffers, cudaStream_t stream, void* gemm_workspace,
                     size_t workspace_bytes, const ModelConfig& c, int64_t layers)
    : rowwise_(mode == Fp8Mode::Rowwise), buf_(buffers), stream_(stream), gemm_(stream, gemm_workspace, workspace_bytes) {
  SHARDLM_CHECK(mode != Fp8Mode::None, "internal: an FP8 linear for model.fp8 = \"none\"");
  if (!buffers.cache_codes) return;
  uint8_t* codes = buffers.cache_codes;
  float* scales = buffers.cache_scales;
  for (int64_t l = 0; l < layers; ++l)  // sizes()'s order: per layer, per weight, plain then transposed
    for (int w = 0; w < kWeights; ++w) {
      const auto [oc, ic] = weight_shape(c, Weight(w));
      Slot s{};
      s.oc = oc, s.ic = ic;
      const int64_t bytes = (oc * ic + 255) / 256 * 256;
      s.codes[0] = codes, s.codes[1] = codes + bytes;
      codes += 2 * bytes;
      s.scales[0] = scales, s.scales[1] = scales + 3 * scale_block(oc);
      scales += 3 * (scale_block(oc) + scale_block(ic));
      slots_.push_back(s);
    }
}

void Fp8Linear::set_params_version(int64_t version) {
  if (version == version_) return;
  version_ = version;
  for (Slot& s : slots_) s.valid[0] = s.valid[1] = false;
}

// The forward's B is W (OC, IC) with scales along IC; dinp's is W^T (IC, OC)
// with scales along OC (the stored matrix's columns).
Fp8Linear::Operand Fp8Linear::weight_operand(const bf16* weight, int64_t OC, int64_t IC, bool transposed, int slot) {
  const Fp8Scaling scaling = !rowwise_ ? Fp8Scaling::Tensor : transposed ? Fp8Scaling::Cols : Fp8Scaling::Rows;
  if (slot < 0 || slots_.empty()) {
    quantize(weight, OC, IC, scaling, Fp8Format::E4M3, transposed, buf_.b_codes, buf_.b_scales);
    return {buf_.b_codes, buf_.b_scales};
  }
  SHARDLM_CHECK(size_t(slot) < slots_.size() && slots_[size_t(slot)].oc == OC && slots_[size_t(slot)].ic == IC,
                "internal: FP8 weight cache slot %d for a (%lld, %lld) weight", slot, (long long)OC, (long long)IC);
  Slot& s = slots_[size_t(slot)];
  const int t = transposed ? 1 : 0;
  if (!s.valid[t]) {
    quantize(weight, OC, IC, scaling, Fp8Format::E4M3, transposed, s.codes[t], s.scales[t]);
    s.valid[t] = true;
  }
  return {s.codes[t], s.scales[t]};
}

void Fp8Linear::quantize(const bf16* x, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format f, bool transpose,
                         uint8_t* codes, float* scales, int64_t ld, bool reuse_scales, Amax given, uint8_t* plain) {
  SHARDLM_CHECK(plain == nullptr || (transpose && scaling == Fp8Scaling::Tensor && !reuse_scales),
                "internal: FP8 plain codes beside the transposed ones only under one tensor scale");
  const int64_t n = scaling == Fp8Scaling::Tensor ? 1 : scaling == Fp8Scaling::Rows ? rows : cols;
  // The inverse scales cuBLASLt reads first, at the block's (256-byte aligned)
  // start: at an offset of 2n floats (8 bytes for one scale) it refused the
  // GEMM ("not supported") on the H200 where separately allocated scales ran.
  float* inv = scales;
  float* amax = scales + scale_block(n);
  float* scale = scales + 2 * scale_block(n);
  if (reuse_scales) return fp8_quantize(x, rows, cols, scale, scaling, f, codes, transpose, stream_, ld);
  SHARDLM_CHECK(given.at != nullptr || !given.ready, "internal: an FP8 amax said ready with nowhere to read it");
  if (scaling == Fp8Scaling::Tensor) {  // the scale made inside the quantise kernel: one launch fewer
    if (given.at) amax = given.at;
    if (!given.ready) fp8_amax(x, rows, cols, ld ? ld : cols, amax, stream_);
    if (plain) return fp8_quantize_tensor_both(x, rows, cols, amax, f, scale, inv, plain, codes, stream_, ld);
    return fp8_quantize_tensor(x, rows, cols, amax, f, scale, inv, codes, transpose, stream_, ld);
  }
  SHARDLM_CHECK(given.at == nullptr, "internal: an FP8 amax handed in under rowwise scaling");
  if (scaling == Fp8Scaling::Rows) fp8_amax_rows(x, rows, cols, amax, stream_, ld);
  else fp8_amax_cols(x, rows, cols, amax, stream_, ld);
  fp8_scales(amax, n, f, scale, inv, stream_);
  fp8_quantize(x, rows, cols, scale, scaling, f, codes, transpose, stream_, ld);
}

void Fp8Linear::forward(bf16* out, int64_t ldc, const bf16* inp, const bf16* weight, const bf16* bias, int64_t N,
                        int64_t IC, int64_t OC, const bf16* residual, bool same_input, int slot, Amax inp_amax) {
  const Fp8Scaling along_k = rowwise_ ? Fp8Scaling::Rows : Fp8Scaling::Tensor;
  if (same_input) {
    SHARDLM_CHECK(a_held_.is(inp, N, IC), "internal: an FP8 forward reusing input codes of another input or shape");
  } else {
    quantize(inp, N, IC, along_k, Fp8Format::E4M3, false, buf_.a_codes, buf_.a_scales, 0, false, inp_amax);
    a_held_ = {inp, N, IC};
  }
  const Operand w = weight_operand(weight, OC, IC, /*transposed=*/false, slot);
  gemm_.matmul(N, OC, IC, buf_.a_codes, Fp8Format::E4M3, IC, buf_.a_scales, w.codes, Fp8Format::E4M3,
               IC, w.scales, rowwise_, out, ldc, GemmOut::BF16, 1.0f, residual ? 1.0f : 0.0f,
               /*fast_accum=*/false, bias, residual);
}

void Fp8Linear::backward(bf16* dinp, bool accumulate_dinp, float* dweight, float* dbias, const bf16* dout, int64_t ldo,
                         const bf16* inp, const bf16* weight, int64_t N, int64_t IC, int64_t OC, void* bias_scratch,
                         size_t bias_scratch_bytes, bool same_input, int slot, Amax inp_amax, Amax dout_amax) {
  // K runs along dout's rows (dinp) or across the stored matrices (W^T, dout^T,
  // inp^T, the transposed copies): under rowwise a scale per row or per column.
  a_held_ = {};  // the A buffers are overwritten below
  if (ldo == 0) ldo = OC;
  SHARDLM_CHECK(ldo >= OC && (dbias == nullptr || ldo == OC), "internal: FP8 backward with dout rows %lld apart",
                static_cast<long long>(ldo));
  const Fp8Scaling rows = rowwise_ ? Fp8Scaling::Rows : Fp8Scaling::Tensor;
  const Fp8Scaling cols = rowwise_ ? Fp8Scaling::Cols : Fp8Scaling::Tensor;
  // dout^T's codes for dweight: written with dout's plain ones from one read when
  // there is room for both (t_codes, tensorwise), else a second pass after dinp's GEMM.
  uint8_t* dout_t = nullptr;
  if (dinp != nullptr) {
    // dinp (N, IC) = dout (N, OC) W (OC, IC): A = dout, B = W^T (IC, OC).
    if (buf_.t_codes && !rowwise_) {
      quantize(dout, N, OC, rows, cpu::kFp8GradFormat, true, buf_.t_codes, buf_.a_scales, ldo, false, dout_amax,
               /*plain=*/buf_.a_codes);
      dout_t = buf_.t_codes;
    } else {
      quantize(dout, N, OC, rows, cpu::kFp8GradFormat, false, buf_.a_codes, buf_.a_scales, ldo, false, dout_amax);
    }
    const Operand w = weight_operand(weight, OC, IC, /*transposed=*/true, slot);
    gemm_.matmul(N, IC, OC, buf_.a_codes, cpu::kFp8GradFormat, OC, buf_.a_scales, w.codes, Fp8Format::E4M3,
                 OC, w.scales, rowwise_, dinp, IC, GemmOut::BF16, 1.0f, accumulate_dinp ? 1.0f : 0.0f);
  }
  // dweight (OC, IC) += dout^T (OC, N) inp (N, IC): A = dout^T, B = inp^T (IC, N).
  // One tensor scale serves dout's two copies: the amax above is dout's whole.
  if (dout_t == nullptr) {
    quantize(dout, N, OC, cols, cpu::kFp8GradFormat, true, buf_.a_codes, buf_.a_scales, ldo,
             /*reuse_scales=*/dinp != nullptr && !rowwise_, dout_amax);
    dout_t = buf_.a_codes;
  }
  if (same_input) {
    SHARDLM_CHECK(x_held_.is(inp, N, IC), "internal: an FP8 backward reusing input codes of another input or shape");
  } else {
    quantize(inp, N, IC, cols, Fp8Format::E4M3, true, buf_.x_codes, buf_.x_scales, 0, false, inp_amax);
    x_held_ = {inp, N, IC};
  }
  gemm_.matmul(OC, IC, N, dout_t, cpu::kFp8GradFormat, N, buf_.a_scales, buf_.x_codes, Fp8Format::E4M3, N,
               buf_.x_scales, rowwise_, dweight, IC, GemmOut::F32, 1.0f, 1.0f);
  if (dbias != nullptr) bias_grad(dbias, dout, N, OC, bias_scratch, bias_scratch_bytes, stream_);
}

}  // namespace shardlm::cuda
