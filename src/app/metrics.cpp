// metrics.cpp — progress lines, metrics.jsonl (rows and events), TensorBoard scalars, the run summary.
#include "app/metrics.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"
#include "app/tensorboard.hpp"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

std::string clock_text(double seconds) {
  const long s = static_cast<long>(seconds + 0.5);
  return fmt("%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
}

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A JSON number, or null for NaN / Inf (which JSON cannot hold); `nonfinite`
// collects the names of the fields written as null that way.
std::string number(const char* name, double v, std::vector<std::string>& nonfinite) {
  if (std::isfinite(v)) return fmt("%.9g", v);
  nonfinite.push_back(name);
  return "null";
}

// An event row in the step rows' spelling ("key": value, ...), values escaped by nlohmann.
std::string json_row(const nlohmann::ordered_json& row) {
  std::string out = "{";
  for (auto it = row.begin(); it != row.end(); ++it)
    out += (it == row.begin() ? "\"" : ", \"") + it.key() + "\": " + it.value().dump();
  return out + "}";
}

}  // namespace

Metrics::Metrics(const Config& config, bool writer, const RunStart& start, double flops_per_token, double peak_flops)
    : config_(config),
      writer_(writer),
      start_(std::chrono::steady_clock::now()),
      tokens_total_(start.tokens_seen),
      flops_per_token_(flops_per_token),
      peak_flops_(peak_flops * start.world_size) {  // tokens/s are the job's: against the job's peak
  if (!writer_) return;
  const fs::path path = fs::path(config.run.dir) / config.log.jsonl;
  path_ = path.string();
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  const bool resumed = !start.checkpoint.empty();
  if (resumed) dropped_rows_ = keep_jsonl_rows_before(path, start.step + 1);  // rows of steps <= start.step stay
  jsonl_ = std::fopen(path.c_str(), resumed ? "a" : "w");
  SHARDLM_CHECK(jsonl_, "cannot open %s for writing: %s", path.c_str(), std::strerror(errno));

  nlohmann::ordered_json row;
  row["event"] = resumed ? "resume" : "start";
  row["step"] = start.step;
  row["run_name"] = config.run.name;
  row["time"] = unix_time();
  row["host"] = start.host;
  row["world_size"] = start.world_size;
  row["backend"] = start.backend;
  row["fp8"] = config.model.fp8;  // the decoder blocks' linears: none | tensorwise | rowwise
  row["version"] = start.version;
  row["max_steps"] = config.run.max_steps;
  row["deck"] = start.deck_file;
  if (resumed) {
    row["checkpoint"] = start.checkpoint;
    row["tokens"] = start.tokens_seen;
    row["dropped_rows"] = dropped_rows_;
    nlohmann::ordered_json changes = nlohmann::ordered_json::object();
    for (const auto& c : start.deck_changes) changes[c.key] = {c.before, c.after};
    row["deck_changes"] = changes;
  }
  write_row(json_row(row));
  if (config.log.tensorboard)
    // TensorBoard keeps an earlier file's events before the START step: the rows up to the checkpoint.
    tensorboard_ = std::make_unique<TensorBoardWriter>(fs::path(config.run.dir) / "tensorboard", start.step + 1);
}

Metrics::~Metrics() {
  if (jsonl_) std::fclose(jsonl_);
}

double Metrics::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Metrics::write_row(const std::string& json) {
  if (std::fputs(json.c_str(), jsonl_) < 0 || std::fputc('\n', jsonl_) == EOF || std::fflush(jsonl_) != 0)
    SHARDLM_FAIL("cannot write %s: %s", path_.c_str(), std::strerror(errno));
}

void Metrics::log(const StepStats& s) {
  tokens_total_ += s.tokens;
  tokens_this_start_ += s.tokens;
  window_tokens_ += s.tokens;
  window_time_s_ += s.step_time_s;
  ++steps_done_;
  if (first_step_ < 0) first_step_ = s.step, first_loss_ = s.loss;
  last_step_ = s.step, last_loss_ = s.loss;
  if (steps_done_ > 1) {
    sum_step_s_ += s.step_time_s, sum_data_s_ += s.data_s, sum_compute_s_ += s.compute_s;
    sum_opt_s_ += s.optimizer_s, sum_sync_s_ += s.param_sync_s, sum_tokens_ += s.tokens, ++sum_steps_;
  }
  const int64_t step1 = s.step + 1;
  if (s.evaluated) {
    ++evaluations_, last_eval_loss_ = s.eval_loss, last_eval_step_ = step1;
    if (evaluations_ == 1 || s.eval_loss < best_eval_loss_) best_eval_loss_ = s.eval_loss, best_eval_step_ = step1;
  }
  // An evaluated step is always shown: the eval loss, and the inference ranks'
  // evaluation its rollout file carries, are rarer than the progress line.
  const bool accuracy = std::any_of(s.rollout_metrics.begin(), s.rollout_metrics.end(),
                                    [](const auto& m) { return m.first.starts_with("eval_"); });
  if (!writer_ || (step1 % config_.log.interval != 0 && step1 != config_.run.max_steps && !s.evaluated && !accuracy))
    return;

  const double elapsed = elapsed_s();
  const double tok_s = window_time_s_ > 0 ? static_cast<double>(window_tokens_) / window_time_s_ : 0.0;
  const double eta = steps_done_ > 0 ? elapsed / static_cast<double>(steps_done_) *
                                           static_cast<double>(config_.run.max_steps - step1)
                                     : 0.0;
  const int64_t peak = host_memory().total_peak;
  const std::string eval_text = s.evaluated ? fmt(" | eval loss %.4f", s.eval_loss) : "";
  const bool device = config_.device.backend == "cuda";
  const int64_t device_peak = device ? device_memory().total_peak : 0;
  const bool mfu_known = flops_per_token_ > 0 && peak_flops_ > 0;
  const double mfu = mfu_known ? tok_s * flops_per_token_ / peak_flops_ : 0.0;
  const std::string redone_text =
      s.redone_steps >= 0 ? fmt(" | update redone %lld/%lld", (long long)s.redone_steps, (long long)steps_done_) : "";
  std::printf("step %6lld/%lld | loss %.4f%s | grad norm %.4f | lr %.3e | %.0f tok/s | elapsed %s | eta %s%s%s\n",
              (long long)step1, (long long)config_.run.max_steps, s.loss, eval_text.c_str(), s.grad_norm, s.lr, tok_s,
              clock_text(elapsed).c_str(), clock_text(eta).c_str(), redone_text.c_str(),
              s.skipped ? " | SKIPPED (NaN/Inf)" : "");
  if (s.rl) {
    std::string reward_text;  // the rollout file's mean reward, when the inference side measured it
    for (const auto& [name, v] : s.rollout_metrics)
      if (name == "reward_mean") reward_text = fmt(" | rollout reward %.4f", v);
    const std::string is_text = config_.loss.is_level == "none" ? ""
        : fmt(" | is ratio %.4f capped %.3f masked %.3f", s.is_ratio, s.is_capped_fraction, s.is_masked_fraction);
    const std::string ref_text = config_.loss.ref_kl_coef > 0 ? fmt(" | ref kl %.3e", s.ref_kl) : "";
    // Several updates a step: each one's clip (mask) fraction, in order.
    std::string updates_text;
    if (s.updates.size() > 1) {
      updates_text = fmt(" (%zu updates:", s.updates.size());
      for (const UpdateStats& u : s.updates) updates_text += fmt(" %.3f", u.bound_fraction);
      updates_text += ")";
    }
    std::printf("        rl | entropy %.4f | mismatch kl %.3e%s | %s%s%s | mean advantage %+.4f | "
                "waited %.2f s for rollouts%s\n",
                s.entropy, s.mismatch_kl, ref_text.c_str(),
                config_.loss.objective != "masked" ? fmt("clip fraction %.3f", s.clip_fraction).c_str()
                                                   : fmt("masked high %.3f low %.3f", s.masked_high, s.masked_low).c_str(),
                updates_text.c_str(), is_text.c_str(), s.advantage, s.rollout_wait_s, reward_text.c_str());
  }
  std::fflush(stdout);

  std::vector<std::string> nonfinite;  // in the row's key order: each number() call is its own statement
  const double now = unix_time();
  const std::string loss = number("loss", s.loss, nonfinite), grad_norm = number("grad_norm", s.grad_norm, nonfinite),
                    lr = number("lr", s.lr, nonfinite);
  std::string row = fmt("{\"step\": %lld, \"loss\": %s, \"grad_norm\": %s, \"lr\": %s, \"tokens\": %lld, "
                        "\"loss_tokens\": %lld, \"tokens_per_s\": %.6g, \"step_time_s\": %.6g, \"mem_peak_bytes\": %lld",
                        (long long)step1, loss.c_str(), grad_norm.c_str(), lr.c_str(), (long long)tokens_total_,
                        (long long)s.loss_tokens, tok_s, s.step_time_s, (long long)peak);
  if (device) row += fmt(", \"device_mem_peak_bytes\": %lld", (long long)device_peak);
  row += mfu_known ? fmt(", \"mfu\": %.6g", mfu) : std::string(", \"mfu\": null");
  row += fmt(", \"skipped\": %s, \"time\": %.3f, \"elapsed_s\": %.3f", s.skipped ? "true" : "false", now, elapsed);
  if (s.redone_steps >= 0) row += fmt(", \"redone_steps\": %lld", (long long)s.redone_steps);
  if (s.router_aux)
    row += fmt(", \"router_aux_loss\": %s", number("router_aux_loss", s.router_aux_loss, nonfinite).c_str());
  if (s.rl) {
    for (const auto& [key, v] : {std::pair<const char*, double>{"entropy", s.entropy}, {"mismatch_kl", s.mismatch_kl},
                                 {"masked_high", s.masked_high}, {"masked_low", s.masked_low},
                                 {"masked_fraction", s.masked_fraction}, {"clip_fraction", s.clip_fraction},
                                 {"mean_advantage", s.advantage}})
      row += fmt(", \"%s\": %s", key, number(key, v, nonfinite).c_str());
    if (config_.loss.is_level != "none")
      for (const auto& [key, v] : {std::pair<const char*, double>{"is_ratio", s.is_ratio},
                                   {"is_capped_fraction", s.is_capped_fraction},
                                   {"is_masked_fraction", s.is_masked_fraction}})
        row += fmt(", \"%s\": %s", key, number(key, v, nonfinite).c_str());
    if (config_.loss.ref_kl_coef > 0) row += fmt(", \"ref_kl\": %s", number("ref_kl", s.ref_kl, nonfinite).c_str());
    // loss.epochs x loss.mini_batches > 1: each update's numbers, in order.
    if (s.updates.size() > 1) {
      const char* bound = config_.loss.objective != "masked" ? "update_clip_fraction" : "update_masked_fraction";
      row += fmt(", \"updates\": %zu", s.updates.size());
      for (const auto& [key, field] : {std::pair{"update_loss", &UpdateStats::loss},
                                       std::pair{"update_grad_norm", &UpdateStats::grad_norm},
                                       std::pair{bound, &UpdateStats::bound_fraction}}) {
        row += fmt(", \"%s\": [", key);
        for (size_t i = 0; i < s.updates.size(); ++i) row += (i ? ", " : "") + number(key, s.updates[i].*field, nonfinite);
        row += "]";
      }
    }
    row += fmt(", \"rollout_wait_s\": %.6g, \"rollout_wait_fraction\": %.6g", s.rollout_wait_s,
               s.step_time_s > 0 ? s.rollout_wait_s / s.step_time_s : 0.0);
    // The step's rollout file's own measurements, prefixed: "rollout_reward_mean", ...; the
    // inference ranks' latest evaluation (eval_accuracy, ...) under its own names.
    for (const auto& [name, v] : s.rollout_metrics) {
      const std::string key = name.starts_with("eval_") ? name : "rollout_" + name;
      row += fmt(", \"%s\": %s", key.c_str(), number(key.c_str(), v, nonfinite).c_str());
    }
  }
  if (s.evaluated)
    row += fmt(", \"eval_loss\": %s, \"eval_loss_tokens\": %lld, \"eval_time_s\": %.6g",
               number("eval_loss", s.eval_loss, nonfinite).c_str(), (long long)s.eval_loss_tokens, s.eval_s);
  if (!nonfinite.empty()) {
    row += ", \"nonfinite\": [";
    for (size_t i = 0; i < nonfinite.size(); ++i) row += (i ? ", \"" : "\"") + nonfinite[i] + "\"";
    row += "]";
  }
  write_row(row + "}");

  if (tensorboard_) {
    std::vector<std::pair<std::string, float>> scalars = {
        {"train/loss", float(s.loss)},
        {"train/grad_norm", float(s.grad_norm)},
        {"train/lr", float(s.lr)},
        {"train/tokens", float(tokens_total_)},
        {"perf/tokens_per_s", float(tok_s)},
        {"perf/step_time_s", float(s.step_time_s)},
        {"perf/mem_peak_gib", float(double(peak) / 1073741824.0)},
    };
    if (device) scalars.push_back({"perf/device_mem_peak_gib", float(double(device_peak) / 1073741824.0)});
    if (mfu_known) scalars.push_back({"perf/mfu", float(mfu)});
    if (s.router_aux) scalars.push_back({"train/router_aux_loss", float(s.router_aux_loss)});
    if (s.rl)
      for (const auto& [tag, v] : {std::pair<const char*, double>{"rl/entropy", s.entropy}, {"rl/mismatch_kl", s.mismatch_kl},
                                   {"rl/masked_high", s.masked_high}, {"rl/masked_low", s.masked_low},
                                   {"rl/masked_fraction", s.masked_fraction}, {"rl/clip_fraction", s.clip_fraction},
                                   {"rl/mean_advantage", s.advantage}, {"rl/rollout_wait_s", s.rollout_wait_s}})
        scalars.push_back({tag, float(v)});
    if (s.rl && config_.loss.ref_kl_coef > 0) scalars.push_back({"rl/ref_kl", float(s.ref_kl)});
    if (s.rl && config_.loss.is_level != "none")
      for (const auto& [tag, v] : {std::pair<const char*, double>{"rl/is_ratio", s.is_ratio},
                                   {"rl/is_capped_fraction", s.is_capped_fraction},
                                   {"rl/is_masked_fraction", s.is_masked_fraction}})
        scalars.push_back({tag, float(v)});
    for (const auto& [name, v] : s.rollout_metrics)
      scalars.push_back({name.starts_with("eval_") ? "eval/" + name.substr(5) : "rollout/" + name, float(v)});
    if (s.evaluated) scalars.push_back({"eval/loss", float(s.eval_loss)});
    tensorboard_->scalars(step1, now, scalars);
  }
  window_tokens_ = 0;
  window_time_s_ = 0;
}

void Metrics::end(const char* status, int exit_code, int64_t steps_done) {
  if (!writer_) return;
  nlohmann::ordered_json row;
  row["event"] = "end";
  row["step"] = steps_done;
  row["status"] = status;
  row["exit_code"] = exit_code;
  row["time"] = unix_time();
  row["elapsed_s"] = elapsed_s();
  write_row(json_row(row));
}

void Metrics::summary(const MemoryPlan& plan, int64_t host_peak, int64_t device_peak, int64_t bad_steps) {
  if (!writer_) return;
  const double elapsed = elapsed_s();
  std::printf("summary: %lld steps (%lld..%lld) in %s | loss %.4f -> %.4f | %lld tokens, %.0f tok/s (%lld in the "
              "run) | %lld skipped steps\n",
              (long long)steps_done_, (long long)first_step_ + 1, (long long)last_step_ + 1,
              clock_text(elapsed).c_str(), first_loss_, last_loss_, (long long)tokens_this_start_,
              elapsed > 0 ? static_cast<double>(tokens_this_start_) / elapsed : 0.0, (long long)tokens_total_,
              (long long)bad_steps);
  auto line = [](const char* where, int64_t peak, int64_t planned) {
    std::printf("memory: peak %.3f MiB %s on the largest rank, planned %.3f MiB (%+.1f%%)\n",
                static_cast<double>(peak) / 1048576.0, where, static_cast<double>(planned) / 1048576.0,
                planned > 0 ? 100.0 * (static_cast<double>(peak) / static_cast<double>(planned) - 1.0) : 0.0);
  };
  if (sum_steps_ > 0) {
    const double tok_s = static_cast<double>(sum_tokens_) / sum_step_s_;
    const double ms = 1e3 / static_cast<double>(sum_steps_);
    // The first step of this start pays for warm-up: the rates count from the second.
    std::printf("throughput (steps %lld..%lld): %.0f tok/s", (long long)first_step_ + 2, (long long)last_step_ + 1,
                tok_s);
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
  // The async snapshot's device copy, where the GPU had room for it (outside the plan's total).
  const bool device_copy = device_memory().peak[static_cast<int>(Mem::Snapshot)] > 0;
  if (plan.device) line("GPU", device_peak, plan.device_total() + (device_copy ? plan.checkpoint_device_snapshot : 0));
  std::fflush(stdout);
}

}  // namespace shardlm
