// test_data.cpp — the token-data pipeline: packing, order, micro-batch
// assignment over world sizes, position save/restore, and every file error.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "reference_data.hpp"
#include "data/data.hpp"
#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"

namespace fs = std::filesystem;

// Print vectors in failure messages instead of {?}.
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
using shardlm::DataPosition;
using shardlm::DataSpec;
using shardlm::MicroBatch;
using shardlm::TokenDataset;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    const auto ticks = std::chrono::steady_clock::now().time_since_epoch().count();
    path = fs::temp_directory_path() /
           ("shardlm_test_data_" + std::to_string(getpid()) + "_" + std::to_string(ticks) + "_" +
            std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const char* name) const { return (path / name).string(); }
};

// Writes HDF5 datasets and attributes with the plain C API.
struct H5Writer {
  shardlm::h5::Handle file;
  explicit H5Writer(const std::string& path)
      : file(H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose) {}

  template <class T>
  void dataset(const char* name, hid_t file_type, hid_t mem_type, const std::vector<T>& values,
               int rank = 1) {
    hsize_t dims[2] = {values.size(), 1};
    if (rank == 2) dims[0] = values.size() / 2, dims[1] = 2;
    shardlm::h5::Handle space(H5_CHECK(H5Screate_simple(rank, dims, nullptr)), H5Sclose);
    shardlm::h5::Handle dset(
        H5_CHECK(H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)),
        H5Dclose);
    if (!values.empty())
      H5_CHECK(H5Dwrite(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
  }
  void tokens(const std::vector<int32_t>& v) { dataset("tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, v); }
  void offsets(const std::vector<int64_t>& v) { dataset("offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, v); }
  void loss_mask(const std::vector<uint8_t>& v) { dataset("loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, v); }

  void int_attribute(const char* name, int64_t value) {
    shardlm::h5::Handle space(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose);
    shardlm::h5::Handle attr(
        H5_CHECK(H5Acreate2(file, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
    H5_CHECK(H5Awrite(attr, H5T_NATIVE_INT64, &value));
  }
  void string_attribute(const char* name, const std::string& value, bool variable_length) {
    shardlm::h5::Handle space(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose);
    shardlm::h5::Handle type(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
    H5_CHECK(H5Tset_size(type, variable_length ? H5T_VARIABLE : value.size()));
    H5_CHECK(H5Tset_cset(type, H5T_CSET_UTF8));
    shardlm::h5::Handle attr(H5_CHECK(H5Acreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT)),
                             H5Aclose);
    const char* text = value.c_str();
    H5_CHECK(H5Awrite(attr, type, variable_length ? static_cast<const void*>(&text) : text));
  }
};

void write_tokens(const std::string& path, const std::vector<int32_t>& tokens,
                  const std::vector<int64_t>& offsets, const std::vector<uint8_t>& mask = {}) {
  H5Writer w(path);
  w.tokens(tokens);
  w.offsets(offsets);
  if (!mask.empty()) w.loss_mask(mask);
}

DataSpec spec_for(const std::string& path, int64_t seq_len, int64_t micro_batch, int64_t global_batch,
                  uint64_t seed = 7, bool shuffle = true) {
  return DataSpec{.paths = {path}, .weights = {}, .seq_len = seq_len, .micro_batch = micro_batch,
                  .global_batch = global_batch, .seed = seed, .vocab_size = 100, .shuffle = shuffle};
}

// `count` documents with lengths 1..29 from a small LCG (token ids 1..99), all
// loss on except every 7th token.
void write_random_documents(const std::string& path, int count) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  std::vector<uint8_t> mask;
  uint32_t state = 12345;
  auto next = [&] { return state = state * 1664525u + 1013904223u, state >> 8; };
  for (int d = 0; d < count; ++d) {
    const uint32_t length = 1 + next() % 29;
    for (uint32_t i = 0; i < length; ++i) {
      tokens.push_back(static_cast<int32_t>(1 + next() % 99));
      mask.push_back(tokens.size() % 7 == 0 ? 0 : 1);
    }
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  write_tokens(path, tokens, offsets, mask);
}

// One row of a micro-batch, for comparing rows between world sizes (seq_ids
// are relative to the micro-batch, so they are left out).
struct Row {
  std::vector<int32_t> tokens, targets, positions;
  std::vector<float> weights;
  bool operator==(const Row&) const = default;
};

Row row_of(const MicroBatch& mb, int64_t r) {
  auto slice = [&](const auto& v) {
    using V = std::decay_t<decltype(v)>;
    return V(v.begin() + r * mb.seq_len, v.begin() + (r + 1) * mb.seq_len);
  };
  return Row{slice(mb.tokens), slice(mb.targets), slice(mb.positions), slice(mb.weights)};
}

// Every row of `step` in micro-batch number order, from all ranks of a world.
std::vector<Row> step_rows(TokenDataset& data, int64_t step, int world, int64_t* loss_tokens) {
  const int64_t accum_steps = data.micro_batches_per_rank(world);
  std::vector<std::vector<Row>> by_number(static_cast<size_t>(accum_steps * world));
  *loss_tokens = 0;
  for (int rank = 0; rank < world; ++rank)
    for (int a = 0; a < accum_steps; ++a) {
      const MicroBatch mb = data.micro_batch(step, a, rank, world);
      *loss_tokens += mb.loss_tokens;
      for (int64_t r = 0; r < mb.rows; ++r) by_number[a * world + rank].push_back(row_of(mb, r));
    }
  std::vector<Row> rows;
  for (auto& group : by_number) rows.insert(rows.end(), group.begin(), group.end());
  return rows;
}

void check_throws_containing(const std::function<void()>& fn, const std::string& expected) {
  try {
    fn();
    FAIL("expected a shardlm::Error containing: " << expected);
  } catch (const shardlm::Error& e) {
    INFO("message: " << std::string(e.what()));
    CHECK(std::string(e.what()).find(expected) != std::string::npos);
  }
}


// How a test file stores its datasets: every layout and filter the reader accepts.
enum class Storage { Contiguous, Chunked, Gzip, GzipFletcher, BigEndian, Compact };
const char* storage_name(Storage s) {
  switch (s) {
    case Storage::Contiguous: return "contiguous";
    case Storage::Chunked: return "chunked";
    case Storage::Gzip: return "chunked, shuffle + deflate";
    case Storage::GzipFletcher: return "chunked, shuffle + deflate + fletcher32";
    case Storage::BigEndian: return "contiguous, big-endian";
    case Storage::Compact: return "compact";
  }
  return "?";
}

template <class T>
void stored_dataset(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const std::vector<T>& values,
                    Storage storage) {
  const hsize_t dims[1] = {values.size()};
  shardlm::h5::Handle space(H5_CHECK(H5Screate_simple(1, dims, nullptr)), H5Sclose);
  shardlm::h5::Handle dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)), H5Pclose);
  if (storage == Storage::Chunked || storage == Storage::Gzip || storage == Storage::GzipFletcher) {
    const hsize_t chunk[1] = {7};  // small: pieces of documents cross chunk boundaries
    H5_CHECK(H5Pset_chunk(dcpl, 1, chunk));
    if (storage != Storage::Chunked) {
      H5_CHECK(H5Pset_shuffle(dcpl));
      H5_CHECK(H5Pset_deflate(dcpl, 6));
    }
    if (storage == Storage::GzipFletcher) H5_CHECK(H5Pset_fletcher32(dcpl));
  }
  if (storage == Storage::Compact) H5_CHECK(H5Pset_layout(dcpl, H5D_COMPACT));
  shardlm::h5::Handle dset(H5_CHECK(H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT)),
                           H5Dclose);
  H5_CHECK(H5Dwrite(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()));
}

struct Documents {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  std::vector<uint8_t> mask;
};

// `count` documents of 1..max_len tokens with ids in [low, low + 49), loss off
// on every 5th token (an LCG, so the same every run).
Documents random_documents(int count, uint32_t seed, uint32_t max_len, int32_t low = 1) {
  Documents d;
  uint32_t state = seed;
  auto next = [&] { return state = state * 1664525u + 1013904223u, state >> 8; };
  for (int i = 0; i < count; ++i) {
    const uint32_t length = 1 + next() % max_len;
    for (uint32_t j = 0; j < length; ++j) {
      d.tokens.push_back(low + static_cast<int32_t>(next() % 49));
      d.mask.push_back(next() % 5 == 0 ? 0 : 1);
    }
    d.offsets.push_back(static_cast<int64_t>(d.tokens.size()));
  }
  return d;
}

void write_documents(const std::string& path, const Documents& d, Storage storage, bool with_mask) {
  shardlm::h5::Handle file(H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
  const bool be = storage == Storage::BigEndian;
  stored_dataset(file, "tokens", be ? H5T_STD_I32BE : H5T_STD_I32LE, H5T_NATIVE_INT32, d.tokens, storage);
  stored_dataset(file, "offsets", be ? H5T_STD_I64BE : H5T_STD_I64LE, H5T_NATIVE_INT64, d.offsets, storage);
  if (with_mask) stored_dataset(file, "loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, d.mask, storage);
}

void check_same(const MicroBatch& got, const MicroBatch& want) {
  CHECK(got.rows == want.rows);
  CHECK(got.seq_len == want.seq_len);
  CHECK(got.tokens == want.tokens);
  CHECK(got.targets == want.targets);
  CHECK(got.weights == want.weights);
  CHECK(got.positions == want.positions);
  CHECK(got.seq_ids == want.seq_ids);
  CHECK(got.loss_tokens == want.loss_tokens);
}

shardlm::reference::DataSpec reference_spec(const DataSpec& s) {
  return {.path = s.paths.at(0), .seq_len = s.seq_len, .micro_batch = s.micro_batch, .global_batch = s.global_batch,
          .seed = s.seed, .vocab_size = s.vocab_size, .shuffle = s.shuffle};
}

}  // namespace

TEST_SUITE("data") {

// Documents: A(5 tokens) B(3) X(1, skipped) C(6) D(4) packed into rows of 8.
TEST_CASE("packs documents greedily into rows with targets, weights, positions and seq_ids") {
  TempDir dir;
  const std::string path = dir.file("four.h5");
  write_tokens(path,
               {10, 11, 12, 13, 14, 20, 21, 22, 50, 30, 31, 32, 33, 34, 35, 40, 41, 42, 43},
               {0, 5, 8, 9, 15, 19},
               {0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1});
  TokenDataset data(spec_for(path, 8, 2, 2, 7, /*shuffle=*/false));
  CHECK(data.documents() == 4);
  CHECK(data.total_tokens() == 19);
  CHECK(data.rows_in_epoch(0) == 2);

  const MicroBatch mb = data.micro_batch(0, 0, 0, 1);
  CHECK(mb.rows == 2);
  CHECK(mb.seq_len == 8);
  // Row 0: A's 4 pairs, B's 2 pairs, then C does not fit (5 > 2 left): padding.
  // Row 1: C's 5 pairs, D's 3 pairs, exactly full.
  CHECK(mb.tokens == std::vector<int32_t>{10, 11, 12, 13, 20, 21, 0, 0,  //
                                          30, 31, 32, 33, 34, 40, 41, 42});
  CHECK(mb.targets == std::vector<int32_t>{11, 12, 13, 14, 21, 22, -1, -1,  //
                                           31, 32, 33, 34, 35, 41, 42, 43});
  CHECK(mb.weights == std::vector<float>{0, 1, 1, 1, 1, 1, 0, 0,  //
                                         1, 1, 1, 1, 0, 1, 1, 1});
  CHECK(mb.positions == std::vector<int32_t>{0, 1, 2, 3, 0, 1, 0, 0,  //
                                             0, 1, 2, 3, 4, 0, 1, 2});
  CHECK(mb.seq_ids == std::vector<int32_t>{0, 0, 0, 0, 1, 1, 2, 2,  //
                                           3, 3, 3, 3, 3, 4, 4, 4});
  CHECK(mb.loss_tokens == 12);

  const shardlm::StepCounts counts = data.step_counts(0);
  CHECK(counts.loss_tokens == 12);
  CHECK(counts.tokens == 14);
  CHECK(counts.positions == 16);

  // Micro-batches of one row: seq_ids restart at 0 in each.
  TokenDataset single(spec_for(path, 8, 1, 2, 7, false));
  CHECK(single.micro_batch(0, 1, 0, 1).seq_ids == std::vector<int32_t>{0, 0, 0, 0, 0, 1, 1, 1});
  // Without shuffling, epoch 1 (step 1) repeats epoch 0.
  CHECK(data.micro_batch(1, 0, 0, 1).tokens == mb.tokens);
}

// P(3 tokens) Q(12 tokens, 11 pairs > seq_len 4) R(2 tokens).
TEST_CASE("a document longer than a row is split into pieces; the first fills the open row") {
  TempDir dir;
  const std::string path = dir.file("long.h5");
  write_tokens(path, {1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 30, 31}, {0, 3, 15, 17});
  TokenDataset data(spec_for(path, 4, 4, 4, 7, false));
  REQUIRE(data.rows_in_epoch(0) == 4);
  const MicroBatch mb = data.micro_batch(0, 0, 0, 1);
  CHECK(mb.tokens == std::vector<int32_t>{1, 2, 10, 11,  //
                                          12, 13, 14, 15, //
                                          16, 17, 18, 19, //
                                          20, 30, 0, 0});
  CHECK(mb.targets == std::vector<int32_t>{2, 3, 11, 12,  //
                                           13, 14, 15, 16, //
                                           17, 18, 19, 20, //
                                           21, 31, -1, -1});
  CHECK(mb.positions == std::vector<int32_t>{0, 1, 0, 1,  //
                                             0, 1, 2, 3,  //
                                             0, 1, 2, 3,  //
                                             0, 0, 0, 0});
  CHECK(mb.seq_ids == std::vector<int32_t>{0, 0, 1, 1,  //
                                           2, 2, 2, 2,  //
                                           3, 3, 3, 3,  //
                                           4, 5, 6, 6});
  CHECK(mb.loss_tokens == 14);  // every target of P, Q and R exactly once: 2 + 11 + 1
  CHECK(data.step_counts(0).tokens == 14);
}

TEST_CASE("the union of micro-batches over ranks is the step's global batch for 1, 2 and 4 ranks") {
  TempDir dir;
  const std::string path = dir.file("random.h5");
  write_random_documents(path, 60);
  TokenDataset data(spec_for(path, 16, 2, 8, 98));
  // Steps 0..8 contain one that straddles the end of epoch 0.
  REQUIRE(data.rows_in_epoch(0) % 8 != 0);
  REQUIRE(data.rows_in_epoch(0) < 9 * 8);
  for (int64_t step = 0; step < 9; ++step) {
    CAPTURE(step);
    const shardlm::StepCounts counts = data.step_counts(step);
    int64_t loss_1 = 0;
    const std::vector<Row> rows_1 = step_rows(data, step, 1, &loss_1);
    REQUIRE(rows_1.size() == 8);
    CHECK(loss_1 == counts.loss_tokens);
    CHECK(counts.loss_tokens > 0);
    int64_t non_padding = 0;
    for (const Row& row : rows_1)
      for (int32_t target : row.targets) non_padding += target >= 0;
    CHECK(non_padding == counts.tokens);
    for (int world : {2, 4}) {
      CAPTURE(world);
      int64_t loss_w = 0;
      CHECK(step_rows(data, step, world, &loss_w) == rows_1);
      CHECK(loss_w == counts.loss_tokens);
    }
  }
  CHECK(data.micro_batches_per_rank(1) == 4);
  CHECK(data.micro_batches_per_rank(4) == 1);
  check_throws_containing([&] { data.micro_batches_per_rank(3); },
                          "data.global_batch = 8 rows cannot be split into micro-batches of 2 rows "
                          "over 3 ranks");
}

TEST_CASE("seq_ids are contiguous, increasing and never shared between rows") {
  TempDir dir;
  const std::string path = dir.file("random.h5");
  write_random_documents(path, 60);
  TokenDataset data(spec_for(path, 16, 4, 8, 3));
  for (int a = 0; a < 2; ++a) {
    const MicroBatch mb = data.micro_batch(1, a, 0, 1);
    CHECK(mb.seq_ids[0] == 0);
    for (size_t i = 1; i < mb.seq_ids.size(); ++i) {
      const int32_t step_up = mb.seq_ids[i] - mb.seq_ids[i - 1];
      CHECK((step_up == 0 || step_up == 1));
      if (i % 16 == 0) CHECK(step_up == 1);                  // a new row is a new sequence
      if (step_up == 1 && mb.targets[i] >= 0) CHECK(mb.positions[i] == 0);
      if (step_up == 0) CHECK(mb.positions[i] == (mb.targets[i] >= 0 ? mb.positions[i - 1] + 1 : 0));
    }
  }
}

TEST_CASE("document order is a fixed function of (seed, epoch)") {
  TempDir dir;
  const std::string path = dir.file("random.h5");
  write_random_documents(path, 12);
  TokenDataset a(spec_for(path, 16, 1, 1, 1234));
  TokenDataset b(spec_for(path, 16, 1, 1, 1234));
  TokenDataset c(spec_for(path, 16, 1, 1, 1235));
  REQUIRE(a.documents() == 12);
  // splitmix64 + Fisher-Yates: these numbers change only if the generator does,
  // which would change every run's data order.
  CHECK(a.document_order(0) == std::vector<int64_t>{8, 0, 9, 10, 7, 11, 1, 2, 3, 5, 6, 4});
  CHECK(a.document_order(0) == b.document_order(0));
  CHECK(a.document_order(0) != c.document_order(0));
  CHECK(a.document_order(0) != a.document_order(1));
  std::vector<int64_t> sorted = a.document_order(1);
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  CHECK(a.micro_batch(0, 0, 0, 1).tokens == b.micro_batch(0, 0, 0, 1).tokens);
  CHECK(a.micro_batch(0, 0, 0, 1).tokens != c.micro_batch(0, 0, 0, 1).tokens);
}

TEST_CASE("a saved position reproduces the next steps exactly") {
  TempDir dir;
  const std::string path = dir.file("random.h5");
  write_random_documents(path, 60);
  const DataSpec spec = spec_for(path, 16, 2, 8, 5);
  TokenDataset first(spec);
  for (int64_t step = 0; step < 2; ++step) (void)first.micro_batch(step, 0, 0, 1);
  const std::vector<int64_t> saved = first.position(2).to_vector();
  // format 2: step 2, row 16, seq_len 16, seed 5, 57 documents (3 of the 60
  // have 1 token), shuffled, 1 file: 57 documents, 16 of its rows consumed
  CHECK(saved == std::vector<int64_t>{2, 2, 16, 16, 5, 57, 1, 1, 57, 16});
  // a format-1 position (before mixing) reads as the same one-file position
  CHECK(DataPosition::from_vector(std::vector<int64_t>{1, 2, 16, 16, 5, 57, 1}) == DataPosition::from_vector(saved));

  TokenDataset resumed(spec);
  resumed.restore(DataPosition::from_vector(saved));
  CHECK(resumed.position(2) == first.position(2));
  for (int64_t step = 2; step < 5; ++step)
    for (int rank = 0; rank < 2; ++rank) {
      CAPTURE(step);
      const MicroBatch want = first.micro_batch(step, 1, rank, 2);
      const MicroBatch got = resumed.micro_batch(step, 1, rank, 2);
      CHECK(got.tokens == want.tokens);
      CHECK(got.targets == want.targets);
      CHECK(got.weights == want.weights);
      CHECK(got.positions == want.positions);
      CHECK(got.seq_ids == want.seq_ids);
      CHECK(got.loss_tokens == want.loss_tokens);
      CHECK(resumed.step_counts(step).loss_tokens == first.step_counts(step).loss_tokens);
    }
  check_throws_containing([&] { (void)resumed.micro_batch(1, 0, 0, 1); },
                          "step 1 comes before the restored position (step 2)");

  // A larger global batch after resume continues at the same row: its step 2
  // starts with what was step 2 and goes on into step 3.
  DataSpec doubled = spec;
  doubled.global_batch = 16;
  TokenDataset wider(doubled);
  wider.restore(DataPosition::from_vector(saved));
  CHECK(wider.micro_batch(2, 0, 0, 1).tokens == first.micro_batch(2, 0, 0, 1).tokens);
  CHECK(wider.micro_batch(2, 4, 0, 1).tokens == first.micro_batch(3, 0, 0, 1).tokens);
  CHECK(wider.position(3).rows_consumed == 32);

  DataSpec other_len = spec;
  other_len.seq_len = 32;
  TokenDataset mismatched(other_len);
  check_throws_containing([&] { mismatched.restore(DataPosition::from_vector(saved)); },
                          "cannot continue the data order saved at step 2: data.seq_len was 16 then and is 32 now");
  DataSpec other_seed = spec;
  other_seed.seed = 6;
  TokenDataset reseeded(other_seed);
  check_throws_containing([&] { reseeded.restore(DataPosition::from_vector(saved)); },
                          "the seed was 5 then and is 6 now");
  check_throws_containing([&] { DataPosition::from_vector(std::vector<int64_t>{1, 2, 3}); },
                          "data position: expected format 1 (7 values) or format 2 (8 + 2 per file), got 3 values "
                          "starting with 1");
}

TEST_CASE("file attributes vocab_size and tokenizer are read") {
  TempDir dir;
  for (bool variable_length : {true, false}) {
    const std::string path = dir.file(variable_length ? "vlen.h5" : "fixed.h5");
    {
      H5Writer w(path);
      w.tokens({1, 2, 3});
      w.offsets({0, 3});
      w.int_attribute("vocab_size", 90);
      w.string_attribute("tokenizer", "byte", variable_length);
    }
    TokenDataset data(spec_for(path, 4, 1, 1));
    CHECK(data.file_vocab_size() == 90);
    CHECK(data.tokenizer() == "byte");
  }
}

TEST_CASE("the committed tiny dataset loads") {
  DataSpec spec{.paths = {"inputs/data/tiny.h5"}, .weights = {}, .seq_len = 64, .micro_batch = 2, .global_batch = 8,
                .seed = 1, .vocab_size = 258};
  TokenDataset data(spec);
  CHECK(data.tokenizer() == "byte");
  CHECK(data.file_vocab_size() == 258);
  CHECK(data.documents() == 30);  // paragraphs of inputs/data/tiny.txt
  CHECK(data.total_tokens() == 5773);
  CHECK(data.step_counts(0).loss_tokens > 0);
}

TEST_CASE("bad files and settings fail with a message naming the problem") {
  TempDir dir;
  const std::string path = dir.file("bad.h5");
  auto load = [&](int64_t seq_len = 4, int64_t vocab_size = 100) {
    DataSpec spec = spec_for(path, seq_len, 1, 1);
    spec.vocab_size = vocab_size;
    TokenDataset data(spec);
  };
  // Token ids and loss_mask values are checked as they are read: reading
  // every row of epoch 0 finds any bad value.
  auto read_epoch = [&] {
    TokenDataset data(spec_for(path, 4, 1, 1, 7, /*shuffle=*/false));
    for (int64_t step = 0; step < data.rows_in_epoch(0); ++step) (void)data.micro_batch(step, 0, 0, 1);
  };
  const std::vector<int32_t> tokens{1, 2, 3, 4, 5, 6};
  const std::vector<int64_t> offsets{0, 3, 6};

  SUBCASE("missing file") {
    check_throws_containing([&] { load(); }, "data file '" + path + "' does not exist");
  }
  SUBCASE("not HDF5") {
    std::ofstream(path) << "tokens: 1 2 3\n";
    check_throws_containing([&] { load(); }, "data file '" + path + "' is not an HDF5 file");
  }
  SUBCASE("no tokens dataset") {
    H5Writer(path).offsets(offsets);
    check_throws_containing([&] { load(); }, "data file '" + path + "' has no dataset 'tokens'");
  }
  SUBCASE("no offsets dataset") {
    H5Writer(path).tokens(tokens);
    check_throws_containing([&] { load(); }, "has no dataset 'offsets'");
  }
  SUBCASE("tokens is a group") {
    {
      H5Writer w(path);
      shardlm::h5::Handle group(
          H5_CHECK(H5Gcreate2(w.file, "tokens", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Gclose);
      w.offsets(offsets);
    }
    check_throws_containing([&] { load(); }, "'tokens' exists but is not a dataset");
  }
  SUBCASE("tokens not int32") {
    {  // closed before reading
      H5Writer w(path);
      w.dataset("tokens", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{1, 2, 3, 4, 5, 6});
      w.offsets(offsets);
    }
    check_throws_containing([&] { load(); }, "dataset 'tokens' has dtype int64, expected int32");
  }
  SUBCASE("offsets not int64") {
    {  // closed before reading
      H5Writer w(path);
      w.tokens(tokens);
      w.dataset("offsets", H5T_STD_I32LE, H5T_NATIVE_INT32, std::vector<int32_t>{0, 3, 6});
    }
    check_throws_containing([&] { load(); }, "dataset 'offsets' has dtype int32, expected int64");
  }
  SUBCASE("loss_mask not uint8") {
    {  // closed before reading
      H5Writer w(path);
      w.tokens(tokens);
      w.offsets(offsets);
      w.dataset("loss_mask", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, std::vector<float>(6, 1.0f));
    }
    check_throws_containing([&] { load(); }, "dataset 'loss_mask' has dtype float32, expected uint8");
  }
  SUBCASE("tokens 2-D") {
    {  // closed before reading
      H5Writer w(path);
      w.dataset("tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, tokens, /*rank=*/2);
      w.offsets(offsets);
    }
    check_throws_containing([&] { load(); }, "dataset 'tokens' has rank 2, expected a 1-D array");
  }
  SUBCASE("offsets not starting at 0") {
    write_tokens(path, tokens, {1, 3, 6});
    check_throws_containing([&] { load(); }, "offsets[0] = 1, expected 0");
  }
  SUBCASE("offsets decreasing") {
    write_tokens(path, tokens, {0, 4, 2, 6});
    check_throws_containing([&] { load(); },
                            "offsets decrease at index 2 (offsets[1] = 4 > offsets[2] = 2)");
  }
  SUBCASE("offsets not ending at len(tokens)") {
    write_tokens(path, tokens, {0, 3, 5});
    check_throws_containing([&] { load(); }, "offsets ends at 5 but 'tokens' has 6 elements");
  }
  SUBCASE("offsets empty") {
    write_tokens(path, tokens, {});
    check_throws_containing([&] { load(); }, "dataset 'offsets' is empty");
  }
  SUBCASE("loss_mask length") {
    write_tokens(path, tokens, offsets, {1, 1, 1, 1, 1});
    check_throws_containing([&] { load(); }, "'loss_mask' has 5 elements but 'tokens' has 6");
  }
  SUBCASE("loss_mask value") {
    write_tokens(path, tokens, offsets, {1, 1, 2, 1, 1, 1});
    load();  // not read yet
    check_throws_containing(read_epoch, "loss_mask[2] = 2; values must be 0 or 1");
  }
  SUBCASE("token id too large") {
    write_tokens(path, {1, 2, 3, 100, 5, 6}, offsets);
    check_throws_containing(read_epoch,
                            "'" + path + "': tokens[3] = 100 is outside the model's vocabulary [0, 100)");
  }
  SUBCASE("token id negative") {
    write_tokens(path, {1, -5, 3, 4, 5, 6}, offsets);
    check_throws_containing(read_epoch, "tokens[1] = -5 is outside the model's vocabulary");
  }
  SUBCASE("file made for a larger vocabulary") {
    {
      H5Writer w(path);
      w.tokens(tokens);
      w.offsets(offsets);
      w.int_attribute("vocab_size", 258);
    }
    check_throws_containing([&] { load(); },
                            "was tokenized for a vocabulary of 258 ids (attribute vocab_size");
  }
  SUBCASE("no document with two tokens") {
    write_tokens(path, {1, 2, 3}, {0, 1, 1, 2, 3});
    check_throws_containing([&] { load(); },
                            "has no document with at least 2 tokens (4 documents, 3 tokens)");
  }
  SUBCASE("no loss token") {
    // Loss only on first tokens, which are never targets: the reader does not
    // scan the mask at open; the step's counts say it (0 loss tokens).
    write_tokens(path, tokens, offsets, {1, 0, 0, 1, 0, 0});
    TokenDataset data(spec_for(path, 8, 1, 1));
    CHECK(data.step_counts(0).loss_tokens == 0);
    CHECK(data.step_counts(0).tokens == 4);
  }
  SUBCASE("seq_len below 2") {
    write_tokens(path, tokens, offsets);
    check_throws_containing([&] { load(1); }, "data.seq_len = 1: a row needs at least 2 positions");
  }
  SUBCASE("global batch not a multiple of micro batch") {
    write_tokens(path, tokens, offsets);
    DataSpec spec = spec_for(path, 4, 2, 3);
    check_throws_containing([&] { TokenDataset data(spec); },
                            "data.global_batch = 3 must be a positive multiple of data.micro_batch = 2");
  }
}


// The streamed reader against the in-memory reader it replaced
// (reference_data.hpp): every storage the reader accepts, with and without
// loss_mask and shuffling, rows of 16 that see short, exactly-fitting and
// split documents, steps over three epochs, each rank its own reader asking in
// training order (the prefetched path) as in a run.
TEST_CASE("the streamed reader yields the in-memory reader's micro-batches for every storage at 1-4 ranks") {
  TempDir dir;
  const Documents docs = random_documents(80, 4321, 40);
  for (Storage storage : {Storage::Contiguous, Storage::Chunked, Storage::Gzip, Storage::GzipFletcher,
                          Storage::BigEndian, Storage::Compact}) {
    for (bool with_mask : {true, false}) {
      CAPTURE(storage_name(storage));
      CAPTURE(with_mask);
      const std::string path = dir.file("docs.h5");
      write_documents(path, docs, storage, with_mask);
      for (bool shuffle : {true, false}) {
        CAPTURE(shuffle);
        const DataSpec spec = spec_for(path, 16, 1, 12, 11, shuffle);
        shardlm::reference::TokenDataset ref(reference_spec(spec));
        const int64_t steps = 3 * ref.rows_in_epoch(0) / 12 + 1;
        REQUIRE(steps >= 20);
        for (int world = 1; world <= 4; ++world)
          for (int rank = 0; rank < world; ++rank) {
            CAPTURE(world);
            CAPTURE(rank);
            TokenDataset data(spec);
            CHECK(data.documents() == ref.documents());
            CHECK(data.rows_in_epoch(1) == ref.rows_in_epoch(1));
            MicroBatch mb;
            for (int64_t step = 0; step < steps; ++step) {
              const shardlm::StepCounts mine = data.rank_step_counts(step, rank, world);
              int64_t loss_tokens = 0, tokens = 0;
              for (int a = 0; a < data.micro_batches_per_rank(world); ++a) {
                data.micro_batch(step, a, rank, world, mb);
                const MicroBatch want = ref.micro_batch(step, a, rank, world);
                check_same(mb, want);
                loss_tokens += want.loss_tokens;
                for (int32_t t : want.targets) tokens += t >= 0;
              }
              CHECK(mine.loss_tokens == loss_tokens);
              CHECK(mine.tokens == tokens);
              if (rank == 0 && world == 1) {
                const shardlm::StepCounts all = data.step_counts(step), want = ref.step_counts(step);
                CHECK(all.loss_tokens == want.loss_tokens);
                CHECK(all.tokens == want.tokens);
                CHECK(all.positions == want.positions);
              }
            }
          }
        // Out of order (nothing prefetched is of use): the same micro-batches.
        TokenDataset data(spec);
        for (int64_t step = steps - 1; step >= 0; step -= 3) check_same(data.micro_batch(step, 1, 1, 2), ref.micro_batch(step, 1, 1, 2));
      }
    }
  }
}

TEST_CASE("a restored position continues with the reference's rows; an old format-1 position still restores") {
  TempDir dir;
  const std::string path = dir.file("docs.h5");
  write_documents(path, random_documents(70, 99, 30), Storage::Gzip, true);
  const DataSpec spec = spec_for(path, 16, 2, 12, 3);
  shardlm::reference::TokenDataset ref(reference_spec(spec));
  TokenDataset first(spec);
  for (int64_t step = 0; step < 7; ++step)
    for (int a = 0; a < 2; ++a) (void)first.micro_batch(step, a, 1, 3);
  const DataPosition saved = first.position(7);
  CHECK(saved.rows_consumed == ref.position(7).rows_consumed);
  for (const auto& position : {saved.to_vector(), ref.position(7).to_vector()}) {
    TokenDataset resumed(spec);
    resumed.restore(DataPosition::from_vector(position));
    for (int64_t step = 7; step < 30; ++step)
      for (int rank = 0; rank < 3; ++rank)
        for (int a = 0; a < 2; ++a) {
          CAPTURE(step);
          check_same(resumed.micro_batch(step, a, rank, 3), ref.micro_batch(step, a, rank, 3));
        }
  }
}

TEST_CASE("several files are mixed by weight: deterministic, world-size invariant, each file in its own order") {
  TempDir dir;
  const std::string a = dir.file("a.h5"), b = dir.file("b.h5");
  write_documents(a, random_documents(60, 1, 30, /*low=*/1), Storage::Contiguous, true);   // ids 1..49
  write_documents(b, random_documents(40, 2, 30, /*low=*/50), Storage::Gzip, false);       // ids 50..98
  DataSpec spec = spec_for(a, 16, 1, 8, 5);
  spec.paths = {a, b};
  spec.weights = {3, 1};
  TokenDataset mix(spec), again(spec);
  REQUIRE(mix.sources() == 2);
  CHECK(mix.documents() == TokenDataset(spec_for(a, 16, 1, 8)).documents() + TokenDataset(spec_for(b, 16, 1, 8)).documents());
  // File k shuffles with seed + k; its rows in the mix are its own stream in order.
  TokenDataset alone_a(spec_for(a, 16, 1, 8, 5)), alone_b(spec_for(b, 16, 1, 8, 6));
  int64_t from_a = 0, from_b = 0;
  const int64_t steps = 120;
  for (int64_t step = 0; step < steps; ++step) {
    CAPTURE(step);
    int64_t loss = 0;
    const std::vector<Row> rows = step_rows(mix, step, 1, &loss);
    int64_t loss_again = 0;
    CHECK(step_rows(again, step, 1, &loss_again) == rows);
    CHECK(mix.step_counts(step).loss_tokens == loss);
    for (int world : {2, 4}) {
      int64_t loss_w = 0;
      CHECK(step_rows(mix, step, world, &loss_w) == rows);
      CHECK(loss_w == loss);
    }
    for (const Row& row : rows) {
      const bool is_a = row.tokens[0] < 50;
      const int64_t n = is_a ? from_a++ : from_b++;
      const MicroBatch alone = (is_a ? alone_a : alone_b).micro_batch(n / 8, static_cast<int>(n % 8), 0, 1);
      CHECK(row == row_of(alone, 0));
    }
  }
  // 960 rows drawn 3:1: within 5 points of 75% (a binomial spread of 1.4 points).
  const double share_a = static_cast<double>(from_a) / static_cast<double>(from_a + from_b);
  CHECK(share_a > 0.70);
  CHECK(share_a < 0.80);
  // The position covers the mix: rows of each file before the step.
  const DataPosition pos = mix.position(steps);
  REQUIRE(pos.sources.size() == 2);
  CHECK(pos.sources[0].rows_consumed == from_a);
  CHECK(pos.sources[1].rows_consumed == from_b);
  CHECK(pos.to_vector().size() == 12);

  // Resumed, also with twice the global batch: the same rows.
  DataSpec wider = spec;
  wider.global_batch = 16;
  TokenDataset resumed(wider);
  resumed.restore(DataPosition::from_vector(mix.position(40).to_vector()));
  int64_t loss = 0;
  std::vector<Row> want = step_rows(mix, 40, 1, &loss);
  const std::vector<Row> next = step_rows(mix, 41, 1, &loss);
  want.insert(want.end(), next.begin(), next.end());
  CHECK(step_rows(resumed, 40, 1, &loss) == want);
  // New weights after a resume are accepted (a curriculum); each file goes on where it was.
  DataSpec reweighted = spec;
  reweighted.weights = {1, 3};
  TokenDataset changed(reweighted);
  changed.restore(mix.position(steps));
  const MicroBatch first = changed.micro_batch(steps, 0, 0, 1);
  const bool is_a = first.tokens[0] < 50;
  CHECK(row_of(first, 0) ==
        row_of((is_a ? alone_a : alone_b).micro_batch((is_a ? from_a : from_b) / 8,
                                                      static_cast<int>((is_a ? from_a : from_b) % 8), 0, 1),
               0));
  TokenDataset single(spec_for(a, 16, 1, 8, 5));
  check_throws_containing([&] { single.restore(mix.position(3)); },
                          "cannot continue the data order saved at step 3: data.path had 2 files then and has 1 now");
}

TEST_CASE("mixing without weights follows each file's targets; bad weights are refused") {
  TempDir dir;
  const std::string a = dir.file("a.h5"), b = dir.file("b.h5");
  write_documents(a, random_documents(90, 1, 30, 1), Storage::Contiguous, true);
  write_documents(b, random_documents(30, 2, 30, 50), Storage::Contiguous, true);
  DataSpec spec = spec_for(a, 16, 1, 8, 5);
  spec.paths = {a, b};
  TokenDataset mix(spec);
  int64_t from_a = 0, rows = 0;
  for (int64_t step = 0; step < 100; ++step) {
    int64_t loss = 0;
    for (const Row& row : step_rows(mix, step, 1, &loss)) from_a += row.tokens[0] < 50, ++rows;
  }
  const Documents da = random_documents(90, 1, 30, 1), db = random_documents(30, 2, 30, 50);
  auto pairs = [](const Documents& d) {
    int64_t n = 0;
    for (size_t i = 0; i + 1 < d.offsets.size(); ++i) n += std::max<int64_t>(0, d.offsets[i + 1] - d.offsets[i] - 1);
    return static_cast<double>(n);
  };
  const double expected = pairs(da) / (pairs(da) + pairs(db));
  CHECK(std::abs(static_cast<double>(from_a) / static_cast<double>(rows) - expected) < 0.05);

  spec.weights = {1};
  check_throws_containing([&] { TokenDataset bad(spec); }, "data.weights has 1 entries but data.path has 2 files");
  spec.weights = {0, 0};
  check_throws_containing([&] { TokenDataset bad(spec); }, "data.weights are all 0");
  spec.weights = {1, -1};
  check_throws_containing([&] { TokenDataset bad(spec); }, "data.weights[1] = -1: weights must be >= 0");
}

TEST_CASE("storage that cannot be read on the prefetch thread is refused by name") {
  TempDir dir;
  const std::string path = dir.file("scaleoffset.h5");
  {
    shardlm::h5::Handle file(H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
    const std::vector<int32_t> tokens{1, 2, 3, 4};
    const hsize_t dims[1] = {4}, chunk[1] = {2};
    shardlm::h5::Handle space(H5_CHECK(H5Screate_simple(1, dims, nullptr)), H5Sclose);
    shardlm::h5::Handle dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)), H5Pclose);
    H5_CHECK(H5Pset_chunk(dcpl, 1, chunk));
    H5_CHECK(H5Pset_scaleoffset(dcpl, H5Z_SO_INT, H5Z_SO_INT_MINBITS_DEFAULT));
    shardlm::h5::Handle dset(H5_CHECK(H5Dcreate2(file, "tokens", H5T_STD_I32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT)),
                             H5Dclose);
    H5_CHECK(H5Dwrite(dset, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data()));
    stored_dataset(file, "offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, std::vector<int64_t>{0, 4}, Storage::Contiguous);
  }
  check_throws_containing([&] { TokenDataset data(spec_for(path, 4, 1, 1)); },
                          "dataset 'tokens' is compressed with filter 6 (scaleoffset), which shardlm does not read; "
                          "accepted: gzip (deflate), shuffle, fletcher32");
}

TEST_CASE("the reader holds the document index and two epochs' orders, not the tokens") {
  TempDir dir;
  const std::string path = dir.file("docs.h5");
  const Documents docs = random_documents(500, 7, 30);
  write_documents(path, docs, Storage::Contiguous, true);
  TokenDataset data(spec_for(path, 16, 2, 8, 1));
  const shardlm::DataMemory m = data.memory();
  CHECK(m.index == 8 * 501 + 8 * data.documents());  // offsets, and the kept map (some documents have 1 token)
  CHECK(data.documents() < 500);
  CHECK(m.order >= 2 * 4 * data.documents());
  CHECK(m.buffers >= 2 * 20 * 2 * 16);  // the caller's and the prefetched micro-batch
  CHECK(data.storage() == "contiguous");
  // Nothing grows with the tokens: a file 8x longer in tokens but with the same documents count
  // has the same index.
  const std::string longer = dir.file("longer.h5");
  Documents big = random_documents(500, 7, 240);
  write_documents(longer, big, Storage::Gzip, true);
  TokenDataset data_big(spec_for(longer, 16, 2, 8, 1));
  CHECK(data_big.memory().index <= 8 * 501 + 8 * 500);
  CHECK(data_big.storage() == "chunked (7 elements), shuffle, deflate");
}

}  // TEST_SUITE("data")
