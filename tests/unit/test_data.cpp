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

#include "shardlm/data.hpp"
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
  return DataSpec{.path = path, .seq_len = seq_len, .micro_batch = micro_batch,
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
  CHECK(saved == std::vector<int64_t>{1, 2, 16, 16, 5, 57, 1});  // 3 of the 60 have 1 token

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
                          "data position: expected 7 values in format 1, got 3 values starting with 1");
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
  DataSpec spec{.path = "inputs/data/tiny.h5", .seq_len = 64, .micro_batch = 2, .global_batch = 8,
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
    check_throws_containing([&] { load(); }, "loss_mask[2] = 2; values must be 0 or 1");
  }
  SUBCASE("token id too large") {
    write_tokens(path, {1, 2, 3, 100, 5, 6}, offsets);
    check_throws_containing([&] { load(); },
                            "'" + path + "': tokens[3] = 100 is outside the model's vocabulary [0, 100)");
  }
  SUBCASE("token id negative") {
    write_tokens(path, {1, -5, 3, 4, 5, 6}, offsets);
    check_throws_containing([&] { load(); }, "tokens[1] = -5 is outside the model's vocabulary");
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
    // Loss only on first tokens, which are never targets.
    write_tokens(path, tokens, offsets, {1, 0, 0, 1, 0, 0});
    check_throws_containing([&] { load(); }, "no target token carries loss");
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

}  // TEST_SUITE("data")
