// expert_parallel.hpp — expert parallelism on the CPU backend: each rank of a
// group of P holds num_experts / P whole experts of every layer of experts
// (rank p: experts [p Ep, (p + 1) Ep), Ep = num_experts / P); a layer's routed
// rows travel to their experts' ranks and the results come back.
//
// Owns: ExpertExchange (from every rank's rows per expert: what this rank sends
// to and receives from each rank, and the groups of rows its experts' GEMMs
// run over), the two moves over a Comm (rows to owners, results back), and
// ExpertParallel, the cpu::Experts a layer calls, with its scratch rows. A
// rank's routed rows are grouped by expert (MoeRouting's order), so its rows
// for owner p are one block; an owner keeps what it receives in source-rank
// order (rank q's rows of its expert 0, expert 1, ..., then rank q + 1's), and
// its GEMMs run group by group over them, so no row is ever reordered. The
// moves only copy, so the rows come back exactly. Knows the Comm interface,
// not MPI; nothing of units or shards (the engine hands in the owned experts).
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/comm.hpp"
#include "cpu/layers.hpp"

namespace shardlm::cpu {

struct ExpertExchange {
  int P = 1, rank = 0;
  int64_t experts_per_rank = 0;  // Ep
  // In floats (rows x C), per rank, as Comm::all_to_all_v takes them.
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
  // (P Ep + 1) the received rows' groups: rank q's rows of owned expert j are
  // rows [groups[q Ep + j], groups[q Ep + j + 1]).
  std::vector<int64_t> groups;
  int64_t rows_received = 0;
};
// Fills `x` (its vectors keep their storage from one layer to the next) from
// rows_per_expert (P, E): rank q's routed rows of each expert (every rank's),
// for `rank` of P ranks and rows of C floats. E must be a multiple of P.
void plan_expert_exchange(ExpertExchange& x, const int32_t* rows_per_expert, int rank, int P, int64_t E, int64_t C);
// owned (x.rows_received, C) <- every rank's rows of this rank's experts, from
// `local` (this rank's routed rows, grouped by expert). Collective over `group`.
void rows_to_owners(Comm& group, const ExpertExchange& x, const float* local, float* owned);
// The way back: local (this rank's routed rows, C) <- the owners' results,
// `owned` (x.rows_received, C) in the order rows_to_owners delivered. Collective.
void rows_from_owners(Comm& group, const ExpertExchange& x, const float* owned, float* local);

// ExpertParallel's buffers, rows of the backend's table (Mem::Workspace) for
// up to N tokens a rank.
struct ExpertScratch {
  Buffer<float> local_rows;  // (N K, C) this rank's routed rows: sent, then their results received
  Buffer<float> owned_out;   // (P N K, C) the owned experts' outputs before they go back
  void add_rows(const ModelConfig& c, int64_t N, int64_t P, std::vector<BufferRow>& rows);
};

class ExpertParallel final : public Experts {
 public:
  // `group`: the P ranks the experts are split over, rank p owning experts
  // [p Ep, (p + 1) Ep) (not owned); `scratch` allocated for the micro-batches'
  // N. The owned experts' weights are expert after expert, 3 I C floats apart
  // (an experts unit, model.hpp).
  ExpertParallel(Comm& group, const ModelConfig& c, ExpertScratch& scratch);
  void forward(float* out, LayerActs& acts, const LayerWeights<const float>& w, int64_t N) override;
  void backward(float* dx, float* dweight, const float* dout, const LayerActs& acts,
                const LayerWeights<const float>& w, const LayerWeights<float>& g, LayerGradScratch& s,
                int64_t N) override;
  // Floats from one owned expert's weights to the next one's.
  int64_t expert_stride() const { return 3 * Im_ * C_; }

 private:
  Comm& group_;
  ExpertScratch& s_;
  int64_t C_, Im_, E_, K_, Ep_;
  std::vector<int32_t> own_rows_;  // (E) this rank's routed rows per expert, all-gathered into LayerActs::ep_rows
  ExpertExchange plan_;
};

}  // namespace shardlm::cpu
