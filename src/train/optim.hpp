// optim.hpp — optimizers on flat shards and the learning-rate schedule.
//
// Owns: AdamW (decoupled weight decay, none on norms and biases), SGD (with
// optional momentum) and Muon (the hidden matrices through MuonStep in muon.hpp,
// AdamW for the rest), each updating only this rank's shard, segment by segment
// so every parameter gets its own rule; the optimizer state, laid out like the
// parameter shards so checkpoints write it with the parameters' hyperslab code;
// the lr schedule (the clip norm is the training state's, train/state.hpp).
// Knows nothing about kernels, MPI or files (Muon's exchange goes through Comm).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/memory.hpp"
#include "train/muon.hpp"
#include "train/shard.hpp"

namespace shardlm {

// lr at `step` (0-based): linear warmup from 0 over sched.warmup steps, then
// constant | linear (decay to the floor over the last sched.decay steps, all of
// the rest when 0) | cosine (to the floor at max_steps). The floor is
// sched.min_lr_ratio * peak_lr when that is set (each group's own peak), else sched.min_lr.
double lr_at(const SchedSection& sched, double peak_lr, int64_t max_steps, int64_t step);

// fp32 arrays per parameter element that `config` keeps (AdamW 2, SGD 0 or 1, Muon 2).
int optimizer_states(const OptimSection& config);
// Host bytes of optimizer workspace per rank beyond the state (Muon's exchange and
// Newton–Schulz buffers on the rank that needs the most; 0 for AdamW and SGD).
int64_t optimizer_workspace_bytes(const OptimSection& config, const ModelLayout& layout);
// Muon on the CUDA backend (`cuda`): the GPU Newton–Schulz's device buffers and
// pinned host staging, sized for the largest matrix a rank owns, on the rank that
// needs the most; zeros otherwise and in a CPU-only build. On top of
// optimizer_workspace_bytes (MuonStep's host buffers are there either way).
NsWorkspaceBytes optimizer_gpu_workspace_bytes(const OptimSection& config, const ModelLayout& layout, bool cuda);

class Optimizer {
 public:
  // `comm` is the trainer ranks' (the shards' world): Muon exchanges matrices over it.
  Optimizer(const OptimSection& config, ShardedModel& model, Comm& comm);
  // Without a Comm: AdamW, SGD, and Muon on one rank (a self Comm).
  Optimizer(const OptimSection& config, ShardedModel& model);

  // fp32 arrays per parameter element. state(i)[unit] is (shard_numel), element j
  // belonging to the parameter element the shard holds at j.
  //   adamw: 0 exp_avg, 1 exp_avg_sq
  //   sgd:   0 momentum_buffer (only when optim.momentum > 0)
  //   muon:  0 momentum_buffer on Muon matrices, exp_avg on the AdamW parameters;
  //          1 exp_avg_sq on the AdamW parameters, unused (zero) on Muon matrices
  int states() const { return static_cast<int>(state_.size()); }
  std::vector<Buffer<float>>& state(int i) { return state_[i]; }
  const std::vector<Buffer<float>>& state(int i) const { return state_[i]; }
  // The checkpoint's dataset name for state i (/optim/<param>/<state_name>):
  // "exp_avg", "exp_avg_sq" or "momentum_buffer"; for Muon, AdamW's names.
  std::string state_name(int i) const;
  // The same for one parameter: Muon matrices hold state 0 as "momentum_buffer"
  // and no state 1 (""): a checkpoint skips the empty name.
  std::string state_name(int i, const Unit& unit, const ParamInfo& param) const;

  // One update of every shard with lr (optim.lr's schedule: Muon's matrices take
  // it, Muon's AdamW group takes it times adamw_lr / lr), after scaling gradients
  // by grad_scale (clipping); increments the step count. Collective over the Comm
  // for Muon.
  void step(double lr, float grad_scale);
  // The same split per unit for the offload pipeline (AdamW and SGD): begin_step()
  // counts the step, then step_unit() updates one unit's shard and, given
  // param_bf16 (shard numel), writes its updated values in bf16 there; grad
  // (shard numel), if given, is the unit's gradient instead of its grad shard;
  // step (> 0), if given, is the step number for the bias correction instead
  // of steps_taken() (the offload worker's, which the training thread may
  // count back meanwhile: a skipped step it had speculated on).
  void begin_step() { ++step_; }
  void step_unit(int unit, double lr, float grad_scale, uint16_t* param_bf16 = nullptr, const float* grad = nullptr,
                 int64_t step = 0);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  const std::string& name() const { return config_.name; }
  const MuonStep* muon() const { return muon_.get(); }  // nullptr unless muon
  MuonStep* muon() { return muon_.get(); }              // e.g. to give it the GPU Newton–Schulz

 private:
  void init(Comm* comm);

  OptimSection config_;
  ShardedModel* model_;
  std::unique_ptr<Comm> self_comm_;                   // the two-argument constructor's, at world 1
  std::unique_ptr<MuonStep> muon_;
  std::vector<std::vector<ShardSegment>> segments_;   // [unit]: this rank's (parameter ∩ shard)
  std::vector<std::vector<Buffer<float>>> state_;     // [state][unit] (shard_numel)
  int64_t step_ = 0;
};

}  // namespace shardlm
