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
// Every operand is quantised by its own passes (amax, scale, quantise or
// quantise-transposed: cuda/fp8.hpp's kernels) right before its GEMM, but no
// operand twice where the emulation's codes are the same: projections sharing
// an input (q, k, v; gate, up) quantise it once in the forward and its
// transpose once in the backward; under tensorwise scaling dout's one scale
// serves both its copies (plain for dinp, transposed for dweight), written
// from one read where the T buffer is planned (dout_one_pass); a residual
// is the GEMM's C, not a copy into the output; dgate and dup are read in place
// inside dgate|dup. With model.fp8_weight_cache each layer's weights keep
// their codes (plain for the forward, transposed for dinp) from their first
// use until the parameters change (set_params_version): one quantisation per
// weight and orientation an optimizer step instead of one per micro-batch (and
// per recompute). Under tensorwise scaling the caller may hand an operand's
// amax in (Amax): written by the kernel that produced the data (RMSNorm,
// SwiGLU, the norm and SwiGLU backward passes), or kept from the forward for
// the backward's transposed input — the amax passes' reads gone, the same
// bits (what the CUDA backend always does under tensorwise scaling). Every kernel is deterministic (amaxes are maxima), so run.deterministic reruns stay
// bit-identical.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/model_config.hpp"
#include "cuda/fp8.hpp"

namespace shardlm::cuda {

// A tensorwise operand's amax (one device float) held by Fp8Linear's caller:
// `at` already holds it when `ready` (written by the kernel that produced the
// operand — RMSNorm, SwiGLU, their backward passes — or by an earlier forward
// of the same input, kept for its backward), else the quantisation computes it
// there. Either way no amax pass reads the operand a second time. {}: the
// scale block's own slot, computed (the only form under rowwise scaling).
struct Fp8Amax {
  float* at = nullptr;
  bool ready = false;
};

class Fp8Linear {
 public:
  // Device scratch, planned and allocated by the caller's buffer table.
  struct Buffers {
    uint8_t* a_codes = nullptr;  // (a_code_bytes) operand A's codes
    uint8_t* b_codes = nullptr;  // (b_code_bytes) operand B's codes
    float* a_scales = nullptr;   // (3 x scale_count) A's 1 / scale, amax, scale, each at a multiple of 64 floats
    float* b_scales = nullptr;   // (3 x scale_count)
    uint8_t* x_codes = nullptr;  // (x_code_bytes) the backward's inp^T codes, kept while the input is shared
    float* x_scales = nullptr;   // (3 x scale_count)
    // (t_code_bytes; nullptr: none) dout^T's codes, written with dout's plain ones
    // in one read (dout_one_pass).
    uint8_t* t_codes = nullptr;
    // model.fp8_weight_cache: every layer's weights' codes, both orientations
    // (cache_code_bytes), and their scale blocks (cache_scale_count floats).
    uint8_t* cache_codes = nullptr;
    float* cache_scales = nullptr;
  };
  struct Sizes {
    int64_t a_code_bytes, b_code_bytes, x_code_bytes, scale_count;
    int64_t cache_code_bytes = 0, cache_scale_count = 0;  // 0 without the weight cache
    int64_t t_code_bytes = 0;                             // 0 without dout_one_pass
  };
  // For layers of model c over up to N tokens (the weight cache's for every layer
  // when `cache`; dout^T's buffer when `one_pass`).
  static Sizes sizes(const ModelConfig& c, int64_t N, bool cache = false, bool one_pass = false);
  // Whether the backward quantises dout's plain and transposed codes in one read
  // (tensorwise: one scale serves both): it needs a second buffer of N x the widest
  // projection's bytes, so only while that is at most kOnePassBytes (the 1B shape
  // to 32K tokens; the 8B shape's 131K tokens would need 1.9 GB).
  static constexpr int64_t kOnePassBytes = int64_t(256) << 20;
  static bool dout_one_pass(Fp8Mode mode, const ModelConfig& c, int64_t N);
  // A layer's projection weights, in the order of their cache slots.
  enum Weight { Q, K, V, O, Gate, Up, Down, kWeights };
  // A weight's (OC, IC).
  static std::pair<int64_t, int64_t> weight_shape(const ModelConfig& c, Weight w);
  // n scales rounded up to 64 floats: each part of a scale block starts 256-byte aligned.
  static int64_t scale_block(int64_t n) { return (n + 63) / 64 * 64; }

  // With buffers.cache_codes, c and layers size the weight cache's slots.
  Fp8Linear(Fp8Mode mode, const Buffers& buffers, cudaStream_t stream, void* gemm_workspace, size_t workspace_bytes,
            const ModelConfig& c = {}, int64_t layers = 0);

  // The parameters' version (TrainingState::param_version): a new one empties
  // the weight cache. `slot` below: layer * kWeights + Weight, or -1 (not cached).
  void set_params_version(int64_t version);

  using Amax = Fp8Amax;

  // out (N, OC), row stride ldc = inp (N, IC) weight (OC, IC)^T + bias (OC, or
  // nullptr) [+ residual (N, OC), row stride ldc; may be out]. same_input: inp
  // is the last forward's inp, unchanged (q, k and v share theirs; so do gate
  // and up): its codes and scales are still in the A buffers and are reused.
  // inp_amax: inp's amax (tensorwise), given or to keep for the backward.
  void forward(bf16* out, int64_t ldc, const bf16* inp, const bf16* weight, const bf16* bias, int64_t N, int64_t IC,
               int64_t OC, const bf16* residual = nullptr, bool same_input = false, int slot = -1,
               Amax inp_amax = {});
  // dinp (N, IC) = dout (N, OC) weight [+= with accumulate_dinp]; dweight (OC, IC)
  // fp32 += dout^T inp; dbias (OC) fp32 += dout's column sums (unquantised;
  // nullptr: none; bias_scratch as cuda::bias_grad's). dout's rows lie ldo
  // elements apart (0: OC). same_input: inp is the last backward's inp,
  // unchanged: its transposed codes are still in the X buffers and are reused.
  // inp_amax, dout_amax: their amaxes (tensorwise), as forward's inp_amax.
  void backward(bf16* dinp, bool accumulate_dinp, float* dweight, float* dbias, const bf16* dout, int64_t ldo,
                const bf16* inp, const bf16* weight, int64_t N, int64_t IC, int64_t OC, void* bias_scratch,
                size_t bias_scratch_bytes, bool same_input = false, int slot = -1, Amax inp_amax = {},
                Amax dout_amax = {});

 private:
  // Quantises x (rows, cols; rows ld elements apart, 0: cols) with scales over
  // `scaling` into one operand's codes (transposed: (cols, rows)) and its scale
  // block; with reuse_scales the block already holds x's scales (amax skipped);
  // under tensorwise scaling `amax` says where x's amax is or goes; `plain`
  // (transposed, tensorwise only) also takes x's plain codes from the same read
  // (fp8_quantize_tensor_both).
  void quantize(const bf16* x, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format f, bool transpose,
                uint8_t* codes, float* scales, int64_t ld = 0, bool reuse_scales = false, Amax amax = {},
                uint8_t* plain = nullptr);

  bool rowwise_;
  Buffers buf_;
  // What the A buffers hold after a forward, and the X buffers after a backward
  // (same_input checks it): the input and its shape.
  struct Held {
    const bf16* input = nullptr;
    int64_t rows = 0, cols = 0;
    bool is(const bf16* x, int64_t r, int64_t c) const { return x == input && r == rows && c == cols; }
  };
  Held a_held_, x_held_;
  // The weight's codes and scales for its GEMM: from the cache slot (made on
  // its first use since the version changed) or made now into the B buffers.
  struct Operand {
    const uint8_t* codes;
    const float* scales;
  };
  Operand weight_operand(const bf16* weight, int64_t OC, int64_t IC, bool transposed, int slot);
  struct Slot {
    uint8_t* codes[2];   // plain (OC, IC), transposed (IC, OC)
    float* scales[2];
    bool valid[2];
    int64_t oc, ic;
  };
  std::vector<Slot> slots_;     // empty without the weight cache
  int64_t version_ = -1;
  int64_t scale_count_ = 0;
  cudaStream_t stream_;
  Fp8Gemm gemm_;
};

}  // namespace shardlm::cuda
