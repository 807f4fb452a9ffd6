// generate.hpp — sampling completions for a list of prompts with continuous
// batching over a paged KV cache: a waiting prompt takes a free slot when the
// pool has the blocks it fills (the samples of a group, adjacent requests of
// one prompt span, are prefilled once and share its blocks); a sequence that
// stops gives its slot and blocks back, so the decode batch stays full while
// prompts remain. With several turns (GenerateOptions::next_turn) a sequence's
// observation goes into its cache in one extend, beside the decode step of the
// others. When a round needs more blocks than are free, the latest admitted
// sequence gives way: its blocks go back, and it waits at the front of the
// queue to be prefilled again whole (prompt and tokens so far).
//
// Owns: GenerateRequest, Completion (tokens, the three logprobs of each token,
// why it ended, router replay's routes), GenerateOptions, generate(), and the planning of the
// decoder's limits from the prompts. Uses Decoder (forward, and the model's
// logprobs: on the CPU cpu::token_logprobs, the function the RL loss computes
// the trainer's logprobs with; on the GPU its counterpart on the device) and
// Sampler (the choice, on the host; a decoder that draws on its device, the
// GPU's, makes the same choice there from the same uniforms: Decoder::draw). Must not know: files, MPI, the
// tokenizer, which backend the decoder runs on.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
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
// How an episode of several turns ended: the environment gave its reward
// after a turn, or was told the policy ran out of turns (rollout.max_turns) or
// of tokens (max_new_tokens) and then gave it.
enum class EpisodeEnd : uint8_t { Env, MaxTurns, Length };

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
  // The policy versions (GenerateOptions::policy) its first and last tokens
  // were drawn with; -1 without a policy callback.
  int64_t policy_first = -1, policy_last = -1;
  // Several turns (GenerateOptions::next_turn): per token of `tokens`, 1 where
  // it came from the caller (an observation between two turns; its logprobs
  // are 0), 0 where it was drawn; empty while every token was drawn.
  std::vector<uint8_t> observed;
  // Router replay (Decoder::record_routes): (prompt + tokens, route_width) the
  // experts the router chose at each layer of experts for every position when
  // it was fed in (the prompt's in its prefill, the group's samples sharing
  // them); the last token, never fed, -1. Empty when not recorded.
  std::vector<int32_t> routes;
  int64_t turns = 1;      // the turns drawn
  // RL with env.program (infer/episodes.hpp): the episode's reward, its
  // numbers (the environment's "metrics", a JSON object; "" when none) and
  // how it ended.
  double env_reward = 0;
  std::string env_metrics;
  EpisodeEnd episode_end = EpisodeEnd::Env;
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
  // Called before every prefill, extend and decode step: it may give the
  // decoder new weights (an in-flight update: the running sequences go on with
  // them, their cached keys and values staying as they were computed) and
  // returns the version of the weights that step runs with, which each
  // completion records (policy_first, policy_last). Empty: no version recorded.
  std::function<int64_t()> policy;
  // Several turns: called when a sequence draws a stop id, with its request and
  // completion so far. Returning ids (an observation: a tool's result, the next
  // user turn) goes on with the same sequence: the stop id and the ids go
  // through the decoder in one extend (Decoder::extend: one forward over all
  // of them, its KV cache kept: nothing before them is computed again), the
  // ids are recorded in the completion with `observed` 1, and the next turn's
  // first token is drawn from the extend's last row. nullopt ends the
  // sequence (Finish::Stop). Every token after the prompt, drawn or fed, counts
  // against max_new_tokens: an observation that would pass it ends the
  // sequence (Finish::Length) with what was drawn. Empty: one turn.
  std::function<std::optional<std::vector<int32_t>>(const GenerateRequest&, const Completion&)> next_turn;
};

// Limits for `slots` sequences of these prompts and max_new_tokens, with a KV
// pool of cache_tokens positions (0: every slot at its longest); throws Error
// naming the first prompt that cannot fit the model's max_position_embeddings
// with max_new_tokens after it.
DecoderLimits plan_limits(const ModelConfig& c, std::span<const GenerateRequest> requests, int64_t slots,
                          int64_t max_new_tokens, const std::string& where, int64_t cache_tokens = 0);

// What a generate() call did (added to what the struct held).
struct GenerateStats {
  int64_t prefills = 0;        // prefill calls
  int64_t decode_steps = 0;    // decode calls
  int64_t decode_rows = 0;     // sequences over the decode calls (the mean batch: rows / steps)
  int64_t extends = 0;         // extend calls (observations fed after a stop id)
  int64_t extend_tokens = 0;   // ids those fed: each observation's and the stop id before it
  int64_t preemptions = 0;     // sequences that gave their blocks way and were prefilled again later
  int64_t recomputed = 0;      // positions those later prefills computed again (prompt + tokens drawn)
};

// Every request to its end (a stop id or max_new_tokens), in continuous
// batches; completions in the order of `requests`. Each token is drawn with
// DrawKey (request.prompt, request.sample, position): the result does not
// depend on the batch size, the slot order or the other requests, as long as
// the logits of a row do not (the CPU backend's do not; tests/unit/test_generate.cpp).
std::vector<Completion> generate(Decoder& decoder, std::span<const GenerateRequest> requests,
                                 const GenerateOptions& options, GenerateStats* stats = nullptr);

// generate() whose requests may come in batches while earlier ones decode: an
// RL inference rank's rollout steps, the next step's sequences taking the
// slots the last one's tail leaves free (continuous rollouts). Requests are
// numbered in the order added, from 0; each draws as generate() draws it, so a
// completion does not depend on the batch it came in with. The stream holds
// the decoder's slots between calls: nothing else may use the decoder until
// idle().
class GenerateStream {
 public:
  GenerateStream(Decoder& decoder, const GenerateOptions& options);
  ~GenerateStream();
  // Queues `requests` behind those waiting; their token spans must stay valid
  // until their completions are taken. Returns the number of the first.
  int64_t add(std::span<const GenerateRequest> requests);
  // Prefills and decode steps until requests [first, first + count) have all
  // finished; their completions, in order. `more` (optional) is called
  // whenever fewer requests wait than slots are free: it may add() further
  // requests, which start at once (in the same prefill as the last waiting
  // ones) and run on after this returns.
  std::vector<Completion> run(int64_t first, int64_t count, const std::function<void()>& more = {});
  int64_t added() const;
  // Of requests [first, first + count), those with a token drawn.
  int64_t started(int64_t first, int64_t count) const;
  bool idle() const;  // nothing waiting, nothing running
  const GenerateStats& stats() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace shardlm
