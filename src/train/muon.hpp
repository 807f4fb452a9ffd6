// muon.hpp — Muon for the hidden 2-D weight matrices, on flat shards.
//
// Owns: which parameters Muon updates (the attention and MLP projections of the
// decoder layers), the Newton–Schulz orthogonalisation (host fp32 here; the CUDA
// backend puts a bf16 one on the owner's GPU behind the Orthogonalizer interface,
// which MuonStep calls in its place), the update
// scale rule, the owner rank of each matrix, and MuonStep: the exchange that brings
// each matrix's update direction to its owner and the update's slices back.
// Knows the layout, the shards and the Comm interface; not MPI, not the deck
// (Optimizer passes the hyperparameters), not checkpoints (the momentum lives in
// Optimizer::state(0), laid out like the parameter shards).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/orthogonalizer.hpp"
#include "train/shard.hpp"

namespace shardlm {

// Muon updates ParamKind::Matrix parameters of decoder-layer units; everything
// else (embeddings, lm_head, norms, biases) is AdamW's.
bool is_muon_param(const Unit& unit, const ParamInfo& param);

// Floats of workspace newton_schulz needs for a (rows, cols) matrix.
int64_t newton_schulz_workspace_numel(int64_t rows, int64_t cols);

// out (rows, cols) <- `steps` quintic iterations on X = G / (||G||_F + kNsEps),
// row-major fp32 on the host. When rows > cols it iterates on the smaller Gram
// matrix X^T X (X <- a X + X (b A + c A^2)), which is the transposed form of the
// reference's X X^T step. out may alias G. The norm's sum of squares is in double,
// in fixed blocks; the GEMMs are BLAS's: the same bits at any thread count.
void newton_schulz(float* out, const float* G, int64_t rows, int64_t cols, int steps, float* workspace);

// The update scale: 0.2 * sqrt(max(rows, cols)). An orthogonal (rows, cols) matrix
// has RMS 1 / sqrt(max(rows, cols)), so the scaled update has RMS ~0.2, about
// AdamW's, and one lr and weight decay serve both groups (Moonshot, "Muon is
// scalable for LLM training", 2025).
double muon_update_scale(int64_t rows, int64_t cols);

// Where MuonStep's time went, summed over its steps after the first (the first
// also builds the GEMM plans): the whole step() and the Newton–Schulz calls in it.
struct MuonTiming {
  int64_t steps = 0;
  double step_s = 0, orthogonalize_s = 0;
};

struct MuonMatrix {
  int unit = -1;                 // index into layout.units
  const ParamInfo* param = nullptr;
  int64_t rows = 0, cols = 0;    // shape[0], shape[1]
  int owner = 0;                 // the rank that orthogonalises it
};

// Every Muon matrix, in unit then parameter order, with its owner: unit by unit,
// largest first, onto the least-loaded rank so far (loads in elements, carried
// across units; ties go to the lower rank). A pure function of the layout and
// `world`, so every rank computes the same table without talking.
std::vector<MuonMatrix> assign_muon_owners(const ModelLayout& layout, int world);

// Which slices go where, for one rank: per unit, what it sends to each owner
// (its slices of their matrices) and what it receives as an owner (every rank's
// slices of its matrices). all_to_all_v moves the directions with
// (send, recv) and the updates back with the roles swapped.
struct MuonPiece {
  int matrix = -1;             // index into the MuonMatrix table
  int64_t shard_offset = 0;    // where it sits in the holder's shard
  int64_t matrix_offset = 0;   // where it sits in the full matrix (row-major)
  int64_t count = 0;
  int64_t buffer_offset = 0;   // where it sits in the exchange buffer
};
struct MuonUnitPlan {
  bool has_matrices = false;   // the same on every rank: the unit takes part in the exchange
  std::vector<MuonPiece> send; // this rank's slices, grouped by owner (rank order), then parameter order
  std::vector<MuonPiece> recv; // slices of the matrices this rank owns, grouped by sender, then parameter order
  std::vector<int> owned;      // matrices of this unit this rank orthogonalises
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;  // (world)
  int64_t send_numel() const;  // this rank's Muon slices in the unit
  int64_t recv_numel() const;  // its owned matrices' elements
};
struct MuonExchangePlan {
  std::vector<MuonUnitPlan> units;  // per unit of the layout
  // Floats this rank sends to other ranks per step (directions out as a holder,
  // updates out as an owner; slices that stay on the rank are not counted). It
  // receives exactly as many.
  int64_t floats_sent_per_step = 0;
  int64_t workspace_numel = 0;      // MuonStep's buffers on this rank
};
MuonExchangePlan plan_muon_exchange(const ModelLayout& layout, const std::vector<MuonMatrix>& matrices, int rank,
                                    int world);

// Floats of MuonStep workspace on the rank that needs the most (the memory plan).
int64_t muon_workspace_numel(const ModelLayout& layout, int world);

// The Newton–Schulz capacity for the matrices `rank` owns; rank < 0: the most any
// rank needs (the memory plan).
NsCapacity muon_ns_capacity(const std::vector<MuonMatrix>& matrices, int rank);

// One Muon update of every Muon matrix, unit by unit:
//   1. on this rank's slices: m = mu m + g, direction d = g + mu m (Nesterov);
//   2. all_to_all_v: each owner receives the whole d of its matrices;
//   3. owner: U = newton_schulz(d) * muon_update_scale;
//   4. all_to_all_v back: every rank receives U on its slices;
//   5. p <- p - lr wd p - lr U (decoupled weight decay).
// Buffers are sized once here from the plan; step() allocates nothing.
class MuonStep {
 public:
  MuonStep(ShardedModel& model, Comm& comm, int ns_steps);
  // momentum[unit]: (shard_numel), read and written only on Muon elements.
  void step(double lr, double weight_decay, double mu, float grad_scale, std::vector<Buffer<float>>& momentum);

  const std::vector<MuonMatrix>& matrices() const { return matrices_; }
  const MuonExchangePlan& plan() const { return plan_; }

  // Step 3 through `o` instead of the host newton_schulz (nullptr: back to the
  // host). `o` must take ns_capacity(). The host workspace stays allocated (the
  // memory plan counts it either way).
  void set_orthogonalizer(std::unique_ptr<Orthogonalizer> o);
  const char* orthogonalizer_name() const;  // "host fp32" or the replacement's name()
  NsCapacity ns_capacity() const { return muon_ns_capacity(matrices_, model_->rank); }
  const MuonTiming& timing() const { return timing_; }

 private:
  ShardedModel* model_;
  Comm* comm_;
  int ns_steps_;
  std::vector<MuonMatrix> matrices_;
  MuonExchangePlan plan_;
  Buffer<float> direction_;      // (max over units of this rank's Muon slices): d out, U back
  Buffer<float> gathered_;       // (max over units of its owned matrices' numel): d in, U out
  Buffer<float> matrix_;         // (largest owned matrix) one matrix, contiguous
  Buffer<float> ns_workspace_;   // newton_schulz_workspace_numel of the largest owned matrix
  std::unique_ptr<Orthogonalizer> orthogonalizer_;  // nullptr: newton_schulz on the host
  int64_t steps_seen_ = 0;
  MuonTiming timing_;
};

}  // namespace shardlm
