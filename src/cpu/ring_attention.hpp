// ring_attention.hpp — context parallelism's attention on the CPU backend: the
// ring over a group of C ranks that share one micro-batch's sequences.
//
// Owns: RingAttention (a cpu::Attention) and its scratch rows. Each rank holds
// its own tokens' q, k, v (its two load-balanced chunks of every row); the K/V
// blocks travel rank to rank (Comm::ring_exchange) while each rank attends its
// queries to the block it holds, and the partial results are merged by
// log-sum-exp. Backward passes the K/V blocks round again with their dK/dV
// accumulators, which arrive back at their owners after C hops. The mask is the
// local kernel's: query i sees key j iff j's token_index <= i's and both carry
// the same seq_id (ids are unique per document through a micro-batch, as the
// data pipeline makes them), so packed documents stay apart across chunks.
// Knows the Comm interface, not MPI; nothing about units, shards or the model.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/comm.hpp"
#include "cpu/layers.hpp"

namespace shardlm::cpu {

// The ring's buffers, rows of the backend's table (Mem::Workspace) for up to N
// tokens per rank. A block is one rank's (k | v | token_index | seq_id).
struct RingScratch {
  Buffer<float> block[2];  // (N * (2 * KV * D + 2)) the block attended to, the one arriving
  Buffer<float> grad[2];   // (N * 2 * KV * D) its (dk | dv) accumulators, held and arriving
  Buffer<float> delta;     // (N, H) rowsum(dout * out) of this rank's queries
  int64_t tokens = 0;      // N the rows were sized for
  void add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows);
};

class RingAttention final : public Attention {
 public:
  // `group`: the C ranks sharing the sequences, in ring order (not owned);
  // `scratch` allocated (allocate_rows) for at least the micro-batches' N.
  RingAttention(Comm& group, RingScratch& scratch) : group_(group), s_(scratch) {}
  // in.token_index and in.seq_ids are required.
  void forward(float* out, float* lse, const float* q, const float* k, const float* v, const TokenInputs& in,
               int64_t H, int64_t KV, int64_t D) override;
  void backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v,
                const float* out, const float* lse, const TokenInputs& in, int64_t H, int64_t KV,
                int64_t D) override;

 private:
  Comm& group_;
  RingScratch& s_;
};

}  // namespace shardlm::cpu
