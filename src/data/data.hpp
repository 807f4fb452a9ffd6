// data.hpp — the SFT token-data pipeline: HDF5 token files read on demand,
// packing documents into rows, the deterministic shuffled order, mixing
// several files by weight, micro-batches (prefetched one ahead) and the
// sampler position a checkpoint stores.
//
// Owns: DataSpec, MicroBatch, StepCounts, DataPosition, TokenDataset.
// Knows nothing about MPI, devices or the model: every rank builds the same
// stream of rows from (files, weights, seed, seq_len) and takes its share by
// (rank, world), so the result is the same at any world size. File format and
// rules: docs/data.md.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace shardlm {

struct DataSpec {
  std::vector<std::string> paths;  // HDF5 token files (tools/make_dataset.py); several are mixed
  std::vector<double> weights;     // one per path (empty: in proportion to each file's targets)
  int64_t seq_len = 0;       // positions per row
  int64_t micro_batch = 0;   // rows per micro-batch
  int64_t global_batch = 0;  // rows per optimizer step, over all ranks
  uint64_t seed = 0;         // document order = f(seed, epoch); the mix = f(seed, row)
  int64_t vocab_size = 0;    // the model's; every token id must be < this
  bool shuffle = true;       // false: file order every epoch (eval, tests, curricula)
  bool prefetch = true;      // read the next micro-batch on a background thread
};

// One micro-batch, row-major; every vector holds rows*seq_len entries.
struct MicroBatch {
  int64_t rows = 0, seq_len = 0;
  std::vector<int32_t> tokens;     // (rows, seq_len) input token ids; padding 0
  std::vector<int32_t> targets;    // (rows, seq_len) next token id; -1 = no target
  std::vector<float> weights;      // (rows, seq_len) loss weight: loss_mask of the target, 0 on padding
  std::vector<int32_t> positions;  // (rows, seq_len) RoPE position, restarts at 0 per sequence piece
  std::vector<int32_t> seq_ids;    // (rows, seq_len) attention may only join equal ids;
                                   // contiguous, increasing from 0 through the micro-batch
  int64_t loss_tokens = 0;         // positions with weight > 0 in this micro-batch
};

// Counts over a set of rows (a step's global batch, or one rank's share of it).
struct StepCounts {
  int64_t loss_tokens = 0;  // positions with weight > 0
  int64_t tokens = 0;       // non-padding positions (for tokens/s)
  int64_t positions = 0;    // rows * seq_len, padding included
};

// Where one file of the mix stands: how many of its rows came before the step.
struct SourcePosition {
  int64_t documents = 0;      // documents with >= 2 tokens in the file
  int64_t rows_consumed = 0;  // rows of this file's own stream already used
  bool operator==(const SourcePosition&) const = default;
};

// Where the sampler stands. Rows of the stream are consumed in order; `step`
// starts at row `rows_consumed`. The other fields say what the rows were
// packed from; restore() refuses a position from a different packing.
struct DataPosition {
  int64_t step = 0;
  int64_t rows_consumed = 0;
  int64_t seq_len = 0;
  uint64_t seed = 0;
  int64_t documents = 0;  // documents with >= 2 tokens, all files together
  bool shuffle = true;
  std::vector<SourcePosition> sources{};  // one per data.path entry (empty: RL, no files)

  std::vector<int64_t> to_vector() const;  // for the checkpoint's /data dataset
  static DataPosition from_vector(std::span<const int64_t> values);
  bool operator==(const DataPosition&) const = default;
};

// Host memory a reader holds, by part (the memory plan's "data" rows).
struct DataMemory {
  int64_t index = 0;     // document offsets (8 B per document) and the kept-document map
  int64_t order = 0;     // two epochs' document permutations (4 B per document each) and row tables
  int64_t buffers = 0;   // prefetched micro-batch, read staging, chunk caches, mix tables
  int64_t total() const { return index + order + buffers; }
};

// What `shardlm check` asks of each data.path file, by the code TokenDataset
// opens it with: a regular HDF5 file with 'tokens' and 'offsets' whose
// document index is sound and whose vocab_size attribute (when present) is
// > 0 and <= the model's. Throws shardlm::Error naming the file. The token ids
// are checked as train reads them.
void validate_token_file(const std::string& path, int64_t model_vocab_size);

class TokenDataset {
 public:
  // Opens and validates every file: dtypes, shapes, offsets and storage. Only
  // the document index (offsets) is read into memory; token ids and loss_mask
  // are read per micro-batch (and checked as they are read). Throws
  // shardlm::Error naming the file and what is wrong.
  explicit TokenDataset(const DataSpec& spec);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  // A = global_batch / (micro_batch * world); throws if it does not divide.
  int64_t micro_batches_per_rank(int world) const;

  // Micro-batch number (accum_index * world + rank) of `step`'s global batch.
  // `out` is resized once and then reused without allocating. After each call
  // the next micro-batch in training order (accum_index + 1, else the next
  // step's first) is read on a background thread, so a run that asks for them
  // in that order never waits for the file.
  void micro_batch(int64_t step, int accum_index, int rank, int world, MicroBatch& out);
  MicroBatch micro_batch(int64_t step, int accum_index, int rank, int world);

  // Counts over `step`'s whole global batch (reads every row's loss_mask).
  StepCounts step_counts(int64_t step);
  // Counts over the rows of `step` that `rank` of `world` takes: summed over
  // the ranks (one all-reduce) they are step_counts(step). Prefetched with the
  // step's first micro-batch.
  StepCounts rank_step_counts(int64_t step, int rank, int world);

  // `rows` consecutive rows of the stream from `first_row` into `out`, padded
  // with empty rows up to micro_batch rows (eval reads a file in order this way).
  void read_rows(int64_t first_row, int64_t rows, MicroBatch& out);

  // The position at the start of `step` (save it after finishing step-1).
  DataPosition position(int64_t step);
  // Continue from a saved position: `pos.step` will read the rows it would
  // have read when saved, even if global_batch or data.weights changed since.
  void restore(const DataPosition& pos);

  // Inspection (tests, `shardlm check`, logs). Totals are over all files.
  int64_t documents() const;
  int64_t total_tokens() const;
  int64_t sources() const;
  int64_t file_vocab_size() const;     // the first file's; 0 when absent
  const std::string& tokenizer() const;  // the first file's; "" when absent
  std::string storage() const;  // the first file's tokens: "contiguous", "chunked (N elements), shuffle, deflate"
  // The first file's (the only one unless data.path lists several):
  int64_t rows_in_epoch(int64_t epoch);
  std::vector<int64_t> document_order(int64_t epoch) const;  // indices into its documents
  const DataSpec& spec() const { return spec_; }
  // What this reader holds now and at most (two epochs' orders, all buffers).
  DataMemory memory() const;

  struct Impl;

 private:
  void wait_idle();
  void schedule_after(int64_t step, int accum_index, int rank, int world);

  DataSpec spec_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardlm
