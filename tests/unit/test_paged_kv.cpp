// test_paged_kv.cpp — the sampler's paged KV cache: the block pool's
// bookkeeping (KvBlocks), generate() over it against the unpaged layout, and
// an extend (several ids appended in one forward) against the same ids fed one
// a decode step.
// The reference is the decoder with one block of max_len positions per slot
// (the cache laid out (slots, max_len, KV, D), as before paging) and every
// sample prefilled on its own; the paged runs use blocks of 4 positions, a
// group's samples sharing their prompt's blocks, and pools too small for
// every sequence at once, so sequences wait for blocks and give them way.
// On the CPU a row's logits do not depend on its batch or on how its cache
// was filled, so every token and logprob must be equal, bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "infer/kv_blocks.hpp"
#include "infer/model.hpp"
#include "shardlm/dtype.hpp"

using namespace shardlm;
namespace fs = std::filesystem;

namespace {

// Prompts of 1 to 13 tokens, some a whole number of 4-position blocks.
std::vector<std::vector<int32_t>> mixed_prompts(int count, int64_t vocab) {
  std::vector<std::vector<int32_t>> out;
  for (int p = 0; p < count; ++p) {
    std::vector<int32_t> ids;
    const int len = 1 + (p * 5) % 13;
    for (int t = 0; t < len; ++t) ids.push_back(int32_t((p * 29 + t * 13 + 3) % (vocab - 2)));
    out.push_back(ids);
  }
  return out;
}

struct Run {
  std::vector<Completion> out;
  GenerateStats stats;
  int64_t computed = 0, given = 0, peak_blocks = 0, held_at_peak = 0, blocks = 0;
};

// n samples of each prompt; `shared`: the samples of a prompt are one span (a
// group, prefilled once), else each sample has its own copy of the tokens.
Run sample(const InferenceModel& m, const std::vector<std::vector<int32_t>>& prompts, int64_t n,
           const GenerateOptions& o, int64_t batch, int64_t block_size, int64_t cache_tokens, bool shared) {
  std::vector<std::vector<int32_t>> copies;
  copies.reserve(prompts.size() * size_t(n));
  std::vector<GenerateRequest> requests;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int64_t s = 0; s < n; ++s) {
      if (!shared) copies.push_back(prompts[p]);
      requests.push_back({int64_t(p), s, shared ? std::span<const int32_t>(prompts[p]) : copies.back()});
    }
  DecoderLimits limits = plan_limits(m.config(), requests, batch, o.max_new_tokens, "test");
  limits.block_size = block_size == 0 ? limits.max_len : block_size;
  limits.blocks = cache_tokens == 0 ? 0 : (cache_tokens + limits.block_size - 1) / limits.block_size;
  CpuDecoder decoder(m, limits);
  Run r;
  r.out = generate(decoder, requests, o, &r.stats);
  r.computed = decoder.prefill_tokens_computed();
  r.given = decoder.prefill_tokens_given();
  r.peak_blocks = decoder.kv().peak_used_blocks();
  r.held_at_peak = decoder.kv().held_positions_at_peak();
  r.blocks = decoder.kv().blocks();
  CHECK(decoder.kv().used_blocks() == 0);  // every sequence gave its blocks back
  return r;
}

// Tokens, finish reasons and the three logprobs of every token, bit for bit.
void check_same(const std::vector<Completion>& got, const std::vector<Completion>& want) {
  REQUIRE(got.size() == want.size());
  int64_t tokens = 0, equal = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].tokens == want[i].tokens);
    CHECK(got[i].finish == want[i].finish);
    if (got[i].tokens != want[i].tokens) continue;
    for (size_t t = 0; t < got[i].tokens.size(); ++t, ++tokens)
      equal += got[i].model_logprobs[t] == want[i].model_logprobs[t] &&
               got[i].tempered_logprobs[t] == want[i].tempered_logprobs[t] &&
               got[i].sampling_logprobs[t] == want[i].sampling_logprobs[t];
  }
  CHECK(equal == tokens);
  CHECK(tokens > 0);
}

}  // namespace

TEST_SUITE("generate") {

TEST_CASE("KvBlocks: blocks taken as a sequence grows, a prompt's full blocks shared, its last block copied, "
          "each block freed with its last holder") {
  KvBlocks kv(/*blocks=*/6, /*block_size=*/4, /*slots=*/3, /*max_len=*/12);
  CHECK(kv.table_ld() == 3);
  kv.grow(0, 6);  // two blocks: 4 + 2 positions
  CHECK(kv.used_blocks() == 2);
  CHECK(kv.held_positions() == 6);
  CHECK(kv.blocks_to_grow(0, 8) == 0);
  CHECK(kv.blocks_to_grow(0, 9) == 1);
  const BlockCopy copy = kv.share(0, 1);  // the full block shared, the half-filled one copied
  CHECK(copy.from == kv.pages().table[1]);
  CHECK(copy.to == kv.pages().table[1 * 3 + 1]);
  CHECK(kv.pages().table[1 * 3] == kv.pages().table[0]);
  CHECK(kv.used_blocks() == 3);
  CHECK(kv.held_positions() == 8);  // 4 shared + 2 + 2
  CHECK(kv.length(1) == 6);
  kv.grow(1, 9);                    // fills its copy, then one block more
  CHECK(kv.used_blocks() == 4);
  CHECK(kv.held_positions() == 4 + 2 + 4 + 1);
  kv.release(0);                    // the shared block stays with slot 1
  CHECK(kv.used_blocks() == 3);
  CHECK(kv.free_blocks() == 3);
  kv.release(1);
  CHECK(kv.used_blocks() == 0);
  CHECK(kv.held_positions() == 0);
  CHECK(kv.peak_used_blocks() == 4);
  CHECK(kv.held_positions_at_peak() == 11);
  // A prompt of whole blocks is shared without a copy.
  kv.grow(2, 8);
  CHECK(kv.share(2, 0).from == -1);
  CHECK(kv.used_blocks() == 2);
  // More than the pool holds is refused before anything changes.
  kv.grow(1, 12);
  kv.grow(0, 12);
  CHECK(kv.free_blocks() == 0);
  CHECK_THROWS(kv.grow(2, 9));
  CHECK(kv.length(2) == 8);
  CHECK(kv.free_blocks() == 0);
}

TEST_CASE("paged decoding = the unpaged layout token for token: greedy and sampled, mixed lengths, shared prompts, "
          "slot churn, sequences that give way") {
  for (const std::string name : {"llama-gqa-tied", "qwen2-bias", "qwen3-qknorm"}) {
    CAPTURE(name);
    const InferenceModel m = InferenceModel::from_hf(fs::path("tests/fixtures") / name);
    const int64_t V = m.config().vocab_size;
    const auto prompts = mixed_prompts(7, V);
    int64_t unique_tokens = 0;
    for (const auto& p : prompts) unique_tokens += int64_t(p.size());
    for (const double temperature : {0.0, 0.9}) {
      CAPTURE(temperature);
      GenerateOptions o;
      o.sampling = {.temperature = temperature, .top_k = 50, .top_p = 0.9, .seed = 77};
      o.max_new_tokens = 14;
      // Stop ids end about one step in twelve: sequences end at different times and slots churn.
      for (int32_t id = 0; id < V; id += 12) o.stop_ids.push_back(id);
      const int64_t n = 3, batch = 6;
      // One block of max_len positions per slot, each sample prefilled alone.
      const Run want = sample(m, prompts, n, o, batch, /*block_size=*/0, /*cache_tokens=*/0, /*shared=*/false);
      CHECK(want.computed == n * unique_tokens);
      CHECK(want.stats.preemptions == 0);

      // Blocks of 4, a group's samples prefilled once, a pool for every slot at its longest.
      const Run roomy = sample(m, prompts, n, o, batch, 4, 0, true);
      check_same(roomy.out, want.out);
      CHECK(roomy.stats.preemptions == 0);
      CHECK(roomy.given == n * unique_tokens);
      CHECK(roomy.computed == unique_tokens);  // each prompt computed once
      // Paging's waste at the peak: at most a partly filled block per sequence (batch of them).
      CHECK(roomy.peak_blocks * 4 - roomy.held_at_peak < batch * 4);
      CHECK(roomy.peak_blocks * 4 >= roomy.held_at_peak);

      // A pool of 40 positions (one sequence at its longest needs 28 of them):
      // sequences wait for blocks, and give them way mid-sequence.
      const Run tight = sample(m, prompts, n, o, batch, 4, 40, true);
      check_same(tight.out, want.out);
      MESSAGE(name << " T=" << temperature << ": " << tight.stats.preemptions << " sequences gave way; mean batch "
                   << double(tight.stats.decode_rows) / double(tight.stats.decode_steps) << " against "
                   << double(roomy.stats.decode_rows) / double(roomy.stats.decode_steps) << " with a roomy pool");
      CHECK(tight.stats.preemptions > 0);
      CHECK(tight.peak_blocks <= tight.blocks);
      CHECK(tight.computed > unique_tokens);  // prompts of sequences that gave way, computed again
      CHECK(tight.stats.recomputed > 0);
      CHECK(roomy.stats.recomputed == 0);
      MESSAGE(name << " T=" << temperature << ": prefill computed " << tight.computed << " = " << unique_tokens
                   << " unique + " << tight.stats.recomputed << " again for sequences that gave way");
      CHECK(tight.computed - tight.stats.recomputed == unique_tokens);  // no group went in parts here
    }
  }
}

TEST_CASE("a stream fed step by step (the next step's samples admitted while the last one's tail decodes) = "
          "generate() on all of them, token for token") {
  const InferenceModel m = InferenceModel::from_hf(fs::path("tests/fixtures") / "qwen3-qknorm");
  const int64_t V = m.config().vocab_size;
  const auto prompts = mixed_prompts(12, V);
  GenerateOptions o;
  o.sampling = {.temperature = 0.9, .top_k = 0, .top_p = 1.0, .seed = 5};
  o.max_new_tokens = 16;
  for (int32_t id = 0; id < V; id += 9) o.stop_ids.push_back(id);  // lengths differ: a step's tail is ragged
  // Three "steps" of 4 prompts x 3 samples, each a group sharing its prompt span.
  const int64_t n = 3, per_step = 4, steps = 3;
  std::vector<std::vector<GenerateRequest>> step_requests(steps);
  std::vector<GenerateRequest> all;
  for (int64_t st = 0; st < steps; ++st)
    for (int64_t i = 0; i < per_step; ++i)
      for (int64_t s = 0; s < n; ++s) {
        const int64_t p = st * per_step + i;
        step_requests[size_t(st)].push_back({p, s, prompts[size_t(p)]});
        all.push_back(step_requests[size_t(st)].back());
      }
  DecoderLimits limits = plan_limits(m.config(), all, /*slots=*/8, o.max_new_tokens, "test");
  limits.block_size = 4;
  CpuDecoder whole_decoder(m, limits);
  const std::vector<Completion> want = generate(whole_decoder, all, o);

  CpuDecoder decoder(m, limits);
  GenerateStream stream(decoder, o);
  std::vector<Completion> got;
  int64_t first = stream.add(step_requests[0]), started_early = 0;
  for (int64_t st = 0; st < steps; ++st) {
    const int64_t count = int64_t(step_requests[size_t(st)].size());
    bool next_added = st + 1 >= steps || stream.added() > first + count;
    const auto more = [&] {
      if (next_added) return;
      stream.add(step_requests[size_t(st + 1)]);
      next_added = true;
      ++started_early;
    };
    std::vector<Completion> done = stream.run(first, count, more);
    for (Completion& c : done) got.push_back(std::move(c));
    if (!next_added) stream.add(step_requests[size_t(st + 1)]);
    first += count;
  }
  CHECK(stream.idle());
  CHECK(decoder.kv().used_blocks() == 0);
  CHECK(started_early == steps - 1);  // every later step began before the one before it ended
  check_same(got, want);
}

TEST_CASE("several turns: an observation fed after a stop id goes on with the same sequence and cache; the next "
          "turn = generate() on the whole conversation as its prompt, logprobs to the bit; only the prompt prefilled") {
  const InferenceModel m = InferenceModel::from_hf(fs::path("tests/fixtures") / "qwen3-qknorm");
  const int64_t V = m.config().vocab_size;
  const auto prompts = mixed_prompts(6, V);
  GenerateOptions o;
  o.sampling = {.temperature = 0.0, .top_k = 0, .top_p = 1.0, .seed = 3};
  o.max_new_tokens = 24;
  const std::vector<int32_t> observation = {int32_t(V - 3), 7, 11, int32_t(V - 5)};
  int tested = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    CAPTURE(p);
    const std::vector<GenerateRequest> one{{int64_t(p), 0, prompts[p]}};
    DecoderLimits limits = plan_limits(m.config(), one, 1, o.max_new_tokens, "test");
    limits.block_size = 4;
    // The first turn ends on its third greedy token, when that one is new.
    std::vector<Completion> plain;
    {
      CpuDecoder d(m, limits);
      plain = generate(d, one, o);
    }
    const std::vector<int32_t>& t = plain[0].tokens;
    if (t.size() < 3 || t[2] == t[0] || t[2] == t[1]) continue;
    GenerateOptions turns = o;
    turns.stop_ids = {t[2]};
    turns.next_turn = [&](const GenerateRequest&, const Completion& c) -> std::optional<std::vector<int32_t>> {
      if (c.turns == 1) return observation;
      return std::nullopt;
    };
    CpuDecoder d(m, limits);
    GenerateStats stats;
    const Completion got = generate(d, one, turns, &stats)[0];
    CHECK(d.prefill_tokens_computed() == int64_t(prompts[p].size()));  // the history never prefilled again
    // The stop id and the observation in one extend; a decode step for every other token fed (all but the last).
    const int64_t fed = int64_t(got.tokens.size()) - 1, in_extend = 1 + int64_t(observation.size());
    CHECK(stats.extends == 1);
    CHECK(stats.extend_tokens == in_extend);
    CHECK(d.extend_tokens_computed() == in_extend);
    CHECK(stats.decode_steps == fed - in_extend);
    MESSAGE("prompt " << p << ": " << stats.decode_steps << " decode steps and one extend of " << in_extend
                      << " ids; fed one a decode step: " << fed << " steps");
    // The conversation so far as a prompt: what the second turn is drawn from.
    std::vector<int32_t> conversation = prompts[p];
    conversation.insert(conversation.end(), t.begin(), t.begin() + 3);
    conversation.insert(conversation.end(), observation.begin(), observation.end());
    GenerateOptions rest = turns;
    rest.next_turn = nullptr;
    rest.max_new_tokens = o.max_new_tokens - 3 - int64_t(observation.size());
    const std::vector<GenerateRequest> whole{{int64_t(p), 0, conversation}};
    DecoderLimits whole_limits = plan_limits(m.config(), whole, 1, rest.max_new_tokens, "test");
    whole_limits.block_size = 4;
    CpuDecoder fresh(m, whole_limits);
    const Completion want = generate(fresh, whole, rest)[0];

    REQUIRE(got.tokens.size() == 3 + observation.size() + want.tokens.size());
    CHECK(got.turns == 2);
    CHECK(got.finish == want.finish);
    CHECK(std::equal(t.begin(), t.begin() + 3, got.tokens.begin()));
    CHECK(std::equal(observation.begin(), observation.end(), got.tokens.begin() + 3));
    CHECK(std::equal(want.tokens.begin(), want.tokens.end(), got.tokens.begin() + 7));
    CHECK(std::equal(want.model_logprobs.begin(), want.model_logprobs.end(), got.model_logprobs.begin() + 7));
    CHECK(std::equal(plain[0].model_logprobs.begin(), plain[0].model_logprobs.begin() + 3, got.model_logprobs.begin()));
    std::vector<uint8_t> observed(got.tokens.size(), 0);
    std::fill(observed.begin() + 3, observed.begin() + 7, 1);
    CHECK(got.observed == observed);
    CHECK(std::all_of(got.model_logprobs.begin() + 3, got.model_logprobs.begin() + 7, [](float x) { return x == 0; }));
    ++tested;
  }
  MESSAGE(tested << " of " << prompts.size() << " prompts had a first turn to end");
  CHECK(tested >= 3);

  // An observation that leaves no room for a token of the next turn ends the sequence: Finish::Length.
  const std::vector<GenerateRequest> one{{0, 0, prompts[1]}};
  DecoderLimits limits = plan_limits(m.config(), one, 1, 8, "test");
  GenerateOptions tight = o;
  tight.max_new_tokens = 8;
  tight.stop_ids.clear();
  for (int32_t id = 0; id < V; ++id) tight.stop_ids.push_back(id);  // every token ends a turn
  tight.next_turn = [&](const GenerateRequest&, const Completion&) -> std::optional<std::vector<int32_t>> {
    return std::vector<int32_t>{5, 6, 7};
  };
  CpuDecoder d(m, limits);
  const Completion cut = generate(d, one, tight)[0];
  CHECK(cut.finish == Finish::Length);
  CHECK(cut.tokens.size() == 4 + 1);  // turn, 3 observed, turn; a third turn would pass 8
  CHECK(cut.turns == 2);
}

TEST_CASE("extend = the same ids fed one a decode step: logits and cache bit for bit, mixed slots and lengths, "
          "across block boundaries, n = 1 and n > block_size, passes split; the pool's blocks counted and freed") {
  for (const std::string name : {"llama-gqa-tied", "qwen2-bias", "qwen3-qknorm"}) {
    CAPTURE(name);
    const InferenceModel m = InferenceModel::from_hf(fs::path("tests/fixtures") / name);
    const ModelConfig& c = m.config();
    const int64_t V = c.vocab_size, KVD = c.num_kv_heads * c.head_dim;
    // max_len 20: an extend pass holds at most 20 rows (max(max_len, slots)).
    const DecoderLimits limits{.slots = 4, .max_len = 20, .block_size = 4};
    CpuDecoder extended(m, limits), fed(m, limits);
    const auto ids = [&](int n, int salt) {
      std::vector<int32_t> out;
      for (int t = 0; t < n; ++t) out.push_back(int32_t((salt * 37 + t * 11 + 5) % V));
      return out;
    };
    // Prompts of 3, 4 (a whole block), 7 and 1 tokens in slots 0 .. 3.
    const std::vector<std::vector<int32_t>> by_slot = {ids(3, 11), ids(4, 12), ids(7, 13), ids(1, 14)};
    const std::vector<int32_t> all = {0, 1, 2, 3};
    const std::vector<std::span<const int32_t>> spans(by_slot.begin(), by_slot.end());
    std::vector<float> logits(size_t(4 * V)), last_fed(static_cast<size_t>(V));
    extended.prefill(all, spans, logits.data());
    fed.prefill(all, spans, logits.data());
    // Two extends: slots out of order, one left out, n = 1, 9 and 5 (9 crosses two
    // block boundaries); then slot 1 by 14 and slot 3 by 11, 25 rows: two passes.
    const std::vector<std::vector<int32_t>> slot_lists = {{2, 0, 3}, {1, 3}};
    const std::vector<std::vector<std::vector<int32_t>>> id_lists = {{ids(1, 1), ids(9, 2), ids(5, 3)},
                                                                     {ids(14, 4), ids(11, 5)}};
    int64_t rows = 0, equal_rows = 0, blocks_added = 0;
    for (size_t e = 0; e < slot_lists.size(); ++e) {
      CAPTURE(e);
      const std::vector<int32_t>& slots = slot_lists[e];
      const std::vector<std::span<const int32_t>> new_ids(id_lists[e].begin(), id_lists[e].end());
      const int64_t free_before = extended.kv().free_blocks(), need = extended.extend_blocks(slots, new_ids);
      extended.extend(slots, new_ids, logits.data());
      CHECK(free_before - extended.kv().free_blocks() == need);
      blocks_added += need;
      // The same ids one a decode step, slot after slot in the extend's order (so the pool hands out the same blocks).
      for (size_t i = 0; i < slots.size(); ++i) {
        for (int32_t id : new_ids[i]) {
          const std::vector<int32_t> one_slot = {slots[i]}, one_id = {id};
          fed.decode(one_slot, one_id, last_fed.data());
        }
        ++rows;
        equal_rows += std::memcmp(last_fed.data(), logits.data() + int64_t(i) * V, sizeof(float) * size_t(V)) == 0;
        CHECK(extended.length(slots[i]) == fed.length(slots[i]));
      }
    }
    CHECK(equal_rows == rows);
    CHECK(blocks_added == 2 + 0 + 1 + 4 + 3);  // slot 0: 3 -> 12, 2: 7 -> 8, 3: 1 -> 6 -> 17, 1: 4 -> 18
    CHECK(extended.extend_tokens_computed() == 1 + 9 + 5 + 14 + 11);
    CHECK(extended.extends() == 2);
    CHECK(extended.decode_positions_read() == 0);
    CHECK(fed.extend_tokens_computed() == 0);
    CHECK(extended.kv().used_blocks() == fed.kv().used_blocks());
    CHECK(extended.kv().used_blocks() == 3 + 5 + 2 + 5);  // ceil(12 / 4), ceil(18 / 4), ceil(8 / 4), ceil(17 / 4)
    // The block tables and every layer's keys and values at every position, bit for bit.
    const KvPages a = extended.kv().pages(), b = fed.kv().pages();
    int64_t positions = 0, same = 0;
    for (int32_t s : all) {
      CHECK(std::equal(a.table + s * a.table_ld, a.table + s * a.table_ld + extended.kv().blocks_for(extended.length(s)),
                       b.table + s * b.table_ld));
      for (int l = 0; l < int(c.num_layers); ++l)
        for (int64_t p = 0; p < extended.length(s); ++p, ++positions)
          same += std::memcmp(extended.cached_keys(l, s, p), fed.cached_keys(l, s, p), sizeof(float) * KVD) == 0 &&
                  std::memcmp(extended.cached_values(l, s, p), fed.cached_values(l, s, p), sizeof(float) * KVD) == 0;
    }
    CHECK(same == positions);
    CHECK(positions == c.num_layers * (12 + 18 + 8 + 17));
    // A decode step of every slot after them reads the caches: the same bits again.
    std::vector<float> after_extend(size_t(4 * V)), after_fed(size_t(4 * V));
    const std::vector<int32_t> next = {1, 2, 3, 4};
    extended.decode(all, next, after_extend.data());
    fed.decode(all, next, after_fed.data());
    CHECK(after_extend == after_fed);
    // Released, every block goes back.
    for (int32_t s : all) extended.release(s), fed.release(s);
    CHECK(extended.kv().free_blocks() == extended.kv().blocks());
    CHECK(extended.kv().used_blocks() == 0);
    CHECK(extended.kv().held_positions() == 0);
    // Asking for more blocks than are free, or past max_len, is refused before anything changes.
    CpuDecoder small(m, DecoderLimits{.slots = 2, .max_len = 20, .block_size = 4, .blocks = 6});
    const std::vector<int32_t> two = {0, 1};
    small.prefill(two, std::vector<std::span<const int32_t>>{spans[0], spans[1]}, logits.data());
    const std::vector<int32_t> long_ids = ids(16, 6), short_ids = ids(3, 7);
    const std::vector<std::span<const int32_t>> too_many = {long_ids, short_ids};
    CHECK(small.extend_blocks(two, too_many) == 4 + 1);  // 3 -> 19: 4 more; 4 -> 7: 1 more; 4 are free
    CHECK_THROWS_WITH(small.extend(two, too_many, logits.data()),
                      doctest::Contains("an extend needs 5 KV blocks, 4 free"));
    const std::vector<int32_t> past = ids(18, 8);
    CHECK_THROWS_WITH(small.extend(std::vector<int32_t>{0}, std::vector<std::span<const int32_t>>{past}, logits.data()),
                      doctest::Contains("18 tokens appended to slot 0, which holds 3 of 20 positions"));
    CHECK(small.length(0) == 3);
    CHECK(small.kv().free_blocks() == 4);
  }
}

TEST_CASE("several turns in a batch: observations fed by extends give the tokens and logprobs of batch 1 and of a "
          "tight pool (sequences give way with an observation not yet fed); decode rows drop by every fed id") {
  const InferenceModel m = InferenceModel::from_hf(fs::path("tests/fixtures") / "qwen2-bias");
  const int64_t V = m.config().vocab_size;
  const auto prompts = mixed_prompts(8, V);
  GenerateOptions o;
  o.sampling = {.temperature = 0.9, .top_k = 0, .top_p = 1.0, .seed = 21};
  o.max_new_tokens = 30;
  for (int32_t id = 0; id < V; id += 6) o.stop_ids.push_back(id);  // turns of about six tokens
  // Turn 1 is answered with 6 ids (more than a block of 4), turn 2 with 1, turn 3 ends the episode.
  o.next_turn = [&](const GenerateRequest& r, const Completion& c) -> std::optional<std::vector<int32_t>> {
    if (c.turns == 1) return std::vector<int32_t>{int32_t(V - 1), int32_t(r.prompt), 9, 10, 11, int32_t(V - 2)};
    if (c.turns == 2) return std::vector<int32_t>{int32_t(V - 3)};
    return std::nullopt;
  };
  const Run batch1 = sample(m, prompts, 2, o, 1, 4, 0, true);
  const Run batch6 = sample(m, prompts, 2, o, 6, 4, 0, true);
  // 48 positions: one sequence at its longest takes 42 of them.
  const Run tight = sample(m, prompts, 2, o, 6, 4, 48, true);
  check_same(batch6.out, batch1.out);
  check_same(tight.out, batch1.out);
  CHECK(tight.stats.preemptions > 0);
  // Every token but a sequence's last is fed once: the observations' ids and
  // the stop id before each by an extend, the drawn tokens by decode steps.
  int64_t turns = 0, observed = 0, fed = 0;
  for (const Completion& c : batch6.out) {
    const int64_t obs = std::count(c.observed.begin(), c.observed.end(), uint8_t(1));
    turns += c.turns;
    observed += obs;
    fed += int64_t(c.tokens.size()) - 1;
    CHECK(c.turns <= 3);
  }
  const int64_t observations = turns - int64_t(batch6.out.size());
  MESSAGE(observations << " observations of " << observed << " ids over " << batch6.out.size() << " sequences; "
                       << "decode rows " << batch6.stats.decode_rows << " (one a fed token: " << fed
                       << "), decode steps at batch 6 " << batch6.stats.decode_steps << ", at batch 1 "
                       << batch1.stats.decode_steps << " (" << fed << " with one a fed token); extends "
                       << batch6.stats.extends << " at batch 6, " << batch1.stats.extends << " at batch 1");
  CHECK(observations >= int64_t(batch6.out.size()));  // most sequences had a second turn
  for (const Run* r : {&batch1, &batch6}) {
    CHECK(r->stats.preemptions == 0);
    CHECK(r->stats.extend_tokens == observed + observations);
    CHECK(r->stats.decode_rows == fed - observed - observations);
  }
  CHECK(batch1.stats.decode_steps == fed - observed - observations);
  CHECK(batch1.stats.extends == observations);
  CHECK(batch6.stats.extends < observations);  // several sequences' observations in one extend
}

}  // TEST_SUITE

TEST_CASE("an in-flight weight update between two decode steps: the running sequences go on with the new weights") {
  // Greedy over a batch that holds every sequence (no stop id): the reference
  // drives the decoder by hand, one prefill then one decode step after another,
  // and changes the weights before decode step 4; generate() does the same
  // through GenerateOptions::policy.
  InferenceModel m = InferenceModel::from_hf(fs::path("tests/fixtures") / "qwen3-qknorm");
  const int64_t V = m.config().vocab_size;
  const auto prompts = mixed_prompts(5, V);
  const ParamInfo& norm = m.weights->layout.head().param("model.norm.weight");
  std::vector<uint16_t> changed(size_t(norm.numel));
  for (int64_t i = 0; i < norm.numel; ++i) changed[size_t(i)] = f32_to_bf16_rne(i % 3 == 0 ? 2.0f : 0.25f);
  const InferenceModel original = InferenceModel::from_hf(fs::path("tests/fixtures") / "qwen3-qknorm");
  constexpr int64_t kNew = 10, kSwapBefore = 4;  // the swap before decode step 4 (the 5th forward)

  GenerateOptions o;
  o.sampling = {.temperature = 0.0, .top_k = 0, .top_p = 1.0, .seed = 1};
  o.max_new_tokens = kNew;
  std::vector<GenerateRequest> requests;
  for (size_t p = 0; p < prompts.size(); ++p) requests.push_back({int64_t(p), 0, prompts[p]});
  const DecoderLimits limits = plan_limits(m.config(), requests, int64_t(prompts.size()), kNew, "test");

  // The reference, by hand.
  std::vector<std::vector<int32_t>> want(prompts.size());
  {
    InferenceModel ref = InferenceModel::from_hf(fs::path("tests/fixtures") / "qwen3-qknorm");
    CpuDecoder decoder(ref, limits);
    const int64_t B = int64_t(prompts.size());
    std::vector<int32_t> slots(static_cast<size_t>(B)), tokens(static_cast<size_t>(B));
    std::iota(slots.begin(), slots.end(), 0);
    std::vector<std::span<const int32_t>> spans(prompts.begin(), prompts.end());
    std::vector<float> logits(size_t(B * V));
    const auto argmax = [&] {
      for (int64_t b = 0; b < B; ++b) {
        const float* row = logits.data() + b * V;
        tokens[size_t(b)] = int32_t(std::max_element(row, row + V) - row);  // the lowest id on ties
        want[size_t(b)].push_back(tokens[size_t(b)]);
      }
    };
    decoder.prefill(slots, spans, logits.data());
    argmax();
    for (int64_t step = 1; step < kNew; ++step) {
      if (step == kSwapBefore) ref.load_bf16(ref.weights->layout.head().param("model.norm.weight"), changed.data());
      decoder.decode(slots, tokens, logits.data());
      argmax();
    }
  }

  // generate() with the update given by the policy callback.
  int64_t calls = 0;
  o.policy = [&] {
    if (++calls == kSwapBefore + 1) m.load_bf16(norm, changed.data());
    return calls > kSwapBefore ? int64_t(7) : int64_t(6);  // the versions: 6, then 7 from the swap on
  };
  std::vector<Completion> got;
  {
    CpuDecoder decoder(m, limits);
    got = generate(decoder, requests, o);
  }
  // Without the update.
  GenerateOptions fixed = o;
  fixed.policy = nullptr;
  CpuDecoder plain(original, limits);
  const std::vector<Completion> unchanged = generate(plain, requests, fixed);

  REQUIRE(got.size() == prompts.size());
  int changed_after = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].tokens == want[i]);
    CHECK(got[i].policy_first == 6);
    CHECK(got[i].policy_last == 7);
    CHECK(unchanged[i].policy_first == -1);
    // The first kSwapBefore tokens were drawn before the update: the same as without it.
    CHECK(std::equal(got[i].tokens.begin(), got[i].tokens.begin() + kSwapBefore, unchanged[i].tokens.begin()));
    changed_after += got[i].tokens != unchanged[i].tokens;
  }
  MESSAGE(changed_after << " of " << got.size() << " sequences changed by the update");
  CHECK(changed_after >= 1);  // the update did change what was drawn
}
