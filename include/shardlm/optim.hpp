// optim.hpp — optimizers on flat shards and the learning-rate schedule.
//
// Owns: AdamW (decoupled weight decay, none on norms and biases) and SGD (with
// optional momentum), each updating only this rank's shard, segment by segment
// so every parameter gets its own decay rule; the lr schedule; the global
// gradient norm. Knows nothing about kernels, MPI or files (the norm's
// all-reduce goes through Comm).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/shard.hpp"

namespace shardlm {

// lr at `step` (0-based): linear warmup from 0 over sched.warmup steps, then
// constant | linear (decay to min_lr over the last sched.decay steps, all of the
// rest when 0) | cosine (to min_lr at max_steps).
double lr_at(const SchedSection& sched, double peak_lr, int64_t max_steps, int64_t step);

class Optimizer {
 public:
  Optimizer(const OptimSection& config, ShardedModel& model);
  int states() const;  // fp32 arrays per parameter element (AdamW 2, SGD 0 or 1)
  // One update of every shard with lr, after scaling gradients by grad_scale
  // (clipping); increments the step count.
  void step(double lr, float grad_scale);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  std::vector<Buffer<float>>& state(int i) { return state_[i]; }
  const std::string& name() const { return config_.name; }

 private:
  OptimSection config_;
  ShardedModel& model_;
  std::vector<std::vector<Buffer<float>>> state_;  // [state][unit] (shard_numel)
  int64_t step_ = 0;
};

// sqrt(sum over all ranks and units of grad^2): one all-reduce of one double.
double global_grad_norm(const ShardedModel& model, Comm& comm);
// True if any gradient element on any rank is NaN or Inf (one all-reduce).
bool grads_finite(double global_norm);

}  // namespace shardlm
