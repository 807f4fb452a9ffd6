// train.hpp — everything one training run holds, and one optimizer step.
//
// Owns: TrainSession (the step source, sharded model, optimizer, engine and
// training state: all state in one place, each variant chosen once when it is
// built) and step(), the phases of one step in order: batch, forward / loss /
// backward per micro-batch, global-norm clipping, update. The step has one path:
// where the state lives (train/state.hpp) and where the tokens come from
// (train/step_source.hpp) are objects, not branches. Knows the Comm it is given
// (the trainer ranks), not MPI_COMM_WORLD, so tests can run it on
// sub-communicators of any size.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "data/data.hpp"
#include "train/engine.hpp"
#include "train/eval.hpp"
#include "train/optim.hpp"
#include "train/reference_pass.hpp"
#include "train/sequence_pass.hpp"
#include "train/shard.hpp"
#include "train/state.hpp"
#include "train/step_source.hpp"

namespace shardlm {

// One optimizer update of a step (RL: loss.epochs x loss.mini_batches of them).
struct UpdateStats {
  double loss = 0;             // its loss, normalised over its part of the step
  double grad_norm = 0;        // before clipping
  // RL: the fraction of its loss tokens whose ratio the bound held: the clip
  // ("clipped", "gspo"; "cispo": whose weight it truncated) or the mask ("masked").
  double bound_fraction = 0;
  bool skipped = false;        // NaN/Inf: no update (several updates: one of them at least)
  std::vector<UpdateStats> updates;  // each optimizer update of the step, in order
};

struct StepStats {
  int64_t step = 0;            // 0-based
  double loss = 0;             // mean NLL over the step's loss tokens (all ranks); RL: the mean of its updates' losses
  double grad_norm = 0;        // before clipping; several updates: the mean of theirs
  double lr = 0;               // every update of the step takes it (the schedule counts steps)
  int64_t tokens = 0;          // non-padding tokens in the step (all ranks)
  int64_t loss_tokens = 0;
  bool skipped = false;        // NaN/Inf: no update (several updates: one of them at least)
  std::vector<UpdateStats> updates;  // each optimizer update of the step, in order
  int64_t redone_steps = -1;   // model.optim_offload_speculate: steps redone (clipped) or discarded so far; -1: off
  double step_time_s = 0;
  // RL (loss.type = "rl"), means over the step's loss tokens:
  bool rl = false;
  double entropy = 0, mismatch_kl = 0, masked_high = 0, masked_low = 0, advantage = 0;
  double masked_fraction = 0;  // loss.objective = "masked": tokens masked, either side
  double clip_fraction = 0;    // "clipped", "gspo": tokens whose ratio the clip held; "cispo": whose weight it truncated
  // loss.is_level != "none": the importance ratio's mean (each bounded to
  // [e^-20, e^20]), the tokens whose weight was capped, whose loss was masked.
  double is_ratio = 0, is_capped_fraction = 0, is_masked_fraction = 0;
  double ref_kl = 0;           // loss.ref_kl_coef > 0: the KL estimator against the starting weights
  // A model of experts with model.router_aux_loss: the load-balancing loss,
  // the mean over the step's micro-batches (its coefficient times it is in `loss`).
  bool router_aux = false;
  double router_aux_loss = 0;
  double rollout_wait_s = 0;   // time spent waiting for the rollout file
  // What the inference side measured making the step's rollout file (its
  // group 'metrics': reward_mean, reward_<component>, sampling_tokens_per_s, ...).
  std::vector<std::pair<std::string, double>> rollout_metrics;
  // Where the step's time went (seconds): batch assembly, forward/loss/backward
  // with the collectives and gradient transfers inside it, clip + optimizer,
  // refreshing the backend's parameter copies.
  double data_s = 0, compute_s = 0, optimizer_s = 0, param_sync_s = 0;
  // [eval] after this step (TrainSession::evaluate): the held-out loss.
  bool evaluated = false;
  double eval_loss = 0;        // mean NLL over the eval rows' loss tokens
  int64_t eval_loss_tokens = 0;
  double eval_s = 0;
};

// Training FLOPs per token: 6 N + 12 L H Q T (N = weights used in matmuls, lm-head
// included; L layers, H heads, Q head dim, T sequence length), as DESIGN.md counts MFU.
double flops_per_token(const ModelLayout& layout, int64_t seq_len);

// The model's architecture for a deck: model.hf's config.json, else the deck's sizes.
ModelConfig model_config_for(const Config& config);
EngineOptions engine_options_for(const Config& config);
// The deck's [loss] as the RL loss kernels take it.
RlLossParams rl_loss_params(const LossSection& loss);
// Optimizer updates a step makes: loss.epochs x loss.mini_batches under the RL
// loss, else 1. The optimizer's step count advances by this much a step.
int64_t updates_per_step(const Config& config);

struct TrainSession {
  Config config;
  Comm& comm;
  ModelConfig arch;            // model.hf's config.json or the deck's sizes
  std::optional<TokenDataset> data;  // SFT token files (RL reads rollout files instead): its position is checkpointed
  std::optional<EvalSet> eval;       // eval.path, when set (SFT and RL)
  // model.context_parallel > 1: this rank's group of ranks sharing its sequences
  // (a split of `comm`); the backend's ring runs over it. nullptr otherwise.
  std::unique_ptr<Comm> cp_group;
  ShardedModel model;
  Optimizer optimizer;
  Engine engine;
  std::unique_ptr<StepSource> source;   // token files | rollouts
  std::unique_ptr<SequencePass> sequence_pass;  // the RL loss's sums over whole samples | nothing
  // The KL term against the starting weights: their frozen copy (taken here,
  // before any update or checkpoint load) and logprobs | nothing.
  std::unique_ptr<ReferencePass> reference_pass;
  std::unique_ptr<TrainingState> state; // host | device | offload
  int64_t bad_steps_in_a_row = 0;
  int64_t bad_steps_total = 0;

  TrainSession(const Config& config, Comm& comm);
  StepStats step(int64_t step);
  // [eval]: whether the held-out loss is due after `steps_done` steps, and
  // computing it into the step's stats (collective over the trainer ranks).
  bool eval_due(int64_t steps_done) const;
  void evaluate(StepStats& stats);

  // The host shards (model.param, optimizer.state) as the checkpoint, the
  // export and the host broadcast read them: pull_state() makes them current
  // (a device mirror refreshed, the offload worker idle), push_state() makes
  // the state follow them after a checkpoint load.
  void pull_state() {
    state->host_reader.wait_done();  // an async save still reading the device state's host mirror
    state->pull();
  }
  void push_state() { state->push(); }

 private:
  // One optimizer update on part `part` of the step: the sample sums at the
  // weights it trains, forward / loss / backward per micro-batch, the global
  // norm, clip and update. Adds its loss sums over all ranks into `sums` and
  // its times into `s`.
  UpdateStats update(int64_t step, int64_t part, const UpdatePlan& plan, StepStats& s, LossStats& sums);
  // The step's loss statistics (sums over all ranks and updates) as means.
  void record_loss(StepStats& s, const LossStats& sums) const;
  // Clip by the global norm and update, or skip a NaN/Inf update.
  void apply_update(int64_t step, double lr, UpdateStats& u);
};

}  // namespace shardlm
