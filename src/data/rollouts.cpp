// rollouts.cpp — reading and validating rollout files, waiting for them, and
// packing their samples into rank-balanced micro-batches. Rules: docs/rollouts.md.
#include "data/rollouts.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <set>
#include <thread>
#include <utility>

#include "shardlm/comm.hpp"  // answer_collective_queries
#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"

namespace shardlm {

namespace {

namespace fs = std::filesystem;

constexpr const char* kFormatHint =
    "a rollout file needs 'tokens' int32, 'offsets' int64, 'loss_mask' uint8, 'advantages' float32 and "
    "'inference_logprobs' float32; see docs/rollouts.md";

// ---------------------------------------------------------------- HDF5 reading

bool has_link(hid_t file, const char* name);

// The group 'metrics' (optional): scalar numeric attributes, in name order.
// Their names become keys of metrics.jsonl and TensorBoard tags, so they are
// checked: letters, digits and '_', at most 64 characters, at most 256 of them.
std::vector<std::pair<std::string, double>> read_metrics(hid_t file, const std::string& path) {
  std::vector<std::pair<std::string, double>> out;
  if (!has_link(file, "metrics")) return out;
  h5::Handle group(H5_CHECK(H5Gopen2(file, "metrics", H5P_DEFAULT)), H5Gclose);
  std::vector<std::string> names;  // H5Aiterate2: the same calls in HDF5 1.10 and 1.12+
  const auto collect = [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
    static_cast<std::vector<std::string>*>(out)->push_back(name);
    return 0;
  };
  H5_CHECK(H5Aiterate2(group, H5_INDEX_NAME, H5_ITER_INC, nullptr, collect, &names));
  SHARDLM_CHECK(names.size() <= 256, "rollout file '%s': group 'metrics' has %zu attributes, at most 256",
                path.c_str(), names.size());
  for (const std::string& key : names) {
    const bool plain = !key.empty() && key.size() <= 64 && std::all_of(key.begin(), key.end(), [](char ch) {
      return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_';
    });
    SHARDLM_CHECK(plain, "rollout file '%s': metrics attribute '%s' must be named by letters, digits and '_' (at "
                  "most 64): it becomes a key of metrics.jsonl", path.c_str(), key.c_str());
    h5::Handle attr(H5_CHECK(H5Aopen(group, key.c_str(), H5P_DEFAULT)), H5Aclose);
    h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
    h5::Handle space(H5_CHECK(H5Aget_space(attr)), H5Sclose);
    const H5T_class_t cls = H5Tget_class(type);
    SHARDLM_CHECK((cls == H5T_FLOAT || cls == H5T_INTEGER) && H5Sget_simple_extent_npoints(space) == 1,
                  "rollout file '%s': metrics attribute '%s' must be one number", path.c_str(), key.c_str());
    double value = 0;
    H5_CHECK(H5Aread(attr, H5T_NATIVE_DOUBLE, &value));
    out.emplace_back(key, value);
  }
  return out;
}

enum class Kind { Int, UInt, Float };

bool has_type(hid_t type, Kind kind, size_t bytes) {
  const H5T_class_t cls = H5Tget_class(type);
  if (H5Tget_size(type) != bytes) return false;
  if (kind == Kind::Float) return cls == H5T_FLOAT;
  return cls == H5T_INTEGER && (H5Tget_sign(type) == H5T_SGN_2) == (kind == Kind::Int);
}

bool has_link(hid_t file, const char* name) { return H5_CHECK(H5Lexists(file, name, H5P_DEFAULT)) > 0; }

// Reads 1-D dataset `name` whole after checking its type and rank; an optional
// dataset that is absent gives an empty vector and *present = false.
template <class T>
std::vector<T> read_1d(hid_t file, const std::string& path, const char* name, Kind kind, const char* expected,
                       hid_t mem_type, bool required, bool* present = nullptr) {
  if (present) *present = false;
  if (!has_link(file, name)) {
    SHARDLM_CHECK(!required, "rollout file '%s' has no dataset '%s' (%s)", path.c_str(), name, kFormatHint);
    return {};
  }
  h5::Handle dset = h5::open_dataset(file, name, fmt("rollout file '%s'", path.c_str()));
  h5::Handle type(H5_CHECK(H5Dget_type(dset)), H5Tclose);
  SHARDLM_CHECK(has_type(type, kind, sizeof(T)), "rollout file '%s': dataset '%s' has dtype %s, expected %s",
                path.c_str(), name, h5::dtype_name(type).c_str(), expected);
  h5::Handle space(H5_CHECK(H5Dget_space(dset)), H5Sclose);
  const int rank = H5_CHECK(H5Sget_simple_extent_ndims(space));
  SHARDLM_CHECK(rank == 1, "rollout file '%s': dataset '%s' has rank %d, expected a 1-D array", path.c_str(),
                name, rank);
  hsize_t length = 0;
  H5_CHECK(H5Sget_simple_extent_dims(space, &length, nullptr));
  std::error_code ec;
  h5::check_declared_size(dset, name, static_cast<int64_t>(length), sizeof(T),
                          static_cast<int64_t>(fs::file_size(path, ec)), fmt("rollout file '%s'", path.c_str()));
  std::vector<T> values(length);
  if (length > 0) H5_CHECK(H5Dread(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
  if (present) *present = true;
  return values;
}

// The optional 2-D int32 dataset 'routes' (T, R): router replay's experts per
// token. Absent: empty, width 0.
std::vector<int32_t> read_routes(hid_t file, const std::string& path, int64_t& width) {
  width = 0;
  if (!has_link(file, "routes")) return {};
  h5::Handle dset = h5::open_dataset(file, "routes", fmt("rollout file '%s'", path.c_str()));
  h5::Handle type(H5_CHECK(H5Dget_type(dset)), H5Tclose);
  SHARDLM_CHECK(has_type(type, Kind::Int, 4), "rollout file '%s': dataset 'routes' has dtype %s, expected int32",
                path.c_str(), h5::dtype_name(type).c_str());
  h5::Handle space(H5_CHECK(H5Dget_space(dset)), H5Sclose);
  const int rank = H5_CHECK(H5Sget_simple_extent_ndims(space));
  SHARDLM_CHECK(rank == 2, "rollout file '%s': dataset 'routes' has rank %d, expected (tokens, layers of experts x "
                "experts a token)", path.c_str(), rank);
  hsize_t dims[2] = {0, 0};
  H5_CHECK(H5Sget_simple_extent_dims(space, dims, nullptr));
  SHARDLM_CHECK(dims[1] >= 1, "rollout file '%s': dataset 'routes' has rows of 0 experts", path.c_str());
  std::error_code ec;
  h5::check_declared_size(dset, "routes", static_cast<int64_t>(dims[0] * dims[1]), 4,
                          static_cast<int64_t>(fs::file_size(path, ec)), fmt("rollout file '%s'", path.c_str()));
  std::vector<int32_t> values(dims[0] * dims[1]);
  if (!values.empty()) H5_CHECK(H5Dread(dset, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
  width = static_cast<int64_t>(dims[1]);
  return values;
}

int64_t read_int_attribute(hid_t file, const std::string& path, const char* name, const char* meaning) {
  SHARDLM_CHECK(H5_CHECK(H5Aexists(file, name)) > 0, "rollout file '%s' has no root attribute '%s' (int64: %s)",
                path.c_str(), name, meaning);
  h5::Handle attr(H5_CHECK(H5Aopen(file, name, H5P_DEFAULT)), H5Aclose);
  h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
  h5::Handle space(H5_CHECK(H5Aget_space(attr)), H5Sclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_INTEGER && H5Sget_simple_extent_npoints(space) == 1,
                "rollout file '%s': attribute '%s' must be one integer, found %s with %lld values", path.c_str(),
                name, h5::dtype_name(type).c_str(), static_cast<long long>(H5Sget_simple_extent_npoints(space)));
  int64_t value = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_INT64, &value));
  return value;
}

// "sample 3, token 5" for flat token index t.
std::string where_token(const std::vector<int64_t>& offsets, int64_t t) {
  const auto it = std::upper_bound(offsets.begin(), offsets.end(), t);
  const int64_t s = (it - offsets.begin()) - 1;
  return fmt("sample %lld, token %lld", static_cast<long long>(s), static_cast<long long>(t - offsets[s]));
}

std::string describe(float v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt("%g", double(v));
}

// ------------------------------------------------------------------- read_rollouts' phases

// The file at `path_text`, opened read-only after the checks that name what is
// wrong with it (missing, not a regular file, empty, not HDF5). No file
// locking, serial driver: every rank reads it at once.
h5::Handle open_rollout_file(const std::string& path_text) {
  const char* path = path_text.c_str();
  std::error_code ec;
  SHARDLM_CHECK(fs::exists(path_text, ec), "rollout file '%s' does not exist", path);
  SHARDLM_CHECK(fs::is_regular_file(path_text, ec), "rollout file '%s' is not a regular file", path);
  SHARDLM_CHECK(fs::file_size(path_text, ec) > 0,
                "rollout file '%s' is empty (0 bytes); writers must write step_<N>.h5.tmp and rename it to "
                "step_<N>.h5 only when it is complete",
                path);
  h5::silence_error_stack();
  const htri_t is_hdf5 = H5Fis_hdf5(path);
  H5Eclear2(H5E_DEFAULT);
  SHARDLM_CHECK(is_hdf5 > 0, "rollout file '%s' is not an HDF5 file (see docs/rollouts.md)", path);

  h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  H5_CHECK(H5Pset_file_locking(fapl, false, true));
  return h5::Handle(H5_CHECK(H5Fopen(path, H5F_ACC_RDONLY, fapl)), H5Fclose);
}

// The offsets (from 0 to len(tokens), never decreasing, at least one sample)
// and every array's length against them; sets b.advantages_per_sample.
void check_offsets_and_lengths(RolloutBatch& b, bool has_temperature, bool has_loss_weight) {
  const char* path = b.path.c_str();
  const auto n_tokens = static_cast<int64_t>(b.tokens.size());
  const std::vector<int64_t>& off = b.offsets;
  SHARDLM_CHECK(!off.empty(), "rollout file '%s': dataset 'offsets' is empty; it must hold at least "
                "[0, len(tokens)]", path);
  SHARDLM_CHECK(off[0] == 0, "rollout file '%s': offsets[0] = %lld, expected 0", path,
                static_cast<long long>(off[0]));
  for (size_t i = 1; i < off.size(); ++i)
    SHARDLM_CHECK(off[i] >= off[i - 1],
                  "rollout file '%s': offsets decrease at index %zu (offsets[%zu] = %lld > offsets[%zu] = %lld)",
                  path, i, i - 1, static_cast<long long>(off[i - 1]), i, static_cast<long long>(off[i]));
  SHARDLM_CHECK(off.back() == n_tokens,
                "rollout file '%s': offsets ends at %lld but 'tokens' has %lld elements; the last offset must "
                "be len(tokens)",
                path, static_cast<long long>(off.back()), static_cast<long long>(n_tokens));
  const int64_t n_samples = b.samples();
  SHARDLM_CHECK(n_samples > 0 && n_tokens > 0, "rollout file '%s' holds no samples (%lld samples, %lld tokens)",
                path, static_cast<long long>(n_samples), static_cast<long long>(n_tokens));

  auto check_length = [&](const char* name, size_t got, int64_t want, const char* per) {
    SHARDLM_CHECK(static_cast<int64_t>(got) == want,
                  "rollout file '%s': '%s' has %zu elements, expected %lld (one per %s)", path, name, got,
                  static_cast<long long>(want), per);
  };
  check_length("loss_mask", b.loss_mask.size(), n_tokens, "token");
  check_length("inference_logprobs", b.inference_logprobs.size(), n_tokens, "token");
  if (!b.sampling_logprobs.empty()) check_length("sampling_logprobs", b.sampling_logprobs.size(), n_tokens, "token");
  if (b.route_width > 0)
    SHARDLM_CHECK(static_cast<int64_t>(b.routes.size()) == n_tokens * b.route_width,
                  "rollout file '%s': 'routes' has %lld rows, expected %lld (one per token)", path,
                  static_cast<long long>(b.routes.size()) / b.route_width, static_cast<long long>(n_tokens));
  if (has_temperature) check_length("temperature", b.temperature.size(), n_samples, "sample");
  if (has_loss_weight) check_length("loss_weight", b.loss_weight.size(), n_tokens, "token");
  const auto n_adv = static_cast<int64_t>(b.advantages.size());
  SHARDLM_CHECK(n_adv == n_tokens || n_adv == n_samples,
                "rollout file '%s': 'advantages' has %lld elements, expected %lld (one per token) or %lld (one "
                "per sample)",
                path, static_cast<long long>(n_adv), static_cast<long long>(n_tokens),
                static_cast<long long>(n_samples));
  // With n_tokens == n_samples every sample is one token: both readings agree.
  b.advantages_per_sample = n_adv == n_samples && n_adv != n_tokens;
}

// The values that must hold everywhere: token ids in the vocabulary, a 0/1
// loss mask, positive finite temperatures (1 where absent), finite weights
// >= 0 (1 where absent), finite per-sample advantages (then spread per token).
void check_values(RolloutBatch& b, int64_t vocab_size, bool has_temperature, bool has_loss_weight) {
  const char* path = b.path.c_str();
  const auto n_tokens = static_cast<int64_t>(b.tokens.size());
  const int64_t n_samples = b.samples();
  const std::vector<int64_t>& off = b.offsets;
  for (int64_t t = 0; t < n_tokens; ++t)
    SHARDLM_CHECK(b.tokens[t] >= 0 && b.tokens[t] < vocab_size,
                  "rollout file '%s': tokens[%lld] = %d (%s) is outside the model's vocabulary [0, %lld)", path,
                  static_cast<long long>(t), b.tokens[t], where_token(off, t).c_str(),
                  static_cast<long long>(vocab_size));
  for (size_t i = 0; i < b.routes.size(); ++i)  // the experts' range is the model's: the backend checks it
    SHARDLM_CHECK(b.routes[i] >= -1, "rollout file '%s': routes[%lld, %lld] = %d (%s); an expert is >= 0, -1 where "
                  "nothing was recorded", path, static_cast<long long>(i) / b.route_width,
                  static_cast<long long>(i) % b.route_width, b.routes[i],
                  where_token(off, static_cast<int64_t>(i) / b.route_width).c_str());
  for (int64_t t = 0; t < n_tokens; ++t)
    SHARDLM_CHECK(b.loss_mask[t] <= 1, "rollout file '%s': loss_mask[%lld] = %d (%s); values must be 0 or 1", path,
                  static_cast<long long>(t), b.loss_mask[t], where_token(off, t).c_str());
  if (has_temperature) {
    for (int64_t s = 0; s < n_samples; ++s)
      SHARDLM_CHECK(std::isfinite(b.temperature[s]) && b.temperature[s] > 0.0f,
                    "rollout file '%s': temperature[%lld] = %s; temperatures must be positive and finite "
                    "(the sampling temperature of the sample)",
                    path, static_cast<long long>(s), describe(b.temperature[s]).c_str());
  } else {
    b.temperature.assign(n_samples, 1.0f);
  }
  if (has_loss_weight) {
    for (int64_t t = 0; t < n_tokens; ++t)
      SHARDLM_CHECK(std::isfinite(b.loss_weight[t]) && b.loss_weight[t] >= 0.0f,
                    "rollout file '%s': loss_weight[%lld] = %s (%s); weights must be finite and >= 0", path,
                    static_cast<long long>(t), describe(b.loss_weight[t]).c_str(), where_token(off, t).c_str());
  } else {
    b.loss_weight.assign(n_tokens, 1.0f);
  }
  if (b.advantages_per_sample) {
    for (int64_t s = 0; s < n_samples; ++s)
      SHARDLM_CHECK(std::isfinite(b.advantages[s]), "rollout file '%s': advantages[%lld] (sample %lld) is %s",
                    path, static_cast<long long>(s), static_cast<long long>(s), describe(b.advantages[s]).c_str());
    std::vector<float> per_token(n_tokens);
    for (int64_t s = 0; s < n_samples; ++s)
      std::fill(per_token.begin() + off[s], per_token.begin() + off[s + 1], b.advantages[s]);
    b.advantages = std::move(per_token);
  }
}

// The values at loss tokens (other positions are never read and may hold
// anything): finite log-probabilities <= 0 and finite advantages. Counts them
// into b.loss_tokens, which must not be 0.
void count_loss_tokens(RolloutBatch& b) {
  const char* path = b.path.c_str();
  const int64_t n_samples = b.samples();
  const std::vector<int64_t>& off = b.offsets;
  for (int64_t s = 0; s < n_samples; ++s) {
    for (int64_t t = off[s] + 1; t < off[s + 1]; ++t) {
      if (b.loss_mask[t] == 0 || !(b.loss_weight[t] > 0.0f)) continue;
      ++b.loss_tokens;
      for (const auto& [name, values] : {std::pair<const char*, const std::vector<float>*>{"inference_logprobs",
                                                                                             &b.inference_logprobs},
                                         {"sampling_logprobs", &b.sampling_logprobs}}) {
        if (values->empty()) continue;
        const float lp = (*values)[t];
        SHARDLM_CHECK(std::isfinite(lp), "rollout file '%s': %s[%lld] (%s) is %s at a token that carries loss",
                      path, name, static_cast<long long>(t), where_token(off, t).c_str(), describe(lp).c_str());
        SHARDLM_CHECK(lp <= 0.0f,
                      "rollout file '%s': %s[%lld] (%s) = %g is positive; log-probabilities must be <= 0 (were "
                      "probabilities written instead of their logs?)",
                      path, name, static_cast<long long>(t), where_token(off, t).c_str(), double(lp));
      }
      if (!b.advantages_per_sample)
        SHARDLM_CHECK(std::isfinite(b.advantages[t]),
                      "rollout file '%s': advantages[%lld] (%s) is %s at a token that carries loss", path,
                      static_cast<long long>(t), where_token(off, t).c_str(), describe(b.advantages[t]).c_str());
    }
  }
  SHARDLM_CHECK(b.loss_tokens > 0,
                "rollout file '%s': no token carries loss (loss_mask * loss_weight is 0 at every token after the "
                "first of its sample); there is nothing to train on",
                path);
}

}  // namespace

// ------------------------------------------------------------------- reading

std::string rollout_path(const std::string& dir, int64_t step) {
  return (fs::path(dir) / fmt("step_%lld.h5", static_cast<long long>(step))).string();
}

RolloutBatch read_rollouts(const std::string& path_text, int64_t vocab_size) {
  SHARDLM_CHECK(vocab_size >= 1, "rollouts: vocab_size = %lld, the model's vocabulary size must be set",
                static_cast<long long>(vocab_size));
  const h5::Handle file = open_rollout_file(path_text);
  RolloutBatch b;
  b.path = path_text;
  const char* path = path_text.c_str();
  // Presence of every required dataset first, so a file missing several names the first in this order.
  for (const char* name : {"tokens", "offsets", "loss_mask", "advantages", "inference_logprobs"})
    SHARDLM_CHECK(has_link(file, name), "rollout file '%s' has no dataset '%s' (%s)", path, name, kFormatHint);
  b.tokens = read_1d<int32_t>(file, path_text, "tokens", Kind::Int, "int32", H5T_NATIVE_INT32, true);
  b.offsets = read_1d<int64_t>(file, path_text, "offsets", Kind::Int, "int64", H5T_NATIVE_INT64, true);
  b.loss_mask = read_1d<uint8_t>(file, path_text, "loss_mask", Kind::UInt, "uint8", H5T_NATIVE_UINT8, true);
  b.advantages = read_1d<float>(file, path_text, "advantages", Kind::Float, "float32", H5T_NATIVE_FLOAT, true);
  b.inference_logprobs =
      read_1d<float>(file, path_text, "inference_logprobs", Kind::Float, "float32", H5T_NATIVE_FLOAT, true);
  bool has_temperature = false, has_loss_weight = false, has_sampling = false;
  b.sampling_logprobs = read_1d<float>(file, path_text, "sampling_logprobs", Kind::Float, "float32",
                                       H5T_NATIVE_FLOAT, false, &has_sampling);
  if (!has_sampling) b.sampling_logprobs.clear();
  b.routes = read_routes(file, path_text, b.route_width);
  b.temperature = read_1d<float>(file, path_text, "temperature", Kind::Float, "float32", H5T_NATIVE_FLOAT,
                                 false, &has_temperature);
  b.loss_weight = read_1d<float>(file, path_text, "loss_weight", Kind::Float, "float32", H5T_NATIVE_FLOAT,
                                 false, &has_loss_weight);
  b.metrics = read_metrics(file, path_text);
  b.step = read_int_attribute(file, path_text, "step", "the trainer step these rollouts are for");
  b.policy_step =
      read_int_attribute(file, path_text, "policy_step", "the trainer step whose weights generated them");

  check_offsets_and_lengths(b, has_temperature, has_loss_weight);
  check_values(b, vocab_size, has_temperature, has_loss_weight);
  count_loss_tokens(b);
  return b;
}

uint64_t rollout_fingerprint(const RolloutBatch& b) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto add = [&](const void* data, size_t bytes) {  // 8 bytes a round: ~50 MB of a large step in ms
    const auto* p = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      h = (h ^ w) * 0x100000001b3ull;
    }
    for (; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  const auto add_vector = [&](const auto& v) {
    const uint64_t n = v.size();
    add(&n, sizeof n);
    add(v.data(), v.size() * sizeof(v[0]));
  };
  add(&b.step, sizeof b.step);
  add(&b.policy_step, sizeof b.policy_step);
  add_vector(b.tokens);
  add_vector(b.offsets);
  add_vector(b.loss_mask);
  add_vector(b.advantages);
  add_vector(b.inference_logprobs);
  add_vector(b.sampling_logprobs);
  add_vector(b.temperature);
  add_vector(b.loss_weight);
  add_vector(b.routes);
  return h;
}

// ------------------------------------------------------------------- waiting

void validate_rollout_dir(const std::string& dir) {
  std::error_code ec;
  SHARDLM_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec),
                "data.rollout_dir = '%s' is not a directory: it names the directory where step_<N>.h5 rollout files "
                "appear", dir.c_str());
}

uint64_t read_rollout_job_id(const std::string& path) {
  h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  H5_CHECK(H5Pset_file_locking(fapl, false, true));  // every rank reads it at once
  h5::silence_error_stack();
  h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose);
  SHARDLM_CHECK(file.get() >= 0, "rollout file '%s' cannot be opened as HDF5 (%s)", path.c_str(),
                h5::error_stack_message().c_str());
  if (H5_CHECK(H5Aexists(file, "job_id")) <= 0) return 0;
  h5::Handle attr(H5_CHECK(H5Aopen(file, "job_id", H5P_DEFAULT)), H5Aclose);
  h5::Handle space(H5_CHECK(H5Aget_space(attr)), H5Sclose);
  SHARDLM_CHECK(H5Sget_simple_extent_npoints(space) == 1, "rollout file '%s': attribute 'job_id' must be one integer",
                path.c_str());
  uint64_t id = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_UINT64, &id));
  return id;
}

std::string wait_for_rollouts(const std::string& dir, int64_t step, double timeout_s,
                              const std::function<void(const std::string&)>& progress,
                              double progress_interval_s, uint64_t job_id) {
  using clock = std::chrono::steady_clock;
  const std::string path = rollout_path(dir, step);
  validate_rollout_dir(dir);
  const auto start = clock::now();
  double next_progress_s = progress_interval_s;
  bool foreign_said = false;
  for (;;) {
    std::error_code ec;
    if (fs::exists(path, ec)) {
      if (job_id == 0) return path;
      // Renamed into place whole, so the id read is that of a complete file.
      const uint64_t found = read_rollout_job_id(path);
      if (found == job_id) return path;
      if (!foreign_said && progress)
        progress(found == 0 ? fmt("waiting for rollouts for step %lld: %s has no job id; it belongs to another job "
                                  "(offline rollouts), not this one (job %016llx): waiting for this job's inference "
                                  "ranks to replace it",
                                  static_cast<long long>(step), path.c_str(), static_cast<unsigned long long>(job_id))
                            : fmt("waiting for rollouts for step %lld: %s belongs to another job (job %016llx), not "
                                  "this one (job %016llx): waiting for this job's inference ranks to replace it",
                                  static_cast<long long>(step), path.c_str(), static_cast<unsigned long long>(found),
                                  static_cast<unsigned long long>(job_id)));
      foreign_said = true;
    }
    const double waited_s = std::chrono::duration<double>(clock::now() - start).count();
    if (waited_s >= timeout_s)
      SHARDLM_FAIL("no rollouts for step %lld in %s after %g s (is the inference server running?)",
                   static_cast<long long>(step), dir.c_str(), timeout_s);
    if (progress && progress_interval_s > 0 && waited_s >= next_progress_s) {
      progress(fmt("waiting for rollouts for step %lld: %s not there after %.0f s (timeout %g s)",
                   static_cast<long long>(step), path.c_str(), waited_s, timeout_s));
      while (next_progress_s <= waited_s) next_progress_s += progress_interval_s;
    }
    answer_collective_queries("waiting for rollouts");  // bounded by timeout_s
    // Trainer rank 0 of a job with inference ranks: are they still there?
    watch_other_side(fmt("waiting for the rollouts of step %lld", static_cast<long long>(step)).c_str(), waited_s);
    const double sleep_s = std::min(0.1, std::max(0.0, timeout_s - waited_s));
    std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
  }
}

void write_rollouts(const std::string& dir, const RolloutFile& r) {
  const std::string path = rollout_path(dir, r.step), tmp = path + ".tmp";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  h5::silence_error_stack();
  {
    h5::Handle f(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    SHARDLM_CHECK(f.get() >= 0, "rollouts for step %lld: cannot create %s (%s)", (long long)r.step, tmp.c_str(),
                  h5::error_stack_message().c_str());
    h5::write_1d(f, "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, r.tokens);
    h5::write_1d(f, "offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, r.offsets);
    h5::write_1d(f, "loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, r.loss_mask);
    h5::write_1d(f, "advantages", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, r.advantages);
    h5::write_1d(f, "inference_logprobs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, r.inference_logprobs);
    if (!r.sampling_logprobs.empty())
      h5::write_1d(f, "sampling_logprobs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, r.sampling_logprobs);
    if (r.route_width > 0) {
      SHARDLM_CHECK(r.routes.size() == r.tokens.size() * size_t(r.route_width),
                    "internal: rollouts for step %lld: %zu route entries for %zu tokens of %lld", (long long)r.step,
                    r.routes.size(), r.tokens.size(), (long long)r.route_width);
      const hsize_t dims[2] = {r.tokens.size(), hsize_t(r.route_width)};
      h5::Handle space(H5_CHECK(H5Screate_simple(2, dims, nullptr)), H5Sclose);
      h5::Handle d(H5_CHECK(H5Dcreate2(f, "routes", H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)),
                   H5Dclose);
      if (!r.routes.empty()) H5_CHECK(H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, r.routes.data()));
    }
    h5::write_1d(f, "temperature", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, r.temperature);
    h5::write_attr(f, "step", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{r.step});
    h5::write_attr(f, "policy_step", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{r.policy_step});
    if (r.job_id != 0) h5::write_attr(f, "job_id", H5T_STD_U64LE, H5T_NATIVE_UINT64, std::vector<uint64_t>{r.job_id});
    if (!r.rewards.empty()) h5::write_1d(f, "rewards", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, r.rewards);
    if (!r.metrics.empty()) {
      h5::Handle group(H5_CHECK(H5Gcreate2(f, "metrics", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Gclose);
      for (const auto& [name, value] : r.metrics)
        h5::write_attr(group, name.c_str(), H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, std::vector<double>{value});
    }
  }
  std::filesystem::rename(tmp, path, ec);
  SHARDLM_CHECK(!ec, "rollouts for step %lld: cannot rename %s to %s: %s", (long long)r.step, tmp.c_str(),
                path.c_str(), ec.message().c_str());
}

int64_t normalize_per_sequence(RolloutBatch& b) {
  int64_t samples = 0;
  for (int64_t s = 0; s < b.samples(); ++s) {
    int64_t count = 0;  // the sample's loss tokens, as read_rollouts counted them
    for (int64_t t = b.offsets[s] + 1; t < b.offsets[s + 1]; ++t) count += b.loss_mask[t] != 0 && b.loss_weight[t] > 0.0f;
    if (count == 0) continue;
    ++samples;
    for (int64_t t = b.offsets[s] + 1; t < b.offsets[s + 1]; ++t) b.loss_weight[t] /= float(count);
  }
  return samples;
}

void check_rollout_step(const RolloutBatch& b, int64_t step, int64_t max_async) {
  const char* path = b.path.c_str();
  SHARDLM_CHECK(b.step == step,
                "rollout file '%s' has attribute step = %lld but was read for step %lld; the file name and its "
                "step attribute must agree",
                path, static_cast<long long>(b.step), static_cast<long long>(step));
  SHARDLM_CHECK(b.policy_step <= step,
                "rollout file '%s': policy_step = %lld is after step %lld; rollouts cannot come from weights the "
                "trainer has not made yet",
                path, static_cast<long long>(b.policy_step), static_cast<long long>(step));
  SHARDLM_CHECK(step - b.policy_step <= max_async,
                "rollout file '%s' was generated with the weights of step %lld, %lld steps behind step %lld, but "
                "data.max_async = %lld allows at most %lld; raise data.max_async or let the inference server "
                "catch up",
                path, static_cast<long long>(b.policy_step), static_cast<long long>(step - b.policy_step),
                static_cast<long long>(step), static_cast<long long>(max_async),
                static_cast<long long>(max_async));
}

// ------------------------------------------------------------------- packing

std::vector<int> assign_samples_to_ranks(const RolloutBatch& b, int world) {
  SHARDLM_CHECK(world >= 1, "rollouts: world size %d must be at least 1", world);
  const int64_t n = b.samples();
  std::vector<int64_t> order(n);
  for (int64_t s = 0; s < n; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return b.sample_pairs(x) > b.sample_pairs(y); });
  std::vector<int> rank_of(n, -1);
  std::vector<int64_t> filled(world, 0);
  for (int64_t s : order) {
    if (b.sample_pairs(s) == 0) continue;
    const int r = static_cast<int>(std::min_element(filled.begin(), filled.end()) - filled.begin());
    rank_of[s] = r;
    filled[r] += b.sample_pairs(s);
  }
  return rank_of;
}

namespace {

// Best-fit decreasing: rows[i] lists the samples of row i in placement order.
// Samples arrive longest first; each goes into the row with the least room that
// still fits it (the lowest row index among equals), else a new row.
std::vector<std::vector<int64_t>> pack_rows(const RolloutBatch& b, const std::vector<int64_t>& samples,
                                            int64_t seq_len) {
  std::vector<std::vector<int64_t>> rows;
  std::set<std::pair<int64_t, int64_t>> room;  // (free positions, row)
  for (int64_t s : samples) {
    const int64_t need = b.sample_pairs(s);
    auto it = room.lower_bound({need, -1});
    int64_t row = 0, free = 0;
    if (it == room.end()) {
      row = static_cast<int64_t>(rows.size());
      rows.emplace_back();
      free = seq_len;
    } else {
      row = it->second;
      free = it->first;
      room.erase(it);
    }
    rows[row].push_back(s);
    if (free - need > 0) room.insert({free - need, row});
  }
  return rows;
}

void resize_micro_batch(RlMicroBatch& m, int64_t rows, int64_t seq_len, bool sampling_logprobs, int64_t route_width) {
  const auto numel = static_cast<size_t>(rows * seq_len);
  m.batch.rows = rows;
  m.batch.seq_len = seq_len;
  m.batch.loss_tokens = 0;
  m.batch.tokens.assign(numel, 0);
  m.batch.targets.assign(numel, -1);
  m.batch.weights.assign(numel, 0.0f);
  m.batch.positions.assign(numel, 0);
  m.batch.seq_ids.assign(numel, 0);
  m.advantages.assign(numel, 0.0f);
  m.inference_logprobs.assign(numel, 0.0f);
  if (sampling_logprobs) m.sampling_logprobs.assign(numel, 0.0f);
  else m.sampling_logprobs.clear();
  m.routes.assign(numel * size_t(route_width), -1);
  m.route_width = route_width;
  m.temperatures.assign(numel, 1.0f);
  m.sample_ids.assign(numel, -1);
}

// Writes the samples of one row into slot `slot` of m; seq_id continues from next_seq_id.
void fill_row(const RolloutBatch& b, const std::vector<int64_t>& samples, int64_t slot, int32_t& next_seq_id,
              RlMicroBatch& m) {
  const int64_t seq_len = m.batch.seq_len;
  const int64_t base = slot * seq_len;
  int64_t used = 0;
  for (int64_t s : samples) {
    const int64_t first = b.offsets[s];
    const int64_t pairs = b.sample_pairs(s);
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t at = base + used + j;
      const int64_t target = first + j + 1;
      const float weight = b.loss_mask[target] ? b.loss_weight[target] : 0.0f;
      m.batch.tokens[at] = b.tokens[target - 1];
      m.batch.targets[at] = b.tokens[target];
      m.batch.weights[at] = weight;
      m.batch.positions[at] = static_cast<int32_t>(j);
      m.batch.seq_ids[at] = next_seq_id;
      m.batch.loss_tokens += weight > 0.0f;
      m.advantages[at] = b.advantages[target];
      m.inference_logprobs[at] = b.inference_logprobs[target];
      if (!b.sampling_logprobs.empty()) m.sampling_logprobs[at] = b.sampling_logprobs[target];
      if (b.route_width > 0)  // the input token's: the route recorded when it was fed in
        std::copy_n(b.routes.begin() + (target - 1) * b.route_width, b.route_width,
                    m.routes.begin() + at * b.route_width);
      m.temperatures[at] = b.temperature[s];
      m.sample_ids[at] = static_cast<int32_t>(s);
    }
    used += pairs;
    ++next_seq_id;
  }
  if (used < seq_len) {  // padding: one sequence of its own that nothing attends into
    for (int64_t at = base + used; at < base + seq_len; ++at) m.batch.seq_ids[at] = next_seq_id;
    ++next_seq_id;
  }
}

}  // namespace

RankRollouts pack_rollouts(const RolloutBatch& b, int64_t seq_len, int64_t micro_batch, int rank, int world) {
  SHARDLM_CHECK(seq_len >= 2, "data.seq_len = %lld: a row needs at least 2 positions",
                static_cast<long long>(seq_len));
  SHARDLM_CHECK(micro_batch >= 1, "data.micro_batch = %lld: must be at least 1", static_cast<long long>(micro_batch));
  SHARDLM_CHECK(micro_batch * seq_len <= INT32_MAX, "data.micro_batch * data.seq_len = %lld positions exceeds 2^31-1",
                static_cast<long long>(micro_batch * seq_len));
  SHARDLM_CHECK(world >= 1 && rank >= 0 && rank < world, "rollouts: rank %d is outside a world of %d", rank, world);
  for (int64_t s = 0; s < b.samples(); ++s)
    SHARDLM_CHECK(b.sample_pairs(s) <= seq_len,
                  "rollout file '%s': sample %lld has %lld tokens, more than data.seq_len + 1 = %lld (a row holds "
                  "seq_len input/target pairs); raise data.seq_len or cap the generation length",
                  b.path.c_str(), static_cast<long long>(s), static_cast<long long>(b.sample_tokens(s)),
                  static_cast<long long>(seq_len + 1));

  const std::vector<int> rank_of = assign_samples_to_ranks(b, world);
  // Samples of each rank, longest first (the assignment order), then every
  // rank's rows: all ranks pack, so each knows the largest micro-batch count.
  std::vector<int64_t> order(b.samples());
  for (int64_t s = 0; s < b.samples(); ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return b.sample_pairs(x) > b.sample_pairs(y); });
  std::vector<std::vector<int64_t>> samples_of(world);
  for (int64_t s : order)
    if (rank_of[s] >= 0) samples_of[rank_of[s]].push_back(s);

  RankRollouts out;
  int64_t max_micro_batches = 0;
  std::vector<std::vector<int64_t>> my_rows;
  for (int r = 0; r < world; ++r) {
    std::vector<std::vector<int64_t>> rows = pack_rows(b, samples_of[r], seq_len);
    const auto n_rows = static_cast<int64_t>(rows.size());
    max_micro_batches = std::max(max_micro_batches, (n_rows + micro_batch - 1) / micro_batch);
    int64_t tokens = 0;
    for (int64_t s : samples_of[r]) tokens += b.sample_pairs(s);
    out.tokens_global += tokens;
    if (r == rank) {
      my_rows = std::move(rows);
      out.tokens = tokens;
      out.samples = static_cast<int64_t>(samples_of[r].size());
    }
  }
  out.loss_tokens_global = b.loss_tokens;

  const auto n_rows = static_cast<int64_t>(my_rows.size());
  out.real_micro_batches = (n_rows + micro_batch - 1) / micro_batch;
  out.micro_batches.resize(max_micro_batches);
  for (int64_t i = 0; i < max_micro_batches; ++i) {
    RlMicroBatch& m = out.micro_batches[i];
    resize_micro_batch(m, micro_batch, seq_len, !b.sampling_logprobs.empty(), b.route_width);
    int32_t next_seq_id = 0;
    static const std::vector<int64_t> kEmptyRow;
    for (int64_t slot = 0; slot < micro_batch; ++slot) {
      const int64_t row = i * micro_batch + slot;
      fill_row(b, row < n_rows ? my_rows[row] : kEmptyRow, slot, next_seq_id, m);
    }
    out.loss_tokens += m.batch.loss_tokens;
  }
  return out;
}

}  // namespace shardlm
