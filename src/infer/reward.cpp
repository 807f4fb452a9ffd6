// reward.cpp — verifiers, the reward program, group advantages; see reward.hpp.
#include "infer/reward.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <regex>

#include "shardlm/error.hpp"

namespace shardlm {
namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n"), e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

class ExactReward final : public Reward {
 public:
  std::vector<double> score(const std::vector<RewardItem>& items, int64_t) override {
    std::vector<double> r;
    for (const RewardItem& it : items) r.push_back(extract_answer(it.text) == trim(it.answer) ? 1.0 : 0.0);
    return r;
  }
  std::string name() const override { return "exact"; }
};

class NumericReward final : public Reward {
 public:
  std::vector<double> score(const std::vector<RewardItem>& items, int64_t) override {
    std::vector<double> r;
    for (const RewardItem& it : items) {
      double got = 0, want = 0;
      const bool ok = extract_number(it.text, &got) && extract_number(it.answer, &want) &&
                      std::fabs(got - want) <= 1e-6 * std::max(1.0, std::fabs(want));
      r.push_back(ok ? 1.0 : 0.0);
    }
    return r;
  }
  std::string name() const override { return "numeric"; }
};

// rollout.reward_regex, "{answer}" standing for the prompt's reference answer (escaped).
class RegexReward final : public Reward {
 public:
  explicit RegexReward(std::string pattern) : pattern_(std::move(pattern)) {}
  std::vector<double> score(const std::vector<RewardItem>& items, int64_t) override {
    std::vector<double> r;
    const bool per_answer = pattern_.find("{answer}") != std::string::npos;
    const std::regex fixed = per_answer ? std::regex() : std::regex(pattern_);
    for (const RewardItem& it : items) {
      if (!per_answer) {
        r.push_back(std::regex_search(it.text, fixed) ? 1.0 : 0.0);
        continue;
      }
      static const std::regex special(R"([.^$|()\[\]{}*+?\\])");
      const std::string escaped = std::regex_replace(trim(it.answer), special, R"(\$&)");
      std::string p = pattern_;
      for (size_t at; (at = p.find("{answer}")) != std::string::npos;) p.replace(at, 8, escaped);
      r.push_back(std::regex_search(it.text, std::regex(p)) ? 1.0 : 0.0);
    }
    return r;
  }
  std::string name() const override { return "regex /" + pattern_ + "/"; }

 private:
  std::string pattern_;
};

// `/bin/sh -c PROGRAM` once per step: every completion as one JSON line on its
// stdin, then EOF; one reward per line back on its stdout; its stderr is ours.
// Both pipes are served by one poll loop, so a program that answers while it
// reads cannot deadlock with us; past rollout.reward_timeout_s it is killed.
class ProgramReward final : public Reward {
 public:
  ProgramReward(std::string command, double timeout_s) : command_(std::move(command)), timeout_s_(timeout_s) {}
  std::string name() const override { return "program '" + command_ + "'"; }

  std::vector<double> score(const std::vector<RewardItem>& items, int64_t step) override {
    std::string input;
    for (const RewardItem& it : items) {
      nlohmann::json j = {{"prompt_index", it.prompt}, {"sample", it.sample},   {"answer", it.answer},
                          {"completion", it.text},     {"prompt_ids", it.prompt_ids},
                          {"completion_ids", it.completion_ids}, {"finish_reason", it.finish}};
      input += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    }
    const std::string where = fmt("reward program '%s' (rollout.reward_program, rollout step %lld)",
                                  command_.c_str(), (long long)step);
    int to_child[2], from_child[2];
    SHARDLM_CHECK(pipe(to_child) == 0 && pipe(from_child) == 0, "%s: pipe: %s", where.c_str(), std::strerror(errno));
    const pid_t pid = fork();
    SHARDLM_CHECK(pid >= 0, "%s: fork: %s", where.c_str(), std::strerror(errno));
    if (pid == 0) {  // the child: only async-signal-safe calls until exec
      dup2(to_child[0], STDIN_FILENO);
      dup2(from_child[1], STDOUT_FILENO);
      close(to_child[0]), close(to_child[1]), close(from_child[0]), close(from_child[1]);
      execl("/bin/sh", "sh", "-c", command_.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    int in_fd = to_child[1], out_fd = from_child[0];
    fcntl(in_fd, F_SETFL, O_NONBLOCK);
    // A program that exits without reading all its input must not kill us with SIGPIPE.
    struct sigaction ignore {}, old {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &old);
    std::string output;
    size_t sent = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    bool timed_out = false;
    while (out_fd >= 0) {
      if (in_fd >= 0 && sent == input.size()) close(in_fd), in_fd = -1;
      pollfd fds[2] = {{out_fd, POLLIN, 0}, {in_fd, POLLOUT, 0}};
      const auto left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left_ms <= 0) {
        timed_out = true;
        break;
      }
      const int ready = poll(fds, in_fd >= 0 ? 2 : 1, int(std::min<int64_t>(left_ms, 1000)));
      if (ready < 0 && errno == EINTR) continue;
      SHARDLM_CHECK(ready >= 0, "%s: poll: %s", where.c_str(), std::strerror(errno));
      if (in_fd >= 0 && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP))) {
        const ssize_t n = write(in_fd, input.data() + sent, input.size() - sent);
        if (n > 0) sent += size_t(n);
        else if (n < 0 && errno != EAGAIN && errno != EINTR) close(in_fd), in_fd = -1;  // it stopped reading
      }
      if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[65536];
        const ssize_t n = read(out_fd, buf, sizeof buf);
        if (n > 0) output.append(buf, size_t(n));
        else if (n == 0 || (errno != EAGAIN && errno != EINTR)) close(out_fd), out_fd = -1;
      }
    }
    sigaction(SIGPIPE, &old, nullptr);
    if (in_fd >= 0) close(in_fd);
    if (out_fd >= 0) close(out_fd);
    if (timed_out) kill(pid, SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    SHARDLM_CHECK(!timed_out, "%s gave no complete answer within rollout.reward_timeout_s = %g s (%zu completions "
                  "sent); it was killed", where.c_str(), timeout_s_, items.size());
    if (WIFSIGNALED(status))
      SHARDLM_FAIL("%s was killed by signal %d", where.c_str(), WTERMSIG(status));
    SHARDLM_CHECK(WEXITSTATUS(status) != 127, "%s: the shell could not run it (exit 127: command not found?)",
                  where.c_str());
    SHARDLM_CHECK(WEXITSTATUS(status) == 0, "%s exited with status %d", where.c_str(), WEXITSTATUS(status));
    std::vector<double> rewards;
    size_t line_start = 0;
    for (int64_t line = 1; line_start < output.size(); ++line) {
      size_t end = output.find('\n', line_start);
      if (end == std::string::npos) end = output.size();
      const std::string text = trim(output.substr(line_start, end - line_start));
      line_start = end + 1;
      char* stop = nullptr;
      const double v = std::strtod(text.c_str(), &stop);
      SHARDLM_CHECK(!text.empty() && *stop == '\0' && std::isfinite(v),
                    "%s: line %lld of its output is '%s', not a finite number (one reward per line, in the order "
                    "of the input lines)", where.c_str(), (long long)line, text.c_str());
      rewards.push_back(v);
    }
    SHARDLM_CHECK(rewards.size() == items.size(), "%s answered %zu rewards for %zu completions (one line each)",
                  where.c_str(), rewards.size(), items.size());
    return rewards;
  }

 private:
  std::string command_;
  double timeout_s_;
};

}  // namespace

std::string extract_answer(const std::string& text) {
  const size_t boxed = text.rfind("\\boxed{");
  if (boxed != std::string::npos) {
    int depth = 1;
    const size_t start = boxed + 7;
    for (size_t i = start; i < text.size(); ++i) {
      depth += text[i] == '{' ? 1 : text[i] == '}' ? -1 : 0;
      if (depth == 0) return trim(text.substr(start, i - start));
    }
  }
  const size_t hashes = text.rfind("####");
  if (hashes != std::string::npos) return trim(text.substr(hashes + 4));
  const std::string t = trim(text);
  const size_t space = t.find_last_of(" \t\r\n");
  return space == std::string::npos ? t : t.substr(space + 1);
}

bool extract_number(const std::string& text, double* value) {
  std::string plain;  // "1,234" -> "1234"
  for (size_t i = 0; i < text.size(); ++i)
    if (!(text[i] == ',' && i > 0 && i + 1 < text.size() && std::isdigit((unsigned char)text[i - 1]) &&
          std::isdigit((unsigned char)text[i + 1])))
      plain += text[i];
  static const std::regex number(R"(-?\d+(\.\d+)?([eE][-+]?\d+)?)");
  std::string last;
  for (auto it = std::sregex_iterator(plain.begin(), plain.end(), number); it != std::sregex_iterator(); ++it)
    last = it->str();
  if (last.empty()) return false;
  *value = std::strtod(last.c_str(), nullptr);
  return std::isfinite(*value);
}

std::vector<float> group_advantages(const std::vector<double>& rewards, int64_t n, bool divide_by_std) {
  SHARDLM_CHECK(n >= 1 && int64_t(rewards.size()) % n == 0, "internal: %zu rewards in groups of %lld",
                rewards.size(), (long long)n);
  std::vector<float> adv(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += size_t(n)) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i) mean += rewards[g + size_t(i)];
    mean /= double(n);
    for (int64_t i = 0; i < n; ++i) var += (rewards[g + size_t(i)] - mean) * (rewards[g + size_t(i)] - mean);
    const double scale = divide_by_std ? 1.0 / (std::sqrt(var / double(n)) + 1e-6) : 1.0;
    for (int64_t i = 0; i < n; ++i) adv[g + size_t(i)] = float((rewards[g + size_t(i)] - mean) * scale);
  }
  return adv;
}

std::unique_ptr<Reward> make_reward(const std::string& kind, const RolloutSection& r) {
  if (kind == "exact") return std::make_unique<ExactReward>();
  if (kind == "numeric") return std::make_unique<NumericReward>();
  if (kind == "regex") return std::make_unique<RegexReward>(r.reward_regex);
  if (kind == "program") return std::make_unique<ProgramReward>(r.reward_program, r.reward_timeout_s);
  SHARDLM_FAIL("rollout.reward: unknown component \"%s\" (exact, numeric, regex or program)", kind.c_str());
}

RewardSet::RewardSet(const RolloutSection& r) : kinds_(r.reward) {
  SHARDLM_CHECK(!kinds_.empty(), "rollout.reward names no component");
  SHARDLM_CHECK(r.reward_weights.empty() || r.reward_weights.size() == kinds_.size(),
                "rollout.reward_weights has %zu entries for %zu components", r.reward_weights.size(), kinds_.size());
  weights_ = r.reward_weights.empty() ? std::vector<double>(kinds_.size(), 1.0) : r.reward_weights;
  for (const std::string& kind : kinds_) components_.push_back(make_reward(kind, r));
}

RewardSet::Scores RewardSet::score(const std::vector<RewardItem>& items, int64_t step) {
  Scores s;
  s.total.assign(items.size(), 0.0);
  for (size_t c = 0; c < components_.size(); ++c) {
    s.component.push_back(components_[c]->score(items, step));
    SHARDLM_CHECK(s.component.back().size() == items.size(), "internal: reward %s gave %zu scores for %zu items",
                  components_[c]->name().c_str(), s.component.back().size(), items.size());
    for (size_t i = 0; i < items.size(); ++i) s.total[i] += weights_[c] * s.component.back()[i];
  }
  return s;
}

std::string RewardSet::name() const {
  if (components_.size() == 1 && weights_[0] == 1.0) return components_[0]->name();
  std::string out;
  for (size_t c = 0; c < components_.size(); ++c)
    out += (c ? " + " : "") + fmt("%g*", weights_[c]) + components_[c]->name();
  return out;
}

}  // namespace shardlm
