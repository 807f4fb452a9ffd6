// metrics.cpp — progress lines, metrics.jsonl and the run summary.
#include "shardlm/metrics.hpp"

#include <filesystem>

#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"

namespace shardlm {
namespace {

std::string clock_text(double seconds) {
  const long s = static_cast<long>(seconds + 0.5);
  return fmt("%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
}

}  // namespace

Metrics::Metrics(const Config& config, bool writer, bool append, double flops_per_token, double peak_flops)
    : config_(config),
      writer_(writer),
      start_(std::chrono::steady_clock::now()),
      flops_per_token_(flops_per_token),
      peak_flops_(peak_flops) {
  if (!writer_) return;
  const auto path = std::filesystem::path(config.run.dir) / config.log.jsonl;
  jsonl_ = std::fopen(path.c_str(), append ? "a" : "w");
  SHARDLM_CHECK(jsonl_, "cannot open %s for writing", path.c_str());
}

Metrics::~Metrics() {
  if (jsonl_) std::fclose(jsonl_);
}

void Metrics::log(const StepStats& s) {
  tokens_total_ += s.tokens;
  window_tokens_ += s.tokens;
  window_time_s_ += s.step_time_s;
  ++steps_done_;
  if (first_logged_step_ < 0) first_logged_step_ = s.step, first_loss_ = s.loss;
  last_loss_ = s.loss;
  if (steps_done_ > 1) {
    sum_step_s_ += s.step_time_s, sum_data_s_ += s.data_s, sum_compute_s_ += s.compute_s;
    sum_opt_s_ += s.optimizer_s, sum_sync_s_ += s.param_sync_s, sum_tokens_ += s.tokens, ++sum_steps_;
  }
  const int64_t step1 = s.step + 1;
  if (s.evaluated) {
    ++evaluations_, last_eval_loss_ = s.eval_loss, last_eval_step_ = step1;
    if (evaluations_ == 1 || s.eval_loss < best_eval_loss_) best_eval_loss_ = s.eval_loss, best_eval_step_ = step1;
  }
  // An evaluated step is always shown: the eval loss is rarer than the progress line.
  if (!writer_ || (step1 % config_.log.interval != 0 && step1 != config_.run.max_steps && !s.evaluated)) return;

  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double tok_s = window_time_s_ > 0 ? static_cast<double>(window_tokens_) / window_time_s_ : 0.0;
  const double eta = steps_done_ > 0 ? elapsed / static_cast<double>(steps_done_) *
                                           static_cast<double>(config_.run.max_steps - step1)
                                     : 0.0;
  const int64_t peak = host_memory().total_peak;
  const std::string eval_text = s.evaluated ? fmt(" | eval loss %.4f", s.eval_loss) : "";
  std::printf("step %6lld/%lld | loss %.4f%s | grad norm %.4f | lr %.3e | %.0f tok/s | elapsed %s | eta %s%s\n",
              (long long)step1, (long long)config_.run.max_steps, s.loss, eval_text.c_str(), s.grad_norm, s.lr, tok_s,
              clock_text(elapsed).c_str(), clock_text(eta).c_str(), s.skipped ? " | SKIPPED (NaN/Inf)" : "");
  if (s.rl)
    std::printf("        rl | entropy %.4f | mismatch kl %.3e | masked high %.3f low %.3f | mean advantage %+.4f | "
                "waited %.2f s for rollouts\n",
                s.entropy, s.mismatch_kl, s.masked_high, s.masked_low, s.advantage, s.rollout_wait_s);
  std::fflush(stdout);
  std::string rl_fields;
  if (s.rl)
    rl_fields = fmt(", \"entropy\": %.9g, \"mismatch_kl\": %.9g, \"masked_high\": %.9g, \"masked_low\": %.9g, "
                    "\"mean_advantage\": %.9g, \"rollout_wait_s\": %.6g",
                    s.entropy, s.mismatch_kl, s.masked_high, s.masked_low, s.advantage, s.rollout_wait_s);
  if (s.evaluated)
    rl_fields += fmt(", \"eval_loss\": %.9g, \"eval_loss_tokens\": %lld, \"eval_time_s\": %.6g", s.eval_loss,
                     (long long)s.eval_loss_tokens, s.eval_s);
  std::fprintf(jsonl_,
               "{\"step\": %lld, \"loss\": %.9g, \"grad_norm\": %.9g, \"lr\": %.9g, \"tokens\": %lld, "
               "\"loss_tokens\": %lld, \"tokens_per_s\": %.6g, \"step_time_s\": %.6g, \"mem_peak_bytes\": %lld, "
               "\"skipped\": %s%s}\n",
               (long long)step1, s.loss, s.grad_norm, s.lr, (long long)tokens_total_, (long long)s.loss_tokens,
               tok_s, s.step_time_s, (long long)peak, s.skipped ? "true" : "false", rl_fields.c_str());
  std::fflush(jsonl_);
  window_tokens_ = 0;
  window_time_s_ = 0;
}

void Metrics::summary(const MemoryPlan& plan, int64_t host_peak, int64_t device_peak, int64_t bad_steps) {
  if (!writer_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::printf("summary: %lld steps in %s | loss %.4f -> %.4f | %lld tokens, %.0f tok/s | %lld skipped steps\n",
              (long long)steps_done_, clock_text(elapsed).c_str(), first_loss_, last_loss_, (long long)tokens_total_,
              elapsed > 0 ? static_cast<double>(tokens_total_) / elapsed : 0.0, (long long)bad_steps);
  auto line = [](const char* where, int64_t peak, int64_t planned) {
    std::printf("memory: peak %.3f MiB %s on the largest rank, planned %.3f MiB (%+.1f%%)\n",
                static_cast<double>(peak) / 1048576.0, where, static_cast<double>(planned) / 1048576.0,
                planned > 0 ? 100.0 * (static_cast<double>(peak) / static_cast<double>(planned) - 1.0) : 0.0);
  };
  if (sum_steps_ > 0) {
    const double tok_s = static_cast<double>(sum_tokens_) / sum_step_s_;
    const double ms = 1e3 / static_cast<double>(sum_steps_);
    std::printf("throughput (steps 2..%lld): %.0f tok/s", (long long)steps_done_, tok_s);
    if (flops_per_token_ > 0 && peak_flops_ > 0)
      std::printf(", %.1f TFLOP/s, MFU %.1f%% of %.0f TFLOP/s", tok_s * flops_per_token_ / 1e12,
                  100.0 * tok_s * flops_per_token_ / peak_flops_, peak_flops_ / 1e12);
    std::printf("\nstep time %.1f ms: data %.1f, forward/backward %.1f (collectives and gradient transfers inside), "
                "optimizer %.1f, parameter sync %.1f\n",
                sum_step_s_ * ms, sum_data_s_ * ms, sum_compute_s_ * ms, sum_opt_s_ * ms, sum_sync_s_ * ms);
  }
  if (evaluations_ > 0)
    std::printf("eval: loss %.4f after step %lld; best %.4f after step %lld (%lld evaluations of %s)\n",
                last_eval_loss_, (long long)last_eval_step_, best_eval_loss_, (long long)best_eval_step_,
                (long long)evaluations_, config_.eval.path.c_str());
  line("host", host_peak, plan.host_total());
  if (plan.device) line("GPU", device_peak, plan.device_total());
  std::fflush(stdout);
}

}  // namespace shardlm
