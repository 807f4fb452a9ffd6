// test_rollouts.cpp — rollout files: reading with defaults and per-sample
// advantages, every reader error, exact packing of a hand-made file, balance over
// world sizes 1, 2, 3, padding micro-batches, the step/lag check, waiting for a
// file (timeout, progress, a file renamed into place by another thread), and the
// output of tools/make_rollouts.py.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "run_command.hpp"
#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"
#include "data/rollouts.hpp"

namespace fs = std::filesystem;

namespace doctest {
template <class T>
  requires std::is_arithmetic_v<T>
struct StringMaker<std::vector<T>> {
  static String convert(const std::vector<T>& values) {
    std::string text = "{";
    for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
    return (text + "}").c_str();
  }
};
}  // namespace doctest

using shardlm::RankRollouts;
using shardlm::RlMicroBatch;
using shardlm::RolloutBatch;

namespace {

constexpr int64_t kVocab = 50;

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    const auto ticks = std::chrono::steady_clock::now().time_since_epoch().count();
    path = fs::temp_directory_path() / ("shardlm_test_rollouts_" + std::to_string(getpid()) + "_" +
                                        std::to_string(ticks) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// The contents of a rollout file, written with the plain HDF5 C API. Empty
// optional vectors are not written.
struct RolloutFile {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets;
  std::vector<uint8_t> loss_mask;
  std::vector<float> advantages, inference_logprobs, temperature, loss_weight, sampling_logprobs;
  std::optional<int64_t> step = 5, policy_step = 4;
  std::set<std::string> omit;   // required datasets to leave out
  std::string wrong_dtype;      // write this dataset with another dtype
  std::string rank_two;         // write this dataset as a 2-D array
};

// Hand-made: s0 = 1..5 (prompt 2), s1 = 6..8 (prompt 1), s2 = 9 (one token:
// nothing to predict), s3 = 10..16 (prompt 3). Loss targets: 3 + 2 + 4 = 9.
RolloutFile hand_made() {
  RolloutFile f;
  f.tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  f.offsets = {0, 5, 8, 9, 16};
  f.loss_mask = {0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1};
  f.advantages = {0.5f, -1.0f, 2.0f, 0.25f};  // per sample
  for (int t = 0; t < 16; ++t) f.inference_logprobs.push_back(-0.1f * float(t + 1));
  f.temperature = {1.0f, 0.7f, 1.0f, 1.3f};
  return f;
}

template <class T>
void write_dataset(hid_t file, const std::string& name, hid_t file_type, hid_t mem_type, const std::vector<T>& values,
                   bool rank_two) {
  hsize_t dims[2] = {values.size(), 1};
  if (rank_two) dims[0] = values.size() / 2, dims[1] = 2;
  shardlm::h5::Handle space(H5_CHECK(H5Screate_simple(rank_two ? 2 : 1, dims, nullptr)), H5Sclose);
  shardlm::h5::Handle dset(
      H5_CHECK(H5Dcreate2(file, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Dclose);
  if (!values.empty()) H5_CHECK(H5Dwrite(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
}

void write_attribute(hid_t file, const char* name, int64_t value) {
  shardlm::h5::Handle space(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose);
  shardlm::h5::Handle attr(H5_CHECK(H5Acreate2(file, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT)),
                           H5Aclose);
  H5_CHECK(H5Awrite(attr, H5T_NATIVE_INT64, &value));
}

void write_rollouts(const std::string& path, const RolloutFile& f) {
  shardlm::h5::Handle file(H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
  auto put = [&](const std::string& name, auto&& values, hid_t file_type, hid_t wrong_type, hid_t mem_type,
                 bool optional) {
    if (f.omit.count(name) || (optional && values.empty())) return;
    write_dataset(file, name, f.wrong_dtype == name ? wrong_type : file_type, mem_type, values, f.rank_two == name);
  };
  put("tokens", f.tokens, H5T_STD_I32LE, H5T_STD_I64LE, H5T_NATIVE_INT32, false);
  put("offsets", f.offsets, H5T_STD_I64LE, H5T_STD_I32LE, H5T_NATIVE_INT64, false);
  put("loss_mask", f.loss_mask, H5T_STD_U8LE, H5T_STD_I8LE, H5T_NATIVE_UINT8, false);
  put("advantages", f.advantages, H5T_IEEE_F32LE, H5T_IEEE_F64LE, H5T_NATIVE_FLOAT, false);
  put("inference_logprobs", f.inference_logprobs, H5T_IEEE_F32LE, H5T_IEEE_F64LE, H5T_NATIVE_FLOAT, false);
  put("temperature", f.temperature, H5T_IEEE_F32LE, H5T_IEEE_F64LE, H5T_NATIVE_FLOAT, true);
  put("loss_weight", f.loss_weight, H5T_IEEE_F32LE, H5T_IEEE_F64LE, H5T_NATIVE_FLOAT, true);
  put("sampling_logprobs", f.sampling_logprobs, H5T_IEEE_F32LE, H5T_IEEE_F64LE, H5T_NATIVE_FLOAT, true);
  if (f.step) write_attribute(file, "step", *f.step);
  if (f.policy_step) write_attribute(file, "policy_step", *f.policy_step);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const shardlm::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Expects a shardlm::Error whose message contains every one of `parts`.
void check_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  const std::string message = error_of(fn);
  INFO("message: " << message);
  for (const std::string& part : parts) CHECK(message.find(part) != std::string::npos);
}

// `count` samples with lengths 1..30 from an LCG, prompt = first third (loss 0),
// per-token advantages, some loss_weight 0 and 2.
RolloutFile random_file(int count, uint32_t seed) {
  RolloutFile f;
  f.offsets = {0};
  uint32_t state = seed;
  auto next = [&] { return state = state * 1664525u + 1013904223u, state >> 8; };
  for (int s = 0; s < count; ++s) {
    const uint32_t length = 1 + next() % 30;
    for (uint32_t i = 0; i < length; ++i) {
      f.tokens.push_back(static_cast<int32_t>(next() % kVocab));
      f.loss_mask.push_back(i >= length / 3 ? 1 : 0);
      f.advantages.push_back(float(int(next() % 200) - 100) / 50.0f);
      f.inference_logprobs.push_back(-float(1 + next() % 400) / 100.0f);
      f.loss_weight.push_back(next() % 9 == 0 ? 0.0f : (next() % 5 == 0 ? 2.0f : 1.0f));
    }
    f.temperature.push_back(s % 3 == 0 ? 0.8f : 1.0f);
    f.offsets.push_back(static_cast<int64_t>(f.tokens.size()));
  }
  return f;
}

// Every packed position of every rank, checked against the file: each sample
// with >= 2 tokens appears once, whole, in order, in one row of one rank.
struct Coverage {
  int64_t loss_tokens = 0, tokens = 0;
  std::map<int32_t, int> rank_of_sample;
};

Coverage check_world(const RolloutBatch& b, int world, int64_t seq_len, int64_t micro_batch) {
  Coverage cov;
  std::vector<RankRollouts> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(shardlm::pack_rollouts(b, seq_len, micro_batch, r, world));
  const size_t count = ranks[0].micro_batches.size();
  std::map<int32_t, int64_t> next_pos;  // sample -> next pair index expected
  for (int r = 0; r < world; ++r) {
    const RankRollouts& rr = ranks[r];
    CHECK(rr.micro_batches.size() == count);  // same micro-batch count on every rank
    CHECK(rr.loss_tokens_global == b.loss_tokens);
    int64_t rank_loss = 0, rank_tokens = 0;
    for (size_t i = 0; i < rr.micro_batches.size(); ++i) {
      const RlMicroBatch& m = rr.micro_batches[i];
      REQUIRE(m.batch.rows == micro_batch);
      REQUIRE(m.batch.tokens.size() == size_t(micro_batch * seq_len));
      if (int64_t(i) >= rr.real_micro_batches) {  // padding micro-batch: nothing in it
        CHECK(m.batch.loss_tokens == 0);
        CHECK(std::all_of(m.sample_ids.begin(), m.sample_ids.end(), [](int32_t s) { return s == -1; }));
      }
      int64_t loss = 0;
      int32_t prev_seq = -1;
      for (int64_t at = 0; at < micro_batch * seq_len; ++at) {
        // seq_ids: contiguous, increasing by at most 1, starting at 0
        const int32_t seq = m.batch.seq_ids[size_t(at)];
        CHECK((seq == prev_seq || seq == prev_seq + 1));
        if (at % seq_len == 0 && at > 0) CHECK(seq == prev_seq + 1);  // never shared between rows
        prev_seq = seq;
        const int32_t s = m.sample_ids[size_t(at)];
        if (s < 0) {
          CHECK(m.batch.targets[size_t(at)] == -1);
          CHECK(m.batch.weights[size_t(at)] == 0.0f);
          continue;
        }
        const int64_t j = next_pos[s]++;
        CHECK(m.batch.positions[size_t(at)] == j);
        const int64_t target = b.offsets[size_t(s)] + j + 1;
        REQUIRE(target < b.offsets[size_t(s) + 1]);
        CHECK(m.batch.tokens[size_t(at)] == b.tokens[size_t(target - 1)]);
        CHECK(m.batch.targets[size_t(at)] == b.tokens[size_t(target)]);
        const float w = b.loss_mask[size_t(target)] ? b.loss_weight[size_t(target)] : 0.0f;
        CHECK(m.batch.weights[size_t(at)] == w);
        CHECK(m.advantages[size_t(at)] == b.advantages[size_t(target)]);
        CHECK(m.inference_logprobs[size_t(at)] == b.inference_logprobs[size_t(target)]);
        CHECK(m.temperatures[size_t(at)] == b.temperature[size_t(s)]);
        loss += w > 0;
        ++rank_tokens;
        if (cov.rank_of_sample.count(s)) CHECK(cov.rank_of_sample[s] == r);
        cov.rank_of_sample[s] = r;
      }
      CHECK(m.batch.loss_tokens == loss);
      rank_loss += loss;
    }
    CHECK(rr.loss_tokens == rank_loss);
    CHECK(rr.tokens == rank_tokens);
    cov.loss_tokens += rank_loss;
    cov.tokens += rank_tokens;
    CHECK(rr.tokens_global == ranks[0].tokens_global);
  }
  // Every sample with something to predict, completely.
  int64_t pairs = 0;
  for (int64_t s = 0; s < b.samples(); ++s) {
    pairs += b.sample_pairs(s);
    CHECK(next_pos[int32_t(s)] == b.sample_pairs(s));
  }
  CHECK(cov.tokens == pairs);
  CHECK(ranks[0].tokens_global == pairs);
  CHECK(cov.loss_tokens == b.loss_tokens);
  return cov;
}

}  // namespace

TEST_SUITE("rollouts") {

TEST_CASE("reads a file: attributes, per-sample advantages expanded, default temperature and weights") {
  TempDir dir;
  const std::string path = dir.file("step_5.h5");
  RolloutFile f = hand_made();
  f.temperature.clear();
  write_rollouts(path, f);
  const RolloutBatch b = shardlm::read_rollouts(path, kVocab);
  CHECK(b.path == path);
  CHECK(b.step == 5);
  CHECK(b.policy_step == 4);
  CHECK(b.samples() == 4);
  CHECK(b.tokens == f.tokens);
  CHECK(b.offsets == f.offsets);
  CHECK(b.advantages_per_sample);
  CHECK(b.advantages == std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f, 0.5f, -1, -1, -1, 2, 0.25f, 0.25f, 0.25f, 0.25f,
                                           0.25f, 0.25f, 0.25f});
  CHECK(b.temperature == std::vector<float>{1, 1, 1, 1});
  CHECK(b.loss_weight == std::vector<float>(16, 1.0f));
  CHECK(b.loss_tokens == 9);
  CHECK(b.sample_pairs(2) == 0);
  CHECK(b.sample_pairs(3) == 6);

  // Per-token advantages are taken as they are; loss_weight 0 removes loss tokens.
  f = hand_made();
  f.advantages.assign(16, 0.0f);
  f.advantages[3] = 7.0f;
  f.loss_weight.assign(16, 1.0f);
  f.loss_weight[3] = 0.0f;
  f.loss_weight[4] = 0.5f;
  write_rollouts(path, f);
  const RolloutBatch c = shardlm::read_rollouts(path, kVocab);
  CHECK_FALSE(c.advantages_per_sample);
  CHECK(c.advantages[3] == 7.0f);
  CHECK(c.temperature == f.temperature);
  CHECK(c.loss_tokens == 8);
  CHECK(shardlm::rollout_path("/runs/r", 12) == "/runs/r/step_12.h5");
  CHECK(c.sampling_logprobs.empty());  // absent: the importance weights use inference_logprobs

  // sampling_logprobs, when present, is read as it is and packed at the target like inference_logprobs.
  f = hand_made();
  for (int t = 0; t < 16; ++t) f.sampling_logprobs.push_back(-0.05f * float(t + 1));
  write_rollouts(path, f);
  const RolloutBatch d = shardlm::read_rollouts(path, kVocab);
  CHECK(d.sampling_logprobs == f.sampling_logprobs);
  const shardlm::RankRollouts packed = shardlm::pack_rollouts(d, 8, 2, 0, 1);
  int64_t checked = 0;
  for (const auto& m : packed.micro_batches) {
    REQUIRE(m.sampling_logprobs.size() == m.inference_logprobs.size());
    for (size_t at = 0; at < m.inference_logprobs.size(); ++at)
      if (m.batch.targets[at] >= 0) {
        CHECK(m.sampling_logprobs[at] == doctest::Approx(0.5 * double(m.inference_logprobs[at])));
        ++checked;
      }
  }
  CHECK(checked == 12);  // every target of the 4 samples (4 + 2 + 0 + 6)
  CHECK(shardlm::rollout_fingerprint(d) != shardlm::rollout_fingerprint(c));
}

TEST_CASE("reader errors name the file and what is wrong") {
  TempDir dir;
  const std::string path = dir.file("step_5.h5");
  auto read_with = [&](const std::function<void(RolloutFile&)>& change) {
    RolloutFile f = hand_made();
    change(f);
    write_rollouts(path, f);
    return [&] { shardlm::read_rollouts(path, kVocab); };
  };
  auto expect = [&](const std::function<void(RolloutFile&)>& change, std::initializer_list<std::string> parts) {
    check_error(read_with(change), parts);
  };
  const std::string in = "rollout file '" + path + "'";

  // The unmodified file reads (so each error below is caused by its change).
  CHECK(error_of(read_with([](RolloutFile&) {})) == "(no error)");

  check_error([&] { shardlm::read_rollouts(dir.file("step_9.h5"), kVocab); },
              {"rollout file '" + dir.file("step_9.h5") + "' does not exist"});
  std::ofstream(dir.file("empty.h5")).close();
  check_error([&] { shardlm::read_rollouts(dir.file("empty.h5"), kVocab); },
              {"rollout file '" + dir.file("empty.h5") + "' is empty (0 bytes)", "step_<N>.h5.tmp"});
  std::ofstream(dir.file("text.h5")) << "not hdf5\n";
  check_error([&] { shardlm::read_rollouts(dir.file("text.h5"), kVocab); },
              {"rollout file '" + dir.file("text.h5") + "' is not an HDF5 file"});

  for (const char* name : {"tokens", "offsets", "loss_mask", "advantages", "inference_logprobs"})
    expect([&](RolloutFile& f) { f.omit.insert(name); },
           {in + " has no dataset '" + name + "'", "docs/rollouts.md"});
  expect([](RolloutFile& f) { f.step.reset(); }, {in + " has no root attribute 'step'"});
  expect([](RolloutFile& f) { f.policy_step.reset(); }, {in + " has no root attribute 'policy_step'"});

  expect([](RolloutFile& f) { f.wrong_dtype = "tokens"; }, {in + ": dataset 'tokens' has dtype int64, expected int32"});
  expect([](RolloutFile& f) { f.wrong_dtype = "offsets"; }, {in + ": dataset 'offsets' has dtype int32, expected int64"});
  expect([](RolloutFile& f) { f.wrong_dtype = "loss_mask"; }, {in + ": dataset 'loss_mask' has dtype int8, expected uint8"});
  expect([](RolloutFile& f) { f.wrong_dtype = "advantages"; },
         {in + ": dataset 'advantages' has dtype float64, expected float32"});
  expect([](RolloutFile& f) { f.wrong_dtype = "inference_logprobs"; },
         {in + ": dataset 'inference_logprobs' has dtype float64, expected float32"});
  expect([](RolloutFile& f) { f.wrong_dtype = "temperature"; },
         {in + ": dataset 'temperature' has dtype float64, expected float32"});
  expect([](RolloutFile& f) { f.rank_two = "tokens"; }, {in + ": dataset 'tokens' has rank 2, expected a 1-D array"});

  expect([](RolloutFile& f) { f.offsets = {0, 5, 8, 9, 15}; },
         {in + ": offsets ends at 15 but 'tokens' has 16 elements"});
  expect([](RolloutFile& f) { f.offsets = {0, 5, 4, 9, 16}; }, {in + ": offsets decrease at index 2"});
  expect([](RolloutFile& f) { f.offsets = {1, 5, 8, 9, 16}; }, {in + ": offsets[0] = 1, expected 0"});
  expect([](RolloutFile& f) { f.offsets = {}; }, {in + ": dataset 'offsets' is empty"});
  expect([](RolloutFile& f) { f.tokens = {}; f.offsets = {0}; f.loss_mask = {}; f.inference_logprobs = {};
                              f.advantages = {}; f.temperature = {}; },
         {in + " holds no samples (0 samples, 0 tokens)"});

  expect([](RolloutFile& f) { f.loss_mask.pop_back(); },
         {in + ": 'loss_mask' has 15 elements, expected 16 (one per token)"});
  expect([](RolloutFile& f) { f.inference_logprobs.push_back(-1); },
         {in + ": 'inference_logprobs' has 17 elements, expected 16 (one per token)"});
  expect([](RolloutFile& f) { f.advantages = {1, 2, 3}; },
         {in + ": 'advantages' has 3 elements, expected 16 (one per token) or 4 (one per sample)"});
  expect([](RolloutFile& f) { f.temperature = {1, 1}; },
         {in + ": 'temperature' has 2 elements, expected 4 (one per sample)"});
  expect([](RolloutFile& f) { f.loss_weight.assign(15, 1.0f); },
         {in + ": 'loss_weight' has 15 elements, expected 16 (one per token)"});

  expect([](RolloutFile& f) { f.tokens[7] = kVocab; },
         {in + ": tokens[7] = 50 (sample 1, token 2) is outside the model's vocabulary [0, 50)"});
  expect([](RolloutFile& f) { f.tokens[0] = -3; }, {in + ": tokens[0] = -3 (sample 0, token 0) is outside"});
  expect([](RolloutFile& f) { f.loss_mask[12] = 2; }, {in + ": loss_mask[12] = 2 (sample 3, token 3); values must be 0 or 1"});
  expect([](RolloutFile& f) { f.temperature[1] = 0.0f; }, {in + ": temperature[1] = 0; temperatures must be positive"});
  expect([](RolloutFile& f) { f.loss_weight.assign(16, 1.0f); f.loss_weight[4] = -1.0f; },
         {in + ": loss_weight[4] = -1 (sample 0, token 4); weights must be finite and >= 0"});

  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  expect([&](RolloutFile& f) { f.inference_logprobs[3] = nan; },
         {in + ": inference_logprobs[3] (sample 0, token 3) is NaN at a token that carries loss"});
  expect([&](RolloutFile& f) { f.inference_logprobs[13] = -inf; },
         {in + ": inference_logprobs[13] (sample 3, token 4) is -inf at a token that carries loss"});
  expect([](RolloutFile& f) { f.inference_logprobs[6] = 0.5f; },
         {in + ": inference_logprobs[6] (sample 1, token 1) = 0.5 is positive; log-probabilities must be <= 0"});
  expect([](RolloutFile& f) { f.sampling_logprobs.assign(15, -1.0f); },
         {in + ": 'sampling_logprobs' has 15 elements, expected 16 (one per token)"});
  expect([&](RolloutFile& f) { f.sampling_logprobs.assign(16, -1.0f); f.sampling_logprobs[7] = nan; },
         {in + ": sampling_logprobs[7] (sample 1, token 2) is NaN at a token that carries loss"});
  expect([](RolloutFile& f) { f.sampling_logprobs.assign(16, -1.0f); f.sampling_logprobs[14] = 0.25f; },
         {in + ": sampling_logprobs[14] (sample 3, token 5) = 0.25 is positive; log-probabilities must be <= 0"});
  expect([&](RolloutFile& f) { f.advantages[1] = nan; }, {in + ": advantages[1] (sample 1) is NaN"});
  expect([&](RolloutFile& f) { f.advantages.assign(16, 1.0f); f.advantages[7] = inf; },
         {in + ": advantages[7] (sample 1, token 2) is inf at a token that carries loss"});
  expect([](RolloutFile& f) { std::fill(f.loss_mask.begin(), f.loss_mask.end(), 0); f.loss_mask[0] = 1; f.loss_mask[5] = 1; },
         {in + ": no token carries loss", "nothing to train on"});

  // Values at positions that carry no loss are never read: NaN and positive
  // logprobs on prompt tokens, and on a sample's first token, are accepted.
  CHECK(error_of(read_with([&](RolloutFile& f) {
          f.inference_logprobs[0] = nan;   // first token of sample 0
          f.inference_logprobs[1] = 3.0f;  // prompt token
          f.inference_logprobs[10] = nan;  // prompt token of sample 3
        })) == "(no error)");

  check_error([&] { shardlm::read_rollouts(path, 0); }, {"vocab_size = 0"});
}

TEST_CASE("packs a hand-made file exactly (best fit, next-token pairs, RL arrays of the target)") {
  TempDir dir;
  const std::string path = dir.file("step_5.h5");
  write_rollouts(path, hand_made());
  const RolloutBatch b = shardlm::read_rollouts(path, kVocab);
  // pairs: s0 4, s1 2, s2 0, s3 6. Longest first: s3 -> row 0 (2 left); s0 does
  // not fit -> row 1 (4 left); s1 fits row 0 exactly (the least room that fits).
  const RankRollouts r = shardlm::pack_rollouts(b, 8, 2, 0, 1);
  REQUIRE(r.micro_batches.size() == 1);
  CHECK(r.real_micro_batches == 1);
  CHECK(r.samples == 3);
  CHECK(r.tokens == 12);
  CHECK(r.tokens_global == 12);
  CHECK(r.loss_tokens == 9);
  CHECK(r.loss_tokens_global == 9);
  const RlMicroBatch& m = r.micro_batches[0];
  CHECK(m.batch.rows == 2);
  CHECK(m.batch.seq_len == 8);
  CHECK(m.batch.tokens == std::vector<int32_t>{10, 11, 12, 13, 14, 15, 6, 7,  //
                                               1, 2, 3, 4, 0, 0, 0, 0});
  CHECK(m.batch.targets == std::vector<int32_t>{11, 12, 13, 14, 15, 16, 7, 8,  //
                                                2, 3, 4, 5, -1, -1, -1, -1});
  CHECK(m.batch.weights == std::vector<float>{0, 0, 1, 1, 1, 1, 1, 1,  //
                                              0, 1, 1, 1, 0, 0, 0, 0});
  CHECK(m.batch.positions == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 1,  //
                                                  0, 1, 2, 3, 0, 0, 0, 0});
  CHECK(m.batch.seq_ids == std::vector<int32_t>{0, 0, 0, 0, 0, 0, 1, 1,  //
                                                2, 2, 2, 2, 3, 3, 3, 3});
  CHECK(m.batch.loss_tokens == 9);
  CHECK(m.sample_ids == std::vector<int32_t>{3, 3, 3, 3, 3, 3, 1, 1,  //
                                             0, 0, 0, 0, -1, -1, -1, -1});
  CHECK(m.advantages == std::vector<float>{0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, -1, -1,  //
                                           0.5f, 0.5f, 0.5f, 0.5f, 0, 0, 0, 0});
  CHECK(m.temperatures == std::vector<float>{1.3f, 1.3f, 1.3f, 1.3f, 1.3f, 1.3f, 0.7f, 0.7f,  //
                                             1, 1, 1, 1, 1, 1, 1, 1});
  // The logprob of the target token: file index of the target (s3's start at 9).
  const std::vector<float>& lp = hand_made().inference_logprobs;
  CHECK(m.inference_logprobs == std::vector<float>{lp[10], lp[11], lp[12], lp[13], lp[14], lp[15], lp[6], lp[7],  //
                                                   lp[1], lp[2], lp[3], lp[4], 0, 0, 0, 0});

  // Two ranks: s3 (6) -> rank 0; s0 (4) -> rank 1; s1 (2) -> rank 1 (4 < 6).
  CHECK(shardlm::assign_samples_to_ranks(b, 2) == std::vector<int>{1, 1, -1, 0});
  const RankRollouts r1 = shardlm::pack_rollouts(b, 8, 1, 1, 2);
  REQUIRE(r1.micro_batches.size() == 1);
  CHECK(r1.micro_batches[0].batch.tokens == std::vector<int32_t>{1, 2, 3, 4, 6, 7, 0, 0});
  CHECK(r1.loss_tokens == 5);
  CHECK(r1.loss_tokens_global == 9);
  CHECK(r1.tokens_global == 12);

  // Too long for the row: the error names the sample.
  check_error([&] { shardlm::pack_rollouts(b, 5, 1, 0, 1); },
              {"rollout file '" + path + "': sample 3 has 7 tokens, more than data.seq_len + 1 = 6"});
  CHECK(error_of([&] { shardlm::pack_rollouts(b, 6, 1, 0, 1); }) == "(no error)");  // exactly seq_len pairs fit
  check_error([&] { shardlm::pack_rollouts(b, 8, 1, 2, 2); }, {"rank 2 is outside a world of 2"});
}

TEST_CASE("assignment: longest first, to the rank with the fewest positions, ties to the lowest rank") {
  RolloutBatch b;
  // pairs 3, 5, 3, 1, 5, 3, 0 (a one-token sample).
  b.offsets = {0, 4, 10, 14, 16, 22, 26, 27};
  // sorted: s1(5) s4(5) s0(3) s2(3) s5(3) s3(1):
  // s1 -> 0 (0,0 tie) | s4 -> 1 | s0 -> 0 (5,5 tie) | s2 -> 1 | s5 -> 0 (8,8 tie) | s3 -> 1 (11 vs 8)
  CHECK(shardlm::assign_samples_to_ranks(b, 2) == std::vector<int>{0, 0, 1, 1, 1, 0, -1});
  // Three ranks: s1 -> 0, s4 -> 1, s0 -> 2, s2 -> 2 (3 < 5), s5 -> 0 (5,5,6), s3 -> 1 (8,5,6)
  CHECK(shardlm::assign_samples_to_ranks(b, 3) == std::vector<int>{2, 0, 2, 1, 1, 0, -1});
  CHECK(shardlm::assign_samples_to_ranks(b, 1) == std::vector<int>{0, 0, 0, 0, 0, 0, -1});
}

TEST_CASE("balance over W = 1, 2, 3: every sample once, loss-token totals equal, same micro-batch count") {
  TempDir dir;
  const std::string path = dir.file("step_5.h5");
  write_rollouts(path, random_file(45, 99));
  const RolloutBatch b = shardlm::read_rollouts(path, kVocab);
  int64_t max_pairs = 0;
  for (int64_t s = 0; s < b.samples(); ++s) max_pairs = std::max(max_pairs, b.sample_pairs(s));
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    const Coverage cov = check_world(b, world, 32, 2);
    // Greedy longest-first: ranks differ by at most the longest sample.
    std::vector<int64_t> per_rank(world, 0);
    for (const auto& [s, r] : cov.rank_of_sample) per_rank[size_t(r)] += b.sample_pairs(s);
    const auto [lo, hi] = std::minmax_element(per_rank.begin(), per_rank.end());
    CHECK(*hi - *lo <= max_pairs);
    CHECK(*lo > 0);
  }
}

TEST_CASE("ranks with fewer micro-batches are padded with empty ones") {
  TempDir dir;
  const std::string path = dir.file("step_5.h5");
  // Three samples of 9 tokens (8 pairs, a full row each) over 2 ranks, 1 row per micro-batch.
  RolloutFile f;
  for (int s = 0; s < 3; ++s)
    for (int i = 0; i < 9; ++i) f.tokens.push_back(int32_t(1 + s * 9 + i));
  f.offsets = {0, 9, 18, 27};
  f.loss_mask.assign(27, 1);
  f.advantages = {1.0f, -1.0f, 0.5f};
  f.inference_logprobs.assign(27, -1.0f);
  write_rollouts(path, f);
  const RolloutBatch b = shardlm::read_rollouts(path, kVocab);
  const RankRollouts r0 = shardlm::pack_rollouts(b, 8, 1, 0, 2);
  const RankRollouts r1 = shardlm::pack_rollouts(b, 8, 1, 1, 2);
  CHECK(r0.real_micro_batches == 2);
  CHECK(r1.real_micro_batches == 1);
  REQUIRE(r0.micro_batches.size() == 2);
  REQUIRE(r1.micro_batches.size() == 2);
  const RlMicroBatch& pad = r1.micro_batches[1];
  CHECK(pad.batch.loss_tokens == 0);
  CHECK(pad.batch.targets == std::vector<int32_t>(8, -1));
  CHECK(pad.batch.weights == std::vector<float>(8, 0.0f));
  CHECK(pad.batch.seq_ids == std::vector<int32_t>(8, 0));
  CHECK(pad.temperatures == std::vector<float>(8, 1.0f));
  CHECK(r0.loss_tokens + r1.loss_tokens == 24);
  check_world(b, 2, 8, 1);
}

TEST_CASE("check_rollout_step: step attribute and the allowed policy lag") {
  RolloutBatch b;
  b.path = "/r/step_10.h5";
  b.step = 10;
  b.policy_step = 8;
  CHECK(error_of([&] { shardlm::check_rollout_step(b, 10, 2); }) == "(no error)");
  CHECK(error_of([&] { shardlm::check_rollout_step(b, 10, 1); }) ==
        "rollout file '/r/step_10.h5' was generated with the weights of step 8, 2 steps behind step 10, but "
        "data.max_async = 1 allows at most 1; raise data.max_async or let the inference server catch up");
  check_error([&] { shardlm::check_rollout_step(b, 11, 5); },
              {"rollout file '/r/step_10.h5' has attribute step = 10 but was read for step 11"});
  b.policy_step = 11;
  check_error([&] { shardlm::check_rollout_step(b, 10, 5); }, {"policy_step = 11 is after step 10"});
  b.policy_step = 10;
  CHECK(error_of([&] { shardlm::check_rollout_step(b, 10, 0); }) == "(no error)");  // on-policy
}

TEST_CASE("wait_for_rollouts: times out with the message, reports progress, ignores .tmp") {
  TempDir dir;
  std::ofstream(dir.file("step_7.h5.tmp")) << "being written";
  std::vector<std::string> progress;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string message = error_of([&] {
    shardlm::wait_for_rollouts(dir.path.string(), 7, 0.35, [&](const std::string& m) { progress.push_back(m); },
                               0.1);
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(message == "no rollouts for step 7 in " + dir.path.string() +
                       " after 0.35 s (is the inference server running?)");
  CHECK(waited >= 0.35);
  CHECK(waited < 5.0);
  CHECK(progress.size() >= 2);
  CHECK(progress.size() <= 4);
  REQUIRE_FALSE(progress.empty());
  CHECK(progress[0].find("waiting for rollouts for step 7: " + dir.file("step_7.h5") + " not there after") == 0);

  // Present already: returns at once, no progress message.
  std::ofstream(dir.file("step_8.h5")) << "x";
  progress.clear();
  CHECK(shardlm::wait_for_rollouts(dir.path.string(), 8, 0.0, [&](const std::string& m) { progress.push_back(m); }) ==
        dir.file("step_8.h5"));
  CHECK(progress.empty());
}

TEST_CASE("wait_for_rollouts: returns when another thread renames a complete file into place") {
  TempDir dir;
  const std::string final_path = dir.file("step_3.h5");
  RolloutFile f = hand_made();
  f.step = 3;
  f.policy_step = 3;
  write_rollouts(final_path + ".tmp", f);  // here: HDF5 is not called from two threads
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    fs::rename(final_path + ".tmp", final_path);
  });
  const auto t0 = std::chrono::steady_clock::now();
  std::string got;
  const std::string message = error_of([&] { got = shardlm::wait_for_rollouts(dir.path.string(), 3, 30.0, nullptr); });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  writer.join();
  CHECK(message == "(no error)");
  CHECK(got == final_path);
  CHECK(waited >= 0.25);
  CHECK(waited < 10.0);
  const RolloutBatch b = shardlm::read_rollouts(got, kVocab);
  CHECK(b.step == 3);
  CHECK(error_of([&] { shardlm::check_rollout_step(b, 3, 0); }) == "(no error)");
}

TEST_CASE("tools/make_rollouts.py writes files the reader accepts and packs") {
  const char* env = std::getenv("PYTHON");
  const std::string python = env && *env ? env : "/usr/bin/python3";
  if (shardlm_test::run(python + " -c 'import h5py, numpy'").status != 0) {
    MESSAGE("skipped: " << python << " has no h5py/numpy");
    return;
  }
  TempDir dir;
  const auto r = shardlm_test::run(python + " tools/make_rollouts.py inputs/data/tiny.h5 --out " +
                                   dir.path.string() + " --steps 2 --samples-per-step 6 --max-tokens 65 --lag 1 "
                                   "--temperature 0.9");
  INFO(r.output);
  REQUIRE(r.status == 0);
  for (int64_t step : {0, 1}) {
    const RolloutBatch b = shardlm::read_rollouts(shardlm::rollout_path(dir.path.string(), step), 258);
    CHECK(b.step == step);
    CHECK(b.policy_step == std::max<int64_t>(0, step - 1));
    CHECK(b.samples() == 6);
    CHECK(b.advantages_per_sample);
    CHECK(b.temperature == std::vector<float>(6, 0.9f));
    CHECK(error_of([&] { shardlm::check_rollout_step(b, step, 1); }) == "(no error)");
    check_world(b, 2, 64, 2);
  }
}

TEST_CASE("router replay's routes survive the file: written, read back, packed at the INPUT token, padding -1; a "
          "file without them reads as before; bad routes are named") {
  TempDir dir;
  // The hand-made file's samples through the writer the inference ranks use, with routes of
  // 2 layers x 2 experts: token t's row is {t % 8, (t + 1) % 8, (t + 3) % 8, (t + 5) % 8}, a
  // sample's last token -1 (never fed).
  const RolloutFile hand = hand_made();
  shardlm::RolloutFile w;
  w.step = 5;
  w.policy_step = 4;
  w.tokens = hand.tokens;
  w.offsets = hand.offsets;
  w.loss_mask = hand.loss_mask;
  w.advantages = hand.advantages;
  w.inference_logprobs = hand.inference_logprobs;
  w.temperature = hand.temperature;
  const int64_t R = 4, T = int64_t(w.tokens.size());
  w.route_width = R;
  for (int64_t t = 0; t < T; ++t) {
    const bool last = std::find(w.offsets.begin() + 1, w.offsets.end(), t + 1) != w.offsets.end();
    for (int32_t k : {0, 1, 3, 5}) w.routes.push_back(last ? -1 : int32_t((t + k) % 8));
  }
  shardlm::write_rollouts(dir.path.string(), w);
  const std::string path = shardlm::rollout_path(dir.path.string(), 5);
  const RolloutBatch b = shardlm::read_rollouts(path, kVocab);
  CHECK(b.route_width == R);
  CHECK(b.routes == w.routes);

  const RankRollouts r = shardlm::pack_rollouts(b, 8, 2, 0, 1);
  REQUIRE(r.micro_batches.size() == 1);
  const RlMicroBatch& m = r.micro_batches[0];
  CHECK(m.route_width == R);
  REQUIRE(m.routes.size() == m.batch.tokens.size() * size_t(R));
  int64_t filled = 0, padding = 0;
  for (size_t at = 0; at < m.batch.tokens.size(); ++at) {
    CAPTURE(at);
    const std::vector<int32_t> row(m.routes.begin() + ptrdiff_t(at) * R, m.routes.begin() + ptrdiff_t(at + 1) * R);
    if (m.sample_ids[at] < 0) {
      CHECK(row == std::vector<int32_t>(size_t(R), -1));
      ++padding;
      continue;
    }
    // The hand-made tokens are their file index + 1: the input's row, never the target's.
    const int64_t input = m.batch.tokens[at] - 1;
    CHECK(row == std::vector<int32_t>(w.routes.begin() + input * R, w.routes.begin() + (input + 1) * R));
    CHECK(row[0] >= 0);  // an input was always fed
    ++filled;
  }
  CHECK(filled == 12);
  CHECK(padding == 4);
  CHECK(shardlm::rollout_fingerprint(b) != [&] {
    RolloutBatch other = b;
    other.routes[5] = (other.routes[5] + 1) % 8;
    return shardlm::rollout_fingerprint(other);
  }());

  // Without routes: nothing to replay, the micro-batch has none.
  shardlm::RolloutFile plain = w;
  plain.step = 6;
  plain.routes.clear();
  plain.route_width = 0;
  shardlm::write_rollouts(dir.path.string(), plain);
  const RolloutBatch none = shardlm::read_rollouts(shardlm::rollout_path(dir.path.string(), 6), kVocab);
  CHECK(none.route_width == 0);
  CHECK(none.routes.empty());
  CHECK(shardlm::pack_rollouts(none, 8, 2, 0, 1).micro_batches[0].routes.empty());

  // An expert below -1 is named with its token.
  shardlm::RolloutFile bad = w;
  bad.step = 7;
  bad.routes[size_t(6 * R + 2)] = -3;
  shardlm::write_rollouts(dir.path.string(), bad);
  check_error([&] { shardlm::read_rollouts(shardlm::rollout_path(dir.path.string(), 7), kVocab); },
              {"routes[6, 2] = -3 (sample 1, token 1)", "-1 where nothing was recorded"});
}

}  // TEST_SUITE
