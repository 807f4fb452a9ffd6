// command.cpp — `shardlm generate` (see command.hpp; format: docs/generate.md).
#include "infer/command.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "checkpoint/agree.hpp"
#include "checkpoint/inspect.hpp"
#include "data/prompts.hpp"
#include "data/token_encoder.hpp"
#include "data/tokenizer.hpp"
#include "infer/decoder_cuda.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/h5util.hpp"

namespace fs = std::filesystem;

namespace shardlm {

namespace {

int64_t int_option(const std::map<std::string, std::string>& o, const char* name, int64_t fallback, int64_t lo,
                   int64_t hi) {
  const auto it = o.find(name);
  if (it == o.end()) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  SHARDLM_CHECK(end != it->second.c_str() && *end == '\0' && errno == 0 && v >= lo && v <= hi,
                "--%s expects an integer in [%lld, %lld], got '%s'", name, (long long)lo, (long long)hi,
                it->second.c_str());
  return v;
}

double real_option(const std::map<std::string, std::string>& o, const char* name, double fallback) {
  const auto it = o.find(name);
  if (it == o.end()) return fallback;
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  SHARDLM_CHECK(end != it->second.c_str() && *end == '\0', "--%s expects a number, got '%s'", name,
                it->second.c_str());
  return v;
}

// ---------------------------------------------------------------- gathering

// Completions as bytes for MPI: counts, then arrays, per completion.
void put(std::vector<char>& b, const void* p, size_t n) {
  if (n > 0) b.insert(b.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
}
template <class T>
void put_vec(std::vector<char>& b, const std::vector<T>& v) {
  const int64_t n = int64_t(v.size());
  put(b, &n, sizeof n);
  put(b, v.data(), sizeof(T) * v.size());
}
template <class T>
void get(const char*& p, T& v) { std::memcpy(&v, p, sizeof v), p += sizeof v; }
template <class T>
void get_vec(const char*& p, std::vector<T>& v) {
  int64_t n = 0;
  get(p, n);
  v.resize(size_t(n));
  if (n > 0) std::memcpy(v.data(), p, sizeof(T) * size_t(n));  // never memcpy to an empty vector's null
  p += sizeof(T) * size_t(n);
}

std::vector<char> pack(const std::vector<Completion>& cs) {
  std::vector<char> b;
  for (const Completion& c : cs) {
    put(b, &c.prompt, sizeof c.prompt);
    put(b, &c.sample, sizeof c.sample);
    put(b, &c.finish, sizeof c.finish);
    put(b, &c.policy_first, sizeof c.policy_first);
    put(b, &c.policy_last, sizeof c.policy_last);
    put_vec(b, c.tokens);
    put_vec(b, c.sampling_logprobs);
    put_vec(b, c.model_logprobs);
    put_vec(b, c.tempered_logprobs);
    put_vec(b, c.observed);
    put_vec(b, c.routes);
    put(b, &c.turns, sizeof c.turns);
    put(b, &c.env_reward, sizeof c.env_reward);
    put_vec(b, std::vector<char>(c.env_metrics.begin(), c.env_metrics.end()));
    put(b, &c.episode_end, sizeof c.episode_end);
  }
  return b;
}

void unpack(const char* p, const char* end, std::vector<Completion>& out) {
  while (p < end) {
    Completion c;
    get(p, c.prompt);
    get(p, c.sample);
    get(p, c.finish);
    get(p, c.policy_first);
    get(p, c.policy_last);
    get_vec(p, c.tokens);
    get_vec(p, c.sampling_logprobs);
    get_vec(p, c.model_logprobs);
    get_vec(p, c.tempered_logprobs);
    get_vec(p, c.observed);
    get_vec(p, c.routes);
    get(p, c.turns);
    get(p, c.env_reward);
    std::vector<char> metrics;
    get_vec(p, metrics);
    c.env_metrics.assign(metrics.begin(), metrics.end());
    get(p, c.episode_end);
    out.push_back(std::move(c));
  }
}

// This rank's index among the ranks of `comm` on its node (collective).
int node_local_rank(MPI_Comm comm) {
  MPI_Comm node;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int local = 0;
  MPI_CHECK(MPI_Comm_rank(node, &local));
  MPI_CHECK(MPI_Comm_free(&node));
  return local;
}

// "auto" | "cpu" | "cuda" -> the backend the decoder runs on; for "cuda" this
// rank's GPU is bound as training binds it (local rank modulo the devices).
std::string bind_backend(const std::string& requested, int local_rank) {
  const int ndev = cuda_device_count();
  if (requested == "cpu" || (requested == "auto" && ndev == 0)) return "cpu";
  SHARDLM_CHECK(cuda_built(), "--device cuda (or the deck's device.backend = \"cuda\") but this shardlm was built "
                              "without CUDA: rebuild with CUDA=1, or use --device cpu");
  SHARDLM_CHECK(ndev > 0, "--device cuda (or the deck's device.backend = \"cuda\") but no CUDA device is visible; "
                          "use --device cpu");
  cuda_set_device(ndev == 1 ? 0 : local_rank % ndev);
  return "cuda";
}

// Rank 0 gets every rank's completions, sorted by (prompt, sample).
std::vector<Completion> gather(std::vector<Completion> mine, MPI_Comm comm) {
  const int rank = ckpt::comm_rank(comm), world = ckpt::comm_size(comm);
  if (world == 1) return mine;
  const std::vector<char> bytes = pack(mine);
  // Each rank's share is bounded by its prompts x n x max_new_tokens; MPI counts are int.
  SHARDLM_CHECK(bytes.size() < size_t(INT32_MAX), "generate: rank %d's completions are %zu bytes, over MPI's 2 GiB "
                "count (use more ranks or fewer samples per call)", rank, bytes.size());
  int count = int(bytes.size());
  std::vector<int> counts(static_cast<size_t>(world)), displs(static_cast<size_t>(world));
  // Watched (comm.timeout_s): a rank still sampling answers as busy, one that
  // stopped is named. In an RL job the trainers asking this rank hear it is busy.
  MPI_Request request;
  MPI_CHECK(MPI_Igather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm, &request));
  wait_collective(comm, &request, "completions gather");
  std::vector<char> all;
  if (rank == 0) {
    int64_t total = 0;
    for (int r = 0; r < world; ++r) displs[size_t(r)] = int(total), total += counts[size_t(r)];
    SHARDLM_CHECK(total < INT32_MAX, "generate: %lld bytes of completions, over MPI's 2 GiB count", (long long)total);
    all.resize(size_t(total));
  }
  MPI_CHECK(MPI_Gatherv(bytes.data(), count, MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, 0, comm));
  std::vector<Completion> out;
  if (rank == 0) unpack(all.data(), all.data() + all.size(), out);
  std::sort(out.begin(), out.end(), [](const Completion& a, const Completion& b) {
    return a.prompt != b.prompt ? a.prompt < b.prompt : a.sample < b.sample;
  });
  return out;
}

// ---------------------------------------------------------------- HDF5 output

h5::Handle utf8_type() {
  h5::Handle t(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_size(t, H5T_VARIABLE));
  H5_CHECK(H5Tset_cset(t, H5T_CSET_UTF8));
  return t;
}

void write_strings(hid_t file, const char* name, const std::vector<std::string>& v) {
  std::vector<const char*> ptrs;
  for (const auto& s : v) ptrs.push_back(s.c_str());
  h5::Handle t = utf8_type();
  h5::write_1d(file, name, t, t, ptrs);
}

void attr_string(hid_t file, const char* name, const std::string& value) {
  h5::Handle t = utf8_type();
  h5::Handle space(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose);
  h5::Handle a(H5_CHECK(H5Acreate2(file, name, t, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
  const char* p = value.c_str();
  H5_CHECK(H5Awrite(a, t, &p));
}

// ---------------------------------------------------------------- run_generate's phases

// What every rank holds once the model, the prompts and the decoder are set up.
struct GenerateSetup {
  GenerateArgs args;                        // as given, with the deck's defaults filled in
  InferenceModel model;
  PromptSet prompts;
  std::vector<GenerateRequest> requests;    // this rank's: prompts r, r + W, ..., all n samples of each
  GenerateOptions options;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<TokenDecoder> tokenizer;  // rank 0, when the model has a tokenizer.json: the completions' text
};

// --deck: its seed and device where the options give none, and its model
// where neither --hf nor --checkpoint is given (its run's latest checkpoint,
// else its model.hf). Throws on a bad deck or one that names no model.
void apply_deck_defaults(GenerateArgs& args) {
  DeckResult deck = parse_deck(args.deck, args.overrides, 1);
  if (!deck.ok()) {
    std::string all;
    for (const auto& e : deck.errors) all += "\n  " + e;
    SHARDLM_FAIL("the deck %s has %zu error%s:%s", args.deck.c_str(), deck.errors.size(),
                 deck.errors.size() == 1 ? "" : "s", all.c_str());
  }
  if (!args.seed_given) args.sampling.seed = deck.config.run.seed;
  if (args.device.empty()) args.device = deck.config.device.backend;
  if (args.hf.empty() && args.checkpoint.empty()) {
    std::error_code ec;
    const fs::path ckpts = fs::path(deck.config.run.dir) / "checkpoints";
    if (fs::is_directory(ckpts, ec) && !fs::is_empty(ckpts, ec)) args.checkpoint = deck.config.run.dir;
    else if (!deck.config.model.hf.empty()) args.hf = deck.config.model.hf;
    else SHARDLM_FAIL("the deck %s names no model to sample: run.dir %s has no checkpoint and model.hf is "
                      "not set (give --hf or --checkpoint)", args.deck.c_str(), deck.config.run.dir.c_str());
  }
}

// The prompts: --prompt TEXT through the model's tokenizer.json, else
// --prompt-ids or --prompts FILE; every id checked against the vocabulary.
PromptSet read_prompt_set(const GenerateArgs& args, const InferenceModel& model) {
  const ModelConfig& c = model.config();
  std::error_code ec;
  if (args.has_prompt_text) {
    // The text as it is (add_special_tokens = False): a BOS or a chat template's
    // markup is written into it, its added tokens are matched there.
    SHARDLM_CHECK(!model.tokenizer_dir.empty() && fs::exists(model.tokenizer_dir / "tokenizer.json", ec),
                  "--prompt needs the model's tokenizer.json (%s has none): tokenize the prompt with "
                  "tools/make_prompts.py and give --prompts, or give --prompt-ids",
                  model.tokenizer_dir.empty() ? model.source.c_str() : model.tokenizer_dir.c_str());
    const TokenEncoder encoder = TokenEncoder::load(model.tokenizer_dir.string());
    return prompt_from_tokens(encoder.encode(args.prompt_text), "--prompt", c.vocab_size);
  }
  return args.prompts_file.empty() ? prompt_from_ids(args.prompt_ids, c.vocab_size)
                                   : read_prompts(args.prompts_file, c.vocab_size);
}

// The sampling options: the prompt file's stop ids, then the model's EOS ids
// not among them, each checked against the vocabulary.
GenerateOptions sampling_options(const GenerateArgs& args, const PromptSet& prompts, const InferenceModel& model) {
  const ModelConfig& c = model.config();
  GenerateOptions options;
  options.sampling = args.sampling;
  options.max_new_tokens = args.max_new_tokens;
  options.stop_ids = prompts.stop_ids;
  for (int32_t id : model.eos_ids)
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), id) == options.stop_ids.end())
      options.stop_ids.push_back(id);
  for (int32_t id : options.stop_ids)
    SHARDLM_CHECK(id < c.vocab_size, "%s: stop token id %d is outside the model's vocabulary [0, %lld)",
                  prompts.path.c_str(), id, (long long)c.vocab_size);
  return options;
}

// The model, its tokenizer (rank 0), the prompts, this rank's share of them,
// the options, and the decoder on its backend. Throws on any bad input.
void set_up(GenerateSetup& g, int rank, int world, int local_rank) {
  GenerateArgs& args = g.args;
  if (!args.deck.empty()) apply_deck_defaults(args);
  g.model = args.hf.empty() ? InferenceModel::from_checkpoint(args.checkpoint) : InferenceModel::from_hf(args.hf);
  const ModelConfig& c = g.model.config();
  std::error_code ec;
  if (rank == 0 && !g.model.tokenizer_dir.empty() && fs::exists(g.model.tokenizer_dir / "tokenizer.json", ec))
    g.tokenizer = std::make_unique<TokenDecoder>(TokenDecoder::load(g.model.tokenizer_dir.string()));
  g.prompts = read_prompt_set(args, g.model);
  // Rank r: prompts r, r + W, ...; all n samples of a prompt on one rank.
  for (int64_t p = rank; p < g.prompts.size(); p += world)
    for (int64_t s = 0; s < args.n; ++s) g.requests.push_back({p, s, g.prompts.prompt(p)});
  g.options = sampling_options(args, g.prompts, g.model);
  // Every prompt is checked on every rank (the message is the same everywhere).
  std::vector<GenerateRequest> all;
  for (int64_t p = 0; p < g.prompts.size(); ++p) all.push_back({p, 0, g.prompts.prompt(p)});
  plan_limits(c, all, args.batch, args.max_new_tokens, g.prompts.path);
  const std::string backend = bind_backend(args.device.empty() ? "auto" : args.device, local_rank);
  DecoderLimits limits =
      plan_limits(c, g.requests, args.batch, args.max_new_tokens, g.prompts.path, args.kv_cache_tokens);
  limits.memory_fraction = args.kv_cache_memory;
  g.decoder = make_decoder(g.model, limits, backend);
}

// Rank 0: the model, the prompts and ranks, the decoder, its cache and weights, the sampling.
void print_setup(const GenerateSetup& g, int world) {
  const GenerateArgs& args = g.args;
  const Decoder& decoder = *g.decoder;
  const DecoderLimits& l = decoder.limits();
  std::printf("generate: %s | %lld prompt%s x %lld sample%s over %d rank%s | %s | batch %lld, sequences up to %lld "
              "positions, KV pool %lld positions (%.1f MiB), weights %.1f MiB | temperature %g, top-k %lld, top-p %g, "
              "seed %llu, stop ids %zu\n",
              g.model.source.c_str(), (long long)g.prompts.size(), g.prompts.size() == 1 ? "" : "s",
              (long long)args.n, args.n == 1 ? "" : "s", world, world == 1 ? "" : "s", decoder.describe().c_str(),
              (long long)l.slots, (long long)l.max_len, (long long)(pool_blocks(l) * l.block_size),
              decoder.cache_bytes() / 1048576.0,
              (decoder.weight_bytes() ? decoder.weight_bytes() : g.model.bytes()) / 1048576.0,
              args.sampling.temperature,
              (long long)args.sampling.top_k, args.sampling.top_p, (unsigned long long)args.sampling.seed,
              g.options.stop_ids.size());
  std::fflush(stdout);
}

// Every rank's completions on rank 0, with the tokens they hold over all ranks
// and this rank's sampling time.
struct GatheredCompletions {
  std::vector<Completion> completions;  // rank 0: all, sorted by (prompt, sample); elsewhere none
  int64_t tokens = 0;                   // rank 0: over every rank
  double seconds = 0;                   // this rank's generate()
};

// Collective: this rank's requests sampled (rank 0 prints the decoder's
// timings), then gathered to rank 0.
GatheredCompletions sample_and_gather(GenerateSetup& g, int rank, MPI_Comm comm) {
  Decoder& decoder = *g.decoder;
  GatheredCompletions out;
  const auto t0 = std::chrono::steady_clock::now();
  GenerateStats stats;
  std::vector<Completion> mine = generate(decoder, g.requests, g.options, &stats);
  int64_t my_tokens = 0;
  for (const Completion& c : mine) my_tokens += int64_t(c.tokens.size());
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0 && decoder.decode_steps() > 0)
    std::printf("generate: rank 0: %lld decode steps, %.3f ms each on the device (forward and lm-head, event-timed; "
                "the logits' download and the sampling not counted)\n",
                (long long)decoder.decode_steps(), 1e3 * decoder.decode_seconds() / double(decoder.decode_steps()));
  if (rank == 0 && stats.decode_steps > 0) {
    const KvBlocks& kv = decoder.kv();
    const int64_t peak = kv.peak_used_blocks() * kv.block_size(), held = kv.held_positions_at_peak();
    std::printf("generate: rank 0: prefill computed %lld of %lld prompt tokens (a group's prompt once), %lld more "
                "for sequences that gave way; KV pool peak %lld of %lld blocks of %lld (%lld positions) holding %lld "
                "(%.1f%% unused); %lld sequence%s gave way and %s prefilled again; decode steps: mean batch %.1f, %.0f "
                "cached positions read each\n",
                (long long)(decoder.prefill_tokens_computed() - stats.recomputed),
                (long long)(decoder.prefill_tokens_given() - stats.recomputed), (long long)stats.recomputed,
                (long long)kv.peak_used_blocks(), (long long)kv.blocks(), (long long)kv.block_size(),
                (long long)peak, (long long)held, peak > 0 ? 100.0 * double(peak - held) / double(peak) : 0.0,
                (long long)stats.preemptions, stats.preemptions == 1 ? "" : "s",
                stats.preemptions == 1 ? "was" : "were", double(stats.decode_rows) / double(stats.decode_steps),
                double(decoder.decode_positions_read()) / double(stats.decode_steps));
  }
  if (const std::string profile = decoder.profile_report(out.seconds); rank == 0 && !profile.empty())
    std::printf("generate: rank 0: %s", profile.c_str());
  out.completions = gather(std::move(mine), comm);
  MPI_CHECK(MPI_Reduce(&my_tokens, &out.tokens, 1, MPI_INT64_T, MPI_SUM, 0, comm));
  return out;
}

// Rank 0: the output file (with each completion's text when the model has a
// tokenizer.json) and the summary line. Throws when the file cannot be written.
void write_output(const GenerateSetup& setup, GatheredCompletions gathered, int world) {
  const GenerateArgs& args = setup.args;
  GenerationsFile g;
  g.model_source = setup.model.source;
  g.prompts_source = setup.prompts.path;
  g.prompt_tokens = setup.prompts.tokens;
  g.prompt_offsets = setup.prompts.offsets;
  g.completions = std::move(gathered.completions);
  g.stop_ids = setup.options.stop_ids;
  g.sampling = args.sampling;
  g.n = args.n;
  g.max_new_tokens = args.max_new_tokens;
  g.world = world;
  std::string text_note = "no tokenizer.json: no text";
  if (const TokenDecoder* tokenizer = setup.tokenizer.get()) {
    // A model's vocabulary may be padded past its tokenizer's: such ids have no text.
    std::vector<int32_t> known;
    for (const Completion& c : g.completions) {
      known.clear();
      for (int32_t id : c.tokens)
        if (id < tokenizer->vocab_size()) known.push_back(id);
      g.texts.push_back(tokenizer->text(known, /*skip_special=*/false));
    }
    text_note = "text from " + tokenizer->where();
  }
  write_generations(args.out, g);
  int64_t stopped = 0;
  for (const Completion& c : g.completions) stopped += c.finish == Finish::Stop;
  const int64_t tokens = gathered.tokens;
  const double seconds = gathered.seconds;
  std::printf("generate: %zu completions, %lld tokens in %.2f s (%.1f tokens/s per rank), %lld stopped by a "
              "stop id, %lld at --max-new-tokens; %s -> %s\n",
              g.completions.size(), (long long)tokens, seconds, seconds > 0 ? tokens / seconds / world : 0.0,
              (long long)stopped, (long long)(g.completions.size() - stopped), text_note.c_str(),
              args.out.c_str());
  std::fflush(stdout);
}

}  // namespace

void write_generations(const std::string& path, const GenerationsFile& g) {
  h5::silence_error_stack();
  const std::string tmp = path + ".tmp";
  {
    h5::Handle f(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    SHARDLM_CHECK(f.get() >= 0, "--out %s: cannot create %s (%s)", path.c_str(), tmp.c_str(),
                  h5::error_stack_message().c_str());
    std::vector<int64_t> prompt_index, sample_index, offsets{0};
    std::vector<int32_t> tokens;
    std::vector<float> sampling, model, tempered;
    std::vector<std::string> finish;
    for (const Completion& c : g.completions) {
      prompt_index.push_back(c.prompt);
      sample_index.push_back(c.sample);
      tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
      sampling.insert(sampling.end(), c.sampling_logprobs.begin(), c.sampling_logprobs.end());
      model.insert(model.end(), c.model_logprobs.begin(), c.model_logprobs.end());
      tempered.insert(tempered.end(), c.tempered_logprobs.begin(), c.tempered_logprobs.end());
      offsets.push_back(int64_t(tokens.size()));
      finish.push_back(finish_name(c.finish));
    }
    h5::write_1d(f, "prompt_tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, g.prompt_tokens);
    h5::write_1d(f, "prompt_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, g.prompt_offsets);
    h5::write_1d(f, "prompt_index", H5T_STD_I64LE, H5T_NATIVE_INT64, prompt_index);
    h5::write_1d(f, "sample_index", H5T_STD_I64LE, H5T_NATIVE_INT64, sample_index);
    h5::write_1d(f, "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, tokens);
    h5::write_1d(f, "offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, offsets);
    h5::write_1d(f, "sampling_logprobs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, sampling);
    h5::write_1d(f, "model_logprobs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, model);
    h5::write_1d(f, "tempered_logprobs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, tempered);
    write_strings(f, "finish_reason", finish);
    if (!g.texts.empty()) write_strings(f, "text", g.texts);
    attr_string(f, "format", "shardlm-generations-1");
    attr_string(f, "model", g.model_source);
    attr_string(f, "prompts", g.prompts_source);
    h5::write_attr(f, "seed", H5T_STD_U64LE, H5T_NATIVE_UINT64, std::vector<uint64_t>{g.sampling.seed});
    h5::write_attr(f, "temperature", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, std::vector<double>{g.sampling.temperature});
    h5::write_attr(f, "top_k", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{g.sampling.top_k});
    h5::write_attr(f, "top_p", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, std::vector<double>{g.sampling.top_p});
    h5::write_attr(f, "n", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{g.n});
    h5::write_attr(f, "max_new_tokens", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{g.max_new_tokens});
    h5::write_attr(f, "world_size", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{g.world});
    std::vector<int64_t> stops(g.stop_ids.begin(), g.stop_ids.end());
    if (!stops.empty()) h5::write_attr(f, "stop_token_ids", H5T_STD_I64LE, H5T_NATIVE_INT64, stops, false);
  }
  SHARDLM_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "--out: cannot rename %s to %s: %s", tmp.c_str(),
                path.c_str(), std::strerror(errno));
}

std::vector<Completion> gather_completions(std::vector<Completion> mine, MPI_Comm comm) {
  return gather(std::move(mine), comm);
}

GenerateArgs parse_generate_args(const std::map<std::string, std::string>& o, const std::string& deck,
                                 const std::vector<std::string>& overrides) {
  GenerateArgs a;
  auto text = [&](const char* name) { return o.count(name) ? o.at(name) : std::string(); };
  a.hf = text("hf");
  a.checkpoint = text("checkpoint");
  a.deck = deck;
  a.overrides = overrides;
  a.prompts_file = text("prompts");
  a.prompt_ids = text("prompt-ids");
  a.prompt_text = text("prompt");
  a.has_prompt_text = o.count("prompt") > 0;
  a.out = text("out");
  SHARDLM_CHECK(!(o.count("hf") && o.count("checkpoint")), "give one of --hf DIR and --checkpoint CKPT, not both");
  SHARDLM_CHECK(o.count("hf") || o.count("checkpoint") || !deck.empty(),
                "'generate' needs a model: --hf DIR, --checkpoint CKPT, or --deck DECK (its run's latest checkpoint, "
                "else its model.hf)");
  SHARDLM_CHECK(o.count("prompts") + o.count("prompt-ids") + o.count("prompt") == 1,
                "'generate' needs exactly one of --prompts FILE (tools/make_prompts.py), --prompt-ids \"1,2,3\" and "
                "--prompt \"TEXT\"");
  SHARDLM_CHECK(!a.out.empty(), "'generate' needs --out FILE (the HDF5 file of completions)");
  a.n = int_option(o, "n", 1, 1, 1 << 20);
  a.max_new_tokens = int_option(o, "max-new-tokens", 64, 1, kMaxPositions);
  a.batch = int_option(o, "batch", 8, 1, 65536);
  a.kv_cache_tokens = int_option(o, "kv-cache-tokens", 0, 0, INT32_MAX);
  a.kv_cache_memory = real_option(o, "kv-cache-memory", 0.0);
  SHARDLM_CHECK(a.kv_cache_memory >= 0 && a.kv_cache_memory <= 1,
                "--kv-cache-memory %g: give the fraction of the device's memory the decoder may take, in (0, 1]",
                a.kv_cache_memory);
  SHARDLM_CHECK(a.kv_cache_memory == 0 || a.kv_cache_tokens == 0,
                "give one of --kv-cache-tokens (the pool in positions) and --kv-cache-memory (a fraction of the "
                "device's memory), not both");
  a.device = text("device");
  SHARDLM_CHECK(a.device.empty() || a.device == "auto" || a.device == "cpu" || a.device == "cuda",
                "--device expects auto, cpu or cuda, got '%s'", a.device.c_str());
  a.sampling.temperature = real_option(o, "temperature", 1.0);
  a.sampling.top_p = real_option(o, "top-p", 1.0);
  a.sampling.top_k = int_option(o, "top-k", 0, 0, INT32_MAX);
  a.seed_given = o.count("seed") > 0;
  if (a.seed_given) {
    const std::string& s = o.at("seed");
    char* end = nullptr;
    errno = 0;
    a.sampling.seed = std::strtoull(s.c_str(), &end, 10);
    SHARDLM_CHECK(end != s.c_str() && *end == '\0' && errno == 0 && s[0] != '-',
                  "--seed expects a non-negative integer, got '%s'", s.c_str());
  }
  if (std::string e = sampling_params_error(a.sampling); !e.empty()) SHARDLM_FAIL("%s", e.c_str());
  return a;
}

int run_generate(const GenerateArgs& given, MPI_Comm comm) {
  const int rank = ckpt::comm_rank(comm), world = ckpt::comm_size(comm);
  const int local_rank = node_local_rank(comm);
  GenerateSetup setup;
  setup.args = given;
  try {
    // Every rank loads the whole model and reads the prompts; a bad input is
    // the same on every rank, and agreed so that all stop together.
    ckpt::agreed(comm, [&] { set_up(setup, rank, world, local_rank); });
  } catch (const std::exception& e) {
    if (rank == 0) std::fprintf(stderr, "shardlm generate: error: %s\n", e.what());
    return 1;
  }
  if (rank == 0) print_setup(setup, world);
  GatheredCompletions gathered = sample_and_gather(setup, rank, comm);

  int failed = 0;
  std::string message;
  if (rank == 0) {
    try {
      write_output(setup, std::move(gathered), world);
    } catch (const std::exception& e) {
      failed = 1;
      message = e.what();
    }
  }
  MPI_CHECK(MPI_Bcast(&failed, 1, MPI_INT, 0, comm));
  if (failed) {
    if (rank == 0) std::fprintf(stderr, "shardlm generate: error: %s\n", message.c_str());
    return 1;
  }
  return 0;
}

}  // namespace shardlm
