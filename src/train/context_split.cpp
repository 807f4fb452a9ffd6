// context_split.cpp — the load-balanced split of a micro-batch over a context-parallel group.
#include "train/context_split.hpp"

#include "shardlm/error.hpp"

namespace shardlm {

std::vector<int32_t> context_share_indices(int64_t rows, int64_t seq_len, int cp_rank, int cp_size) {
  SHARDLM_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, "internal: context-parallel rank %d of %d",
                cp_rank, cp_size);
  SHARDLM_CHECK(seq_len % (2 * cp_size) == 0,
                "data.seq_len = %lld does not split into 2 x model.context_parallel = %d equal chunks",
                (long long)seq_len, 2 * cp_size);
  const int64_t chunk = seq_len / (2 * cp_size);
  std::vector<int32_t> index;
  index.reserve(size_t(rows * 2 * chunk));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c : {int64_t(cp_rank), int64_t(2 * cp_size - 1 - cp_rank)})
      for (int64_t t = 0; t < chunk; ++t) index.push_back(int32_t(r * seq_len + c * chunk + t));
  return index;
}

TokenBatch ContextShare::take(const MicroBatch& full) {
  if (full.rows != rows_ || full.seq_len != seq_len_) {
    rows_ = full.rows, seq_len_ = full.seq_len;
    index_ = context_share_indices(rows_, seq_len_, cp_rank_, cp_size_);
    for (auto* v : {&tokens_, &targets_, &positions_, &seq_ids_}) v->resize(index_.size());
    weights_.resize(index_.size());
  }
  for (size_t i = 0; i < index_.size(); ++i) {
    const int32_t at = index_[i];
    tokens_[i] = full.tokens[size_t(at)];
    targets_[i] = full.targets[size_t(at)];
    weights_[i] = full.weights[size_t(at)];
    positions_[i] = full.positions[size_t(at)];
    seq_ids_[i] = full.seq_ids[size_t(at)];
  }
  TokenBatch b;
  b.N = int64_t(index_.size());
  b.advantages = b.inference_logprobs = b.temperatures = nullptr;
  b.tokens = tokens_.data();
  b.targets = targets_.data();
  b.weights = weights_.data();
  b.positions = positions_.data();
  b.seq_ids = seq_ids_.data();
  b.token_index = index_.data();
  return b;
}

TokenBatch ContextShare::take(const RlMicroBatch& full, const float* sampling_logprobs) {
  // A model of experts refuses context parallelism (moe_deck_error), so router replay's routes never get here.
  SHARDLM_CHECK(full.routes.empty(), "internal: router replay's routes in a context-parallel micro-batch");
  TokenBatch b = take(full.batch);
  auto gather = [&](auto& share, const auto* whole) {
    share.resize(index_.size());
    for (size_t i = 0; i < index_.size(); ++i) share[i] = whole[size_t(index_[i])];
    return share.data();
  };
  b.advantages = gather(advantages_, full.advantages.data());
  b.inference_logprobs = gather(inference_logprobs_, full.inference_logprobs.data());
  b.sampling_logprobs = sampling_logprobs ? gather(sampling_logprobs_, sampling_logprobs) : nullptr;
  b.temperatures = gather(temperatures_, full.temperatures.data());
  b.sample_ids = gather(sample_ids_, full.sample_ids.data());
  return b;
}

}  // namespace shardlm
