// shard.hpp — the model's parameters as flat shards: rank r owns slice r of
// every unit's padded flat buffer, in fp32 (master weights and gradients).
//
// Owns: ShardedModel (parameter and gradient shards per unit), the walk over
// (parameter ∩ shard) segments that init, loading, the optimizer and checkpoints
// use, seeded init and HF loading straight into the shard (the full model is
// never materialised on one rank), and HF export one unit at a time. Knows the
// Comm interface but not MPI itself; knows nothing about kernels or the deck.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/model.hpp"

namespace shardlm {

class SafetensorsReader;

// One parameter's part of one rank's shard.
struct ShardSegment {
  const ParamInfo* param;
  int64_t param_begin;   // first element of the parameter (flattened) in this segment
  int64_t shard_offset;  // where it sits in the shard
  int64_t count;
};

// Zero a fresh shard (shard_numel fp32) so that its pages are first touched by
// the threads that will update them: each segment in the CPU AdamW's blocks and
// static schedule on OpenMP's default team (cpu::zero_first_touch), the padding
// by this thread. On a host with several NUMA nodes each page then lives on the
// node of the core that streams it in the update.
void zero_shard_first_touch(float* shard, const std::vector<ShardSegment>& segments, int64_t shard_numel);

struct ShardedModel {
  ModelLayout layout;
  int rank = 0, world = 1;
  std::vector<Buffer<float>> param;  // per unit: (shard_numel) fp32 master weights
  std::vector<Buffer<float>> grad;   // per unit: (shard_numel) fp32 accumulated gradients

  // host_grads = false: no host gradient shards (device-resident state keeps
  // them on the GPU); grad[u] is then empty. expert_parallel: ModelLayout's.
  ShardedModel(const ModelConfig& config, int rank, int world, bool host_grads = true, int64_t expert_parallel = 1);
  int64_t shard_begin(const Unit& u) const { return rank * u.shard_numel; }
  std::vector<ShardSegment> segments(const Unit& u) const;
  void zero_grads();

  void init_seeded(uint64_t seed, double std);
  // Every parameter must be in `weights` with its shape; extra tensors are refused
  // (lm_head.weight of a tied model excepted).
  void load_hf(const SafetensorsReader& weights);
};

// Gathers every unit in turn (transient memory: one unit) and writes
// DIR/config.json + DIR/model.safetensors from the comm's rank 0.
// dtype "F32" or "BF16". Collective over `comm`.
void export_hf(const ShardedModel& model, Comm& comm, const std::filesystem::path& dir, const std::string& dtype);

// All parameters gathered, for tests: name -> values (every rank gets them).
std::vector<std::vector<float>> gather_all_params(const ShardedModel& model, Comm& comm);

}  // namespace shardlm
