// metrics.hpp — what a run reports: progress lines, metrics.jsonl, TensorBoard, the summary.
//
// Owns: the rank-0 progress line every log.interval steps, <run.dir>/<log.jsonl>
// (docs/metrics.md: one JSON object per logged step, plus "start", "resume" and
// "end" event rows; on a resume the rows past the resumed step are dropped, the
// file rewritten as .tmp then renamed), the TensorBoard event file when
// log.tensorboard is on, and the closing summary with peak memory next to the
// plan. Every write is checked: a failed write is an Error naming the file.
// Knows nothing about how a step is computed or where a checkpoint came from.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/config.hpp"
#include "train/engine.hpp"
#include "base/run_dir.hpp"
#include "train/train.hpp"

namespace shardlm {

class TensorBoardWriter;

// Where this start of the run begins, for the "start" / "resume" row.
struct RunStart {
  int64_t step = 0;                     // 0-based step this start trains first
  int64_t tokens_seen = 0;              // tokens before it (the checkpoint's)
  std::string checkpoint;               // resumed from ("" = a fresh start)
  std::string deck_file;                // config-step<N>.toml in run.dir
  std::vector<DeckChange> deck_changes; // this deck against the checkpoint's
  int world_size = 1;
  std::string host, backend, version;
};

class Metrics {
 public:
  // writer: rank 0 of the trainers; flops_per_token and peak_flops for MFU (0: not reported).
  // A resumed start (start.checkpoint set) keeps the rows up to start.step and adds a resume row.
  Metrics(const Config& config, bool writer, const RunStart& start, double flops_per_token = 0, double peak_flops = 0);
  ~Metrics();
  void log(const StepStats& s);
  // The closing row: status "done" | "stopped" (signal, exit 75) | "checkpoint_failed"; step = steps completed.
  void end(const char* status, int exit_code, int64_t steps_done);
  // Peaks are the largest over the trainer ranks (host, and device when the plan has one).
  void summary(const MemoryPlan& plan, int64_t host_peak, int64_t device_peak, int64_t bad_steps);

  // What a resume did to metrics.jsonl (for the log line and the tests).
  int64_t dropped_rows() const { return dropped_rows_; }

 private:
  void write_row(const std::string& json);
  double elapsed_s() const;

  const Config& config_;
  bool writer_;
  std::string path_;
  std::FILE* jsonl_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::chrono::steady_clock::time_point start_;
  int64_t dropped_rows_ = 0;
  int64_t tokens_total_ = 0;            // over the whole run, the resumed checkpoint's included
  int64_t tokens_this_start_ = 0;
  int64_t steps_done_ = 0;              // in this start
  double window_time_s_ = 0;
  int64_t window_tokens_ = 0;
  double first_loss_ = 0, last_loss_ = 0;
  int64_t first_step_ = -1, last_step_ = -1;  // 0-based steps of this start
  double flops_per_token_ = 0, peak_flops_ = 0;
  // Sums over steps after the first (which pays for warm-up), for the breakdown.
  double sum_step_s_ = 0, sum_data_s_ = 0, sum_compute_s_ = 0, sum_opt_s_ = 0, sum_sync_s_ = 0;
  int64_t sum_tokens_ = 0, sum_steps_ = 0;
  // [eval]: the last and the best held-out loss.
  int64_t evaluations_ = 0, last_eval_step_ = 0, best_eval_step_ = 0;
  double last_eval_loss_ = 0, best_eval_loss_ = 0;
};

}  // namespace shardlm
