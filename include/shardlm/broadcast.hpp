// broadcast.hpp — trainer → inference weight broadcast, and its reference receiver.
//
// Owns: sending the current weights every broadcast.interval steps, either over
// the broadcast communicator (trainer rank 0 + the receivers of an MPMD launch;
// MPI on the CPU backend, NCCL on GPUs) or through the filesystem
// (<broadcast.dir>/step_<N>/model.safetensors + config.json + STABLE), and
// `shardlm receive`, which checks what arrives. Transient memory on the trainer
// is one gathered unit. Knows the sharded model and Comm, not the kernels.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/shard.hpp"

namespace shardlm {

// Order-independent checksum of bf16 values at flat indices [begin, begin + n):
// a sum (mod 2^64) of one mixed word per element, so ranks can hash their own
// slices and add the partial sums. Used by both broadcast paths.
uint64_t bf16_checksum(const uint16_t* values, int64_t begin, int64_t n);

// Host bytes the weight broadcast (one gathered unit + its bf16 copy) or the
// final export (one gathered unit) hold at most: part of the memory plan.
int64_t output_workspace_bytes(const Config& config, const ModelLayout& layout);

class WeightBroadcaster {
 public:
  WeightBroadcaster(const Config& config, const Runtime& rt, Comm& train_comm);
  bool due(int64_t steps_done) const;
  // Collective over the trainers: every rank takes part in the gathers.
  void send(const ShardedModel& model, int64_t steps_done);
  // Tells the receivers that training is over (they exit 0).
  void finish();

 private:
  void send_over_comm(const ShardedModel& model, int64_t step);
  void send_to_filesystem(const ShardedModel& model, int64_t step);

  const Config& config_;
  const Runtime& rt_;
  Comm& comm_;
  bool enabled_ = false;
};

// `shardlm receive DECK [--out DIR]`: receive every broadcast, verify checksums,
// report step, bytes, latency and bandwidth; on the trainer's end write the
// last weights to `out_dir` (if given) as an HF directory (bf16). Returns the
// number of broadcasts received.
int64_t run_receiver(const Config& config, const Runtime& rt, const std::string& out_dir);

}  // namespace shardlm
