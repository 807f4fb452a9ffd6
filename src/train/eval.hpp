// eval.hpp — the held-out loss: forward only over the same rows of an eval
// token file at any world size.
//
// Owns: EvalSet (the eval file read in file order, its rows cut into
// micro-batches that go round-robin over the ranks, or over the groups of
// model.context_parallel ranks, each rank of a group taking its share of the
// rows as in training) and EvalResult. Uses the
// engine's forward-only loss and one all-reduce; knows nothing about the
// optimizer, checkpoints or metrics.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "data/data.hpp"
#include "train/context_split.hpp"
#include "train/engine.hpp"

namespace shardlm {

struct EvalResult {
  double loss = 0;           // sum of weight * NLL / loss_tokens, over every evaluated row
  int64_t loss_tokens = 0;   // targets carrying loss in the evaluated rows
  int64_t rows = 0;
  double seconds = 0;        // wall time of the evaluation on this rank
};

class EvalSet {
 public:
  // eval.path packed like the training data (data.seq_len, data.micro_batch)
  // in file order; eval.rows from its start, or every row of the file.
  EvalSet(const Config& config, int64_t vocab_size);

  int64_t rows() const { return rows_; }
  int64_t micro_batches() const { return (rows_ + data_.spec().micro_batch - 1) / data_.spec().micro_batch; }
  const TokenDataset& data() const { return data_; }
  TokenDataset& data() { return data_; }

  // Collective over `comm`: micro-batch m of the eval rows goes to rank
  // m % world; every rank runs the same number of forward passes (an empty
  // micro-batch where it has none left), then one all-reduce of the sums.
  // With a context-parallel group (cp_group, the engine's ring), micro-batch m
  // goes to group m % (world / C) and each of its ranks attends its share.
  EvalResult evaluate(Engine& engine, Comm& comm, Comm* cp_group = nullptr);

 private:
  TokenDataset data_;
  int64_t rows_ = 0;
  MicroBatch micro_;
  std::optional<ContextShare> share_;  // context parallelism: this rank's share of each micro-batch
};

}  // namespace shardlm
