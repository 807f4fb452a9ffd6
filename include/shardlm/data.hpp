// data.hpp — the SFT token-data pipeline: HDF5 token files, packing documents
// into rows, the deterministic shuffled order, micro-batches and the sampler
// position a checkpoint stores.
//
// Owns: DataSpec, MicroBatch, StepCounts, DataPosition, TokenDataset.
// Knows nothing about MPI, devices or the model: every rank builds the same
// stream of rows from (file, seed, seq_len) and takes its share by
// (rank, world), so the result is the same at any world size. File format and
// rules: docs/data.md.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace shardlm {

struct DataSpec {
  std::string path;          // HDF5 token file (tools/make_dataset.py)
  int64_t seq_len = 0;       // positions per row
  int64_t micro_batch = 0;   // rows per micro-batch
  int64_t global_batch = 0;  // rows per optimizer step, over all ranks
  uint64_t seed = 0;         // document order = f(seed, epoch)
  int64_t vocab_size = 0;    // the model's; every token id must be < this
  bool shuffle = true;       // false: file order every epoch (tests, curricula)
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

// Counts over one step's global batch: every rank computes them from the data
// alone, so the loss can be normalised by loss_tokens without an all-reduce.
struct StepCounts {
  int64_t loss_tokens = 0;  // positions with weight > 0
  int64_t tokens = 0;       // non-padding positions (for tokens/s)
  int64_t positions = 0;    // global_batch * seq_len, padding included
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

}  // namespace shardlm
