// metrics.hpp — what a run reports: progress lines, metrics.jsonl, the summary.
//
// Owns: the rank-0 progress line every log.interval steps, <run.dir>/<log.jsonl>
// (one JSON object per logged step), and the closing summary with peak memory
// next to the plan. Knows nothing about how a step is computed.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "shardlm/config.hpp"
#include "shardlm/engine.hpp"
#include "shardlm/train.hpp"

namespace shardlm {

class Metrics {
 public:
  // writer: rank 0 of the trainers; flops_per_token for MFU (0: not reported).
  // append: a resumed run adds to metrics.jsonl instead of starting it again.
  Metrics(const Config& config, bool writer, bool append = false, double flops_per_token = 0, double peak_flops = 0);
  ~Metrics();
  void log(const StepStats& s);
  // Peaks are the largest over the trainer ranks (host, and device when the plan has one).
  void summary(const MemoryPlan& plan, int64_t host_peak, int64_t device_peak, int64_t bad_steps);

 private:
  const Config& config_;
  bool writer_;
  std::FILE* jsonl_ = nullptr;
  std::chrono::steady_clock::time_point start_;
  int64_t tokens_total_ = 0;
  int64_t steps_done_ = 0;
  double window_time_s_ = 0;
  int64_t window_tokens_ = 0;
  double first_loss_ = 0, last_loss_ = 0;
  int64_t first_logged_step_ = -1;
  double flops_per_token_ = 0, peak_flops_ = 0;
  // Sums over steps after the first (which pays for warm-up), for the breakdown.
  double sum_step_s_ = 0, sum_data_s_ = 0, sum_compute_s_ = 0, sum_opt_s_ = 0, sum_sync_s_ = 0;
  int64_t sum_tokens_ = 0, sum_steps_ = 0;
  // [eval]: the last and the best held-out loss.
  int64_t evaluations_ = 0, last_eval_step_ = 0, best_eval_step_ = 0;
  double last_eval_loss_ = 0, best_eval_loss_ = 0;
};

}  // namespace shardlm
