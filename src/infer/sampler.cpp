// sampler.cpp — temperature / top-k / top-p sampling from counter-based draws.
#include "infer/sampler.hpp"

#include <algorithm>
#include <cmath>

#include "data/order.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

std::string sampling_params_error(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0)
    return fmt("--temperature %g must be 0 (greedy) or positive", p.temperature);
  if (p.top_k < 0) return fmt("--top-k %lld must be 0 (off) or positive", (long long)p.top_k);
  if (!(p.top_p > 0 && p.top_p <= 1)) return fmt("--top-p %g must be in (0, 1] (1 = off)", p.top_p);
  return "";
}

double uniform_draw(uint64_t seed, const DrawKey& key) {
  // Each coordinate mixed in turn, with distinct odd constants so that no two
  // keys that differ in one coordinate can cancel; 53 bits give a double in [0, 1).
  uint64_t h = data::mix64(seed ^ 0x5851F42D4C957F2Dull);
  h = data::mix64(h ^ (static_cast<uint64_t>(key.prompt) * 0x9E3779B97F4A7C15ull));
  h = data::mix64(h ^ (static_cast<uint64_t>(key.sample) * 0xC2B2AE3D27D4EB4Full));
  h = data::mix64(h ^ (static_cast<uint64_t>(key.position) * 0x165667B19E3779F9ull));
  return double(h >> 11) * 0x1.0p-53;
}

Sampler::Sampler(const SamplingParams& params, int64_t vocab_size) : params_(params), V_(vocab_size) {
  if (std::string e = sampling_params_error(params); !e.empty()) SHARDLM_FAIL("%s", e.c_str());
  order_.resize(size_t(V_));
  weight_.resize(size_t(V_));
}

double Sampler::truncate(const float* logits) {
  // Greedy: the first largest logit.
  if (params_.temperature == 0) {
    int32_t best = 0;
    for (int64_t v = 1; v < V_; ++v)
      if (logits[v] > logits[best]) best = static_cast<int32_t>(v);
    order_[0] = best;
    weight_[size_t(best)] = 1.0;
    kept_ = 1;
    return 1.0;
  }
  float m = logits[0];
  for (int64_t v = 1; v < V_; ++v) m = std::max(m, logits[v]);
  for (int64_t v = 0; v < V_; ++v) {
    order_[size_t(v)] = static_cast<int32_t>(v);
    weight_[size_t(v)] = std::exp((double(logits[v]) - double(m)) / params_.temperature);
  }
  // Most probable first, the lower id on ties: a strict total order, so the
  // kept set never depends on the sort's implementation.
  const auto before = [&](int32_t a, int32_t b) {
    return weight_[size_t(a)] != weight_[size_t(b)] ? weight_[size_t(a)] > weight_[size_t(b)] : a < b;
  };
  kept_ = V_;
  if (params_.top_k > 0 && params_.top_k < V_) {
    std::partial_sort(order_.begin(), order_.begin() + params_.top_k, order_.end(), before);
    kept_ = params_.top_k;
  } else if (params_.top_p < 1) {
    std::sort(order_.begin(), order_.end(), before);
  }
  double mass = 0;
  for (int64_t i = 0; i < kept_; ++i) mass += weight_[size_t(order_[size_t(i)])];
  if (params_.top_p < 1) {
    const double want = params_.top_p * mass;
    double sum = 0;
    int64_t i = 0;
    while (i < kept_) {
      sum += weight_[size_t(order_[size_t(i)])];
      ++i;
      if (sum >= want) break;
    }
    kept_ = i;
    mass = sum;
  }
  return mass;
}

Sampled Sampler::sample(const float* logits, const DrawKey& key) {
  const double mass = truncate(logits);
  const double target = uniform_draw(params_.seed, key) * mass;
  double sum = 0;
  int32_t token = order_[size_t(kept_ - 1)];  // rounding can leave target past the last partial sum
  for (int64_t i = 0; i < kept_; ++i) {
    sum += weight_[size_t(order_[size_t(i)])];
    if (target < sum) {
      token = order_[size_t(i)];
      break;
    }
  }
  return {token, float(std::log(weight_[size_t(token)] / mass))};
}

void Sampler::distribution(const float* logits, std::vector<int32_t>& ids, std::vector<double>& probs) {
  const double mass = truncate(logits);
  ids.assign(order_.begin(), order_.begin() + kept_);
  probs.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) probs[i] = weight_[size_t(ids[i])] / mass;
}

}  // namespace shardlm
