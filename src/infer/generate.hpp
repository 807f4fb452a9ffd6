// generate.hpp — sampling completions for a list of prompts with continuous
// batching: every slot of the decoder's cache holds one sequence; a sequence
// that stops frees its slot and the next prompt is prefilled into it, so the
// decode batch stays full while prompts remain.
//
// Owns: GenerateRequest, Completion (tokens, the three logprobs of each token,
// why it ended), GenerateOptions, generate(), and the planning of the
// decoder's limits from the prompts. Uses Decoder (forward, and the model's
// logprobs: on the CPU cpu::token_logprobs, the function the RL loss computes
// the trainer's logprobs with; on the GPU its counterpart on the device) and
// Sampler (the choice, on the host; a decoder that draws on its device, the
// GPU's, makes the same choice there from the same uniforms: Decoder::draw). Must not know: files, MPI, the
// tokenizer, which backend the decoder runs on.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "infer/decoder.hpp"
#include "infer/sampler.hpp"

namespace shardlm {

struct GenerateRequest {
  int64_t prompt = 0;                 // index in the prompt file (the draw key's prompt)
  int64_t sample = 0;                 // 0 .. n-1
  std::span<const int32_t> tokens;    // the prompt's ids
};

enum class Finish : uint8_t { Stop = 0, Length = 1 };
const char* finish_name(Finish f);  // "stop" | "length"

struct Completion {
  int64_t prompt = 0, sample = 0;
  std::vector<int32_t> tokens;             // generated ids; a stop id, when one ended it, is the last
  std::vector<float> sampling_logprobs;    // log p(token) under the distribution it was drawn from
                                           //   (temperature, top-k, top-p; 0 when greedy)
  std::vector<float> model_logprobs;       // log_softmax(logits)[token]: the model itself (temperature 1,
                                           //   nothing truncated), as the trainer's forward computes it
  std::vector<float> tempered_logprobs;    // log_softmax(logits / temperature)[token], nothing truncated:
                                           //   what the RL loss compares at that temperature (= model when greedy)
  Finish finish = Finish::Length;
};

struct GenerateOptions {
  SamplingParams sampling;
  int64_t max_new_tokens = 64;
  std::vector<int32_t> stop_ids;           // EOS, end of turn: a sampled one ends the sequence
  // At most this many of the decoder's slots (0 = all of them): an inference
  // rank's decoder is planned for both its rollouts and its evaluation, and
  // each keeps to its own batch.
  int64_t slots = 0;
  // The order free slots are taken in (empty: 0, 1, ...). Tests permute it to
  // show that a completion does not depend on its slot.
  std::vector<int32_t> slot_order;
};

// Limits for `slots` sequences of these prompts and max_new_tokens; throws Error
// naming the first prompt (by `prompt_name(index)`) that cannot fit the model's
// max_position_embeddings with max_new_tokens after it.
DecoderLimits plan_limits(const ModelConfig& c, std::span<const GenerateRequest> requests, int64_t slots,
                          int64_t max_new_tokens, const std::string& where);

// Every request to its end (a stop id or max_new_tokens), in continuous
// batches; completions in the order of `requests`. Each token is drawn with
// DrawKey (request.prompt, request.sample, position): the result does not
// depend on the batch size, the slot order or the other requests, as long as
// the logits of a row do not (the CPU backend's do not; tests/unit/test_generate.cpp).
std::vector<Completion> generate(Decoder& decoder, std::span<const GenerateRequest> requests,
                                 const GenerateOptions& options);

}  // namespace shardlm
