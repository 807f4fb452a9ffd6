// train.cpp — the session's state and one optimizer step.
#include "shardlm/train.hpp"

#include <chrono>
#include <cmath>

#include "shardlm/error.hpp"
#include "shardlm/hf.hpp"

namespace shardlm {

ModelConfig model_config_for(const Config& config) {
  if (config.model.hf.empty()) return config.model.arch;
  return read_hf_config(config.model.hf);
}

EngineOptions engine_options_for(const Config& config) {
  EngineOptions o;
  o.max_tokens = config.data.micro_batch * config.data.seq_len;
  o.chunk_tokens = config.loss.chunk_tokens;
  o.reshard_after_forward = config.model.reshard_after_forward;
  o.checkpoint_activations = config.model.activation_checkpointing == "full";
  return o;
}

namespace {

DataSpec data_spec(const Config& c, int64_t vocab) {
  DataSpec s;
  s.path = c.data.path;
  s.seq_len = c.data.seq_len;
  s.micro_batch = c.data.micro_batch;
  s.global_batch = c.data.global_batch;
  s.seed = static_cast<uint64_t>(c.run.seed);
  s.vocab_size = vocab;
  return s;
}

ShardedModel initial_model(const Config& c, const ModelConfig& arch, const Comm& comm) {
  ShardedModel model(arch, comm.rank(), comm.size());
  if (c.model.hf.empty()) model.init_seeded(static_cast<uint64_t>(c.run.seed), c.model.init_std);
  else model.load_hf(SafetensorsReader(c.model.hf));
  return model;
}

}  // namespace

TokenBatch token_batch(const MicroBatch& mb) {
  return {mb.rows * mb.seq_len, mb.tokens.data(), mb.targets.data(), mb.weights.data(), mb.positions.data(),
          mb.seq_ids.data()};
}

TrainSession::TrainSession(const Config& c, Comm& comm_)
    : config(c),
      comm(comm_),
      arch(model_config_for(c)),
      data(data_spec(c, arch.vocab_size)),
      model(initial_model(c, arch, comm_)),
      optimizer(c.optim, model),
      engine(model, comm_, engine_options_for(c)) {
  SHARDLM_CHECK(c.data.seq_len <= arch.max_position_embeddings,
                "data.seq_len = %lld is larger than the model supports (max_position_embeddings = %lld)",
                (long long)c.data.seq_len, (long long)arch.max_position_embeddings);
}

StepStats TrainSession::step(int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  StepStats s;
  s.step = step;

  // batch: the step's global batch; losses are divided by its global loss-token count
  const StepCounts counts = data.step_counts(step);
  s.tokens = counts.tokens;
  s.loss_tokens = counts.loss_tokens;
  const float grad_scale = counts.loss_tokens > 0 ? 1.0f / static_cast<float>(counts.loss_tokens) : 0.0f;

  // forward / loss / backward per micro-batch; gradients accumulate in the shards
  model.zero_grads();
  double loss_sum = 0.0;
  const int64_t accum = data.micro_batches_per_rank(comm.size());
  for (int64_t a = 0; a < accum; ++a) {
    data.micro_batch(step, static_cast<int>(a), comm.rank(), comm.size(), micro);
    loss_sum += engine.forward_backward(token_batch(micro), grad_scale);
  }
  comm.all_reduce_sum(&loss_sum, 1);
  s.loss = counts.loss_tokens > 0 ? loss_sum / static_cast<double>(counts.loss_tokens) : 0.0;

  // clip by global norm (one all-reduce over shard norms); NaN/Inf skips the update
  s.grad_norm = global_grad_norm(model, comm);
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
    // optimizer step on shards
    optimizer.step(s.lr, clip);
  }
  s.step_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

}  // namespace shardlm
