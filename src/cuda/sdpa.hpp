// sdpa.hpp — causal, GQA, packed-document attention through cuDNN's fused
// flash attention (the cuDNN 9 graph API), with shardlm's own kernels
// (cuda/attention.hpp) as the reference and the fallback.
//
// Owns: loading cuDNN at run time (dlopen of libcudnn.so.9, so a binary built
// with cuDNN's headers starts, and says why it runs on its own kernels, where the
// library is missing), the forward and backward operation graphs, one execution
// plan per micro-batch shape (documents of one length as a plain batch; others as
// a ragged batch, bucketed by powers of two), and the per-micro-batch document
// offsets cuDNN's ragged (THD) layout reads.
// Must not know: the model, MPI, NCCL, the memory plan (it is handed a workspace
// of workspace_bytes() and allocates no device memory of its own).
//
// Semantics: exactly those of cuda::attention_forward / attention_backward
// (cuda/attention.hpp): q (N, H, D), k and v (N, KV, D), out (N, H, D) bf16,
// token-major; lse (N, H) fp32, the natural logsumexp of the scaled scores; token
// i attends to j iff j <= i within i's document (a run of equal seq_id). Each
// document is one batch entry, so no token attends across a document edge and no
// work is spent on the masked-out blocks between documents.
//
// Numerics and determinism: forward is deterministic. cuDNN's backward on Hopper
// accumulates dq with atomics (not bitwise reproducible); run.deterministic = true
// therefore keeps shardlm's own kernels (the caller decides; see device.attention).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace shardlm::cuda {

// Whether cuDNN's SDPA can be used in this process: the build has cuDNN's headers
// (CUDNN=1), libcudnn.so.9 (or $SHARDLM_CUDNN_LIB) loads, its version is 9.x with
// x >= 6, and the device is sm_90 or newer. On false, *why says which of these failed.
bool cudnn_sdpa_available(std::string* why);
// "cuDNN 9.19.0 (/path/libcudnn.so.9)" once loaded, else "".
std::string cudnn_sdpa_version();

class CudnnSdpa {
 public:
  // Device memory the object needs for micro-batches of up to max_tokens tokens, in
  // two parts:
  //   backward buffers: backward's fp32 dq accumulator (N, H, D), softmax row sums
  //     (N, H) and, with GQA, per-query-head dk and dv (N, H, D) bf16, all sized by
  //     the tokens (the engines would otherwise size them by documents x longest).
  //     Live only inside backward(), which takes them per call: the caller may
  //     lend memory that is dead then (the backend lends the layer's gate/up).
  //   persistent: the document lengths and offsets (live from set_documents to the
  //     micro-batch's last call) and kPlanWorkspaceBytes for the plans' own needs.
  static size_t backward_buffer_bytes(int64_t max_tokens, int64_t H, int64_t KV, int64_t D);
  static size_t persistent_bytes(int64_t max_tokens);
  static size_t workspace_bytes(int64_t max_tokens, int64_t H, int64_t KV, int64_t D) {
    return backward_buffer_bytes(max_tokens, H, KV, D) + persistent_bytes(max_tokens);
  }
  static constexpr size_t kPlanWorkspaceBytes = size_t(64) << 20;

  // `persistent` (persistent_bytes) stays the caller's and must not be touched by
  // anything else while the object lives. Throws shardlm::Error when
  // cudnn_sdpa_available() is false.
  CudnnSdpa(int64_t max_tokens, int64_t H, int64_t KV, int64_t D, void* persistent, cudaStream_t stream);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  // The micro-batch's documents, from its host seq_id (N): the runs of equal id.
  // Uploads the offsets on the stream (from pageable memory, so seq_id may be
  // reused at once). Must precede forward/backward of that micro-batch.
  void set_documents(const int32_t* seq_id_host, int64_t N);

  // Both return false, touching nothing, when no cuDNN engine supports this
  // micro-batch's shape (the caller then runs its own kernels, which read and write
  // the same tensors with the same meaning).
  bool forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
               const __nv_bfloat16* v);
  // backward_buffers: backward_buffer_bytes(...) of device memory, 256-byte aligned.
  bool backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                const __nv_bfloat16* out, const float* lse, void* backward_buffers);

  // FP8 (e4m3) attention through cuDNN's FP8 engines (the training step
  // calls them through cuda::Fp8Attention under model.fp8_attention): q, k, v,
  // out, dout, dq, dk, dv are e4m3 codes in the layouts above, each with a
  // per-tensor scale (codes = values * scale; descale =
  // 1 / scale), all fp32 scalars in device memory. The forward's softmax P is
  // coded with scale_s (P <= 1: 448 fills e4m3's range) and out with scale_o
  // (|out| <= max |v|, the rows of P summing to 1); amax_s and amax_o receive
  // max P and max |out| before scale_o. The backward's dP (the scaled score
  // gradient), dq, dk and dv are coded with scales given in advance (the
  // previous step's amaxes: delayed scaling) and their amaxes written for the
  // next. lse is the forward's. Both take documents of one length only (not a
  // ragged batch: see sdpa_cudnn.cu); on Hopper cuDNN takes the FP8 forward at
  // head dims <= 256 and the FP8 backward only at head dim 128. Both return
  // false, touching nothing, when refused.
  struct Fp8Scales {
    const float *descale_q, *descale_k, *descale_v, *descale_o, *descale_do, *descale_s, *descale_dp;
    const float *scale_s, *scale_o, *scale_dp, *scale_dq, *scale_dk, *scale_dv;
    float *amax_s, *amax_o, *amax_dp, *amax_dq, *amax_dk, *amax_dv;
  };
  bool forward_fp8(uint8_t* out, float* lse, const uint8_t* q, const uint8_t* k, const uint8_t* v,
                   const Fp8Scales& scales);
  // workspace: fp8_backward_workspace_bytes(...) of device memory, live only
  // during the call (cuDNN's FP8 backward keeps fp32 accumulators for dq, dk and
  // dv there, ~3 x N x H x D x 4 bytes).
  static size_t fp8_backward_workspace_bytes(int64_t max_tokens, int64_t H, int64_t D);
  bool backward_fp8(uint8_t* dq, uint8_t* dk, uint8_t* dv, const uint8_t* dout, const uint8_t* q, const uint8_t* k,
                    const uint8_t* v, const uint8_t* out, const float* lse, const Fp8Scales& scales, void* workspace);

  // Plans built so far (each shape builds one forward and, when trained, one
  // backward plan, in each precision used), for logs and tests.
  int plans_built() const { return plans_built_; }
  // The most recently built plan: pass, shape, engine, workspace, build time.
  const std::string& last_plan_note() const { return last_plan_note_; }

  struct Plan;  // one finalised execution plan and its workspace size (sdpa_cudnn.cu)

 private:
  enum Pass { kForward, kBackward, kForwardFp8, kBackwardFp8, kPasses };
  struct Bucket {
    std::unique_ptr<Plan> plan[kPasses];
    bool failed[kPasses] = {};
  };
  // This micro-batch's plan for one pass, built at first use; false when refused.
  // max_workspace: what the plan may need (the persistent kPlanWorkspaceBytes, or
  // the workspace the call lends).
  bool plan_for(Pass pass, size_t max_workspace = kPlanWorkspaceBytes);
  // True, with last_plan_note() saying why, when this micro-batch is ragged.
  bool refuse_ragged_fp8(const char* pass);
  void run(std::vector<int64_t> uids, std::vector<void*> ptrs, void* workspace = nullptr);

  int64_t max_tokens_, H_, KV_, D_;
  cudaStream_t stream_;
  void* handle_ = nullptr;  // cudnnHandle_t
  // Carved from `persistent`:
  int32_t* seq_len_ = nullptr;        // (max_tokens): tokens of each document (0 for padding entries)
  int32_t* off_q_ = nullptr;          // (max_tokens + 1): element offsets of q/out/dq rows
  int32_t* off_kv_ = nullptr;         // (max_tokens + 1): of k/v/dk/dv
  int32_t* off_stats_ = nullptr;      // (max_tokens + 1): of lse and the row sums
  void* plan_workspace_ = nullptr;
  // This micro-batch (set_documents): documents, batch entries, longest (rounded up
  // when ragged), and whether the lengths differ.
  int64_t docs_ = 0, batch_ = 0, max_len_ = 0;
  bool ragged_ = false;
  std::vector<int32_t> host_offsets_;  // staging for the four uploads
  std::map<std::tuple<int64_t, int64_t, bool>, Bucket> buckets_;
  const Plan* current_ = nullptr;
  int plans_built_ = 0;
  std::string last_plan_note_;
};

}  // namespace shardlm::cuda
