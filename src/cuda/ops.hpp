// ops.hpp — the CUDA layer ops of the GPU backend (everything but attention, the
// GEMMs and the optimizer update) and their host launchers.
//
// Owns: shardlm::cuda::{embedding (embedding.cu), rmsnorm (+ fused residual add;
// rmsnorm.cu), rope, swiglu, cast/accumulate/scale (elementwise.cu), cross_entropy
// and sum_rows (cross_entropy.cu), sum_squares and bias_grad (reduce.cu)}. Each op
// mirrors its CPU reference in cpu/ops.hpp (same argument order, same
// overwrite/accumulate rules) and is checked against it by tests/gpu/test_cuda_ops.cu;
// docs/kernels.md gives each op's tolerance, determinism story and bytes moved. The
// AdamW/SGD update is in optim_kernels.hpp, CUDA_CHECK in check.hpp.
// Must not know: MPI, NCCL, the model (units, parameter names), the deck, files.
// Included only by .cu files and the GPU tests (it exposes CUDA types).
//
// Conventions (every function):
//   - Async on the given stream; no host synchronisation, no allocation. Ops that
//     need scratch take (scratch, scratch_bytes) and have a *_scratch_bytes()
//     function; scratch may be reused freely between calls on the same stream.
//   - Precision: activations and gathered parameters bf16 in memory, all math in
//     fp32 (saved statistics rstd and per-row losses in fp32); parameter gradients,
//     master weights and optimizer state fp32.
//   - Activation gradients are OVERWRITTEN; parameter gradients (dweight, dtable,
//     dbias) are ACCUMULATED (+=), as on the CPU.
//   - Deterministic: no atomics anywhere. Every reduction runs in a fixed order
//     (per-block partials in fixed blocks, then an ordered pass) that depends only
//     on the sizes, so the same inputs give the same bits run to run.
//   - Vectorised 16-byte accesses when the pointers are 16-byte aligned and the
//     row lengths are multiples of 8 elements; a scalar path otherwise (correct,
//     slower). Buffers from cudaMalloc at multiple-of-8 offsets take the fast path.
//   - Sizes are int64; a size the kernels cannot take throws shardlm::Error.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/check.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cuda {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------- embedding

// out[t] = table[ids[t]].  out (N, C) overwritten; ids (N) int32; table (V, C).
// An id outside [0, V) cannot throw on the device: its row is written as NaN so the
// loss shows it (the data loader validates ids on the host).
void embedding_forward(bf16* out, const int32_t* ids, const bf16* table, int64_t N,
                       int64_t V, int64_t C, cudaStream_t stream);

// dtable[ids[t]] += dout[t].  dtable (V, C) fp32 +=; dout (N, C) bf16; ids (N).
// Deterministic: tokens are stably sorted by id (CUB radix sort), each id's rows are
// summed in token order in fixed tiles of 32 sorted tokens, and runs that cross a
// tile are finished by an ordered second pass. Ids outside [0, V) are skipped.
size_t embedding_backward_scratch_bytes(int64_t N, int64_t C);
void embedding_backward(float* dtable, const bf16* dout, const int32_t* ids, int64_t N,
                        int64_t V, int64_t C, void* scratch, size_t scratch_bytes,
                        cudaStream_t stream);

// ---------------------------------------------------------------- RMSNorm

// A norm's weight (C) as the kernels read it: the gathered unit's bf16 copy, or
// fp32 (model.norm_dtype = "fp32": the master's values, as transformers reads
// them under autocast). Either converts implicitly from its pointer.
struct NormWeight {
  const bf16* b = nullptr;
  const float* f = nullptr;
  NormWeight(const bf16* w) : b(w) {}   // NOLINT(google-explicit-constructor)
  NormWeight(const float* w) : f(w) {}  // NOLINT(google-explicit-constructor)
  const void* ptr() const { return f ? static_cast<const void*>(f) : static_cast<const void*>(b); }
};

// HF LlamaRMSNorm: out = weight * (inp * rstd), rstd = 1 / sqrt(mean(inp^2) + eps).
//   out (rows, C) overwritten (may alias inp); rstd (rows) fp32 saved for backward;
//   inp (rows, C); weight (C). Qwen3 q/k norm: rows = N * heads, C = head_dim.
//   C <= 8192 (C <= 1024 when C is not a multiple of 8).
//   amax (nullptr: none) = max |out| (bf16 values as written), zeroed then folded
//   into by the blocks: model.fp8's tensor amax of the projection input without a
//   pass of its own, equal to cuda::fp8_amax(out) bit for bit.
void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, NormWeight weight,
                     int64_t rows, int64_t C, double eps, cudaStream_t stream, float* amax = nullptr);

// Fused residual add + norm: residual_out = bf16(a + b); normed = rmsnorm of the
// rounded residual_out (what an unfused add then norm computes).
//   residual_out may alias a or b; normed must not alias a, b or residual_out.
void residual_rmsnorm_forward(bf16* residual_out, bf16* normed, float* rstd,
                              const bf16* a, const bf16* b, NormWeight weight,
                              int64_t rows, int64_t C, double eps, cudaStream_t stream,
                              float* amax = nullptr);

// A split-K GEMM's reduction with its residual, then the next norm: out (rows, C) =
// bf16(a + sum_s parts[s]) (parts: S fp32 (rows, C) blocks part_stride elements
// apart, summed in s order, the residual added last as a GEMM epilogue adds its
// C), and, when normed is not nullptr, normed = rmsnorm(out) with weight, rstd per
// row (residual_rmsnorm_forward's arithmetic on the rounded out). out must not
// alias a; every pointer 16-byte aligned. S = kSplitkParts; C a multiple of 8 up
// to 8192 (splitk_residual_rmsnorm_takes). The CUDA decoder's down projection
// (src/infer/decoder_cuda.cu: 4 parts, 1.235 against 1.283 ms a decode step with
// one GEMM at the 1B shape, batch 64, on an H200: docs/benchmarks.md).
inline constexpr int kSplitkParts = 4;
bool splitk_residual_rmsnorm_takes(int64_t C);
void splitk_residual_rmsnorm_forward(bf16* out, bf16* normed, float* rstd, const bf16* a, const float* parts,
                                     int64_t part_stride, NormWeight weight, int64_t rows, int64_t C, double eps,
                                     cudaStream_t stream);

// model.residual_dtype = "fp32": the residual stream (inp, a, residual_out) in fp32.
// The sum a + b is not rounded (b, a projection's bf16 output, is added exactly as
// transformers adds a bf16 module output to its fp32 residual under autocast).
void rmsnorm_forward(bf16* out, float* rstd, const float* inp, NormWeight weight,
                     int64_t rows, int64_t C, double eps, cudaStream_t stream, float* amax = nullptr);
void residual_rmsnorm_forward(float* residual_out, bf16* normed, float* rstd,
                              const float* a, const bf16* b, NormWeight weight,
                              int64_t rows, int64_t C, double eps, cudaStream_t stream,
                              float* amax = nullptr);

// dinp = norm backward (+ dresidual when not nullptr: the residual stream's gradient
// is added in the same pass, rounded to bf16 once). amax (nullptr: none): as the
// forward's, over the bf16 gradient the next projection reads (dinp, or dinp_bf16
// on an fp32 stream, which then must not be nullptr).
//   dinp (rows, C) overwritten; may alias dresidual, not dout or inp.
//   dweight (C) fp32 += sum_rows dout * inp * rstd, deterministic through per-block
//   partials in scratch and an ordered column pass.
size_t rmsnorm_backward_scratch_bytes(int64_t rows, int64_t C);
void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp,
                      NormWeight weight, const float* rstd, const bf16* dresidual,
                      int64_t rows, int64_t C, void* scratch, size_t scratch_bytes,
                      cudaStream_t stream, float* amax = nullptr);
// The same on an fp32 residual stream (inp, dresidual and dinp fp32, nothing
// rounded); dinp_bf16 (rows, C), when not nullptr, gets dinp rounded to bf16 in
// the same pass: the operand of the projection backward that reads it next.
void rmsnorm_backward(float* dinp, bf16* dinp_bf16, float* dweight, const bf16* dout,
                      const float* inp, NormWeight weight, const float* rstd,
                      const float* dresidual, int64_t rows, int64_t C, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream, float* amax = nullptr);

// ---------------------------------------------------------------- RoPE

// In-place rotation of x (N, heads, D), HF rotate_half convention (pairs (i, i+D/2)),
// angle = float(pos) * inv_freq[i] in fp32 as HF; cos/sin in fp32.
//   positions (N) int32; inv_freq (D/2) fp32 on the device: cpu::rope_inv_freq
//   (Llama-3 scaling included) rounded to float, copied once at start-up.
//   row_stride: elements between consecutive tokens (0 means heads * D). A fused
//   q|k|v buffer (N, (H + 2 KV) * D) rotates q and k in one call with
//   heads = H + KV and row_stride = (H + 2 KV) * D.
void rope_forward(bf16* x, const int32_t* positions, const float* inv_freq, int64_t N,
                  int64_t heads, int64_t D, int64_t row_stride, cudaStream_t stream);
// The decode step's fused q|k|v rows (N, (H + 2 KV) * D, row_stride apart): RoPE
// on the H + KV q and k heads in place, as rope_forward, and in the same pass
// each token's k heads (rotated) and v heads into physical cache row rows[t]
// (block * block_size + offset: the decoder resolves the position through its
// block table, shardlm/kv_pages.hpp's kv_cache_row) of k_cache and v_cache
// ((blocks, KV, block_size, D), as store_kv): rope_forward then store_kv, the
// same bits.
void rope_store_kv(bf16* qkv, const int32_t* positions, const float* inv_freq, int64_t N, int64_t H, int64_t KV,
                   int64_t D, int64_t row_stride, bf16* k_cache, bf16* v_cache, const int32_t* rows,
                   int64_t block_size, cudaStream_t stream);
// The inverse rotation (the transpose), in place on the gradient dx.
void rope_backward(bf16* dx, const int32_t* positions, const float* inv_freq, int64_t N,
                   int64_t heads, int64_t D, int64_t row_stride, cudaStream_t stream);

// ---------------------------------------------------------------- SwiGLU

// h = silu(gate) * up on (rows, I) matrices with row strides (elements), so gate and
// up may be the two halves of one (rows, 2I) GEMM output: gate = gu, up = gu + I,
// ld_gate = ld_up = 2I. amax (nullptr: none): max |h|, as rmsnorm_forward's; the
// backward's amax_dgate / amax_dup the same over dgate and dup.
void swiglu_forward(bf16* h, int64_t ld_h, const bf16* gate, int64_t ld_gate,
                    const bf16* up, int64_t ld_up, int64_t rows, int64_t I,
                    cudaStream_t stream, float* amax = nullptr);
// dgate, dup overwritten (dgate may alias gate and dup may alias up: each element is
// read before it is written by the same thread, so the fused buffer can take its own
// gradient in place).
void swiglu_backward(bf16* dgate, int64_t ld_dgate, bf16* dup, int64_t ld_dup,
                     const bf16* dh, int64_t ld_dh, const bf16* gate, int64_t ld_gate,
                     const bf16* up, int64_t ld_up, int64_t rows, int64_t I,
                     cudaStream_t stream, float* amax_dgate = nullptr, float* amax_dup = nullptr);

// ---------------------------------------------------------------- cross-entropy

// Fused forward + backward on a chunk of logits (n, V), in place, one row per thread
// block cluster (the row is held in the cluster's shared memory, so HBM sees one read
// and one write of the logits).
//   logits in, dlogits = weight * grad_scale * (softmax - onehot(target)) out (bf16);
//   loss (n) fp32 overwritten: weight * (logsumexp - logit[target]);
//   targets (n) int32; weights (n) fp32 or nullptr (= 1).
// A row with target < 0 or weight == 0 gets loss 0 and a zero gradient. A target
// >= V (the CPU throws) gets loss NaN and a zero gradient. V <= 409600.
void cross_entropy_forward_backward(bf16* logits, float* loss, const int32_t* targets,
                                    const float* weights, float grad_scale, int64_t n,
                                    int64_t V, cudaStream_t stream);

// *out = sum of x (n) in double, in a fixed order (one block): the loss of a chunk.
// accumulate: *out += the sum instead of overwriting.
void sum_rows(double* out, const float* x, int64_t n, bool accumulate,
              cudaStream_t stream);

// ---------------------------------------------------------------- helpers

// out = bf16(in), round to nearest even.
void cast_f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t stream);
// out = a + float(b), in fp32 (a == nullptr: out = float(b)); out may alias a.
// The fp32 residual stream's add of a bf16 projection output.
void add_bf16_to_f32(float* out, const float* a, const bf16* b, int64_t n, cudaStream_t stream);
// y += x.
void accumulate_f32(float* y, const float* x, int64_t n, cudaStream_t stream);
// x *= alpha.
void scale_f32(float* x, float alpha, int64_t n, cudaStream_t stream);

// *out = sum(x^2) in double (accumulate: *out += it), deterministic: a fixed grid
// of kSumSquaresBlocks blocks writes partials to scratch, one block adds them in
// order. For the global gradient norm (sum over units, then one all-reduce).
inline constexpr int kSumSquaresBlocks = 1024;
size_t sum_squares_scratch_bytes();
void sum_squares(double* out, const float* x, int64_t n, bool accumulate, void* scratch,
                 size_t scratch_bytes, cudaStream_t stream);

// dbias (OC) fp32 += sum over rows of dout (N, OC) bf16: the bias gradient of a
// linear layer, deterministic (row-chunk partials in scratch, then an ordered pass).
size_t bias_grad_scratch_bytes(int64_t N, int64_t OC);
void bias_grad(float* dbias, const bf16* dout, int64_t N, int64_t OC, void* scratch,
               size_t scratch_bytes, cudaStream_t stream);

}  // namespace shardlm::cuda
