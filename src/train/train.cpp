// train.cpp — the session's state and one optimizer step.
#include "train/train.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cmath>

#include "shardlm/error.hpp"
#include "cuda/newton_schulz.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"

namespace shardlm {

ModelConfig model_config_for(const Config& config) {
  if (config.model.hf.empty()) return config.model.arch;  // validated with the deck
  const ModelConfig arch = read_hf_config(config.model.hf);
  // The deck's cross-field rules on the model that config.json describes.
  const std::string where = config.model.hf + "/config.json";
  SHARDLM_CHECK(config.data.seq_len <= arch.max_position_embeddings,
                "data.seq_len = %lld is larger than %s's max_position_embeddings = %lld", (long long)config.data.seq_len,
                where.c_str(), (long long)arch.max_position_embeddings);
  SHARDLM_CHECK(config.model.selective_layers <= arch.num_layers,
                "model.selective_layers = %lld is more than %s's num_hidden_layers = %lld",
                (long long)config.model.selective_layers, where.c_str(), (long long)arch.num_layers);
  const std::string e = model_scale_error(arch, config.data.micro_batch * config.data.seq_len, config.loss.chunk_tokens);
  SHARDLM_CHECK(e.empty(), "%s: %s", where.c_str(), e.c_str());
  if (config.model.fp8 != "none") {
    const std::string fp8 = fp8_shape_error(arch, config.data.seq_len / config.model.context_parallel);
    SHARDLM_CHECK(fp8.empty(), "%s: %s", where.c_str(), fp8.c_str());
  }
  const std::string moe = moe_deck_error(config, arch);
  SHARDLM_CHECK(moe.empty(), "%s: %s", where.c_str(), moe.c_str());
  return arch;
}

RlLossParams rl_loss_params(const LossSection& l) {
  const std::string& o = l.objective;
  const RlObjective objective = o == "clipped" ? RlObjective::Clipped : o == "gspo" ? RlObjective::Gspo
                              : o == "cispo"   ? RlObjective::Cispo   : RlObjective::Masked;
  const IsLevel is_level = l.is_level == "token" ? IsLevel::Token : l.is_level == "sequence" ? IsLevel::Sequence
                                                                                            : IsLevel::None;
  return {.mask_high = l.mask_high, .mask_low = l.mask_low, .kl_coef = l.kl_coef, .ce_coef = l.ce_coef,
          .objective = objective, .clip_low = l.clip_low, .clip_high = l.clip_high, .is_level = is_level,
          .is_cap = l.is_cap, .is_mask = l.is_mask, .entropy_coef = l.entropy_coef, .ref_kl_coef = l.ref_kl_coef,
          .ref_kl_estimator = l.ref_kl_estimator == "k1"   ? RefKlEstimator::K1
                              : l.ref_kl_estimator == "k2" ? RefKlEstimator::K2
                                                           : RefKlEstimator::K3};
}

int64_t updates_per_step(const Config& c) { return c.loss.type == "rl" ? c.loss.epochs * c.loss.mini_batches : 1; }

EngineOptions engine_options_for(const Config& config) {
  EngineOptions o;
  o.rl = config.loss.type == "rl";
  o.rl_params = rl_loss_params(config.loss);
  // Under context parallelism each rank holds 1/C of every row: its activations are sized for its share.
  o.context_parallel = config.model.context_parallel;
  o.expert_parallel = config.model.expert_parallel;
  o.max_tokens = config.data.micro_batch * config.data.seq_len / std::max<int64_t>(1, o.context_parallel);
  o.chunk_tokens = config.loss.chunk_tokens;
  o.reshard_after_forward = config.model.reshard_after_forward;
  o.checkpoint_activations = config.model.activation_checkpointing != "none";
  o.save_attention = config.model.activation_checkpointing == "selective";
  o.save_attention_layers = config.model.selective_layers;
  o.state = state_placement_for(config);
  o.offload_device_grads = offload_grads_on_device(config);
  o.offload_device_units = offload_device_units(config);
  o.offload_speculate = o.state == StatePlacement::Offload && config.model.optim_offload_speculate;
  o.reduce_bf16 = config.model.reduce_dtype == "bf16";
  // "auto" is resolved by select_comm() at start-up; a session built without it
  // (tests, tools) on one GPU per rank uses NCCL.
  o.comm_backend = config.comm.backend == "auto" ? "nccl" : config.comm.backend;
  o.comm_timeout_s = config.comm.timeout_s;
  o.attention = config.device.attention;
  o.deterministic = config.run.deterministic;
  o.fp8 = fp8_mode(config.model.fp8);
  o.fp8_weight_cache = o.fp8 != Fp8Mode::None && config.model.fp8_weight_cache;
  o.fp8_attention = config.model.fp8_attention;
  o.residual_fp32 = config.model.residual_dtype == "fp32";
  o.norm_fp32 = config.model.norm_dtype == "fp32";
  return o;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Tests (SHARDLM_TEST_NAN_STEP=N): step N's gradient norm is NaN on every
// rank, as after an overflow, so that the step is skipped; 0: none.
int64_t injected_nan_step() {
  static const int64_t step = [] {
    const char* e = std::getenv("SHARDLM_TEST_NAN_STEP");
    return e ? std::atoll(e) : 0;
  }();
  return step;
}

// Context parallelism's groups: C consecutive ranks share one sequence.
std::unique_ptr<Comm> context_group(const Config& c, Comm& comm) {
  const int64_t cp = c.model.context_parallel;
  if (cp <= 1) return nullptr;
  SHARDLM_CHECK(comm.size() % cp == 0,
                "model.context_parallel = %lld does not divide the %d training ranks: the ranks form groups of "
                "model.context_parallel that share one sequence; run a multiple of %lld ranks or change it",
                (long long)cp, comm.size(), (long long)cp);
  return comm.split(comm.rank() / int(cp), comm.rank() % int(cp));
}

ShardedModel initial_model(const Config& c, const ModelConfig& arch, const Comm& comm) {
  ShardedModel model(arch, comm.rank(), comm.size(), host_grad_shards(state_placement_for(c), offload_grads_on_device(c)),
                     c.model.expert_parallel);
  if (c.model.hf.empty()) model.init_seeded(static_cast<uint64_t>(c.run.seed), c.model.init_std);
  else model.load_hf(SafetensorsReader(c.model.hf));
  return model;
}

}  // namespace

double flops_per_token(const ModelLayout& layout, int64_t seq_len) {
  const ModelConfig& c = layout.config;
  return 6.0 * static_cast<double>(layout.matmul_parameter_count()) +
         12.0 * static_cast<double>(c.num_layers * c.num_heads * c.head_dim) * static_cast<double>(seq_len);
}

TrainSession::TrainSession(const Config& c, Comm& comm_)
    : config(c),
      comm(comm_),
      arch(model_config_for(c)),
      data(c.loss.type == "sft" ? std::optional<TokenDataset>(data_spec_for(c, arch.vocab_size)) : std::nullopt),
      eval(c.eval.path.empty() ? std::nullopt : std::optional<EvalSet>(std::in_place, c, arch.vocab_size)),
      cp_group(context_group(c, comm_)),
      model(initial_model(c, arch, comm_)),
      optimizer(c.optim, model, comm_),
      engine(model, comm_, engine_options_for(c),
             c.device.backend == "cuda" ? make_cuda_backend() : make_cpu_backend()),
      source(data ? make_token_source(*data, comm_, cp_group.get())
                  : make_rollout_source(c, arch.vocab_size, comm_, cp_group.get(),
                                        c.loss.router_replay ? arch.route_width() : 0)),
      sequence_pass(make_sequence_pass(engine.options().rl, engine.options().rl_params, engine, comm_,
                                       engine.options().max_tokens)),
      reference_pass(make_reference_pass(engine.options().rl, engine.options().rl_params, engine, model)) {
  if (cp_group) engine.backend().set_context_parallel(*cp_group);
  // Expert parallelism's group is the training world (ModelLayout checked it).
  if (c.model.expert_parallel > 1) engine.backend().set_expert_parallel(comm_);
  // Muon on a GPU: Newton–Schulz in bf16 on this rank's device (cuda/newton_schulz.hpp);
  // the CPU backend keeps the host fp32 one, the reference.
  if (c.device.backend == "cuda" && optimizer.muon())
    optimizer.muon()->set_orthogonalizer(make_cuda_orthogonalizer(optimizer.muon()->ns_capacity()));
  const auto t0 = Clock::now();
  state = make_training_state(engine.options(), model, optimizer, c.optim, engine.backend(),
                              static_cast<int>(c.device.cpu_threads));
  state->setup_s = seconds_since(t0);
  engine.set_state(*state);
  SHARDLM_CHECK(c.data.seq_len <= arch.max_position_embeddings,
                "data.seq_len = %lld is larger than the model supports (max_position_embeddings = %lld)",
                (long long)c.data.seq_len, (long long)arch.max_position_embeddings);
}

// batch, then per update: forward / loss / backward per micro-batch, clip,
// update. One path for every placement of the state and every source of
// tokens; an SFT step and an RL step with loss.epochs = loss.mini_batches = 1
// are one update.
StepStats TrainSession::step(int64_t step) {
  const auto t0 = Clock::now();
  StepStats s;
  s.step = step;
  s.rl = source->rl();
  // batch: this rank's micro-batches of each part; each part's loss is divided by its own global count
  const StepPlan batch = source->begin(step);
  s.tokens = batch.tokens_global, s.loss_tokens = batch.loss_tokens_global, s.rollout_wait_s = batch.rollout_wait_s;
  s.rollout_metrics = batch.rollout_metrics;
  s.data_s = seconds_since(t0) - batch.collective_s;
  s.compute_s = batch.collective_s;  // a collective's wait for the slowest rank is not data time
  // The KL term against the starting weights: their logprobs of every
  // micro-batch of the step, once for all its updates.
  s.compute_s += reference_pass->run(*source, step, batch);
  // The schedule counts steps: every update of the step takes the step's learning rate.
  s.lr = lr_at(config.sched, config.optim.lr, config.run.max_steps, step);
  // loss.epochs passes over the parts (loss.mini_batches), one update each.
  // The ratio stays against the rollout file's logprobs, the policy that
  // sampled: from the second update on the weights have moved and the clips act.
  const int64_t epochs = s.rl ? config.loss.epochs : 1;
  LossStats sums;  // over all ranks and updates
  for (int64_t epoch = 0; epoch < epochs; ++epoch)
    for (int64_t part = 0; part < int64_t(batch.parts.size()); ++part)
      s.updates.push_back(update(step, part, batch.parts[size_t(part)], s, sums));
  record_loss(s, sums);
  s.step_time_s = seconds_since(t0);
  return s;
}

UpdateStats TrainSession::update(int64_t step, int64_t part, const UpdatePlan& plan, StepStats& s, LossStats& sums) {
  UpdateStats u;
  const float grad_scale = plan.loss_divisor > 0 ? static_cast<float>(1.0 / plan.loss_divisor) : 0.0f;
  // The load-balancing loss joins as transformers' gradient accumulation has it:
  // the coefficient times the mean of the micro-batches' losses (every rank's).
  const double router_aux_scale = arch.router_aux_loss && plan.micro_batches > 0
      ? arch.router_aux_loss_coef / static_cast<double>(plan.micro_batches * comm.size()) : 0.0;
  const auto t_sync = Clock::now();
  state->begin_step(plan.micro_batches);  // gradients from zero, the backend's parameter copies current
  s.param_sync_s += seconds_since(t_sync);
  // A loss over whole samples (GSPO, sequence-level importance sampling): their
  // sums from a forward-only pass over the part's micro-batches first, at the
  // weights this update trains.
  s.compute_s += sequence_pass->run(*source, step, part, plan);
  LossStats mine;
  for (int64_t a = 0; a < plan.micro_batches; ++a) {
    const auto t_data = Clock::now();
    TokenBatch micro = reference_pass->attach(part, a, sequence_pass->attach(source->micro_batch(step, part, a)));
    micro.router_aux_scale = router_aux_scale;
    s.data_s += seconds_since(t_data);
    // The offloaded units' updates may start under the last backward (as if unclipped).
    if (a + 1 == plan.micro_batches) state->speculate(s.lr);
    const auto t_compute = Clock::now();
    mine += engine.forward_backward(micro, grad_scale);
    // The norm below waits for the device anyway; waiting here instead puts the
    // backward's device time in compute_s rather than in optimizer_s.
    if (a + 1 == plan.micro_batches) engine.backend().synchronize();
    s.compute_s += seconds_since(t_compute);
  }
  const auto t_opt = Clock::now();
  auto totals = mine.to_array();
  comm.all_reduce_sum(totals.data(), static_cast<int64_t>(totals.size()));
  const LossStats reduced = LossStats::from_array(totals);
  sums += reduced;
  // The loss is divided as its gradient was (the part's loss tokens, its
  // samples under loss.normalize = "sequence", or loss.normalize_constant).
  u.loss = reduced.loss / (plan.loss_divisor > 0 ? plan.loss_divisor : 1.0);
  if (reduced.router_aux_batches > 0)
    u.loss += arch.router_aux_loss_coef * reduced.router_aux_sum / static_cast<double>(reduced.router_aux_batches);
  const double tokens = reduced.loss_tokens > 0 ? static_cast<double>(reduced.loss_tokens) : 1.0;
  u.bound_fraction = static_cast<double>(reduced.masked_high + reduced.masked_low) / tokens;
  double sumsq = state->grad_sumsq();  // clip by the global norm: one all-reduce over the ranks' sums
  comm.all_reduce_sum(&sumsq, 1);
  if (step + 1 == injected_nan_step()) sumsq = std::nan("");
  u.grad_norm = std::sqrt(sumsq);
  apply_update(step, s.lr, u);  // on the device, the host, or the CPU per unit overlapping the next forward
  s.redone_steps = state->redone_steps();
  engine.backend().synchronize();
  s.optimizer_s += seconds_since(t_opt);
  return u;
}

void TrainSession::record_loss(StepStats& s, const LossStats& sums) const {
  // The updates' losses and norms, averaged (one update: its own, exactly).
  double loss = s.updates[0].loss, grad_norm = s.updates[0].grad_norm;
  for (size_t i = 1; i < s.updates.size(); ++i) loss += s.updates[i].loss, grad_norm += s.updates[i].grad_norm;
  const double updates = static_cast<double>(s.updates.size());
  s.loss = loss / updates;
  s.grad_norm = grad_norm / updates;
  s.skipped = std::any_of(s.updates.begin(), s.updates.end(), [](const UpdateStats& u) { return u.skipped; });
  // The per-token statistics over every update's loss tokens (zero sums under the SFT loss).
  const double tokens = sums.loss_tokens > 0 ? static_cast<double>(sums.loss_tokens) : 1.0;
  s.entropy = sums.entropy_sum / tokens;
  s.mismatch_kl = sums.mismatch_kl_sum / tokens;
  const double moved = static_cast<double>(sums.masked_high + sums.masked_low) / tokens;
  const bool clipped = config.loss.objective != "masked";  // the bound is a clip: clipped, gspo, cispo
  s.masked_high = clipped ? 0.0 : static_cast<double>(sums.masked_high) / tokens;
  s.masked_low = clipped ? 0.0 : static_cast<double>(sums.masked_low) / tokens;
  s.masked_fraction = clipped ? 0.0 : moved;
  s.clip_fraction = clipped ? moved : 0.0;
  s.advantage = sums.advantage_sum / tokens;
  s.is_ratio = sums.is_ratio_sum / tokens;
  s.is_capped_fraction = static_cast<double>(sums.is_capped) / tokens;
  s.is_masked_fraction = static_cast<double>(sums.is_masked) / tokens;
  s.ref_kl = sums.ref_kl_sum / tokens;
  s.router_aux = sums.router_aux_batches > 0;
  s.router_aux_loss = s.router_aux ? sums.router_aux_sum / static_cast<double>(sums.router_aux_batches) : 0.0;
}

void TrainSession::apply_update(int64_t step, double lr, UpdateStats& u) {
  if (!std::isfinite(u.grad_norm) || !std::isfinite(u.loss)) {  // NaN/Inf: no update
    u.skipped = true;
    state->discard();  // what was updated under the backward goes back
    ++bad_steps_total;
    SHARDLM_CHECK(++bad_steps_in_a_row < config.run.max_bad_steps,
                  "step %lld: loss or gradient is NaN/Inf for %lld steps in a row (run.max_bad_steps = %lld); "
                  "lower optim.lr or check the data",
                  (long long)step + 1, (long long)bad_steps_in_a_row, (long long)config.run.max_bad_steps);
    return;
  }
  bad_steps_in_a_row = 0;
  const double max_norm = config.optim.max_norm;
  const float clip = (max_norm > 0 && u.grad_norm > max_norm) ? static_cast<float>(max_norm / (u.grad_norm + 1e-6)) : 1.0f;
  state->update(lr, clip);
}

bool TrainSession::eval_due(int64_t steps_done) const {
  if (!eval) return false;
  const int64_t interval = config.eval.interval;
  return (interval > 0 && steps_done % interval == 0) || (config.eval.at_end && steps_done == config.run.max_steps);
}

void TrainSession::evaluate(StepStats& stats) {
  const EvalResult r = eval->evaluate(engine, comm, cp_group.get());
  stats.evaluated = true;
  stats.eval_loss = r.loss;
  stats.eval_loss_tokens = r.loss_tokens;
  stats.eval_s = r.seconds;
}

}  // namespace shardlm
