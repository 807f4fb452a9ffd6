// step_source.cpp — SFT token files and RL rollout files as sources of steps;
// see src/train/step_source.hpp.
#include "train/step_source.hpp"

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>

#include "shardlm/comm.hpp"
#include "shardlm/runtime.hpp"
#include "train/context_split.hpp"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The logprobs of the distribution each token was sampled from (top-k / top-p
// applied), when the rollout file carries them; nullptr: the loss takes the
// inference logprobs for them.
template <class RlBatch>
const float* sampling_logprobs(const RlBatch& mb) {
  if constexpr (requires { mb.sampling_logprobs.data(); })
    return mb.sampling_logprobs.empty() ? nullptr : mb.sampling_logprobs.data();
  else
    return nullptr;
}

TokenBatch token_batch(const RlMicroBatch& mb) {
  TokenBatch b = token_batch(mb.batch);
  b.advantages = mb.advantages.data();
  b.inference_logprobs = mb.inference_logprobs.data();
  b.sampling_logprobs = sampling_logprobs(mb);
  b.temperatures = mb.temperatures.data();
  b.sample_ids = mb.sample_ids.data();
  b.routes = mb.routes.empty() ? nullptr : mb.routes.data();
  return b;
}

class TokenSource final : public StepSource {
 public:
  TokenSource(TokenDataset& data, Comm& comm, Comm* cp_group)
      : data_(data), comm_(comm), cp_size_(cp_group ? cp_group->size() : 1),
        cp_rank_(cp_group ? cp_group->rank() : 0), dp_rank_(comm.rank() / cp_size_), dp_world_(comm.size() / cp_size_) {
    if (cp_size_ > 1) share_.emplace(cp_rank_, cp_size_);
  }
  bool rl() const override { return false; }

  StepPlan begin(int64_t step) override {
    // Each data-parallel group counts its own rows (their loss_mask is read
    // with them, one step ahead by the prefetch); one all-reduce gives the
    // step's totals. A group's rows are counted once, by its first rank.
    const StepCounts mine = data_.rank_step_counts(step, dp_rank_, dp_world_);
    int64_t totals[2] = {cp_rank_ == 0 ? mine.loss_tokens : 0, cp_rank_ == 0 ? mine.tokens : 0};
    const auto t_reduce = Clock::now();
    comm_.all_reduce_sum(totals, 2);
    StepPlan plan;
    plan.collective_s = seconds_since(t_reduce);
    plan.loss_tokens_global = totals[0];
    plan.tokens_global = totals[1];
    plan.parts = {{.micro_batches = data_.micro_batches_per_rank(dp_world_), .tokens_global = totals[1],
                   .loss_tokens_global = totals[0], .loss_divisor = double(totals[0])}};
    return plan;
  }

  TokenBatch micro_batch(int64_t step, int64_t part, int64_t index) override {
    SHARDLM_CHECK(part == 0, "internal: part %lld of an SFT step (one part)", (long long)part);
    data_.micro_batch(step, static_cast<int>(index), dp_rank_, dp_world_, micro_);
    return share_ ? share_->take(micro_) : token_batch(micro_);
  }

 private:
  TokenDataset& data_;
  Comm& comm_;
  const int cp_size_, cp_rank_;   // this rank's place in its context-parallel group (1, 0 without)
  const int dp_rank_, dp_world_;  // its data-parallel group and their number
  std::optional<ContextShare> share_;  // context parallelism: this rank's share of each micro-batch
  MicroBatch micro_;  // reused every micro-batch (the group's whole rows)
};

class RolloutSource final : public StepSource {
 public:
  RolloutSource(const Config& config, int64_t vocab_size, Comm& comm, Comm* cp_group, int64_t route_width)
      : data_(config.data), loss_(config.loss), per_sequence_(config.loss.normalize == "sequence"),
        vocab_size_(vocab_size), route_width_(route_width), comm_(comm),
        cp_size_(cp_group ? cp_group->size() : 1), dp_rank_(comm.rank() / cp_size_), dp_world_(comm.size() / cp_size_) {
    if (cp_size_ > 1) share_.emplace(cp_group->rank(), cp_size_);
    parts_.resize(size_t(config.loss.mini_batches));
  }
  bool rl() const override { return true; }

  // Every rank reads the whole file and packs the same assignment: the counts
  // need no communication. Under context parallelism the samples go to the
  // data-parallel groups, whose ranks pack the same rows and take their shares.
  // With loss.mini_batches > 1 each part of the file is normalised and packed
  // as a file of its own would be.
  StepPlan begin(int64_t step) override {
    StepPlan plan;
    const auto wait0 = Clock::now();
    const std::string path = wait_for_rollouts(data_.rollout_dir, step, data_.rollout_timeout_s,
                                               [&](const std::string& m) {
                                                 if (comm_.rank() == 0) std::printf("%s\n", m.c_str()), std::fflush(stdout);
                                               }, 10.0, own_job_id_);
    plan.rollout_wait_s = seconds_since(wait0);
    RolloutBatch file = read_agreed(path);
    check_rollout_step(file, step, data_.max_async);
    take_routes(file);
    plan.rollout_metrics = std::move(file.metrics);
    const int64_t parts = int64_t(parts_.size());
    SHARDLM_CHECK(file.samples() >= parts,
                  "rollout file '%s' holds %lld samples, fewer than loss.mini_batches = %lld: every update needs a "
                  "sample at least; lower loss.mini_batches to at most %lld or write more samples per step",
                  path.c_str(), (long long)file.samples(), (long long)parts, (long long)file.samples());
    plan.parts.resize(size_t(parts));
    for (int64_t k = 0; k < parts; ++k) {
      RolloutBatch part = parts == 1 ? std::move(file) : rollout_part(file, k, parts);
      const int64_t samples_with_loss = per_sequence_ ? normalize_per_sequence(part) : 0;
      RankRollouts& packed = parts_[size_t(k)];
      packed = pack_rollouts(part, data_.seq_len, data_.micro_batch, dp_rank_, dp_world_);
      UpdatePlan& u = plan.parts[size_t(k)];
      u.micro_batches = static_cast<int64_t>(packed.micro_batches.size());
      u.loss_tokens_global = packed.loss_tokens_global;
      u.loss_divisor = rl_loss_divisor(loss_, samples_with_loss, packed.loss_tokens_global);
      u.tokens_global = packed.tokens_global;
      u.samples = part.samples();
      plan.loss_tokens_global += u.loss_tokens_global;
      plan.tokens_global += u.tokens_global;
    }
    return plan;
  }

  // Every trainer rank reads the file itself, and all must have read the same
  // one: a file replaced while they read it (rollouts written from outside the
  // job, a new version renamed over the old) gives the ranks different
  // versions, silently different data when the micro-batch counts agree.
  // Rank 0's fingerprint decides; on a difference every rank reads again (a
  // rename is whole, so the next read is of one version).
  RolloutBatch read_agreed(const std::string& path) {
    constexpr int kReads = 5;
    for (int read = 1;; ++read) {
      RolloutBatch file = read_rollouts(path, vocab_size_);
      // tests: the rank reads the other version the first time (SHARDLM_FAULT=rollout_other_version@R)
      if (read == 1 && !file.advantages.empty() && fault_armed("rollout_other_version")) file.advantages[0] += 1.0f;
      uint64_t rank0 = rollout_fingerprint(file);
      const uint64_t mine = rank0;
      comm_.broadcast(&rank0, sizeof rank0, 0);
      int64_t differ = mine != rank0 ? 1 : 0;
      comm_.all_reduce_sum(&differ, 1);
      if (differ == 0) return file;
      SHARDLM_CHECK(read < kReads, "the trainer ranks read different versions of %s %d times: it is being replaced "
                    "while they read it (a rollout file must be renamed into place once, whole)", path.c_str(), kReads);
      if (comm_.rank() == 0)
        std::printf("rollouts: %lld of %d trainer ranks read another version of %s than rank 0 (replaced while they "
                    "read it): every rank reads it again\n", (long long)differ, comm_.size(), path.c_str()),
            std::fflush(stdout);
    }
  }

  // loss.router_replay: the file's routes, of this model's width, go to the
  // forward; off: a file's routes are dropped (the forward takes its own top-k).
  void take_routes(RolloutBatch& file) const {
    if (route_width_ == 0) {
      file.routes.clear();
      file.route_width = 0;
      return;
    }
    SHARDLM_CHECK(file.route_width > 0,
                  "rollout file '%s' has no dataset 'routes', which loss.router_replay = true replays: the inference "
                  "ranks record them when their deck sets loss.router_replay too (see docs/rollouts.md); regenerate "
                  "the file so, or set loss.router_replay = false",
                  file.path.c_str());
    SHARDLM_CHECK(file.route_width == route_width_,
                  "rollout file '%s': 'routes' has rows of %lld experts, but this model routes each token to %lld "
                  "(its layers of experts x num_experts_per_tok): was it written for another model?",
                  file.path.c_str(), (long long)file.route_width, (long long)route_width_);
  }

  TokenBatch micro_batch(int64_t, int64_t part, int64_t index) override {
    // The inference ranks that wait for this job's next weights and ask where
    // this rank is hear it is busy (shardlm/comm.hpp).
    answer_collective_queries("training");
    const RlMicroBatch& mb = parts_[size_t(part)].micro_batches[size_t(index)];
    return share_ ? share_->take(mb, sampling_logprobs(mb)) : token_batch(mb);
  }

 private:
  const DataSection data_;
  // The job's id when its own inference ranks write the files (only those are
  // taken); 0 when they come from outside the job (any file is taken).
  const uint64_t own_job_id_ = job_generators() > 0 ? job_id() : 0;
  const LossSection loss_;
  const bool per_sequence_;  // loss.normalize = "sequence"
  const int64_t vocab_size_;
  const int64_t route_width_;  // loss.router_replay: the model's; 0: off
  Comm& comm_;
  const int cp_size_, dp_rank_, dp_world_;  // context parallelism: the group size, this rank's group, their number
  std::optional<ContextShare> share_;       // context parallelism: this rank's share of each micro-batch
  std::vector<RankRollouts> parts_;  // this step's micro-batches of this rank's group, per part (loss.mini_batches)
};

}  // namespace

RolloutBatch rollout_part(const RolloutBatch& file, int64_t part, int64_t parts) {
  const int64_t S = file.samples();
  SHARDLM_CHECK(parts >= 1 && part >= 0 && part < parts && S >= parts,
                "internal: part %lld of %lld of a batch of %lld samples", (long long)part, (long long)parts,
                (long long)S);
  const int64_t first = S * part / parts, last = S * (part + 1) / parts;  // samples [first, last)
  const int64_t t0 = file.offsets[size_t(first)], t1 = file.offsets[size_t(last)];
  RolloutBatch b;
  b.path = file.path;
  b.step = file.step;
  b.policy_step = file.policy_step;
  b.advantages_per_sample = file.advantages_per_sample;
  // Per-token arrays: the part's range (an optional one left empty).
  auto tokens = [&]<class T>(const std::vector<T>& v) {
    return v.empty() ? std::vector<T>() : std::vector<T>(v.begin() + t0, v.begin() + t1);
  };
  b.tokens = tokens(file.tokens);
  b.loss_mask = tokens(file.loss_mask);
  b.advantages = tokens(file.advantages);
  b.inference_logprobs = tokens(file.inference_logprobs);
  b.sampling_logprobs = tokens(file.sampling_logprobs);
  b.route_width = file.route_width;
  if (file.route_width > 0)
    b.routes.assign(file.routes.begin() + t0 * file.route_width, file.routes.begin() + t1 * file.route_width);
  b.loss_weight = tokens(file.loss_weight);
  b.temperature.assign(file.temperature.begin() + first, file.temperature.begin() + last);
  b.offsets.reserve(size_t(last - first + 1));
  for (int64_t s = first; s <= last; ++s) b.offsets.push_back(file.offsets[size_t(s)] - t0);
  // The loss tokens as read_rollouts counts them: a sample's first token is never a target.
  for (int64_t s = 0; s < b.samples(); ++s)
    for (int64_t t = b.offsets[size_t(s)] + 1; t < b.offsets[size_t(s + 1)]; ++t)
      b.loss_tokens += b.loss_mask[size_t(t)] != 0 && b.loss_weight[size_t(t)] > 0.0f;
  return b;
}

double rl_loss_divisor(const LossSection& loss, int64_t samples_with_loss, int64_t loss_tokens) {
  if (loss.normalize == "sequence") return double(samples_with_loss);
  if (loss.normalize == "constant") return loss.normalize_constant;
  return double(loss_tokens);
}

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

std::unique_ptr<StepSource> make_token_source(TokenDataset& data, Comm& comm, Comm* cp_group) {
  return std::make_unique<TokenSource>(data, comm, cp_group);
}

std::unique_ptr<StepSource> make_rollout_source(const Config& config, int64_t vocab_size, Comm& comm,
                                               Comm* cp_group, int64_t route_width) {
  return std::make_unique<RolloutSource>(config, vocab_size, comm, cp_group, route_width);
}

}  // namespace shardlm
