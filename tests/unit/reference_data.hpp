// reference_data.hpp — the in-memory token reader (the whole file read into
// memory), the reference the streamed reader must match row for row. Tests
// only.
#pragma once

#include <algorithm>
#include <climits>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "data/data.hpp"
#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"

namespace shardlm::reference {

using shardlm::MicroBatch;
using shardlm::StepCounts;

struct DataSpec {  // the single-file spec of that version
  std::string path;          // HDF5 token file (tools/make_dataset.py)
  int64_t seq_len = 0;       // positions per row
  int64_t micro_batch = 0;   // rows per micro-batch
  int64_t global_batch = 0;  // rows per optimizer step, over all ranks
  uint64_t seed = 0;         // document order = f(seed, epoch)
  int64_t vocab_size = 0;    // the model's; every token id must be < this
  bool shuffle = true;       // false: file order every epoch (tests, curricula)
};

// Where the sampler stands. Rows of the stream are consumed in order; `step`
// starts at row `rows_consumed`. The other fields say what the rows were
// packed from; restore() refuses a position from a different packing.
struct DataPosition {
  int64_t step = 0;
  int64_t rows_consumed = 0;
  int64_t seq_len = 0;
  uint64_t seed = 0;
  int64_t documents = 0;  // documents with >= 2 tokens in the file
  bool shuffle = true;

  std::vector<int64_t> to_vector() const;  // for the checkpoint's /data dataset
  static DataPosition from_vector(std::span<const int64_t> values);
  bool operator==(const DataPosition&) const = default;
};

class TokenDataset {
 public:
  // Reads and validates the whole file into host memory (tokens 4 B, offsets
  // 8 B per document, loss_mask 1 B per token). Throws shardlm::Error naming
  // the file and what is wrong.
  explicit TokenDataset(const DataSpec& spec);

  // A = global_batch / (micro_batch * world); throws if it does not divide.
  int64_t micro_batches_per_rank(int world) const;

  // Micro-batch number (accum_index * world + rank) of `step`'s global batch.
  // `out` is resized once and then reused without allocating.
  void micro_batch(int64_t step, int accum_index, int rank, int world, MicroBatch& out);
  MicroBatch micro_batch(int64_t step, int accum_index, int rank, int world);

  StepCounts step_counts(int64_t step);

  // The position at the start of `step` (save it after finishing step-1).
  DataPosition position(int64_t step) const;
  // Continue from a saved position: `pos.step` will read the rows it would
  // have read when saved, even if global_batch has changed since.
  void restore(const DataPosition& pos);

  // Inspection (tests, `shardlm check`, logs).
  int64_t documents() const { return static_cast<int64_t>(doc_first_token_.size()); }
  int64_t total_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t file_vocab_size() const { return file_vocab_size_; }  // 0 when absent
  const std::string& tokenizer() const { return tokenizer_; }    // "" when absent
  int64_t rows_in_epoch(int64_t epoch);
  std::vector<int64_t> document_order(int64_t epoch) const;  // indices into documents()
  const DataSpec& spec() const { return spec_; }

 private:
  // A contiguous run of (input, target) pairs of one document inside a row:
  // inputs tokens_[first .. first+pairs), targets one token further.
  struct Segment {
    int64_t first;
    int64_t pairs;
  };
  struct EpochPacking {
    int64_t epoch = -1;
    std::vector<Segment> segments;
    std::vector<int64_t> row_begin;  // row r = segments[row_begin[r] .. row_begin[r+1])
    int64_t rows() const { return static_cast<int64_t>(row_begin.size()) - 1; }
  };

  void pack_epoch(int64_t epoch, EpochPacking& out) const;
  const EpochPacking& packing(int64_t epoch);
  // Global stream row -> (epoch, row within epoch).
  void locate_row(int64_t stream_row, int64_t& epoch, int64_t& row);
  int64_t first_row_of_step(int64_t step) const;
  // Writes row `stream_row` into out[slot]; seq_id continues from `next_seq_id`.
  void fill_row(int64_t stream_row, int64_t slot, int32_t& next_seq_id, MicroBatch& out);

  DataSpec spec_;
  std::vector<int32_t> tokens_;          // (total_tokens)
  std::vector<uint8_t> loss_mask_;       // (total_tokens) or empty = all 1
  std::vector<int64_t> doc_first_token_; // documents with >= 2 tokens, file order
  std::vector<int64_t> doc_pairs_;       // tokens - 1 for each of them
  int64_t file_vocab_size_ = 0;
  std::string tokenizer_;

  DataPosition anchor_;                  // step anchor_.step starts at anchor_.rows_consumed
  std::vector<int64_t> epoch_row_begin_; // stream row where epoch e starts; grows lazily
  EpochPacking cache_[2];                // the two most recently used epochs
  int next_cache_slot_ = 0;
};


namespace {

constexpr int64_t kPositionFormat = 1;
constexpr size_t kPositionValues = 7;

// ---------------------------------------------------------------- HDF5 reading

bool is_integer(hid_t type, size_t bytes, bool is_signed) {
  return H5Tget_class(type) == H5T_INTEGER && H5Tget_size(type) == bytes &&
         (H5Tget_sign(type) == H5T_SGN_2) == is_signed;
}

// Opens dataset `name`, checks it is 1-D with an integer type of `bytes` and
// signedness `is_signed`, and reads it whole, converted to T.
template <class T>
std::vector<T> read_1d(hid_t file, const std::string& path, const char* name,
                       const char* expected, size_t bytes, bool is_signed, hid_t mem_type) {
  hid_t id = H5Dopen2(file, name, H5P_DEFAULT);
  if (id < 0) {
    H5Eclear2(H5E_DEFAULT);
    SHARDLM_FAIL("data file '%s': '%s' exists but is not a dataset", path.c_str(), name);
  }
  h5::Handle dset(id, H5Dclose);
  h5::Handle type(H5_CHECK(H5Dget_type(dset)), H5Tclose);
  SHARDLM_CHECK(is_integer(type, bytes, is_signed),
                "data file '%s': dataset '%s' has dtype %s, expected %s", path.c_str(), name,
                h5::dtype_name(type).c_str(), expected);
  h5::Handle space(H5_CHECK(H5Dget_space(dset)), H5Sclose);
  const int rank = H5_CHECK(H5Sget_simple_extent_ndims(space));
  SHARDLM_CHECK(rank == 1, "data file '%s': dataset '%s' has rank %d, expected a 1-D array",
                path.c_str(), name, rank);
  hsize_t length = 0;
  H5_CHECK(H5Sget_simple_extent_dims(space, &length, nullptr));
  std::vector<T> values(length);
  if (length > 0)
    H5_CHECK(H5Dread(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
  return values;
}

bool has_link(hid_t file, const char* name) {
  return H5_CHECK(H5Lexists(file, name, H5P_DEFAULT)) > 0;
}

bool has_attribute(hid_t file, const char* name) {
  return H5_CHECK(H5Aexists(file, name)) > 0;
}

int64_t read_int_attribute(hid_t file, const std::string& path, const char* name) {
  h5::Handle attr(H5_CHECK(H5Aopen(file, name, H5P_DEFAULT)), H5Aclose);
  h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
  h5::Handle space(H5_CHECK(H5Aget_space(attr)), H5Sclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_INTEGER && H5Sget_simple_extent_npoints(space) == 1,
                "data file '%s': attribute '%s' must be one integer, found %s with %ld values",
                path.c_str(), name, h5::dtype_name(type).c_str(),
                static_cast<long>(H5Sget_simple_extent_npoints(space)));
  int64_t value = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_INT64, &value));
  return value;
}

std::string read_string_attribute(hid_t file, const std::string& path, const char* name) {
  h5::Handle attr(H5_CHECK(H5Aopen(file, name, H5P_DEFAULT)), H5Aclose);
  h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
  h5::Handle space(H5_CHECK(H5Aget_space(attr)), H5Sclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_STRING && H5Sget_simple_extent_npoints(space) == 1,
                "data file '%s': attribute '%s' must be one string, found %s", path.c_str(),
                name, h5::dtype_name(type).c_str());
  h5::Handle mem_type(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_cset(mem_type, H5Tget_cset(type)));
  if (H5_CHECK(H5Tis_variable_str(type)) > 0) {  // h5py writes str attributes this way
    H5_CHECK(H5Tset_size(mem_type, H5T_VARIABLE));
    char* text = nullptr;
    H5_CHECK(H5Aread(attr, mem_type, &text));
    std::string value = text ? text : "";
    H5free_memory(text);
    return value;
  }
  const size_t size = H5Tget_size(type);
  H5_CHECK(H5Tset_size(mem_type, size + 1));  // room for the terminator
  std::string value(size + 1, '\0');
  H5_CHECK(H5Aread(attr, mem_type, value.data()));
  value.resize(value.find('\0'));
  return value;
}

// ------------------------------------------------------------ document order

// splitmix64 (Steele, Lea, Flood 2014): a fixed, portable generator, so the
// order is the same with every compiler and standard library.
uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t mix64(uint64_t x) { return splitmix64_next(x); }

// Uniform in [0, bound) without modulo bias: reject the lowest 2^64 mod bound values.
uint64_t uniform_below(uint64_t& state, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = splitmix64_next(state);
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

// ------------------------------------------------------------------ position

inline std::vector<int64_t> DataPosition::to_vector() const {
  return {kPositionFormat, step, rows_consumed, seq_len, static_cast<int64_t>(seed),
          documents, shuffle ? 1 : 0};
}

inline DataPosition DataPosition::from_vector(std::span<const int64_t> values) {
  SHARDLM_CHECK(values.size() == kPositionValues && values[0] == kPositionFormat,
                "data position: expected %zu values in format %ld, got %zu values%s", kPositionValues,
                static_cast<long>(kPositionFormat), values.size(),
                values.empty() ? "" : fmt(" starting with %ld", static_cast<long>(values[0])).c_str());
  DataPosition pos;
  pos.step = values[1];
  pos.rows_consumed = values[2];
  pos.seq_len = values[3];
  pos.seed = static_cast<uint64_t>(values[4]);
  pos.documents = values[5];
  pos.shuffle = values[6] != 0;
  return pos;
}

// ------------------------------------------------------------------- loading

inline TokenDataset::TokenDataset(const DataSpec& spec) : spec_(spec) {
  const char* path = spec.path.c_str();
  SHARDLM_CHECK(spec.seq_len >= 2,
                "data.seq_len = %ld: a row needs at least 2 positions (one input, one target)",
                spec.seq_len);
  SHARDLM_CHECK(spec.micro_batch >= 1, "data.micro_batch = %ld: must be at least 1",
                spec.micro_batch);
  SHARDLM_CHECK(spec.global_batch >= 1 && spec.global_batch % spec.micro_batch == 0,
                "data.global_batch = %ld must be a positive multiple of data.micro_batch = %ld",
                spec.global_batch, spec.micro_batch);
  // positions and seq_ids are int32 across one micro-batch.
  SHARDLM_CHECK(spec.micro_batch * spec.seq_len <= INT32_MAX,
                "data.micro_batch * data.seq_len = %ld positions exceeds 2^31-1",
                spec.micro_batch * spec.seq_len);
  SHARDLM_CHECK(spec.vocab_size >= 1, "data: vocab_size = %ld, the model's vocabulary size must be set",
                spec.vocab_size);

  std::error_code ec;
  SHARDLM_CHECK(std::filesystem::exists(spec.path, ec), "data file '%s' does not exist", path);
  SHARDLM_CHECK(std::filesystem::is_regular_file(spec.path, ec), "data file '%s' is not a regular file",
                path);
  h5::silence_error_stack();
  const htri_t is_hdf5 = H5Fis_hdf5(path);
  H5Eclear2(H5E_DEFAULT);
  SHARDLM_CHECK(is_hdf5 > 0, "data file '%s' is not an HDF5 file (make one with tools/make_dataset.py)",
                path);

  // Read-only and without file locking: every rank opens the file at once, and
  // parallel file systems often do not support flock. No MPI-IO: each rank
  // reads the file with the serial driver, so this works without MPI_Init too.
  h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  H5_CHECK(H5Pset_file_locking(fapl, false, true));
  h5::Handle file(H5_CHECK(H5Fopen(path, H5F_ACC_RDONLY, fapl)), H5Fclose);

  for (const char* name : {"tokens", "offsets"})
    SHARDLM_CHECK(has_link(file, name),
                  "data file '%s' has no dataset '%s' (expected 'tokens' int32 and 'offsets' int64; "
                  "see docs/data.md)",
                  path, name);
  tokens_ = read_1d<int32_t>(file, spec.path, "tokens", "int32", 4, true, H5T_NATIVE_INT32);
  const std::vector<int64_t> offsets =
      read_1d<int64_t>(file, spec.path, "offsets", "int64", 8, true, H5T_NATIVE_INT64);
  const bool has_loss_mask = has_link(file, "loss_mask");
  if (has_loss_mask)
    loss_mask_ = read_1d<uint8_t>(file, spec.path, "loss_mask", "uint8", 1, false, H5T_NATIVE_UINT8);
  if (has_attribute(file, "vocab_size"))
    file_vocab_size_ = read_int_attribute(file, spec.path, "vocab_size");
  if (has_attribute(file, "tokenizer"))
    tokenizer_ = read_string_attribute(file, spec.path, "tokenizer");

  const auto n_tokens = static_cast<int64_t>(tokens_.size());
  SHARDLM_CHECK(!offsets.empty(),
                "data file '%s': dataset 'offsets' is empty; it must hold at least [0, len(tokens)]",
                path);
  SHARDLM_CHECK(offsets[0] == 0, "data file '%s': offsets[0] = %ld, expected 0", path, offsets[0]);
  for (size_t i = 1; i < offsets.size(); ++i)
    SHARDLM_CHECK(offsets[i] >= offsets[i - 1],
                  "data file '%s': offsets decrease at index %zu (offsets[%zu] = %ld > offsets[%zu] = %ld)",
                  path, i, i - 1, offsets[i - 1], i, offsets[i]);
  SHARDLM_CHECK(offsets.back() == n_tokens,
                "data file '%s': offsets ends at %ld but 'tokens' has %ld elements; the last offset "
                "must be len(tokens)",
                path, offsets.back(), n_tokens);
  if (has_loss_mask) {
    SHARDLM_CHECK(static_cast<int64_t>(loss_mask_.size()) == n_tokens,
                  "data file '%s': 'loss_mask' has %zu elements but 'tokens' has %ld", path,
                  loss_mask_.size(), n_tokens);
    for (size_t i = 0; i < loss_mask_.size(); ++i)
      SHARDLM_CHECK(loss_mask_[i] <= 1, "data file '%s': loss_mask[%zu] = %d; values must be 0 or 1",
                    path, i, loss_mask_[i]);
  }
  SHARDLM_CHECK(file_vocab_size_ <= spec.vocab_size,
                "data file '%s' was tokenized for a vocabulary of %ld ids (attribute vocab_size%s%s) "
                "but the model has vocab_size %ld; use a file made with the model's tokenizer",
                path, file_vocab_size_, tokenizer_.empty() ? "" : ", tokenizer ", tokenizer_.c_str(),
                spec.vocab_size);
  for (int64_t i = 0; i < n_tokens; ++i)
    SHARDLM_CHECK(tokens_[i] >= 0 && tokens_[i] < spec.vocab_size,
                  "data file '%s': tokens[%ld] = %d is outside the model's vocabulary [0, %ld)", path, i,
                  tokens_[i], spec.vocab_size);

  int64_t loss_targets = 0;
  for (size_t d = 0; d + 1 < offsets.size(); ++d) {
    const int64_t n = offsets[d + 1] - offsets[d];
    if (n < 2) continue;  // a single token has nothing to predict
    doc_first_token_.push_back(offsets[d]);
    doc_pairs_.push_back(n - 1);
    if (loss_mask_.empty()) {
      loss_targets += n - 1;
    } else {
      for (int64_t t = offsets[d] + 1; t < offsets[d + 1]; ++t) loss_targets += loss_mask_[t];
    }
  }
  SHARDLM_CHECK(!doc_first_token_.empty(),
                "data file '%s' has no document with at least 2 tokens (%zu documents, %ld tokens); "
                "there is nothing to train on",
                path, offsets.size() - 1, n_tokens);
  SHARDLM_CHECK(loss_targets > 0,
                "data file '%s': no target token carries loss (loss_mask is 0 at every token that "
                "follows another in its document); there is nothing to train on",
                path);

  epoch_row_begin_ = {0};
}

// ------------------------------------------------------------------- packing

inline std::vector<int64_t> TokenDataset::document_order(int64_t epoch) const {
  std::vector<int64_t> order(doc_first_token_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  if (!spec_.shuffle) return order;
  // Fisher-Yates driven by splitmix64 seeded from (seed, epoch).
  uint64_t state = mix64(spec_.seed ^ mix64(static_cast<uint64_t>(epoch) + 0xD1B54A32D192ED03ull));
  for (size_t i = order.size(); i > 1; --i) {
    const uint64_t j = uniform_below(state, i);
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

// Greedy packing in document order. A document of p <= seq_len pairs is never
// split: if it does not fit in the current row, the rest of the row is padding
// and it starts the next row. A document of p > seq_len pairs fills the rest
// of the current row with its first piece and continues in the next rows.
inline void TokenDataset::pack_epoch(int64_t epoch, EpochPacking& out) const {
  const int64_t seq_len = spec_.seq_len;
  out.epoch = epoch;
  out.segments.clear();
  out.row_begin.assign(1, 0);
  int64_t used = 0;  // positions filled in the open row
  auto close_row = [&] {
    out.row_begin.push_back(static_cast<int64_t>(out.segments.size()));
    used = 0;
  };
  for (int64_t d : document_order(epoch)) {
    int64_t first = doc_first_token_[d];
    int64_t pairs = doc_pairs_[d];
    if (pairs <= seq_len && used + pairs > seq_len) close_row();
    while (pairs > 0) {
      const int64_t take = std::min(pairs, seq_len - used);
      out.segments.push_back({first, take});
      used += take;
      first += take;
      pairs -= take;
      if (used == seq_len) close_row();
    }
  }
  if (used > 0) close_row();
}

inline const TokenDataset::EpochPacking& TokenDataset::packing(int64_t epoch) {
  for (const EpochPacking& cached : cache_)
    if (cached.epoch == epoch) return cached;
  EpochPacking& slot = cache_[next_cache_slot_];
  next_cache_slot_ ^= 1;
  pack_epoch(epoch, slot);
  return slot;
}

inline int64_t TokenDataset::rows_in_epoch(int64_t epoch) { return packing(epoch).rows(); }

inline void TokenDataset::locate_row(int64_t stream_row, int64_t& epoch, int64_t& row) {
  while (epoch_row_begin_.back() <= stream_row) {
    const auto next_epoch = static_cast<int64_t>(epoch_row_begin_.size()) - 1;
    epoch_row_begin_.push_back(epoch_row_begin_.back() + rows_in_epoch(next_epoch));
  }
  const auto it = std::upper_bound(epoch_row_begin_.begin(), epoch_row_begin_.end(), stream_row);
  epoch = (it - epoch_row_begin_.begin()) - 1;
  row = stream_row - epoch_row_begin_[epoch];
}

// ------------------------------------------------------------ steps, batches

inline DataPosition TokenDataset::position(int64_t step) const {
  DataPosition pos;
  pos.step = step;
  pos.rows_consumed = first_row_of_step(step);
  pos.seq_len = spec_.seq_len;
  pos.seed = spec_.seed;
  pos.documents = documents();
  pos.shuffle = spec_.shuffle;
  return pos;
}

inline void TokenDataset::restore(const DataPosition& pos) {
  SHARDLM_CHECK(pos.step >= 0 && pos.rows_consumed >= 0,
                "data position: step %ld, rows consumed %ld; both must be >= 0", pos.step,
                pos.rows_consumed);
  std::string changed;
  if (pos.seq_len != spec_.seq_len)
    changed = fmt("data.seq_len was %ld then and is %ld now", pos.seq_len, spec_.seq_len);
  else if (pos.documents != documents())
    changed = fmt("data.path had %ld documents then and has %ld now", pos.documents, documents());
  else if (pos.shuffle != spec_.shuffle)
    changed = fmt("shuffling was %s then and is %s now", pos.shuffle ? "on" : "off",
                  spec_.shuffle ? "on" : "off");
  else if (pos.shuffle && pos.seed != spec_.seed)
    changed = fmt("the seed was %lu then and is %lu now", static_cast<unsigned long>(pos.seed),
                  static_cast<unsigned long>(spec_.seed));
  SHARDLM_CHECK(changed.empty(),
                "cannot continue the data order saved at step %ld: %s, so the saved row position "
                "would point at other rows",
                pos.step, changed.c_str());
  anchor_.step = pos.step;
  anchor_.rows_consumed = pos.rows_consumed;
}

inline int64_t TokenDataset::first_row_of_step(int64_t step) const {
  SHARDLM_CHECK(step >= anchor_.step, "data: step %ld comes before the restored position (step %ld)",
                step, anchor_.step);
  return anchor_.rows_consumed + (step - anchor_.step) * spec_.global_batch;
}

inline int64_t TokenDataset::micro_batches_per_rank(int world) const {
  const int64_t per_step = spec_.micro_batch * world;
  SHARDLM_CHECK(world >= 1 && spec_.global_batch % per_step == 0,
                "data.global_batch = %ld rows cannot be split into micro-batches of %ld rows over %d "
                "ranks; make it a multiple of micro_batch * ranks = %ld",
                spec_.global_batch, spec_.micro_batch, world, per_step);
  return spec_.global_batch / per_step;
}

inline void TokenDataset::fill_row(int64_t stream_row, int64_t slot, int32_t& next_seq_id, MicroBatch& out) {
  int64_t epoch = 0, row = 0;
  locate_row(stream_row, epoch, row);
  const EpochPacking& pack = packing(epoch);
  const int64_t seq_len = spec_.seq_len;
  const int64_t base = slot * seq_len;
  int64_t used = 0;
  for (int64_t s = pack.row_begin[row]; s < pack.row_begin[row + 1]; ++s) {
    const Segment seg = pack.segments[s];
    for (int64_t j = 0; j < seg.pairs; ++j) {
      const int64_t at = base + used + j;
      const int64_t target = seg.first + j + 1;
      const float weight = loss_mask_.empty() ? 1.0f : static_cast<float>(loss_mask_[target]);
      out.tokens[at] = tokens_[target - 1];
      out.targets[at] = tokens_[target];
      out.weights[at] = weight;
      out.positions[at] = static_cast<int32_t>(j);
      out.seq_ids[at] = next_seq_id;
      out.loss_tokens += weight > 0.0f;
    }
    used += seg.pairs;
    ++next_seq_id;
  }
  if (used < seq_len) {  // padding: one sequence of its own that nothing attends into
    for (int64_t at = base + used; at < base + seq_len; ++at) {
      out.tokens[at] = 0;
      out.targets[at] = -1;
      out.weights[at] = 0.0f;
      out.positions[at] = 0;
      out.seq_ids[at] = next_seq_id;
    }
    ++next_seq_id;
  }
}

inline void TokenDataset::micro_batch(int64_t step, int accum_index, int rank, int world, MicroBatch& out) {
  const int64_t accum_steps = micro_batches_per_rank(world);
  SHARDLM_CHECK(rank >= 0 && rank < world && accum_index >= 0 && accum_index < accum_steps,
                "data: micro-batch for rank %d of %d, accumulation index %d of %ld is out of range",
                rank, world, accum_index, accum_steps);
  const int64_t rows = spec_.micro_batch;
  const int64_t numel = rows * spec_.seq_len;
  const int64_t number = static_cast<int64_t>(accum_index) * world + rank;
  const int64_t first_row = first_row_of_step(step) + number * rows;
  out.rows = rows;
  out.seq_len = spec_.seq_len;
  out.tokens.resize(numel);
  out.targets.resize(numel);
  out.weights.resize(numel);
  out.positions.resize(numel);
  out.seq_ids.resize(numel);
  out.loss_tokens = 0;
  int32_t next_seq_id = 0;
  for (int64_t i = 0; i < rows; ++i) fill_row(first_row + i, i, next_seq_id, out);
}

inline MicroBatch TokenDataset::micro_batch(int64_t step, int accum_index, int rank, int world) {
  MicroBatch out;
  micro_batch(step, accum_index, rank, world, out);
  return out;
}

inline StepCounts TokenDataset::step_counts(int64_t step) {
  StepCounts counts;
  counts.positions = spec_.global_batch * spec_.seq_len;
  const int64_t first_row = first_row_of_step(step);
  for (int64_t r = first_row; r < first_row + spec_.global_batch; ++r) {
    int64_t epoch = 0, row = 0;
    locate_row(r, epoch, row);
    const EpochPacking& pack = packing(epoch);
    for (int64_t s = pack.row_begin[row]; s < pack.row_begin[row + 1]; ++s) {
      const Segment seg = pack.segments[s];
      counts.tokens += seg.pairs;
      if (loss_mask_.empty()) {
        counts.loss_tokens += seg.pairs;
      } else {
        for (int64_t t = seg.first + 1; t <= seg.first + seg.pairs; ++t) counts.loss_tokens += loss_mask_[t];
      }
    }
  }
  return counts;
}


}  // namespace shardlm::reference
