// env.cpp — the environment program's exchange; see env.hpp.
#include "infer/env.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "infer/reward.hpp"  // spawn_shell
#include "shardlm/comm.hpp"  // answer_collective_queries
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

constexpr size_t kMaxAnswerBytes = size_t(16) << 20;
constexpr size_t kMaxMetrics = 32;

std::string episode_name(bool eval, int64_t key, int64_t sample) {
  return (eval ? "eval." : "") + std::to_string(key) + "." + std::to_string(sample);
}

// A metric's name: what a metrics.jsonl key and a TensorBoard tag can hold.
bool metric_name(const std::string& name) {
  return !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

}  // namespace

EnvProgram::EnvProgram(std::string command, double timeout_s) : command_(std::move(command)), timeout_s_(timeout_s) {
  pid_ = spawn_shell(command_, "environment program '" + command_ + "' (env.program)", &in_fd_, &out_fd_);
}

EnvProgram::~EnvProgram() {
  if (in_fd_ >= 0) close(in_fd_);  // EOF: a program that reads to the end exits
  if (out_fd_ >= 0) close(out_fd_);
  if (pid_ > 0) {
    // A moment to exit on its own, then its whole group goes.
    int status = 0;
    for (int i = 0; i < 20 && waitpid(pid_, &status, WNOHANG) == 0; ++i) usleep(10000);
    kill(-pid_, SIGKILL);
    while (waitpid(pid_, &status, WNOHANG) == 0) usleep(1000);
  }
}

std::string EnvProgram::exchange(const std::string& line, const std::string& where) {
  // Written whole (the pipe blocks; a program reading as it answers cannot deadlock with one line).
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, &old);
  size_t sent = 0;
  while (sent < line.size()) {
    const ssize_t n = write(in_fd_, line.data() + sent, line.size() - sent);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      sigaction(SIGPIPE, &old, nullptr);
      int status = 0;
      const bool ended = waitpid(pid_, &status, WNOHANG) == pid_;
      SHARDLM_FAIL("%s: the program %s", where.c_str(),
                   ended ? (WIFSIGNALED(status) ? fmt("was killed by signal %d", WTERMSIG(status))
                                                : fmt("exited with status %d", WEXITSTATUS(status)))
                               .c_str()
                         : fmt("does not read its input (%s)", std::strerror(error)).c_str());
    }
    sent += size_t(n);
  }
  sigaction(SIGPIPE, &old, nullptr);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  for (;;) {
    const size_t newline = buffer_.find('\n');
    if (newline != std::string::npos) {
      std::string answer = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      return answer;
    }
    SHARDLM_CHECK(buffer_.size() <= kMaxAnswerBytes, "%s: an answer line over %zu MiB", where.c_str(),
                  kMaxAnswerBytes >> 20);
    const auto left_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    SHARDLM_CHECK(left_ms > 0, "%s: no answer within env.timeout_s = %g s", where.c_str(), timeout_s_);
    // The trainers that ask where this rank is hear it is busy, in its environment.
    answer_collective_queries("the environment program");
    pollfd fd{out_fd_, POLLIN, 0};
    const int ready = poll(&fd, 1, int(std::min<int64_t>(left_ms, 100)));
    if (ready < 0 && errno == EINTR) continue;
    SHARDLM_CHECK(ready >= 0, "%s: poll: %s", where.c_str(), std::strerror(errno));
    if (ready == 0) continue;
    char chunk[65536];
    const ssize_t n = read(out_fd_, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int status = 0;
      std::string how = "closed its output";
      if (waitpid(pid_, &status, 0) == pid_) {
        how = WIFSIGNALED(status) ? fmt("was killed by signal %d", WTERMSIG(status))
                                  : fmt("exited with status %d", WEXITSTATUS(status));
        pid_ = -1;
      }
      SHARDLM_FAIL("%s: the program %s without answering%s", where.c_str(), how.c_str(),
                   buffer_.empty() ? "" : fmt(" (it had written '%.80s')", buffer_.c_str()).c_str());
    }
    buffer_.append(chunk, size_t(n));
  }
}

std::optional<std::vector<int32_t>> EnvProgram::turn(const EnvTurn& t) {
  const std::string episode = episode_name(t.eval, t.key, t.sample);
  const std::string where = fmt("environment program '%s' (env.program), episode %s (prompt %lld, sample %lld), "
                                "turn %lld", command_.c_str(), episode.c_str(), (long long)t.prompt,
                                (long long)t.sample, (long long)t.turn);
  nlohmann::json j = {{"episode", episode}, {"prompt", t.prompt}, {"sample", t.sample}, {"answer", t.answer},
                      {"turn", t.turn},      {"ids", t.ids},       {"text", t.text}};
  if (t.end) j["end"] = t.end;
  if (t.eval) j["eval"] = true;
  if (!t.metadata.empty()) {  // JSON as make_prompts.py writes it; other text as a string
    nlohmann::json metadata = nlohmann::json::parse(t.metadata, nullptr, /*allow_exceptions=*/false);
    j["metadata"] = metadata.is_discarded() ? nlohmann::json(t.metadata) : metadata;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string line = exchange(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", where);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::json a;
  try {
    a = nlohmann::json::parse(line);
  } catch (const std::exception&) {
    SHARDLM_FAIL("%s: the answer is not JSON: '%.120s'", where.c_str(), line.c_str());
  }
  SHARDLM_CHECK(a.is_object() && a.contains("episode"), "%s: the answer has no \"episode\": '%.120s'", where.c_str(),
                line.c_str());
  const std::string answered = a["episode"].is_string() ? a["episode"].get<std::string>() : a["episode"].dump();
  SHARDLM_CHECK(answered == episode, "%s: the answer is for episode %s", where.c_str(), answered.c_str());
  const bool has_reward = a.contains("reward"), has_observation = a.contains("observation");
  SHARDLM_CHECK(has_reward != has_observation,
                "%s: the answer must hold either \"observation\" (ids to continue with) or \"reward\" (the "
                "episode's end): '%.120s'", where.c_str(), line.c_str());
  if (has_reward) {
    SHARDLM_CHECK(a["reward"].is_number() && std::isfinite(a["reward"].get<double>()),
                  "%s: \"reward\" is not a finite number: '%.120s'", where.c_str(), line.c_str());
    EnvOutcome outcome{a["reward"].get<double>(), ""};
    if (a.contains("metrics")) {
      const nlohmann::json& m = a["metrics"];
      SHARDLM_CHECK(m.is_object() && m.size() <= kMaxMetrics,
                    "%s: \"metrics\" is not an object of at most %zu numbers: '%.120s'", where.c_str(), kMaxMetrics,
                    line.c_str());
      for (const auto& [name, value] : m.items())
        SHARDLM_CHECK(metric_name(name) && value.is_number() && std::isfinite(value.get<double>()),
                      "%s: metric '%.64s' is not a finite number named by letters, digits and '_' (at most 64): "
                      "'%.120s'", where.c_str(), name.c_str(), line.c_str());
      outcome.metrics = m.dump();
    }
    outcomes_[{t.eval, t.key, t.sample}] = std::move(outcome);
    return std::nullopt;
  }
  SHARDLM_CHECK(!t.end, "%s: the episode ended (%s) and only a reward may answer, not an observation", where.c_str(),
                t.end);
  const nlohmann::json& obs = a["observation"];
  SHARDLM_CHECK(obs.is_array() && !obs.empty() &&
                    std::all_of(obs.begin(), obs.end(), [](const nlohmann::json& x) { return x.is_number_integer(); }),
                "%s: \"observation\" is not a non-empty list of token ids: '%.120s'", where.c_str(), line.c_str());
  return obs.get<std::vector<int32_t>>();
}

std::optional<EnvOutcome> EnvProgram::outcome_of(bool eval, int64_t key, int64_t sample) {
  const auto it = outcomes_.find({eval, key, sample});
  if (it == outcomes_.end()) return std::nullopt;
  EnvOutcome outcome = std::move(it->second);
  outcomes_.erase(it);
  return outcome;
}

}  // namespace shardlm
