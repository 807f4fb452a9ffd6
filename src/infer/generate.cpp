// generate.cpp — continuous batching over the decoder's slots.
#include "infer/generate.hpp"

#include <algorithm>
#include <deque>
#include <numeric>

#include <omp.h>

#include "shardlm/comm.hpp"  // answer_collective_queries
#include "shardlm/error.hpp"

namespace shardlm {

const char* finish_name(Finish f) { return f == Finish::Stop ? "stop" : "length"; }

DecoderLimits plan_limits(const ModelConfig& c, std::span<const GenerateRequest> requests, int64_t slots,
                          int64_t max_new_tokens, const std::string& where, int64_t cache_tokens) {
  SHARDLM_CHECK(max_new_tokens >= 1, "--max-new-tokens %lld must be at least 1", (long long)max_new_tokens);
  int64_t longest = 1;
  for (const GenerateRequest& r : requests) {
    const int64_t len = int64_t(r.tokens.size());
    SHARDLM_CHECK(len >= 1, "%s: prompt %lld is empty", where.c_str(), (long long)r.prompt);
    // The last token drawn is never fed back: prompt + max_new_tokens - 1 positions.
    SHARDLM_CHECK(len + max_new_tokens - 1 <= c.max_position_embeddings,
                  "%s: prompt %lld has %lld tokens; with --max-new-tokens %lld it needs %lld positions, but the "
                  "model has max_position_embeddings = %lld (shorten the prompt or lower --max-new-tokens)",
                  where.c_str(), (long long)r.prompt, (long long)len, (long long)max_new_tokens,
                  (long long)(len + max_new_tokens - 1), (long long)c.max_position_embeddings);
    longest = std::max(longest, len);
  }
  DecoderLimits limits;
  limits.slots = std::max<int64_t>(1, std::min<int64_t>(slots, std::max<size_t>(requests.size(), 1)));
  limits.max_len = longest + max_new_tokens - 1;
  limits.blocks = (cache_tokens + limits.block_size - 1) / limits.block_size;
  return limits;
}

// The stream's state: the slots, the queue and every request's completion so far.
struct GenerateStream::State {
  Decoder& decoder;
  const GenerateOptions o;
  const int64_t V, slots;
  std::vector<int32_t> order;
  // Where the logits are drawn from: on the decoder's device (the GPU: no
  // logits cross to the host), or here, with one sampler (its (V) scratch) per
  // thread: rows are drawn in parallel, each from its own key, so the tokens
  // do not depend on the thread count.
  const bool on_device;
  std::vector<Sampler> samplers;
  float* logits = nullptr;  // one row per slot (the decoder's own buffer), host-drawn only
  // Planned once: the per-row values of a step.
  std::vector<Sampled> drawn;
  std::vector<double> uniforms;
  std::vector<int32_t> drawn_ids;
  std::vector<float> model_lp, tempered_lp;
  // A round's calls: the prefill's slots and prompts; then every running
  // sequence's ids not yet in its cache (`feeding`, unfed()), split into the
  // extend's slots and ids and the decode step's slots and tokens.
  std::vector<int32_t> step_slots;
  std::vector<std::span<const int32_t>> step_prompts;
  std::vector<int32_t> feeding;
  std::vector<std::span<const int32_t>> feeds;
  std::vector<int32_t> extend_slots, decode_slots, decode_tokens;
  std::vector<std::span<const int32_t>> extend_ids;

  std::vector<GenerateRequest> requests;  // every request added, numbered from 0
  std::vector<Completion> out;            // each one's completion so far (moved out when taken)
  std::vector<char> finished;
  std::vector<int64_t> held;   // request per slot, -1 free
  std::vector<int64_t> since;  // when each slot's sequence was admitted (the latest gives way)
  // Requests not yet in a slot, in order; a sequence that gave way goes back
  // to the front with its prompt and the tokens it drew (`resume`), which a
  // prefill then computes whole.
  std::deque<int64_t> waiting;
  std::vector<std::vector<int32_t>> resume;
  int64_t active = 0, admitted = 0;
  GenerateStats counts;
  int64_t version = -1;  // of the weights the step being taken ran with

  State(Decoder& d, const GenerateOptions& options)
      : decoder(d),
        o(options),
        V(d.config().vocab_size),
        slots(options.slots > 0 ? std::min(options.slots, d.limits().slots) : d.limits().slots),
        order(options.slot_order),
        on_device(d.draws_on_device()) {
    SHARDLM_CHECK(o.max_new_tokens >= 1, "--max-new-tokens %lld must be at least 1", (long long)o.max_new_tokens);
    // Checked here for both paths: the device's draw() assumes usable values as the host Sampler does.
    if (std::string e = sampling_params_error(o.sampling); !e.empty()) SHARDLM_FAIL("%s", e.c_str());
    if (order.empty()) order.resize(size_t(slots)), std::iota(order.begin(), order.end(), 0);
    SHARDLM_CHECK(int64_t(order.size()) == slots, "internal: a slot order of %zu for %lld slots", order.size(),
                  (long long)slots);
    if (!on_device)
      for (int t = 0; t < std::max(1, omp_get_max_threads()); ++t) samplers.emplace_back(o.sampling, V);
    logits = on_device ? nullptr : decoder.host_logits();
    drawn.resize(size_t(slots));
    uniforms.resize(size_t(slots));
    drawn_ids.resize(size_t(slots));
    model_lp.resize(size_t(slots));
    tempered_lp.resize(size_t(slots));
    for (auto* v : {&step_slots, &feeding, &extend_slots, &decode_slots, &decode_tokens}) v->reserve(size_t(slots));
    for (auto* v : {&step_prompts, &feeds, &extend_ids}) v->reserve(size_t(slots));
    held.assign(size_t(slots), -1);
    since.assign(size_t(slots), 0);
  }

  std::span<const int32_t> prompt_of(int64_t r) const {
    return resume[size_t(r)].empty() ? requests[size_t(r)].tokens : std::span<const int32_t>(resume[size_t(r)]);
  }

  // The ids of the sequence in `slot` not yet in its cache: the token it drew
  // last, or, after an observation, its stop id and the observation's ids.
  std::span<const int32_t> unfed(int32_t slot) const {
    const int64_t r = held[size_t(slot)];
    const int64_t cached = decoder.length(slot) - int64_t(requests[size_t(r)].tokens.size());
    return std::span<const int32_t>(out[size_t(r)].tokens).subspan(size_t(cached));
  }

  // Draws one token per row of `logits` for the sequences in `rows` (the
  // slots of the call that wrote them); ends those that stop.
  void take(std::span<const int32_t> rows) {
    // A step done: in an RL job, the trainers that ask where this rank is hear it is busy.
    answer_collective_queries("sampling");
    const int64_t B = int64_t(rows.size());
    const auto key = [&](int64_t b) {
      const Completion& done = out[size_t(held[size_t(rows[size_t(b)])])];
      return DrawKey{done.prompt, done.sample, int64_t(done.tokens.size())};
    };
    if (on_device) {
      for (int64_t b = 0; b < B; ++b) uniforms[size_t(b)] = uniform_draw(o.sampling.seed, key(b));
      decoder.draw(o.sampling, uniforms.data(), B, drawn.data(), model_lp.data(), tempered_lp.data());
    } else {
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t b = 0; b < B; ++b)
        drawn[size_t(b)] = samplers[size_t(omp_get_thread_num())].sample(logits + b * V, key(b));
    }
    for (int64_t b = 0; b < B; ++b) drawn_ids[size_t(b)] = drawn[size_t(b)].token;
    if (!on_device) {
      decoder.token_logprobs(model_lp.data(), logits, drawn_ids.data(), 1.0f, B);
      if (o.sampling.temperature > 0)
        decoder.token_logprobs(tempered_lp.data(), logits, drawn_ids.data(), float(o.sampling.temperature), B);
    }
    for (int64_t b = 0; b < B; ++b) {
      const int32_t slot = rows[size_t(b)];
      const int64_t r = held[size_t(slot)];
      Completion& done = out[size_t(r)];
      const int32_t t = drawn_ids[size_t(b)];
      if (done.tokens.empty()) done.policy_first = version;
      done.policy_last = version;
      done.tokens.push_back(t);
      done.sampling_logprobs.push_back(drawn[size_t(b)].sampling_logprob);
      done.model_logprobs.push_back(model_lp[size_t(b)]);
      done.tempered_logprobs.push_back(o.sampling.temperature > 0 ? tempered_lp[size_t(b)] : model_lp[size_t(b)]);
      if (!done.observed.empty()) done.observed.push_back(0);
      const bool stop = std::find(o.stop_ids.begin(), o.stop_ids.end(), t) != o.stop_ids.end();
      std::optional<Finish> end;
      if (stop) end = o.next_turn ? observe(r, done) : Finish::Stop;
      else if (int64_t(done.tokens.size()) >= o.max_new_tokens) end = Finish::Length;
      if (!end) continue;  // fed next: the token, or after a stop id the stop id and the observation
      done.finish = *end;
      if (decoder.route_width() > 0) {  // every fed position's, then -1 for the tokens never fed (the last)
        const std::span<const int32_t> fed = decoder.routes(slot);
        done.routes.assign(fed.begin(), fed.end());
        done.routes.resize((requests[size_t(r)].tokens.size() + done.tokens.size()) * size_t(decoder.route_width()),
                           -1);
      }
      resume[size_t(r)] = {};
      finished[size_t(r)] = 1;
      held[size_t(slot)] = -1;
      decoder.release(slot);
      --active;
    }
  }

  // A turn ended on a stop id: the caller's observation, appended to the
  // completion (nullopt: the sequence goes on; the next round feeds the stop
  // id and the observation in one extend), or how the sequence ends: Stop
  // without an observation, Length when it would pass max_new_tokens.
  std::optional<Finish> observe(int64_t r, Completion& done) {
    std::optional<std::vector<int32_t>> ids = o.next_turn(requests[size_t(r)], done);
    if (!ids) return Finish::Stop;
    SHARDLM_CHECK(!ids->empty(), "generate: an observation of no tokens after turn %lld of prompt %lld sample %lld",
                  (long long)done.turns, (long long)done.prompt, (long long)done.sample);
    for (int32_t id : *ids)
      SHARDLM_CHECK(id >= 0 && id < V, "generate: observation token %d after turn %lld of prompt %lld is outside the "
                    "vocabulary [0, %lld)", id, (long long)done.turns, (long long)done.prompt, (long long)V);
    if (int64_t(done.tokens.size() + ids->size()) + 1 > o.max_new_tokens) return Finish::Length;  // no room to answer
    if (done.observed.empty()) done.observed.assign(done.tokens.size(), 0);
    done.tokens.insert(done.tokens.end(), ids->begin(), ids->end());
    done.observed.insert(done.observed.end(), ids->size(), 1);
    for (auto* v : {&done.sampling_logprobs, &done.model_logprobs, &done.tempered_logprobs})
      v->insert(v->end(), ids->size(), 0.0f);
    ++done.turns;
    return std::nullopt;
  }

  // The running sequences, in slot order, into `feeding`, and what each feeds next into `feeds`.
  void running() {
    feeding.clear();
    feeds.clear();
    for (int32_t slot = 0; slot < int32_t(slots); ++slot)
      if (held[size_t(slot)] >= 0) feeding.push_back(slot), feeds.push_back(unfed(slot));
  }

  // Fewer requests waiting than slots free: the next prefill leaves slots empty.
  bool queue_short() const { return int64_t(waiting.size()) < slots - active; }

  // One round: free slots take the waiting requests (one prefill), then every
  // running sequence feeds what it has not yet: an extend for those that
  // feed an observation after their stop id, one decode step for the others.
  void step() {
    admit();
    feed();
  }

  // Free slots take the waiting requests in order, all in one prefill, while
  // the pool has the blocks their prompts fill and the next feed adds to every
  // sequence then running (a group's samples share their prompt's blocks: the
  // same span, prefilled once).
  void admit() {
    const KvBlocks& kv = decoder.kv();
    const int64_t block_size = kv.block_size();
    running();
    int64_t next_step = decoder.extend_blocks(feeding, feeds);
    step_slots.clear();
    step_prompts.clear();
    int64_t need = 0;
    std::vector<int32_t> free_slots;
    for (int32_t slot : order)
      if (held[size_t(slot)] < 0) free_slots.push_back(slot);
    size_t taken = 0;
    while (!waiting.empty() && taken < free_slots.size()) {
      // A group: the waiting requests at the front with the front's prompt
      // span. It is admitted whole, so that its prompt is computed once; only
      // a group larger than the batch, or one the pool cannot hold at once
      // while nothing runs, goes in parts.
      const std::span<const int32_t> p = prompt_of(waiting.front());
      size_t group = 1;
      while (group < waiting.size() && same_span(prompt_of(waiting[group]), p)) ++group;  // a resumed one is alone
      const int64_t len = int64_t(p.size());
      size_t fits = 0;
      int64_t group_need = 0, group_grows = 0;
      for (size_t i = 0; i < std::min(group, free_slots.size() - taken); ++i) {
        const int64_t r = waiting[i];
        const int64_t blocks = i > 0 ? int64_t(len % block_size != 0) : kv.blocks_for(len);
        const int64_t grows = len % block_size == 0 && int64_t(out[size_t(r)].tokens.size()) + 1 < o.max_new_tokens;
        if (need + group_need + blocks + next_step + group_grows + grows > kv.free_blocks()) break;
        group_need += blocks, group_grows += grows, ++fits;
      }
      const bool whole = fits == group;
      const bool parts_allowed = group > size_t(slots) || (active == 0 && taken == 0);
      if (fits == 0 || (!whole && !parts_allowed)) break;
      need += group_need;
      next_step += group_grows;
      for (size_t i = 0; i < fits; ++i) {
        const int64_t r = waiting.front();
        waiting.pop_front();
        const int32_t slot = free_slots[taken++];
        Completion& c = out[size_t(r)];
        c.prompt = requests[size_t(r)].prompt;
        c.sample = requests[size_t(r)].sample;
        held[size_t(slot)] = r;
        since[size_t(slot)] = admitted++;
        ++active;
        if (!resume[size_t(r)].empty()) counts.recomputed += len;
        step_slots.push_back(slot);
        step_prompts.push_back(p);
      }
      if (!whole) break;
    }
    SHARDLM_CHECK(!step_slots.empty() || active > 0, "internal: a KV pool of %lld blocks admits no sequence",
                  (long long)kv.blocks());
    if (step_slots.empty()) return;
    if (o.policy) version = o.policy();
    decoder.prefill(step_slots, step_prompts, logits);
    counts.prefills += 1;
    take(step_slots);
  }

  // Every running sequence's unfed ids into its cache, in slot order: those
  // after an observation (the stop id, then the observation's ids) in one
  // extend, whose last row draws the next turn's first token; the others'
  // drawn tokens in one decode step. While the pool lacks the blocks these
  // add, the latest admitted sequence gives way.
  void feed() {
    const KvBlocks& kv = decoder.kv();
    running();
    while (!feeding.empty() && decoder.extend_blocks(feeding, feeds) > kv.free_blocks()) {
      const size_t latest = size_t(std::max_element(feeding.begin(), feeding.end(), [&](int32_t a, int32_t b) {
                                     return since[size_t(a)] < since[size_t(b)];
                                   }) - feeding.begin());
      const int32_t slot = feeding[latest];
      const int64_t r = held[size_t(slot)];
      std::vector<int32_t>& again = resume[size_t(r)];
      const std::span<const int32_t> prompt = requests[size_t(r)].tokens;
      again.assign(prompt.begin(), prompt.end());
      // Every token so far, an observation not yet fed included: the prefill of `again` computes them.
      again.insert(again.end(), out[size_t(r)].tokens.begin(), out[size_t(r)].tokens.end());
      decoder.release(slot);
      held[size_t(slot)] = -1;
      --active;
      waiting.push_front(r);
      feeding.erase(feeding.begin() + ptrdiff_t(latest));
      feeds.erase(feeds.begin() + ptrdiff_t(latest));
      ++counts.preemptions;
    }
    extend_slots.clear();
    extend_ids.clear();
    decode_slots.clear();
    decode_tokens.clear();
    for (size_t i = 0; i < feeding.size(); ++i) {
      if (feeds[i].size() > 1) {
        extend_slots.push_back(feeding[i]);
        extend_ids.push_back(feeds[i]);
      } else {
        decode_slots.push_back(feeding[i]);
        decode_tokens.push_back(feeds[i][0]);
      }
    }
    if (!extend_slots.empty()) {
      if (o.policy) version = o.policy();
      decoder.extend(extend_slots, extend_ids, logits);
      counts.extends += 1;
      for (const auto& ids : extend_ids) counts.extend_tokens += int64_t(ids.size());
      take(extend_slots);
    }
    if (!decode_slots.empty()) {
      if (o.policy) version = o.policy();
      decoder.decode(decode_slots, decode_tokens, logits);
      counts.decode_steps += 1;
      counts.decode_rows += int64_t(decode_slots.size());
      take(decode_slots);
    }
  }
};

GenerateStream::GenerateStream(Decoder& decoder, const GenerateOptions& options)
    : s_(std::make_unique<State>(decoder, options)) {}

GenerateStream::~GenerateStream() {
  // Slots still held (a stream given up by an error) go back to the decoder.
  for (int32_t slot = 0; slot < int32_t(s_->slots); ++slot)
    if (s_->held[size_t(slot)] >= 0) s_->decoder.release(slot);
}

int64_t GenerateStream::add(std::span<const GenerateRequest> requests) {
  State& s = *s_;
  const int64_t first = int64_t(s.requests.size());
  for (const GenerateRequest& r : requests) {
    SHARDLM_CHECK(!r.tokens.empty() && int64_t(r.tokens.size()) + s.o.max_new_tokens - 1 <= s.decoder.limits().max_len,
                  "internal: prompt %lld (%zu tokens) does not fit the decoder's plan", (long long)r.prompt,
                  r.tokens.size());
    s.waiting.push_back(int64_t(s.requests.size()));
    s.requests.push_back(r);
  }
  s.out.resize(s.requests.size());
  s.finished.resize(s.requests.size(), 0);
  s.resume.resize(s.requests.size());
  return first;
}

std::vector<Completion> GenerateStream::run(int64_t first, int64_t count, const std::function<void()>& more) {
  State& s = *s_;
  SHARDLM_CHECK(first >= 0 && count >= 0 && first + count <= int64_t(s.requests.size()),
                "internal: requests [%lld, %lld) of a stream of %zu", (long long)first, (long long)(first + count),
                s.requests.size());
  int64_t left = 0;
  for (int64_t r = first; r < first + count; ++r) left += !s.finished[size_t(r)];
  while (left > 0) {
    if (more && s.queue_short()) more();
    s.step();
    left = 0;
    for (int64_t r = first; r < first + count; ++r) left += !s.finished[size_t(r)];
  }
  std::vector<Completion> done(static_cast<size_t>(count));
  for (int64_t r = first; r < first + count; ++r) done[size_t(r - first)] = std::move(s.out[size_t(r)]);
  return done;
}

int64_t GenerateStream::added() const { return int64_t(s_->requests.size()); }
int64_t GenerateStream::started(int64_t first, int64_t count) const {
  int64_t n = 0;
  for (int64_t r = first; r < first + count; ++r) n += s_->finished[size_t(r)] || !s_->out[size_t(r)].tokens.empty();
  return n;
}
bool GenerateStream::idle() const { return s_->waiting.empty() && s_->active == 0; }
const GenerateStats& GenerateStream::stats() const { return s_->counts; }

std::vector<Completion> generate(Decoder& decoder, std::span<const GenerateRequest> requests,
                                 const GenerateOptions& o, GenerateStats* stats) {
  GenerateStream stream(decoder, o);
  stream.add(requests);
  std::vector<Completion> out = stream.run(0, int64_t(requests.size()));
  if (stats) {
    const GenerateStats& counts = stream.stats();
    stats->preemptions += counts.preemptions;
    stats->recomputed += counts.recomputed;
    stats->prefills += counts.prefills;
    stats->decode_steps += counts.decode_steps;
    stats->decode_rows += counts.decode_rows;
    stats->extends += counts.extends;
    stats->extend_tokens += counts.extend_tokens;
  }
  return out;
}

}  // namespace shardlm
