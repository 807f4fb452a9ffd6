// engine.hpp — forward and backward of one micro-batch over sharded units.
//
// Owns: the unit loop of DESIGN.md's solver (gather u with u+1's gather in
// flight; compute; release; backward in reverse with each unit's gradients
// reduce-scattered into the gradient shards as soon as it is done), the
// gathered-unit and gradient buffers, the activations, and their sizes (the
// memory plan). Knows the Comm interface, the model layout and the CPU layer
// functions; knows nothing about the deck, the data file or the optimizer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/cpu_layers.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/shard.hpp"

namespace shardlm {

struct EngineOptions {
  int64_t max_tokens = 0;            // tokens per micro-batch (rows * seq_len)
  int64_t chunk_tokens = 1024;       // lm-head + loss chunk
  bool reshard_after_forward = true; // free gathered units after forward, re-gather in backward
  bool checkpoint_activations = false;  // keep only layer inputs; recompute in backward
};

// Token arrays of one micro-batch, each (N).
struct TokenBatch {
  int64_t N = 0;
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;   // -1: no target
  const float* weights = nullptr;     // loss weight per position
  const int32_t* positions = nullptr;
  const int32_t* seq_ids = nullptr;
};

// Bytes per rank the engine and the shards will allocate (host, fp32 CPU backend).
struct MemoryPlan {
  int64_t param_shards = 0, grad_shards = 0, optim_state = 0, gathered = 0, activations = 0, workspace = 0;
  int64_t total() const { return param_shards + grad_shards + optim_state + gathered + activations + workspace; }
};
MemoryPlan plan_memory(const ModelConfig& config, int world, const EngineOptions& options, int optim_states);
std::string format_memory_plan(const MemoryPlan& plan, int world);

class Engine {
 public:
  Engine(ShardedModel& model, Comm& comm, const EngineOptions& options);

  // Forward, loss and backward; gradients (scaled by grad_scale) are added into
  // model.grad. Returns this rank's sum of weight * NLL.
  double forward_backward(const TokenBatch& batch, float grad_scale);

  // Forward only: logits (N, V) for every position.
  void forward_logits(const TokenBatch& batch, float* logits);

 private:
  struct ParamSlot {
    int unit = -1;
    Buffer<float> full;   // (max padded numel)
    CommRequest request;
  };
  struct GradSlot {
    int unit = -1;
    Buffer<float> full;   // (max padded numel) this unit's gradient, all of it
    Buffer<float> recv;   // (max shard numel) the reduced slice, added into model.grad
    CommRequest request;
  };

  const float* params(int unit);        // gathered weights of `unit` (waits)
  void prefetch(int unit);              // start gathering `unit` if a slot is free
  void release(int unit);
  float* grads(int unit);               // a zeroed full gradient buffer for `unit`
  void reduce_grads(int unit);          // start reduce-scatter of `unit`'s gradient
  void finish_grad(GradSlot& slot);
  void finish_all_grads();
  void embed_forward(const TokenBatch& b);
  void set_inputs(const TokenBatch& b);
  const float* lm_head_weights();

  ShardedModel& model_;
  Comm& comm_;
  EngineOptions options_;
  const ModelConfig& config_;
  const bool sharded_;                  // world > 1: gather and reduce through comm
  std::vector<double> inv_freq_;
  cpu::TokenInputs inputs_;

  std::vector<ParamSlot> param_slots_;
  std::vector<GradSlot> grad_slots_;
  int next_grad_slot_ = 0;
  std::vector<Buffer<float>> residual_;  // (L + 1) x (N, C): x_0 = embeddings .. x_L
  std::vector<cpu::LayerActs> acts_;     // L sets, or 1 with activation checkpointing
  Buffer<float> recompute_out_;          // (N, C) with activation checkpointing
  Buffer<float> d_x_;                    // (N, C) gradient flowing down the residual stream
  cpu::LayerGradScratch scratch_;
  cpu::HeadScratch head_;
};

}  // namespace shardlm
