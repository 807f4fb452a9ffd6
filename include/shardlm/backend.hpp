// backend.hpp — where the model's arithmetic runs: the one interface between
// the engine's unit loop and a device (CPU fp32 now; CUDA bf16 next).
//
// Owns: the compute of one micro-batch over gathered units (embedding, decoder
// layers, lm-head + loss, and their backward) with the activations and scratch
// it needs, plus the memory the engine asks it for (gathered units, full-unit
// gradients). Knows nothing about ranks, shards or collectives: the engine
// gathers a unit, hands its parameters here, and reduce-scatters the gradients
// it gets back.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/model.hpp"
#include "shardlm/loss.hpp"

namespace shardlm {

struct EngineOptions {
  int64_t max_tokens = 0;            // tokens per micro-batch (rows * seq_len)
  int64_t chunk_tokens = 1024;       // lm-head + loss chunk
  bool reshard_after_forward = true; // free gathered units after forward, re-gather in backward
  bool checkpoint_activations = false;  // keep only layer inputs; recompute in backward
  // With checkpoint_activations: keep each layer's attention output and logsumexp
  // too, so the recompute skips attention (the costliest op at long context).
  bool save_attention = false;
  // How many layers, from the first, keep it (0: all). Fewer trade the recompute
  // of the others' attention for N·H·(2·D + 4) bytes per layer kept.
  int64_t save_attention_layers = 0;
  int64_t attention_layers_kept(int64_t num_layers) const {
    if (!save_attention) return 0;
    return save_attention_layers <= 0 ? num_layers : std::min(save_attention_layers, num_layers);
  }
  bool device_state = false;         // masters, gradients and optimizer state on the device
  bool offload_pipeline = false;     // optim_cpu_offload on a GPU through offload.hpp's pipeline
  bool offload_device_grads = false; // model.optim_offload_grads = "device": no host gradient shards
  bool rl = false;                   // RL policy loss instead of cross-entropy
  RlLossParams rl_params;
  // Device backends at world > 1: how units are gathered and gradients reduced.
  bool reduce_bf16 = false;          // model.reduce_dtype = "bf16": reduce-scatter in bf16 (half the bytes)
  std::string comm_backend = "nccl"; // "nccl" (one GPU per rank) | "mpi" (staged through host memory)
  double comm_timeout_s = 600;       // NCCL collectives older than this abort the job
  std::string attention = "auto";    // device.attention: auto | cudnn | flash (GPU backends)
  bool deterministic = false;        // run.deterministic: only bitwise-reproducible kernels
};

// Token arrays of one micro-batch (host memory), each (N).
struct TokenBatch {
  int64_t N = 0;
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;   // -1: no target
  const float* weights = nullptr;     // loss weight per position
  const int32_t* positions = nullptr;
  const int32_t* seq_ids = nullptr;
  // RL only (nullptr for SFT), per position, taken at the target token:
  const float* advantages = nullptr;
  const float* inference_logprobs = nullptr;
  const float* temperatures = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // One line on the kernels a device backend chose (after prepare), e.g. which
  // attention runs and why; "" when there is nothing to say.
  virtual std::string kernels_note() const { return ""; }
  // True when the backend computes in host memory (the CPU backend): then the
  // fp32 master shards are the parameters it reads and the gradient shards are
  // where it adds, with no copies.
  virtual bool host_resident() const = 0;
  // Bytes per element of the parameters it computes with (4: fp32, 2: bf16).
  virtual int64_t param_bytes() const = 0;

  // Memory for gathered units and gradient buffers, counted per category.
  virtual void* allocate(Mem category, size_t bytes) = 0;
  virtual void deallocate(Mem category, void* ptr, size_t bytes) = 0;
  virtual void zero(void* ptr, size_t bytes) = 0;
  // host_grad (n fp32, host) += src (n of `type`, backend memory).
  virtual void add_grad_to_host(float* host_grad, const void* src, int64_t n, DType type) = 0;
  // dst (n fp32) += src (n of `type`), both in backend memory.
  virtual void accumulate(float* dst, const void* src, int64_t n, DType type) = 0;
  // dst (n bf16) <- src (n fp32), both in backend memory (bf16 gradient reduction).
  virtual void cast_to_bf16(void* dst, const float* src, int64_t n) = 0;
  // The stream the backend computes on (a cudaStream_t; nullptr on the CPU):
  // device Comms order their collectives against it.
  virtual void* stream() { return nullptr; }

  // Parameter shards in the backend's own precision and memory, refreshed from
  // the fp32 master shards (after every optimizer step, load or change).
  virtual void attach_shards(const ModelLayout& layout) = 0;
  virtual void set_param_shard(int unit, const float* master, int64_t n) = 0;
  virtual const void* param_shard(int unit) const = 0;

  // Device-resident training state (GPU backends without optim_cpu_offload):
  // fp32 masters, gradients and optimizer moments live in device memory and the
  // update runs there; the host shards become a mirror, refreshed on request
  // (checkpoint, export, broadcast). Units of the layout, in order.
  struct OptimSpec {
    std::string name;              // adamw | sgd
    double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, momentum = 0;
    int states = 0;                // fp32 arrays per element (AdamW 2, SGD 0 or 1)
  };
  struct Segment { int64_t offset, count; float weight_decay; };  // within a unit shard
  virtual bool supports_device_state() const { return false; }
  virtual void state_attach(const ModelLayout&, const std::vector<std::vector<Segment>>&, const OptimSpec&) {}
  // host -> device and back: the unit's master shard and optimizer states.
  virtual void state_upload(int, const float*, const std::vector<const float*>&) {}
  virtual void state_download(int, float*, const std::vector<float*>&) {}
  virtual float* state_grad(int) { return nullptr; }   // the unit's fp32 gradient shard
  virtual void state_zero_grads() {}
  virtual double state_grad_sumsq() { return 0; }      // one host synchronisation
  virtual void state_step(double, float, int64_t) {}    // lr, clip scale, 1-based step count
  // Wait for queued device work (step-time breakdown; a no-op on the CPU).
  virtual void synchronize() {}

  // Asynchronous host <-> device copies for the offload pipeline (GPU backends
  // with optim_cpu_offload; offload.hpp). Each copy is named by a ticket. A copy
  // to the host first waits for the work queued on the compute stream so far; a
  // copy to the device reads host memory that is ready when it is called. Both
  // run on copy streams of their own, so they overlap compute. Callable from
  // the offload worker thread (after bind_thread()).
  virtual bool supports_async_copies() const { return false; }
  virtual void bind_thread() {}                                  // make this thread use the backend's device
  virtual bool pin_host(void*, size_t) { return false; }         // page-lock for DMA; false: left pageable
  virtual void unpin_host(void*) {}
  virtual int64_t copy_to_host(void*, const void*, size_t) { return -1; }
  virtual int64_t copy_to_device(void*, const void*, size_t) { return -1; }
  virtual void host_wait(int64_t) {}                             // the host waits for a copy
  virtual void compute_wait(int64_t) {}                          // the compute stream waits for a copy
  virtual void* param_shard_for_upload(int) { return nullptr; }  // the unit's bf16 shard (device)
  // The offload pipeline's clip norm, computed where the gradients are: the sum
  // of squares of a unit's device fp32 gradient (n elements), queued on the
  // compute stream; grad_sumsq_read sums units 0..units-1 in unit order (double)
  // after one synchronisation.
  virtual void grad_sumsq_queue(int, const float*, int64_t) {}
  virtual double grad_sumsq_read(int) { return 0; }
  // Bytes and device-timed seconds of the copies the host has waited for, per
  // direction (the offload summary's achieved link bandwidth).
  struct CopyTotals {
    double to_host_bytes = 0, to_host_s = 0, to_device_bytes = 0, to_device_s = 0;
  };
  virtual CopyTotals copy_totals() { return {}; }

  // Activations and scratch for micro-batches of up to options.max_tokens tokens.
  virtual void prepare(const ModelConfig& config, const EngineOptions& options) = 0;
  // Bytes prepare() allocates (the memory plan's activations and workspace).
  virtual int64_t activation_bytes(const ModelConfig& config, const EngineOptions& options) const = 0;
  virtual int64_t workspace_bytes(const ModelConfig& config, const EngineOptions& options) const = 0;

  // One micro-batch. `params` point at a gathered unit (param_bytes() per
  // element); gradients are added into full-unit fp32 buffers laid out like the unit.
  virtual void load_batch(const TokenBatch& batch) = 0;
  virtual void embed_forward(const void* table) = 0;
  virtual void layer_forward(int layer, const Unit& unit, const void* params) = 0;
  // Final norm + lm-head + loss (cross-entropy or RL), forward and backward.
  virtual LossStats head_loss_backward(const void* norm_weight, const void* lm_head, float* norm_grad,
                                       float* lm_head_grad, float grad_scale) = 0;
  virtual void layer_backward(int layer, const Unit& unit, const void* params, float* grads) = 0;
  virtual void embed_backward(float* table_grad) = 0;
  // Forward only: logits (N, V) into host memory.
  virtual void head_logits(const void* norm_weight, const void* lm_head, float* logits) = 0;
  // Forward only: the cross-entropy sums of the micro-batch (loss, loss_tokens)
  // as head_loss_backward computes them for SFT, without gradients; also on a
  // backend prepared for the RL loss (an eval file's loss during RL training).
  virtual LossStats head_loss(const void*, const void*) {
    SHARDLM_FAIL("the %s backend has no forward-only loss", name());
  }
};

// `p` advanced by `elements` parameters of the backend's precision.
inline const void* param_at(const Backend& b, const void* p, int64_t elements) {
  return static_cast<const char*>(p) + elements * b.param_bytes();
}

std::unique_ptr<Backend> make_cpu_backend();
// CUDA bf16 backend on the current device (CUDA builds; throws otherwise).
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace shardlm
