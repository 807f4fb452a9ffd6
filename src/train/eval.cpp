// eval.cpp — the held-out loss over an eval token file's rows.
#include "train/eval.hpp"

#include <chrono>

#include "shardlm/error.hpp"
#include "train/train.hpp"

namespace shardlm {
namespace {

DataSpec eval_spec(const Config& c, int64_t vocab_size) {
  DataSpec s;
  s.paths = {c.eval.path};
  s.seq_len = c.data.seq_len;
  s.micro_batch = c.data.micro_batch;
  s.global_batch = c.data.micro_batch;  // unused: eval reads rows by number
  s.vocab_size = vocab_size;
  s.shuffle = false;   // the same rows in the same order at every evaluation
  s.prefetch = false;  // a forward pass per micro-batch; the reads are small next to it
  return s;
}

}  // namespace

EvalSet::EvalSet(const Config& config, int64_t vocab_size) : data_(eval_spec(config, vocab_size)) {
  const int64_t file_rows = data_.rows_in_epoch(0);
  SHARDLM_CHECK(config.eval.rows <= file_rows,
                "eval.rows = %lld but eval.path '%s' packs into %lld rows of data.seq_len = %lld; set eval.rows "
                "<= %lld or 0 (the whole file)",
                (long long)config.eval.rows, config.eval.path.c_str(), (long long)file_rows,
                (long long)config.data.seq_len, (long long)file_rows);
  rows_ = config.eval.rows > 0 ? config.eval.rows : file_rows;
}

EvalResult EvalSet::evaluate(Engine& engine, Comm& comm, Comm* cp_group) {
  const auto t0 = std::chrono::steady_clock::now();
  const int cp = cp_group ? cp_group->size() : 1;
  if (cp > 1 && !share_) share_.emplace(cp_group->rank(), cp);
  const int64_t per_micro = data_.spec().micro_batch;
  // Micro-batches go round the data-parallel groups (each rank its own at cp = 1);
  // a group's ranks read the same rows and each attends its share (disjoint tokens,
  // so the all-reduce below counts every token once).
  const int64_t total = micro_batches(), groups = comm.size() / cp, group = comm.rank() / cp;
  const int64_t rounds = (total + groups - 1) / groups;
  LossStats sums;
  for (int64_t i = 0; i < rounds; ++i) {
    const int64_t m = i * groups + group;
    const int64_t first = m * per_micro;
    const int64_t rows = m < total ? std::min(per_micro, rows_ - first) : 0;
    data_.read_rows(m < total ? first : 0, rows, micro_);
    sums += engine.forward_loss(share_ ? share_->take(micro_) : token_batch(micro_));
  }
  double loss_sum = sums.loss;
  int64_t loss_tokens = sums.loss_tokens;
  comm.all_reduce_sum(&loss_sum, 1);
  comm.all_reduce_sum(&loss_tokens, 1);
  EvalResult r;
  r.loss_tokens = loss_tokens;
  r.loss = loss_tokens > 0 ? loss_sum / static_cast<double>(loss_tokens) : 0.0;
  r.rows = rows_;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace shardlm
