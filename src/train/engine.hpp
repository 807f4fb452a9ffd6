// engine.hpp — forward and backward of one micro-batch over sharded units.
//
// Owns: the unit loop of DESIGN.md's solver (gather u with u+1's gather in
// flight; compute; release; backward in reverse with each unit's gradients
// reduce-scattered into the gradient shards as soon as it is done; under
// expert parallelism a layer's own experts handed to the backend from the
// shard, never gathered, their gradients added to it unreduced), the
// gathered-unit and gradient-slot buffers, the activations, and their sizes (the
// memory plan). The arithmetic goes to a Backend, the collectives to a Comm,
// each unit's reduced gradient to the TrainingState (train/state.hpp), which
// also says when a unit's parameters may be read; knows nothing about the deck,
// the data file, the optimizer or where the training state lives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/memory.hpp"
#include "train/shard.hpp"
#include "train/state.hpp"

namespace shardlm {

// The engine's rows of a rank's memory plan (gathered units, gradient slots,
// the backend's copies, activations, workspace) plus the training state's
// (train/state.hpp's plan_state_memory), for `config` at `world` ranks.
MemoryPlan plan_memory(const ModelConfig& config, int world, const EngineOptions& options, int optim_states,
                       const Backend& backend);

// model.norm_dtype = "fp32": a unit's norm weights are copied from the fp32
// masters into the backend's copies in pieces, each within one rank's shard; at
// world > 1 every rank sends its own pieces (send_offset into its part of an
// all-gather) and places everyone's. Exact copies: world-size invariant.
struct NormPiece {
  int rank;
  int64_t shard_offset, packed, count, send_offset;
};
// `unit`'s pieces at `world` ranks, in the unit's order (appended to `out` when
// not nullptr); returns the floats the rank holding the most of them holds.
int64_t norm_pieces(const Unit& unit, int world, std::vector<NormPiece>* out);

// model.residual_dtype = "fp32": out (n, C) <- the elements of each token's
// embedding row that this rank's shard [shard_begin, shard_begin + shard_numel)
// of the flat table holds, 0 elsewhere and for a token < 0 (host memory; the
// device's is cuda_owned_rows). Summed over the ranks: the rows, exactly.
void owned_rows(float* out, const int32_t* ids, int64_t n, const float* shard, int64_t shard_begin,
                int64_t shard_numel, int64_t C);

// model.residual_dtype = "fp32" at world > 1: the fp32 rows travel in chunks
// of `tokens` tokens a rank, so one reduce-scatter's parts buffer (world x
// tokens x hidden fp32) stays within max_part_bytes: kRowPartsBytes, or less
// where the collective is staged through host buffers of that size (ranks
// sharing a GPU: the unit comm's staging holds one fp32 unit); `count` chunks
// cover max_tokens. At one rank: one chunk of max_tokens and no parts buffer.
inline constexpr int64_t kRowPartsBytes = int64_t(64) << 20;
struct RowChunks {
  int64_t tokens = 0, count = 0;
  int64_t id_count = 0;     // int32 token ids on the device: count x world x tokens
  int64_t part_floats = 0;  // world x tokens x hidden (world > 1)
};
RowChunks fp32_row_chunks(int world, int64_t max_tokens, int64_t hidden, int64_t max_part_bytes = kRowPartsBytes);
// out (world x max_tokens) <- the ids of every rank's tokens (all_ids: world x
// max_tokens, each rank's -1 padded) laid out for chunks of k tokens a rank:
// chunk j (k tokens a rank, the last min(k, max_tokens - j k)) starts at
// j world k, rank by rank; -1 past each rank's batch. Returns the longest
// rank's token count (the chunks past it are not needed).
int64_t chunk_row_ids(const int32_t* all_ids, int world, int64_t max_tokens, int64_t k, int32_t* out);

// Weights other than the training ones, for a forward-only pass
// (Engine::forward_token_logprobs): this rank's shard of every unit.
struct OtherWeights {
  std::vector<const void*> shards;    // per unit, in the backend's precision and memory (bf16 on a GPU)
  // Per unit in fp32, host memory: what a GPU backend reads from the masters
  // (fp32 norm weights, the fp32 stream's embedding rows). Empty on the CPU
  // backend, whose shards are fp32 already.
  std::vector<const float*> masters;
};

class Engine {
 public:
  // The backend is the engine's own; the model and comm are borrowed.
  Engine(ShardedModel& model, Comm& comm, const EngineOptions& options,
         std::unique_ptr<Backend> backend = make_cpu_backend());
  ~Engine();

  // Where gradients go and when parameters may be read: the session's training
  // state (not owned). Without one the engine keeps its gradients in the
  // model's host shards (forward passes, tests).
  void set_state(TrainingState& state);
  TrainingState& state();

  // Forward, loss and backward; gradients (scaled by grad_scale) are added into
  // the state's gradient shards. Returns this rank's loss sums (SFT: sum of weight * NLL).
  LossStats forward_backward(const TokenBatch& batch, float grad_scale);

  // Forward only: the micro-batch's cross-entropy sums (loss = sum of weight *
  // NLL, loss_tokens), computed as forward_backward computes the SFT loss.
  // Collective over the ranks like forward_backward; gradients are untouched.
  LossStats forward_loss(const TokenBatch& batch);

  // Forward only: logits (N, V) for every position.
  void forward_logits(const TokenBatch& batch, float* logits);

  // Forward only (RL): logprobs (N) of each position's target at its
  // temperature, as the RL loss computes them (0 without a target). Collective
  // over the ranks like forward_backward; gradients are untouched. With
  // `weights` (e.g. the frozen reference of train/reference_pass.hpp) the pass
  // runs on them instead of the training weights.
  void forward_token_logprobs(const TokenBatch& batch, float* logprobs, const OtherWeights* weights = nullptr);

  const Backend& backend() const { return *backend_; }
  Backend& backend() { return *backend_; }
  const EngineOptions& options() const { return options_; }
  // The RL weight broadcast on a GPU backend (broadcast.hpp): unit `unit`'s bf16
  // parameters gathered from every rank's device shard into `device_out`
  // (padded_numel bf16, device memory) through the unit loop's device Comm; at
  // one rank, a device copy of the shard. Collective over the trainer ranks.
  // Queued on the backend's stream (no host synchronisation). Between steps
  // only: it reads the shards the last update wrote and holds no gather slot.
  void gather_unit_bf16(int unit, void* device_out);

 private:
  struct ParamSlot {
    int unit = -1;
    void* full = nullptr;    // (max padded numel) backend memory, backend precision
    CommRequest request;
  };
  struct GradSlot {
    int unit = -1;
    bool reducing = false;   // backward of the unit done; its reduction started
    float* full = nullptr;   // (max padded numel) this unit's gradient, all of it
    void* recv = nullptr;    // (max shard numel) the reduced slice (reduce type), added into the grad shard
    void* full_bf16 = nullptr;  // (max padded numel) bf16 copy of `full` when gradients reduce in bf16
    CommRequest request;
  };

  const void* params(int unit);         // gathered weights of `unit` (waits)
  const void* shard(int unit) const;    // this rank's shard of `unit`: the backend's, or weights_'s
  const float* master(int unit);        // its fp32 shard: the state's masters, or weights_'s
  bool master_on_device(int unit) const;
  void plan_norm_copies();              // model.norm_dtype = "fp32": the pieces below
  void refresh_norms(int unit);         // the backend's fp32 norm weights <- the masters, when they changed
  void embed_rows_fp32(const TokenBatch& b, float* rows);  // the fp32 stream's start from the masters
  void prefetch(int unit);              // start gathering `unit` if a slot is free
  void release(int unit);
  float* grads(int unit);               // a zeroed full gradient buffer for `unit`
  void reduce_grads(int unit);          // start reduce-scatter of `unit`'s gradient
  void finish_grad(GradSlot& slot);
  void finish_all_grads();
  void finish_reductions_early(int unit);  // the state moves each reduced gradient on early (offload)
  void forward(const TokenBatch& b, bool keep_head);
  // Expert parallelism: hands the backend layer `layer`'s own experts (their
  // shard, and `grads` zeroed for a backward; nullptr: a forward) and returns
  // their unit; -1 (nothing done) for a layer without an experts unit.
  int own_experts(int layer, float* grads);
  const void* lm_head_weights();

  ShardedModel& model_;
  Comm& comm_;
  EngineOptions options_;
  std::unique_ptr<Backend> backend_;
  const ModelConfig& config_;
  const bool sharded_;                  // world > 1: gather and reduce through comm
  std::unique_ptr<Comm> device_comm_;   // device backends at world > 1: device-buffer collectives
  TrainingState* state_ = nullptr;      // where gradients go (not owned), or own_state_
  std::unique_ptr<TrainingState> own_state_;
  // Other weights a forward-only pass reads instead of the training ones
  // (forward_token_logprobs); nullptr otherwise.
  const OtherWeights* weights_ = nullptr;
  Comm* unit_comm_ = nullptr;           // device_comm_, or comm_ for host buffers
  DType gather_type_ = DType::F32, reduce_type_ = DType::F32;
  bool grad_slots_used_ = false;        // sharded, or gradients outside host memory
  int64_t slot_floats_ = 0, recv_floats_ = 0;
  std::vector<ParamSlot> param_slots_;
  // Expert parallelism: one layer's owned experts' gradients (the largest
  // experts shard), added to the state's shard after the layer's backward.
  float* experts_grad_ = nullptr;
  int64_t experts_grad_floats_ = 0;
  std::vector<GradSlot> grad_slots_;
  int next_grad_slot_ = 0;
  // model.norm_dtype = "fp32" (NormPiece above).
  std::vector<std::vector<NormPiece>> norm_pieces_;  // [unit]; empty when the backend reads bf16
  std::vector<int64_t> norm_share_;     // [unit] floats each rank sends (the largest rank's pieces)
  std::vector<int64_t> norm_version_;   // [unit] the state's param_version copied last; -1: never
  float* norm_send_ = nullptr;          // (largest share) backend memory, world > 1
  float* norm_recv_ = nullptr;          // (world x largest share)
  int64_t norm_share_max_ = 0;
  // model.residual_dtype = "fp32" on a GPU: every rank's token ids (world x
  // max_tokens, -1 padded; all_ids_ as gathered, row_ids_ laid out by chunk,
  // on the host and the device), each rank's part of every rank's rows for
  // one chunk (world > 1, device), and the rows built on the host when the
  // embedding's masters are there (offload).
  RowChunks row_chunks_;
  std::vector<int32_t> row_ids_, own_ids_, all_ids_;
  int32_t* row_ids_dev_ = nullptr;
  float* row_parts_ = nullptr;
  std::vector<float> row_staging_;
};

}  // namespace shardlm
