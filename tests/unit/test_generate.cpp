// test_generate.cpp — `shardlm generate`'s engine against the training forward:
// greedy = argmax of the full forward step by step, the reported logprobs =
// the forward's log-softmax, decode logits over the KV cache = the full
// forward's, reproducibility under continuous batching, top-k / top-p, stop
// reasons, and bad inputs. The HF fixtures (tests/fixtures: Llama with GQA
// and tied embeddings, Qwen2 with q/k/v biases, Qwen3 with q/k norms) are the
// tiny models; each case runs in well under a second on 2 cores.
#include <doctest/doctest.h>
#include <hdf5.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "config/cli.hpp"
#include "data/prompts.hpp"
#include "infer/command.hpp"
#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "infer/model.hpp"
#include "infer/sampler.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "run_command.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/h5util.hpp"
#include "train/engine.hpp"
#include "train/shard.hpp"

using namespace shardlm;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures[] = {"llama-gqa-tied", "qwen2-bias", "qwen3-qknorm"};

fs::path fixture(const std::string& name) { return fs::path("tests/fixtures") / name; }

// The training path: a one-rank ShardedModel and Engine, one sequence per call,
// positions from 0 (what `shardlm forward` runs).
struct FullForward {
  ModelConfig config;
  std::unique_ptr<Comm> comm = make_self_comm();
  std::unique_ptr<ShardedModel> model;
  std::unique_ptr<Engine> engine;
  explicit FullForward(const fs::path& dir) : config(read_hf_config(dir)) {
    model = std::make_unique<ShardedModel>(config, 0, 1);
    model->load_hf(SafetensorsReader(dir));
    EngineOptions options;
    options.max_tokens = config.max_position_embeddings;
    engine = std::make_unique<Engine>(*model, *comm, options);
  }
  // logits (T, V) of every position of `seq`.
  std::vector<float> logits(const std::vector<int32_t>& seq) {
    std::vector<int32_t> positions(seq.size()), seq_ids(seq.size(), 0);
    std::iota(positions.begin(), positions.end(), 0);
    TokenBatch b;
    b.N = int64_t(seq.size());
    b.tokens = seq.data();
    b.positions = positions.data();
    b.seq_ids = seq_ids.data();
    std::vector<float> out(seq.size() * size_t(config.vocab_size));
    engine->forward_logits(b, out.data());
    return out;
  }
};

int32_t argmax(const float* x, int64_t V) { return int32_t(std::max_element(x, x + V) - x); }

double log_softmax_at(const float* x, int64_t V, int32_t t, double temperature = 1.0) {
  double m = x[0];
  for (int64_t v = 1; v < V; ++v) m = std::max(m, double(x[v]));
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp((double(x[v]) - m) / temperature);
  return (double(x[t]) - m) / temperature - std::log(sum);
}

// Prompts of different lengths, ids drawn from a fixed formula (no RNG state).
std::vector<std::vector<int32_t>> make_prompts(int count, int64_t vocab) {
  std::vector<std::vector<int32_t>> out;
  for (int p = 0; p < count; ++p) {
    std::vector<int32_t> ids;
    const int len = 2 + (p * 7) % 11;
    for (int t = 0; t < len; ++t) ids.push_back(int32_t((p * 31 + t * 17 + 5) % (vocab - 2)));
    out.push_back(ids);
  }
  return out;
}

std::vector<GenerateRequest> requests_for(const std::vector<std::vector<int32_t>>& prompts, int64_t n) {
  std::vector<GenerateRequest> r;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int64_t s = 0; s < n; ++s) r.push_back({int64_t(p), s, prompts[p]});
  return r;
}

std::vector<Completion> run(const InferenceModel& m, const std::vector<GenerateRequest>& requests,
                            const GenerateOptions& o, int64_t batch) {
  CpuDecoder decoder(m, plan_limits(m.config(), requests, batch, o.max_new_tokens, "test"));
  return generate(decoder, requests, o);
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("shardlm-generate-" + std::to_string(getpid()) + "-" + std::to_string(rand()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// A prompt file as tools/make_prompts.py writes it, with knobs to break it.
struct PromptFileSpec {
  std::vector<int32_t> tokens{1, 2, 3, 4, 5};
  std::vector<int64_t> offsets{0, 2, 5};
  bool tokens_as_int64 = false;
  std::string format = "shardlm-prompts-1";
  std::vector<int64_t> stop_ids{257};
};
void write_prompt_file(const fs::path& file, const PromptFileSpec& s) {
  using h5::Handle;
  Handle f(H5_CHECK(H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
  auto write = [&](const char* name, hid_t type, hid_t mem, const void* data, hsize_t n) {
    Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
    Handle d(H5_CHECK(H5Dcreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Dclose);
    if (n) H5_CHECK(H5Dwrite(d, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
  };
  if (s.tokens_as_int64) {
    std::vector<int64_t> wide(s.tokens.begin(), s.tokens.end());
    write("tokens", H5T_STD_I64LE, H5T_NATIVE_INT64, wide.data(), wide.size());
  } else {
    write("tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, s.tokens.data(), s.tokens.size());
  }
  write("offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, s.offsets.data(), s.offsets.size());
  if (!s.format.empty()) {
    Handle t(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
    H5_CHECK(H5Tset_size(t, H5T_VARIABLE));
    Handle space(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose);
    Handle a(H5_CHECK(H5Acreate2(f, "format", t, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
    const char* p = s.format.c_str();
    H5_CHECK(H5Awrite(a, t, &p));
  }
  const hsize_t n = s.stop_ids.size();
  Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
  Handle a(H5_CHECK(H5Acreate2(f, "stop_token_ids", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
  H5_CHECK(H5Awrite(a, H5T_NATIVE_INT64, s.stop_ids.data()));
}

}  // namespace

TEST_SUITE("generate") {

TEST_CASE("greedy decoding is the argmax of the full forward at every step; logprobs are its log-softmax") {
  for (const std::string& name : kFixtures) {
    CAPTURE(name);
    const InferenceModel m = InferenceModel::from_hf(fixture(name));
    FullForward ref(fixture(name));
    const int64_t V = m.config().vocab_size;
    const auto prompts = make_prompts(5, V);
    for (double temperature : {0.0, 0.7}) {
      CAPTURE(temperature);
      GenerateOptions o;
      o.sampling.temperature = temperature;
      o.sampling.seed = 11;
      o.max_new_tokens = 12;
      // Batch 2 for 5 prompts: slots are refilled as sequences finish (continuous batching).
      const auto done = run(m, requests_for(prompts, 1), o, 2);
      REQUIRE(done.size() == prompts.size());
      double max_model_diff = 0, max_tempered_diff = 0;
      int checked = 0;
      for (const Completion& c : done) {
        REQUIRE(int64_t(c.tokens.size()) == o.max_new_tokens);  // no stop id in these options
        CHECK(c.finish == Finish::Length);
        std::vector<int32_t> seq = prompts[size_t(c.prompt)];
        const size_t plen = seq.size();
        seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
        const std::vector<float> logits = ref.logits(seq);
        for (size_t i = 0; i < c.tokens.size(); ++i) {
          const float* row = logits.data() + (plen - 1 + i) * size_t(V);  // predicts token plen + i
          if (temperature == 0) {
            CHECK(c.tokens[i] == argmax(row, V));
            CHECK(c.sampling_logprobs[i] == 0.0f);
          }
          max_model_diff = std::max(max_model_diff, std::abs(c.model_logprobs[i] - log_softmax_at(row, V, c.tokens[i])));
          if (temperature > 0)
            max_tempered_diff = std::max(max_tempered_diff, std::abs(c.tempered_logprobs[i] -
                                                                     log_softmax_at(row, V, c.tokens[i], temperature)));
          ++checked;
        }
      }
      MESSAGE(name << " T=" << temperature << ": " << checked << " tokens, max |model logprob - forward log-softmax| "
                   << max_model_diff << ", tempered " << max_tempered_diff);
      CHECK(max_model_diff < 1e-5);
      CHECK(max_tempered_diff < 1e-5);
    }
  }
}

TEST_CASE("KV-cache decode logits equal the full forward's at every position (batched, slots out of order)") {
  for (const std::string& name : kFixtures) {
    CAPTURE(name);
    const InferenceModel m = InferenceModel::from_hf(fixture(name));
    FullForward ref(fixture(name));
    const int64_t V = m.config().vocab_size;
    const auto prompts = make_prompts(3, V);  // lengths 2, 9, 5
    DecoderLimits limits{.slots = 4, .max_len = 40};
    CpuDecoder dec(m, limits);
    // Three prompts into slots 3, 0, 2 in one prefill; then 20 decode steps feeding a fixed token stream.
    const std::vector<int32_t> slots{3, 0, 2};
    std::vector<std::span<const int32_t>> spans(prompts.begin(), prompts.end());
    std::vector<float> logits(size_t(4 * V));
    dec.prefill(slots, spans, logits.data());
    std::vector<std::vector<int32_t>> seqs = prompts;
    std::vector<std::vector<std::vector<float>>> got(3);  // per prompt, per predicted position: (V)
    for (int i = 0; i < 3; ++i) got[size_t(i)].emplace_back(logits.begin() + i * V, logits.begin() + (i + 1) * V);
    for (int step = 0; step < 20; ++step) {
      std::vector<int32_t> tok;
      for (int i = 0; i < 3; ++i) {
        tok.push_back(int32_t((step * 13 + i * 29 + 7) % V));
        seqs[size_t(i)].push_back(tok.back());
      }
      dec.decode(slots, tok, logits.data());
      for (int i = 0; i < 3; ++i) got[size_t(i)].emplace_back(logits.begin() + i * V, logits.begin() + (i + 1) * V);
    }
    double worst = 0;
    for (int i = 0; i < 3; ++i) {
      CHECK(dec.length(slots[size_t(i)]) == int64_t(seqs[size_t(i)].size()));
      const std::vector<float> full = ref.logits(seqs[size_t(i)]);
      const size_t plen = prompts[size_t(i)].size();
      for (size_t k = 0; k < got[size_t(i)].size(); ++k) {
        const float* row = full.data() + (plen - 1 + k) * size_t(V);
        double diff = 0, norm = 0;
        for (int64_t v = 0; v < V; ++v) {
          diff += std::pow(double(got[size_t(i)][k][size_t(v)]) - row[v], 2);
          norm += double(row[v]) * row[v];
        }
        worst = std::max(worst, std::sqrt(diff / norm));
      }
    }
    MESSAGE(name << ": max relative L2 error of decode logits vs the full forward over 63 positions: " << worst);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("same seed: bit-identical completions at batch 1, 3 and 8, any slot order, 1 thread; another seed differs") {
  const InferenceModel m = InferenceModel::from_hf(fixture("qwen3-qknorm"));
  const int64_t V = m.config().vocab_size;
  const auto prompts = make_prompts(6, V);
  const auto requests = requests_for(prompts, 3);  // 18 sequences
  GenerateOptions o;
  o.sampling = {.temperature = 1.0, .top_k = 100, .top_p = 0.95, .seed = 1234};
  o.max_new_tokens = 16;
  // 24 stop ids: about one step in ten ends a sequence, so slots free at different times.
  for (int32_t id = 0; id < 24; ++id) o.stop_ids.push_back(id * 10);
  const auto base = run(m, requests, o, 1);
  int stopped = 0;
  for (const Completion& c : base) stopped += c.finish == Finish::Stop;
  MESSAGE(stopped << " of " << base.size() << " sequences stopped early");
  CHECK(stopped >= 3);
  CHECK(stopped < int(base.size()));
  struct Variant { int64_t batch; std::vector<int32_t> order; };
  const std::vector<Variant> variants{{3, {}}, {3, {2, 0, 1}}, {8, {7, 6, 5, 4, 3, 2, 1, 0}}, {8, {}}, {5, {}}};
  for (const Variant& v : variants) {
    CAPTURE(v.batch);
    GenerateOptions ov = o;
    ov.slot_order = v.order;
    // The last variant on one thread: the kernels' sums do not depend on the thread count either.
    const int threads = omp_get_max_threads();
    if (v.batch == 5) omp_set_num_threads(1);
    const auto got = run(m, requests, ov, v.batch);
    omp_set_num_threads(threads);
    REQUIRE(got.size() == base.size());
    int logprobs_equal = 0, total = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK(got[i].prompt == base[i].prompt);
      CHECK(got[i].sample == base[i].sample);
      CHECK(got[i].tokens == base[i].tokens);
      CHECK(got[i].finish == base[i].finish);
      if (got[i].tokens != base[i].tokens) continue;
      for (size_t t = 0; t < got[i].tokens.size(); ++t, ++total)
        logprobs_equal += got[i].model_logprobs[t] == base[i].model_logprobs[t] &&
                          got[i].sampling_logprobs[t] == base[i].sampling_logprobs[t] &&
                          got[i].tempered_logprobs[t] == base[i].tempered_logprobs[t];
    }
    MESSAGE("batch " << v.batch << ": " << logprobs_equal << " of " << total << " tokens' logprobs bit-identical");
    CHECK(logprobs_equal == total);
  }
  // The n samples of a prompt differ from each other, and another seed changes them.
  CHECK(base[0].tokens != base[1].tokens);
  GenerateOptions other = o;
  other.sampling.seed = 1235;
  const auto diff = run(m, requests, other, 8);
  int same = 0;
  for (size_t i = 0; i < diff.size(); ++i) same += diff[i].tokens == base[i].tokens;
  CHECK(same <= 1);
}

TEST_CASE("top-k = 1 is greedy; top-p keeps the nucleus only; the draws follow the truncated distribution") {
  const InferenceModel m = InferenceModel::from_hf(fixture("llama-gqa-tied"));
  const auto prompts = make_prompts(4, m.config().vocab_size);
  GenerateOptions greedy;
  greedy.sampling.temperature = 0;
  greedy.max_new_tokens = 10;
  GenerateOptions top1 = greedy;
  top1.sampling = {.temperature = 1.3, .top_k = 1, .top_p = 1.0, .seed = 99};
  const auto a = run(m, requests_for(prompts, 1), greedy, 4);
  const auto b = run(m, requests_for(prompts, 2), top1, 4);
  for (size_t p = 0; p < prompts.size(); ++p) {
    CHECK(b[2 * p].tokens == a[p].tokens);
    CHECK(b[2 * p + 1].tokens == a[p].tokens);
    for (float lp : b[2 * p].sampling_logprobs) CHECK(lp == 0.0f);  // a point mass
  }

  // A 6-token vocabulary with probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (at temperature 1).
  const std::vector<double> p{0.4, 0.25, 0.15, 0.1, 0.06, 0.04};
  std::vector<float> logits;
  for (double q : p) logits.push_back(float(std::log(q)));
  std::swap(logits[0], logits[3]);  // id 3 is the most probable: the sort, not the ids, decides
  std::vector<int32_t> ids;
  std::vector<double> probs;
  Sampler nucleus({.temperature = 1.0, .top_k = 0, .top_p = 0.75, .seed = 5}, 6);
  nucleus.distribution(logits.data(), ids, probs);
  // 0.4 + 0.25 = 0.65 < 0.75 <= 0.8: the three most probable.
  CHECK(ids == std::vector<int32_t>{3, 1, 2});
  REQUIRE(probs.size() == 3);
  CHECK(probs[0] == doctest::Approx(0.4 / 0.8).epsilon(1e-6));
  CHECK(probs[2] == doctest::Approx(0.15 / 0.8).epsilon(1e-6));
  Sampler topk({.temperature = 1.0, .top_k = 2, .top_p = 1.0, .seed = 5}, 6);
  topk.distribution(logits.data(), ids, probs);
  CHECK(ids == std::vector<int32_t>{3, 1});
  CHECK(probs[1] == doctest::Approx(0.25 / 0.65).epsilon(1e-6));
  Sampler both({.temperature = 1.0, .top_k = 4, .top_p = 0.5, .seed = 5}, 6);  // top-p over what top-k left
  both.distribution(logits.data(), ids, probs);
  CHECK(ids == std::vector<int32_t>{3, 1});  // 0.4/0.9 < 0.5 <= 0.65/0.9

  // 20000 draws: nothing outside the nucleus, frequencies within 0.015 of the renormalised probabilities,
  // and each draw's logprob is log of its renormalised probability.
  std::map<int32_t, int> count;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) {
    const Sampled s = nucleus.sample(logits.data(), {0, 0, i});
    ++count[s.token];
    const double want = s.token == 3 ? 0.4 / 0.8 : s.token == 1 ? 0.25 / 0.8 : 0.15 / 0.8;
    if (i < 100) CHECK(s.sampling_logprob == doctest::Approx(std::log(want)).epsilon(1e-6));
  }
  CHECK(count.size() == 3);
  CHECK(double(count[3]) / draws == doctest::Approx(0.5).epsilon(0.03));
  CHECK(double(count[1]) / draws == doctest::Approx(0.3125).epsilon(0.05));
  CHECK(double(count[2]) / draws == doctest::Approx(0.1875).epsilon(0.08));
  MESSAGE("top-p 0.75 over 20000 draws: " << count[3] << " / " << count[1] << " / " << count[2]
                                           << " (expected 10000 / 6250 / 3750)");

  // The draw is a function of (seed, prompt, sample, position) only.
  CHECK(uniform_draw(1, {2, 3, 4}) == uniform_draw(1, {2, 3, 4}));
  CHECK(uniform_draw(1, {2, 3, 4}) != uniform_draw(1, {3, 2, 4}));
  CHECK(uniform_draw(1, {2, 3, 4}) != uniform_draw(2, {2, 3, 4}));
  CHECK(sampling_params_error({.temperature = -1}).find("--temperature") != std::string::npos);
  CHECK(sampling_params_error({.top_p = 0}).find("--top-p") != std::string::npos);
}

TEST_CASE("a stop id ends a sequence with reason stop (the id is its last token); else max_new_tokens, length") {
  const InferenceModel m = InferenceModel::from_hf(fixture("qwen2-bias"));
  const auto prompts = make_prompts(3, m.config().vocab_size);
  GenerateOptions o;
  o.sampling.temperature = 0;
  o.max_new_tokens = 9;
  const auto free_run = run(m, requests_for(prompts, 1), o, 3);
  for (const Completion& c : free_run) {
    CHECK(c.finish == Finish::Length);
    CHECK(c.tokens.size() == 9);
  }
  // The greedy continuation's 4th token of prompt 1 as the stop id: prompt 1 ends there.
  const int32_t stop = free_run[1].tokens[3];
  const size_t first = size_t(std::find(free_run[1].tokens.begin(), free_run[1].tokens.end(), stop) -
                              free_run[1].tokens.begin());
  o.stop_ids = {stop};
  const auto stopped = run(m, requests_for(prompts, 1), o, 3);
  CHECK(stopped[1].finish == Finish::Stop);
  CHECK(stopped[1].tokens.size() == first + 1);
  CHECK(stopped[1].tokens.back() == stop);
  CHECK(std::vector<int32_t>(free_run[1].tokens.begin(), free_run[1].tokens.begin() + long(first) + 1) ==
        stopped[1].tokens);
  for (size_t p : {size_t(0), size_t(2)}) {  // the others are unchanged unless they meet the id too
    const auto it = std::find(free_run[p].tokens.begin(), free_run[p].tokens.end(), stop);
    CHECK(stopped[p].finish == (it == free_run[p].tokens.end() ? Finish::Length : Finish::Stop));
    CHECK(stopped[p].tokens == std::vector<int32_t>(free_run[p].tokens.begin(),
                                                    it == free_run[p].tokens.end() ? it : it + 1));
  }
  // max_new_tokens = 1: one token each, straight from the prefill.
  o.stop_ids.clear();
  o.max_new_tokens = 1;
  for (const Completion& c : run(m, requests_for(prompts, 2), o, 2)) CHECK(c.tokens.size() == 1);
  // The fixtures' eos (config.json and generation_config.json: 257) is a stop id of the model.
  CHECK(m.eos_ids == std::vector<int32_t>{257});
}

TEST_CASE("bad inputs: prompt files, ids, a missing model, a prompt longer than the model's positions") {
  TempDir t;
  const fs::path good = t.path / "good.h5";
  write_prompt_file(good, {});
  const PromptSet ps = read_prompts(good.string(), 258);
  CHECK(ps.size() == 2);
  CHECK(ps.prompt(1).size() == 3);
  CHECK(ps.prompt(1)[0] == 3);
  CHECK(ps.stop_ids == std::vector<int32_t>{257});

  auto bad = [&](const PromptFileSpec& s, int64_t vocab = 258) {
    const fs::path f = t.path / "bad.h5";
    write_prompt_file(f, s);
    return error_of([&] { read_prompts(f.string(), vocab); });
  };
  CHECK(error_of([&] { read_prompts((t.path / "none.h5").string(), 258); }).find("does not exist") !=
        std::string::npos);
  {
    std::ofstream(t.path / "text.h5") << "not hdf5";
    const std::string e = error_of([&] { read_prompts((t.path / "text.h5").string(), 258); });
    CHECK(e.find("is not an HDF5 file") != std::string::npos);
    CHECK(e.find("text.h5") != std::string::npos);
  }
  PromptFileSpec s;
  s.tokens_as_int64 = true;
  CHECK(bad(s).find("dataset 'tokens' has dtype int64, expected int32") != std::string::npos);
  s = {};
  s.offsets = {0, 2, 9};
  CHECK(bad(s).find("prompt 1 spans tokens [2, 9) of 5") != std::string::npos);
  s.offsets = {0, 2, 2, 5};
  CHECK(bad(s).find("no empty prompt") != std::string::npos);
  s.offsets = {0, 2, 4};
  CHECK(bad(s).find("the last offset is 4 but 'tokens' holds 5 ids") != std::string::npos);
  s.offsets = {1, 5};
  CHECK(bad(s).find("offsets[0] is 1") != std::string::npos);
  s = {};
  s.format = "";
  CHECK(bad(s).find("has no 'format' attribute") != std::string::npos);
  s.format = "shardlm-prompts-9";
  CHECK(bad(s).find("has format 'shardlm-prompts-9'") != std::string::npos);
  s = {};
  s.tokens = {1, 2, 3, 300, 5};
  CHECK(bad(s).find("prompt 1, token 1 is 300, outside the model's vocabulary [0, 258)") != std::string::npos);
  CHECK(error_of([] { prompt_from_ids("1,2,x", 258); }).find("comma-separated token ids") != std::string::npos);
  CHECK(error_of([] { prompt_from_ids("1,258", 258); }).find("258, outside the model's vocabulary") !=
        std::string::npos);
  CHECK(prompt_from_ids("4, 5,6", 258).tokens == std::vector<int32_t>{4, 5, 6});

  CHECK(error_of([&] { InferenceModel::from_hf(t.path / "no-model"); }).find("no such directory") !=
        std::string::npos);
  CHECK(error_of([&] { InferenceModel::from_checkpoint(t.path / "step_5.h5"); }).find("no such file") !=
        std::string::npos);
  {
    const InferenceModel m = InferenceModel::from_hf(fixture("qwen3-qknorm"));  // max_position_embeddings 256
    const std::vector<int32_t> longp(250, 7), shortp(5, 7);
    const std::vector<GenerateRequest> r{{0, 0, shortp}, {1, 0, longp}};
    const std::string e = error_of([&] { plan_limits(m.config(), r, 4, 10, "p.h5"); });
    CHECK(e.find("p.h5: prompt 1 has 250 tokens; with --max-new-tokens 10 it needs 259 positions, but the model "
                 "has max_position_embeddings = 256") != std::string::npos);
    CHECK(plan_limits(m.config(), r, 4, 7, "p.h5").max_len == 256);
  }
}

TEST_CASE("a KV pool sized from a fraction of the device's memory: what is left after weights and scratch, in "
          "whole blocks, at most every slot at its longest, at least one sequence") {
  for (const std::string& name : kFixtures) {
    CAPTURE(name);
    const InferenceModel m = InferenceModel::from_hf(fixture(name));
    const ModelConfig& c = m.config();
    for (const std::string backend : {"cpu", "cuda"}) {
      if (backend == "cuda" && !cuda_built()) continue;  // arithmetic only: no device is touched
      CAPTURE(backend);
      DecoderLimits limits{8, 40};  // blocks of 16: three a sequence, 24 at most
      limits.memory_fraction = 0.5;
      const DecoderPlan one = plan_decoder(c, DecoderLimits{8, 40, 16, 3}, backend);
      const DecoderPlan two = plan_decoder(c, DecoderLimits{8, 40, 16, 6}, backend);
      const int64_t per_block = (two.cache - one.cache) / 3;
      const int64_t fixed = one.weights + one.scratch + (backend == "cpu" ? one.host : 0);
      // Half of a device whose memory leaves room for 10 blocks and a bit: 10 blocks.
      const int64_t memory = 2 * (fixed + 10 * per_block + per_block / 2);
      const DecoderLimits ten = size_pool(c, limits, backend, memory);
      CHECK(ten.blocks == 10);
      CHECK(ten.memory_fraction == 0);  // sized: what the decoder is made with
      CHECK(plan_decoder(c, ten, backend).cache == one.cache / 3 * 10);
      // A large device: every slot at its longest, not more.
      CHECK(size_pool(c, limits, backend, int64_t(1) << 50).blocks == pool_blocks(DecoderLimits{8, 40}));
      // Room for two blocks: not one sequence (three); the message says what there is.
      const std::string e = error_of([&] { size_pool(c, limits, backend, 2 * (fixed + 2 * per_block)); });
      CHECK(e.find("no room for one sequence's KV blocks (3 blocks of 16 positions") != std::string::npos);
      // Given in tokens, or not asked for: the limits as they are.
      DecoderLimits tokens = limits;
      tokens.blocks = 5;
      CHECK(size_pool(c, tokens, backend, memory).blocks == 5);
      CHECK(size_pool(c, DecoderLimits{8, 40}, backend, memory).blocks == 0);
    }
  }
}

TEST_CASE("the decoder's plan is the table it allocates from: the CPU's exactly, the GPU's counted without one") {
  for (const std::string& name : kFixtures) {
    CAPTURE(name);
    const InferenceModel m = InferenceModel::from_hf(fixture(name));
    const ModelConfig& c = m.config();
    const DecoderLimits limits{3, 20};  // blocks of 16: two a slot, every slot at its longest
    const int64_t kv_numel = c.num_layers * 2 * limits.slots * 32 * c.num_kv_heads * c.head_dim;
    CHECK(pool_blocks(limits) == 6);
    CHECK(plan_decoder(c, DecoderLimits{3, 20, 4, 7}, "cpu").cache == c.num_layers * 2 * 7 * 4 * c.num_kv_heads * c.head_dim * 4);
    const DecoderPlan cpu_plan = plan_decoder(c, limits, "cpu");
    const CpuDecoder d(m, limits);
    CHECK(cpu_plan.cache == d.cache_bytes());
    CHECK(cpu_plan.cache == kv_numel * 4);
    CHECK(cpu_plan.scratch == d.scratch_bytes());
    CHECK(cpu_plan.weights == 0);
    CHECK(cpu_plan.host == limits.slots * c.vocab_size * 4);
    if (cuda_built()) {  // arithmetic only: no device is touched
      const DecoderPlan gpu = plan_decoder(c, limits, "cuda");
      int64_t weights = 0;
      for (const Unit& u : m.weights->layout.units) weights += 2 * u.padded_numel;
      CHECK(gpu.weights == weights);
      CHECK(gpu.cache == kv_numel * 2);
      CHECK(gpu.scratch > (int64_t(32) << 20));          // cuBLASLt's workspace and more
      CHECK(gpu.host >= limits.slots * c.vocab_size * 4);  // the pinned logits and more
    }
    // The decoders' own checks, before anything is counted.
    const std::string e = error_of([&] { plan_decoder(c, DecoderLimits{2, 300}, "cpu"); });
    CHECK(e.find("300 positions per sequence, but the model has max_position_embeddings = 256") != std::string::npos);
    const std::string small = error_of([&] { plan_decoder(c, DecoderLimits{2, 40, 16, 2}, "cpu"); });
    CHECK(small.find("a KV cache of 32 tokens (2 blocks of 16) cannot hold one sequence of 40 positions (the longest "
                     "prompt + max_new_tokens - 1); give it at least 48 tokens") != std::string::npos);
  }
}

TEST_CASE("check on an RL deck: the prompt file checked against the deck, and the inference rank's plan") {
  TempDir t;
  const fs::path prompts = t.path / "prompts.h5";
  write_prompt_file(prompts, {});  // prompts of 2 and 3 tokens
  // inputs/copy-rl.toml on the Llama fixture: data.seq_len 8, rollout.max_new_tokens 2, 32 prompts x 8 a step.
  const std::string deck = shardlm_test::shardlm_bin() + " check inputs/copy-rl.toml --set model.hf=" +
                           fixture("llama-gqa-tied").string() + " --set 'rollout.reward=\"regex\"' " +
                           "--set 'rollout.reward_regex=\"7\"' --set device.backend=cpu --set rollout.batch=64 --set rollout.prompts=";
  const auto ok = shardlm_test::run(deck + prompts.string());
  REQUIRE(ok.status == 0);
  const size_t at = ok.output.find("inference rank plan");
  REQUIRE(at != std::string::npos);
  long long slots = 0, positions = 0;
  REQUIRE(std::sscanf(ok.output.c_str() + ok.output.find("one of them: ", at), "one of them: %lld slots x %lld positions",
                      &slots, &positions) == 2);
  CHECK(slots == 64);       // min(rollout.batch, 32 x 8)
  CHECK(positions == 4);    // the longest prompt (3) + max_new_tokens (2) - 1
  const size_t kv = ok.output.find("KV cache", at);
  REQUIRE(kv != std::string::npos);
  // A pool of one 16-position block a slot: 2 layers x (k, v) x slots x 16 x 2 kv heads x 16 dims, fp32: 0.5 MiB
  CHECK(ok.output.find("a KV pool of 64 blocks of 16 positions, every slot at its longest") != std::string::npos);
  CHECK(std::stod(ok.output.substr(kv + 30)) == doctest::Approx(2.0 * 2 * slots * 16 * 2 * 16 * 4 / 1048576.0));
  CHECK(ok.output.find("KV cache           host         0.500 MiB") != std::string::npos);
  // A pool from a fraction of the memory: sized at start, and what this machine would give it.
  const auto fraction = shardlm_test::run(deck + prompts.string() + " --set rollout.kv_cache_memory=0.5");
  CHECK(fraction.status == 0);
  CHECK(fraction.output.find("a KV pool of 64 blocks of 16 positions, at most: rollout.kv_cache_memory sizes it at "
                             "start") != std::string::npos);
  CHECK(fraction.output.find("rollout.kv_cache_memory = 0.5 of this machine's ") != std::string::npos);
  CHECK(fraction.output.find("GiB (host): a pool of 1024 positions") != std::string::npos);  // 64 x 16: capped
  const auto both = shardlm_test::run(deck + prompts.string() +
                                      " --set rollout.kv_cache_memory=0.5 --set rollout.kv_cache_tokens=64");
  CHECK(both.status != 0);
  CHECK(both.output.find("rollout.kv_cache_memory = 0.5 and rollout.kv_cache_tokens = 64 both size the KV pool") !=
        std::string::npos);

  PromptFileSpec long_prompt;
  long_prompt.tokens = std::vector<int32_t>(8, 5);
  long_prompt.offsets = {0, 8};
  write_prompt_file(prompts, long_prompt);
  const auto bad = shardlm_test::run(deck + prompts.string());
  CHECK(bad.status != 0);
  CHECK(bad.output.find("prompt 0 has 8 tokens; with rollout.max_new_tokens = 2 a sample can have 10 tokens, more "
                        "than data.seq_len + 1 = 9") != std::string::npos);
  const auto missing = shardlm_test::run(deck + (t.path / "none.h5").string());
  CHECK(missing.status == 0);
  CHECK(missing.output.find("none.h5' does not exist yet") != std::string::npos);
}

TEST_CASE("generate's command line: options parsed and checked, each mistake named") {
  auto parse = [](std::vector<const char*> argv) {
    argv.insert(argv.begin(), {"shardlm", "generate"});
    const CliArgs cli = parse_cli(int(argv.size()), argv.data());
    return parse_generate_args(cli.options, cli.deck, cli.overrides);
  };
  const GenerateArgs a = parse({"--hf", "m", "--prompts", "p.h5", "--out", "o.h5", "--n", "4", "--max-new-tokens",
                                "32", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "50", "--seed", "9",
                                "--batch", "16"});
  CHECK(a.hf == "m");
  CHECK(a.prompts_file == "p.h5");
  CHECK(a.n == 4);
  CHECK(a.max_new_tokens == 32);
  CHECK(a.batch == 16);
  CHECK(a.sampling.temperature == 0.7);
  CHECK(a.sampling.top_p == 0.9);
  CHECK(a.sampling.top_k == 50);
  CHECK(a.sampling.seed == 9);
  CHECK(a.seed_given);
  CHECK(parse({"--deck", "d.toml", "--set", "run.seed=3", "--prompt-ids", "1", "--out", "o"}).deck == "d.toml");
  auto error = [&](std::vector<const char*> argv) { return error_of([&] { parse(argv); }); };
  CHECK(error({"--hf", "m", "--prompt-ids", "1", "--out", "o", "--bogus", "1"}).find(
            "unknown option '--bogus' for 'generate'") != std::string::npos);
  CHECK(error({"deck.toml", "--prompt-ids", "1", "--out", "o"}).find(
            "'generate DECK' is the inference role of an RL job") != std::string::npos);
  CHECK(error({"--prompt-ids", "1", "--out", "o"}).find("'generate' needs a model") != std::string::npos);
  CHECK(error({"--hf", "m", "--out", "o"}).find("exactly one of --prompts FILE") != std::string::npos);
  CHECK(error({"--hf", "m", "--prompt-ids", "1", "--out", "o", "--n", "0"}).find(
            "--n expects an integer in [1, 1048576], got '0'") != std::string::npos);
  CHECK(error({"--hf", "m", "--prompt-ids", "1", "--out", "o", "--temperature", "hot"}).find(
            "--temperature expects a number, got 'hot'") != std::string::npos);
  CHECK(error({"--hf", "m", "--prompt-ids", "1", "--out", "o", "--seed", "-1"}).find(
            "--seed expects a non-negative integer") != std::string::npos);
}

}  // TEST_SUITE
