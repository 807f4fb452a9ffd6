// sampler.hpp — choosing the next token from a row of logits: temperature,
// top-k, top-p, greedy, drawn from a counter-based generator, with the token's
// log-probability under the distribution it was drawn from and under the model.
//
// Owns: SamplingParams, the counter-based uniform draw (a function of (seed,
// prompt, sample, position) only, so a token never depends on which batch or
// slot its sequence sat in), the truncation (which tokens the sampling
// distribution keeps, and their probabilities) and Sampler, whose scratch is
// sized once for the vocabulary. Must not know: the model, caches, MPI, files.
//
// Order of the transforms, as Hugging Face and vLLM apply them: logits /
// temperature, then top-k (the k largest; ties broken by the lower id), then
// top-p over what top-k left (the fewest most probable tokens whose
// probability sums to at least top_p; at least one), renormalised.
// temperature = 0 is greedy: the largest logit (the lowest id on ties), a
// point mass (its sampling logprob is 0).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm {

struct SamplingParams {
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // 1: off
  uint64_t seed = 0;
};
// "" when the values are usable, else a sentence naming the bad one.
std::string sampling_params_error(const SamplingParams& p);

// Which draw: the same key gives the same uniform in [0, 1) on every machine.
struct DrawKey {
  int64_t prompt = 0;    // index of the prompt in the prompt file
  int64_t sample = 0;    // 0 .. n-1 for that prompt
  int64_t position = 0;  // index of the generated token (0 = first after the prompt)
};
double uniform_draw(uint64_t seed, const DrawKey& key);

struct Sampled {
  int32_t token = -1;
  float sampling_logprob = 0;  // log p of the token under the distribution it was drawn from
};

class Sampler {
 public:
  Sampler(const SamplingParams& params, int64_t vocab_size);
  // Draws a token from logits (V) with the uniform of `key`.
  Sampled sample(const float* logits, const DrawKey& key);
  // The truncated, renormalised distribution for logits (V): `ids` and
  // `probs` (same length, most probable first when top-k or top-p is on, else
  // in id order). Greedy: the argmax alone with probability 1.
  void distribution(const float* logits, std::vector<int32_t>& ids, std::vector<double>& probs);
  const SamplingParams& params() const { return params_; }

 private:
  // Fills kept_ (ids) and weight_ (unnormalised, by id) and returns the kept mass.
  double truncate(const float* logits);
  SamplingParams params_;
  int64_t V_;
  std::vector<int32_t> order_;  // (V) candidate ids
  std::vector<double> weight_;  // (V) exp((logit - max) / T) by id
  int64_t kept_ = 0;            // order_[0 .. kept_) is the kept set
};

}  // namespace shardlm
