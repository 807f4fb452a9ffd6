// context_split.hpp — which tokens of a micro-batch each rank of a
// context-parallel group keeps, and that rank's share as a TokenBatch.
//
// Owns: the load-balanced split (each row cut into 2C equal chunks; rank c of
// the group keeps chunks c and 2C-1-c, an early and a late one, so every rank
// has the same causal-attention work) and ContextShare, the buffers of one
// rank's share. The share keeps each token's RoPE position, seq_id, target and
// loss weight, and its index in the whole micro-batch (TokenBatch::token_index,
// the causal order the ring attends in). Knows nothing about MPI or the model.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/backend.hpp"
#include "data/data.hpp"
#include "data/rollouts.hpp"

namespace shardlm {

// The indices into a (rows, seq_len) micro-batch of the tokens rank `cp_rank`
// of `cp_size` keeps, in its local order (increasing): rows * seq_len / cp_size
// of them. seq_len must split into 2 * cp_size equal chunks.
std::vector<int32_t> context_share_indices(int64_t rows, int64_t seq_len, int cp_rank, int cp_size);

class ContextShare {
 public:
  ContextShare(int cp_rank, int cp_size) : cp_rank_(cp_rank), cp_size_(cp_size) {}
  // This rank's share of `full` (every rank of the group reads the same rows);
  // valid until the next call. Allocates only when the shape changes.
  TokenBatch take(const MicroBatch& full);
  // The same for an RL micro-batch: its advantages, inference (and sampling)
  // logprobs, temperatures and sample ids (per target position) come with the
  // tokens. `sampling_logprobs` (rows * seq_len) or nullptr: none.
  TokenBatch take(const RlMicroBatch& full, const float* sampling_logprobs);

 private:
  int cp_rank_, cp_size_;
  int64_t rows_ = -1, seq_len_ = -1;
  std::vector<int32_t> index_, tokens_, targets_, positions_, seq_ids_, sample_ids_;
  std::vector<float> weights_, advantages_, inference_logprobs_, sampling_logprobs_, temperatures_;
};

}  // namespace shardlm
