// train.cpp — the session's state and one optimizer step.
#include "train/train.hpp"

#include <chrono>
#include <cstdio>
#include <cmath>

#include "shardlm/error.hpp"
#include "model/hf.hpp"

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
  return arch;
}

EngineOptions engine_options_for(const Config& config) {
  EngineOptions o;
  o.rl = config.loss.type == "rl";
  o.rl_params = {config.loss.mask_high, config.loss.mask_low, config.loss.kl_coef, config.loss.ce_coef};
  o.max_tokens = config.data.micro_batch * config.data.seq_len;
  o.chunk_tokens = config.loss.chunk_tokens;
  o.reshard_after_forward = config.model.reshard_after_forward;
  o.checkpoint_activations = config.model.activation_checkpointing != "none";
  o.save_attention = config.model.activation_checkpointing == "selective";
  o.save_attention_layers = config.model.selective_layers;
  // On a GPU the fp32 state lives on the device unless it is offloaded to the host.
  o.device_state = config.device.backend == "cuda" && !config.model.optim_cpu_offload;
  o.offload_pipeline = config.device.backend == "cuda" && config.model.optim_cpu_offload && config.optim.name != "muon";
  o.offload_device_grads = o.offload_pipeline && config.model.optim_offload_grads == "device";
  o.reduce_bf16 = config.model.reduce_dtype == "bf16";
  // "auto" is resolved by select_comm() at start-up; a session built without it
  // (tests, tools) on one GPU per rank uses NCCL.
  o.comm_backend = config.comm.backend == "auto" ? "nccl" : config.comm.backend;
  o.comm_timeout_s = config.comm.timeout_s;
  o.attention = config.device.attention;
  o.deterministic = config.run.deterministic;
  return o;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }


ShardedModel initial_model(const Config& c, const ModelConfig& arch, const Comm& comm) {
  // Device-resident state, and the offload pipeline with optim_offload_grads =
  // "device", accumulate gradients in device shards only; the host ones would
  // never be read (checkpoints hold no gradients): none are made.
  const EngineOptions o = engine_options_for(c);
  const bool host_grads = !o.device_state && !o.offload_device_grads;
  ShardedModel model(arch, comm.rank(), comm.size(), host_grads);
  if (c.model.hf.empty()) model.init_seeded(static_cast<uint64_t>(c.run.seed), c.model.init_std);
  else model.load_hf(SafetensorsReader(c.model.hf));
  return model;
}

}  // namespace

DataSpec data_spec_for(const Config& c, int64_t vocab) {
  DataSpec s;
  s.paths = c.data.path;
  s.weights = c.data.weights;
  s.shuffle = c.data.shuffle;
  s.seq_len = c.data.seq_len;
  s.micro_batch = c.data.micro_batch;
  s.global_batch = c.data.global_batch;
  s.seed = static_cast<uint64_t>(c.run.seed);
  s.vocab_size = vocab;
  return s;
}

double flops_per_token(const ModelLayout& layout, int64_t seq_len) {
  const ModelConfig& c = layout.config;
  return 6.0 * static_cast<double>(layout.matmul_parameter_count()) +
         12.0 * static_cast<double>(c.num_layers * c.num_heads * c.head_dim) * static_cast<double>(seq_len);
}

TokenBatch token_batch(const MicroBatch& mb) {
  TokenBatch b;
  b.N = mb.rows * mb.seq_len;
  b.tokens = mb.tokens.data();
  b.targets = mb.targets.data();
  b.weights = mb.weights.data();
  b.positions = mb.positions.data();
  b.seq_ids = mb.seq_ids.data();
  return b;
}

TokenBatch token_batch(const RlMicroBatch& mb) {
  TokenBatch b = token_batch(mb.batch);
  b.advantages = mb.advantages.data();
  b.inference_logprobs = mb.inference_logprobs.data();
  b.temperatures = mb.temperatures.data();
  return b;
}

TrainSession::TrainSession(const Config& c, Comm& comm_)
    : config(c),
      comm(comm_),
      arch(model_config_for(c)),
      data(c.loss.type == "sft" ? std::optional<TokenDataset>(data_spec_for(c, arch.vocab_size)) : std::nullopt),
      eval(c.eval.path.empty() ? std::nullopt : std::optional<EvalSet>(std::in_place, c, arch.vocab_size)),
      model(initial_model(c, arch, comm_)),
      optimizer(c.optim, model, comm_),
      engine(model, comm_, engine_options_for(c),
             c.device.backend == "cuda" ? make_cuda_backend() : make_cpu_backend()) {
  // Muon on a GPU: Newton–Schulz in bf16 on this rank's device (cuda_newton_schulz.hpp);
  // the CPU backend keeps the host fp32 one, the reference.
  if (c.device.backend == "cuda" && optimizer.muon())
    optimizer.muon()->set_orthogonalizer(make_cuda_orthogonalizer(optimizer.muon()->ns_capacity()));
  if (engine.options().device_state) {
    Backend::OptimSpec spec{c.optim.name, c.optim.beta1, c.optim.beta2, c.optim.eps, c.optim.momentum,
                            optimizer.states()};
    std::vector<std::vector<Backend::Segment>> segments;
    for (const auto& u : model.layout.units) {
      segments.emplace_back();
      for (const auto& s : model.segments(u))
        segments.back().push_back({s.shard_offset, s.count,
                                   s.param->weight_decay() ? static_cast<float>(c.optim.weight_decay) : 0.0f});
    }
    const auto t0 = Clock::now();
    engine.backend().state_attach(model.layout, segments, spec);
    push_state();
    state_setup_s = seconds_since(t0);
  }
  // Offload on a GPU: the host-side pipeline (AdamW/SGD; Muon's collective step
  // keeps the plain host path).
  if (engine.options().offload_pipeline) {
    const auto t0 = Clock::now();
    offload = std::make_unique<OffloadPipeline>(model, optimizer, engine.backend(),
                                                static_cast<int>(c.device.cpu_threads),
                                                engine.options().offload_device_grads);
    engine.set_offload(offload.get());
    state_setup_s = seconds_since(t0);
  }
  SHARDLM_CHECK(c.data.seq_len <= arch.max_position_embeddings,
                "data.seq_len = %lld is larger than the model supports (max_position_embeddings = %lld)",
                (long long)c.data.seq_len, (long long)arch.max_position_embeddings);
}

void TrainSession::pull_state() {
  if (offload) offload->finish();  // the host masters are final once the worker is idle
  if (!engine.options().device_state) return;
  for (size_t u = 0; u < model.layout.units.size(); ++u) {
    std::vector<float*> states;
    for (int i = 0; i < optimizer.states(); ++i) states.push_back(optimizer.state(i)[u].data());
    engine.backend().state_download(static_cast<int>(u), model.param[u].data(), states);
  }
}

void TrainSession::push_state() {
  if (offload) engine.sync_params();  // host masters changed outside the pipeline (a load)
  if (!engine.options().device_state) return;
  for (size_t u = 0; u < model.layout.units.size(); ++u) {
    std::vector<const float*> states;
    for (int i = 0; i < optimizer.states(); ++i) states.push_back(optimizer.state(i)[u].data());
    engine.backend().state_upload(static_cast<int>(u), model.param[u].data(), states);
  }
}

StepStats TrainSession::step(int64_t step) {
  const auto t0 = Clock::now();
  StepStats s;
  s.step = step;
  s.rl = config.loss.type == "rl";

  // batch: this rank's micro-batches of the step; losses are divided by the
  // step's global loss-token count, known without communication
  std::vector<TokenBatch> batches;
  int64_t loss_tokens_global = 0;
  double counts_reduce_s = 0;
  if (s.rl) {
    const auto wait0 = Clock::now();
    const std::string path = wait_for_rollouts(config.data.rollout_dir, step, config.data.rollout_timeout_s,
                                               [&](const std::string& m) {
                                                 if (comm.rank() == 0) std::printf("%s\n", m.c_str()), std::fflush(stdout);
                                               });
    s.rollout_wait_s = seconds_since(wait0);
    const RolloutBatch file = read_rollouts(path, arch.vocab_size);
    check_rollout_step(file, step, config.data.max_async);
    rollouts = pack_rollouts(file, config.data.seq_len, config.data.micro_batch, comm.rank(), comm.size());
    for (const auto& mb : rollouts.micro_batches) batches.push_back(token_batch(mb));
    loss_tokens_global = rollouts.loss_tokens_global;
    s.tokens = rollouts.tokens_global;
  } else {
    // Each rank counts its own rows (their loss_mask is read with them, one
    // step ahead by the prefetch); one all-reduce gives the step's totals.
    const StepCounts mine = data->rank_step_counts(step, comm.rank(), comm.size());
    int64_t totals[2] = {mine.loss_tokens, mine.tokens};
    // A collective: the wait for the slowest rank is not data time.
    const auto t_reduce = Clock::now();
    comm.all_reduce_sum(totals, 2);
    counts_reduce_s = seconds_since(t_reduce);
    loss_tokens_global = totals[0];
    s.tokens = totals[1];
  }
  s.loss_tokens = loss_tokens_global;
  const float grad_scale = loss_tokens_global > 0 ? 1.0f / static_cast<float>(loss_tokens_global) : 0.0f;

  s.data_s = seconds_since(t0) - counts_reduce_s;
  s.compute_s = counts_reduce_s;

  // forward / loss / backward per micro-batch; gradients accumulate in the shards
  const bool device_state = engine.options().device_state;
  const int64_t micro_batches = s.rl ? static_cast<int64_t>(batches.size()) : data->micro_batches_per_rank(comm.size());
  auto t_sync = Clock::now();
  // The backend's parameter copies follow the fp32 masters; the offload pipeline
  // uploads each unit itself after its update.
  if (!offload) engine.sync_params();
  s.param_sync_s = seconds_since(t_sync);
  if (device_state) engine.backend().state_zero_grads();
  else if (offload) offload->begin_step(micro_batches);  // the engine sums the micro-batches on the device
  else model.zero_grads();
  LossStats sums;
  for (int64_t a = 0; a < micro_batches; ++a) {
    auto t_data = Clock::now();
    if (!s.rl) data->micro_batch(step, static_cast<int>(a), comm.rank(), comm.size(), micro);
    s.data_s += seconds_since(t_data);
    auto t_compute = Clock::now();
    sums += engine.forward_backward(s.rl ? batches[a] : token_batch(micro), grad_scale);
    // The norm below waits for the device anyway; waiting here instead puts the
    // backward's device time in compute_s rather than in optimizer_s.
    if (a + 1 == micro_batches) engine.backend().synchronize();
    s.compute_s += seconds_since(t_compute);
  }
  auto t_opt = Clock::now();
  auto totals = sums.to_array();
  comm.all_reduce_sum(totals.data(), static_cast<int64_t>(totals.size()));
  sums = LossStats::from_array(totals);
  const double denom = loss_tokens_global > 0 ? static_cast<double>(loss_tokens_global) : 1.0;
  s.loss = sums.loss / denom;
  if (s.rl) {
    s.entropy = sums.entropy_sum / denom;
    s.mismatch_kl = sums.mismatch_kl_sum / denom;
    s.masked_high = static_cast<double>(sums.masked_high) / denom;
    s.masked_low = static_cast<double>(sums.masked_low) / denom;
    s.advantage = sums.advantage_sum / denom;
  }

  // clip by global norm (one all-reduce over shard norms); NaN/Inf skips the update
  if (device_state || offload) {
    double sumsq = offload ? engine.offload_grad_sumsq() : engine.backend().state_grad_sumsq();
    comm.all_reduce_sum(&sumsq, 1);
    s.grad_norm = std::sqrt(sumsq);
  } else {
    s.grad_norm = global_grad_norm(model, comm);
  }
  s.lr = lr_at(config.sched, config.optim.lr, config.run.max_steps, step);
  if (!std::isfinite(s.grad_norm) || !std::isfinite(s.loss)) {
    s.skipped = true;
    ++bad_steps_total;
    SHARDLM_CHECK(++bad_steps_in_a_row < config.run.max_bad_steps,
                  "step %lld: loss or gradient is NaN/Inf for %lld steps in a row (run.max_bad_steps = %lld); "
                  "lower optim.lr or check the data",
                  (long long)step + 1, (long long)bad_steps_in_a_row, (long long)config.run.max_bad_steps);
  } else {
    bad_steps_in_a_row = 0;
    const double max_norm = config.optim.max_norm;
    const float clip = (max_norm > 0 && s.grad_norm > max_norm) ? static_cast<float>(max_norm / (s.grad_norm + 1e-6)) : 1.0f;
    // optimizer step on shards (on the device when the state lives there)
    if (device_state) {
      engine.backend().state_step(s.lr, clip, optimizer.steps_taken() + 1);
      optimizer.set_steps_taken(optimizer.steps_taken() + 1);
    } else if (offload) {
      offload->update(s.lr, clip);  // runs on while the next step's forward starts
    } else {
      optimizer.step(s.lr, clip);
    }
  }
  engine.backend().synchronize();
  s.optimizer_s = seconds_since(t_opt);
  s.step_time_s = seconds_since(t0);
  return s;
}

bool TrainSession::eval_due(int64_t steps_done) const {
  if (!eval) return false;
  const int64_t interval = config.eval.interval;
  return (interval > 0 && steps_done % interval == 0) || (config.eval.at_end && steps_done == config.run.max_steps);
}

void TrainSession::evaluate(StepStats& stats) {
  const EvalResult r = eval->evaluate(engine, comm);
  stats.evaluated = true;
  stats.eval_loss = r.loss;
  stats.eval_loss_tokens = r.loss_tokens;
  stats.eval_s = r.seconds;
}

}  // namespace shardlm
