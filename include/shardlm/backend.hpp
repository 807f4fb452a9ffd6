// backend.hpp — where the model's arithmetic runs: the one interface between
// the engine's unit loop and a device (the CPU fp32 reference; CUDA bf16).
//
// Owns: the compute of one micro-batch over gathered units (embedding, decoder
// layers, lm-head + loss, and their backward) with the activations and scratch
// it needs, the parameter shards in its own precision, and the memory the
// engine asks it for (gathered units, full-unit gradients). Knows nothing about
// ranks, shards or collectives (the engine gathers a unit, hands its parameters
// here, and reduce-scatters the gradients it gets back), nor about where the
// training state lives (train/state.hpp owns the masters, gradient shards and
// the optimizer).
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

// model.fp8: the decoder blocks' linears (q, k, v, o, gate, up, down) multiply
// e4m3 operands with fp32 accumulation, scaled per tensor or per row (the rows
// of each GEMM operand along its reduction dimension); docs/config.md.
enum class Fp8Mode { None, Tensorwise, Rowwise };
// "none" | "tensorwise" | "rowwise" (the deck validates the name) and back.
inline Fp8Mode fp8_mode(const std::string& name) {
  return name == "tensorwise" ? Fp8Mode::Tensorwise : name == "rowwise" ? Fp8Mode::Rowwise : Fp8Mode::None;
}
inline const char* fp8_mode_name(Fp8Mode mode) {
  return mode == Fp8Mode::Tensorwise ? "tensorwise" : mode == Fp8Mode::Rowwise ? "rowwise" : "none";
}

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
  // Where the training state lives (train/state.hpp): the memory plan's rows
  // and whether gradients need the engine's slots at one rank depend on it.
  StatePlacement state = StatePlacement::Host;
  bool offload_device_grads = false; // model.optim_offload_grads = "device": no host gradient shards
  int offload_device_units = 0;      // offload: units [0, n) keep their optimizer state on the GPU (model.optim_gpu_units)
  bool offload_speculate = false;    // offload: model.optim_offload_speculate (copies of the offloaded state)
  bool rl = false;                   // RL policy loss instead of cross-entropy
  RlLossParams rl_params;
  // Device backends at world > 1: how units are gathered and gradients reduced.
  bool reduce_bf16 = false;          // model.reduce_dtype = "bf16": reduce-scatter in bf16 (half the bytes)
  std::string comm_backend = "nccl"; // "nccl" (one GPU per rank) | "mpi" (staged through host memory)
  double comm_timeout_s = 600;       // NCCL collectives older than this abort the job
  int64_t context_parallel = 1;      // model.context_parallel: ranks sharing one sequence (max_tokens is their share)
  // model.expert_parallel: the ranks a layer's experts are split over (1: off;
  // else the world). The backend plans the owners' rows for P x max_tokens x K.
  int64_t expert_parallel = 1;
  std::string attention = "auto";    // device.attention: auto | cudnn | flash (GPU backends)
  bool deterministic = false;        // run.deterministic: only bitwise-reproducible kernels
  Fp8Mode fp8 = Fp8Mode::None;       // model.fp8
  bool fp8_weight_cache = false;     // model.fp8_weight_cache: each layer's weight codes kept until the parameters change
  bool fp8_attention = false;        // model.fp8_attention: cuDNN's FP8 attention where it takes the shape (CUDA)
  // model.residual_dtype = "fp32": the residual stream and its gradient in fp32
  // between kernels (the GEMM operands stay bf16). The CPU backend is fp32 throughout.
  bool residual_fp32 = false;
  // model.norm_dtype = "fp32": the RMSNorm kernels read the norm weights in fp32,
  // copies of the masters the engine keeps current (Backend::norm_weights_fp32),
  // instead of the gathered unit's bf16 (GPU backends; the CPU reads its masters).
  bool norm_fp32 = false;
};

// Token arrays of one micro-batch (host memory), each (N).
struct TokenBatch {
  int64_t N = 0;
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;   // -1: no target
  const float* weights = nullptr;     // loss weight per position
  const int32_t* positions = nullptr;
  const int32_t* seq_ids = nullptr;
  // Context parallelism: each token's index in the group's whole micro-batch
  // (train/context_split.hpp); nullptr when the rank holds whole sequences.
  const int32_t* token_index = nullptr;
  // RL only (nullptr for SFT), per position, taken at the target token:
  const float* advantages = nullptr;
  const float* inference_logprobs = nullptr;
  const float* sampling_logprobs = nullptr;  // the distribution sampled from; nullptr: inference_logprobs
  const float* temperatures = nullptr;
  const int32_t* sample_ids = nullptr;       // the target's sample in the step's file; -1: padding
  // The loss's sums over each token's sample, when it needs them (RlTokenInputs;
  // the step's forward-only pass fills them in, train/sequence_pass.hpp).
  const double* sequence_log_ratio = nullptr;
  const double* sequence_log_is = nullptr;
  // loss.ref_kl_coef > 0: the frozen reference weights' logprob of each target
  // (the step's reference pass, train/reference_pass.hpp).
  const float* ref_logprobs = nullptr;
  // A model of experts with model.router_aux_loss: the weight of this
  // micro-batch's load-balancing loss in the update's loss
  // (model.router_aux_loss_coef over the update's micro-batches, all ranks); 0: none.
  double router_aux_scale = 0;
  // loss.router_replay (a model of experts): the experts the sampler's router
  // chose for each input token, (N, ModelConfig::route_width()) int32 (each
  // layer of experts' K, layer after layer; -1: none recorded, the layer's own
  // top-k). The forward takes them instead of its own top-k; nullptr: off.
  const int32_t* routes = nullptr;

  // The RL loss's per-token inputs among these (host memory).
  RlTokenInputs rl_inputs() const {
    return {advantages,         inference_logprobs, sampling_logprobs, temperatures,
            sequence_log_ratio, sequence_log_is,    ref_logprobs};
  }
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

  // model.norm_dtype = "fp32": where the backend reads `unit`'s norm weights in
  // fp32 (backend memory, packed as norm_slots(unit)); the engine copies them
  // from the masters whenever these change. nullptr: the backend reads the
  // gathered unit's own (bf16; the CPU backend's are the fp32 masters).
  virtual float* norm_weights_fp32(int /*unit*/) { return nullptr; }
  // model.residual_dtype = "fp32" on a GPU backend: where the engine writes the
  // micro-batch's embedding rows (max_tokens, C) in fp32, the masters' values,
  // as the stream's start in place of embed_forward's lookup of the bf16 table
  // (transformers under autocast looks up its fp32 table: the lookup is no
  // GEMM). nullptr: embed_forward looks the rows up.
  virtual float* embedding_rows_fp32() { return nullptr; }
  // The parameters' version (TrainingState::param_version) before a forward:
  // what the backend derived from the weights may be kept while it holds.
  virtual void set_params_version(int64_t /*version*/) {}

  // Wait for queued device work (step-time breakdown; a no-op on the CPU).
  virtual void synchronize() {}
  // The bf16 shard's device memory, for the training state's own writes (the
  // device update, the offload pipeline's uploads); the CPU backend has none.
  virtual void* param_shard_mut(int /*unit*/) { return nullptr; }

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
  // Forward only (RL): each row's log_softmax(logits / temperature)[target], as
  // the RL loss forms it, into host memory (N floats; 0 on rows without a
  // target). The loss's whole-sample sums come from these.
  virtual void head_token_logprobs(const void*, const void*, float*) {
    SHARDLM_FAIL("the %s backend has no forward-only token logprobs", name());
  }
  // Context parallelism: attention runs as a ring over `group` (the ranks
  // sharing this rank's sequences; borrowed for the backend's life), and every
  // micro-batch carries token_index. Before the first micro-batch.
  virtual void set_context_parallel(Comm& group) {
    (void)group;
    SHARDLM_FAIL("model.context_parallel > 1 is not implemented on the %s backend (the ring runs on the CPU and "
                 "CUDA backends): set model.context_parallel = 1", name());
  }
  // Expert parallelism (model.expert_parallel = group.size() > 1): each rank
  // of `group` (borrowed for the backend's life) holds num_experts / P whole
  // experts of every layer of experts, in units of their own that are never
  // gathered (UnitKind::Experts). A layer sends each routed row to the rank
  // owning its expert and gets the output back (all-to-all over `group`); the
  // backward sends the rows' gradients and gets the input gradients back, so
  // the owner's expert gradients are already the sum over every rank's tokens.
  // Before the first micro-batch.
  virtual void set_expert_parallel(Comm& group) {
    (void)group;
    SHARDLM_FAIL("model.expert_parallel > 1 is not implemented on the %s backend (the experts' exchange runs on the "
                 "CPU backend): set model.expert_parallel = 1", name());
  }
  // Under expert parallelism: the experts this rank owns of layer `layer`
  // (`unit`, UnitKind::Experts, and this rank's shard of it) for the next
  // layer_forward / layer_backward of that layer, and where that backward adds
  // their gradients (a shard-sized fp32 buffer; nullptr before a forward).
  virtual void set_layer_experts(int layer, const Unit& unit, const void* shard, float* grads) {
    (void)layer, (void)unit, (void)shard, (void)grads;
    SHARDLM_FAIL("internal: the %s backend has no expert parallelism", name());
  }
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
