// cuda/fp8_attention.hpp — attention with FP8 operands for training
// (model.fp8_attention): bf16 q, k, v in, bf16 out and gradients, cuDNN's FP8
// graphs inside (CudnnSdpa::forward_fp8 / backward_fp8). The CUDA backend calls
// it per layer in place of CudnnSdpa's bf16 passes.
//
// Owns: each layer's scales and amaxes (the only state kept between calls).
// Borrows per call: scratch for the e4m3 codes of the operands (q, k, v, out,
// dout, dq, dk, dv) and the FP8 backward's accumulators, dead outside the call
// (the backend lends its attention phase's memory).
// Must not know: the model, the deck, MPI.
//
// Scaling (each scale a power of two, so a code decoded into bf16 and coded
// again with the same scale gives the same code: the backward re-codes out from
// the bf16 copy the forward wrote, and q, k, v from theirs):
//   q, k, v, dout  current: 2^floor(log2(448 / amax)) from their amaxes
//   out            from v's amax: |out| <= max |v| (the rows of P sum to 1)
//   P              448 (P <= 1)
//   dP, dq, dk, dv delayed: from the layer's amaxes of its previous backward,
//                  with a factor 2 of headroom; a layer's first backward runs
//                  the FP8 graph three times, the first two only for the
//                  amaxes (cuDNN takes them before the scale: dP's and dv's
//                  are right at unit scales, dq's and dk's at dP's scale).
// The passes return false, touching nothing the caller reads, where cuDNN
// refuses the graph (on Hopper: the backward at head dims other than 128;
// documents of different lengths): the caller then runs its bf16 attention.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/sdpa.hpp"

namespace shardlm::cuda {

class Fp8Attention {
 public:
  // Device memory kept while the object lives: `layers` layers' scalars.
  static size_t state_bytes(int64_t layers);
  // Device memory one call borrows, for micro-batches of up to max_tokens
  // tokens: the codes (forward: q, k, v, out; backward: all eight) and the
  // backward's workspace (CudnnSdpa::fp8_backward_workspace_bytes).
  static size_t scratch_bytes(int64_t max_tokens, int64_t H, int64_t KV, int64_t D);

  // sdpa: the micro-batch's documents set (CudnnSdpa::set_documents) before each
  // pass. state: state_bytes(layers) of device memory, 256-byte aligned, the
  // object's while it lives.
  Fp8Attention(CudnnSdpa& sdpa, int64_t max_tokens, int64_t H, int64_t KV, int64_t D, int64_t layers, void* state,
               cudaStream_t stream);

  // out (N, H, D) bf16 and lse (N, H) as cuda::attention_forward's, of q, k, v
  // coded as e4m3; out is the decoded FP8 output (exact codes / scale).
  // scratch: scratch_bytes(...) of device memory, 256-byte aligned, free during the call.
  bool forward(int64_t layer, __nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
               const __nv_bfloat16* v, int64_t N, void* scratch);
  // dq, dk, dv bf16 (decoded) from dout and the forward's q, k, v, out and lse
  // (forward() of this layer must have run on this micro-batch).
  bool backward(int64_t layer, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                const float* lse, int64_t N, void* scratch);

  // A layer's scalars (fp32, device): the slots below, kSlots a layer.
  enum Slot {
    kScaleQ, kScaleK, kScaleV, kScaleO, kScaleDO, kScaleS, kScaleDP, kScaleDQ, kScaleDK, kScaleDV,
    kDescaleQ, kDescaleK, kDescaleV, kDescaleO, kDescaleDO, kDescaleS, kDescaleDP, kDescaleDQ, kDescaleDK, kDescaleDV,
    kAmaxQ, kAmaxK, kAmaxV, kAmaxDO, kAmaxS, kAmaxO, kAmaxDP, kAmaxDQ, kAmaxDK, kAmaxDV,
    kSlots
  };
  const float* scalars(int64_t layer) const { return scalars_ + layer * kSlots; }

 private:
  // A call's scratch, carved: the codes, then the backward's workspace.
  struct Scratch {
    uint8_t *q8, *k8, *v8, *o8, *do8, *dq8, *dk8, *dv8;
    void* backward_workspace;
  };
  Scratch carve(void* scratch) const;
  CudnnSdpa::Fp8Scales scales(int64_t layer) const;
  void check_call(int64_t layer, int64_t N) const;
  CudnnSdpa& sdpa_;
  int64_t max_tokens_, H_, KV_, D_, layers_;
  cudaStream_t stream_;
  float* scalars_;
  std::vector<bool> has_history_;  // per layer: its backward amaxes exist
};

}  // namespace shardlm::cuda
