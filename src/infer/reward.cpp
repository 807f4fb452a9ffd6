// reward.cpp — verifiers, the reward program, group advantages; see reward.hpp.
#include "infer/reward.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <regex>
#include <string_view>

#include "shardlm/comm.hpp"  // answer_collective_queries
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

// Bounds of one exchange with a reward program.
constexpr size_t kMaxAnswerLineBytes = 4096;  // one reward: a number, whitespace around it
constexpr size_t kQuotedBytes = 64;           // of a bad line, in an error message
constexpr int kExitPollMs = 20;               // how often the program's exit is looked for

// A short, printable quote of what a program printed: at most kQuotedBytes,
// other bytes than printable ASCII as \xNN, "..." where it was cut.
std::string quote_prefix(std::string_view text, bool cut = false) {
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < kQuotedBytes; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    out += c >= 0x20 && c < 0x7F && c != '\'' ? std::string(1, char(c)) : fmt("\\x%02X", unsigned(c));
  }
  return out + (cut || text.size() > kQuotedBytes ? "...'" : "'");
}

// The program's stdout, read as the protocol defines it: one reward per line,
// as many lines as completions. Holds at most one line of kMaxAnswerLineBytes;
// the first fault (a line too long, not a number, one too many) stops it.
class AnswerReader {
 public:
  explicit AnswerReader(size_t expected) : expected_(expected) {}
  void feed(const char* data, size_t n) {
    for (size_t i = 0; i < n && fault_.empty(); ++i) {
      if (rewards_.size() == expected_) {
        const size_t end = std::min(n, i + kQuotedBytes);
        const std::string extra = quote_prefix(std::string_view(data + i, end - i), end < n);
        fault_ = fmt("answered more than %zu rewards for %zu completions (one line each; after line %zu it printed %s)",
                     expected_, expected_, expected_, extra.c_str());
      } else if (data[i] == '\n') {
        end_line();
      } else if (line_.size() == kMaxAnswerLineBytes) {
        fault_ = fmt("line %zu of its output is longer than %zu bytes, not one reward (it starts %s)",
                     rewards_.size() + 1, kMaxAnswerLineBytes, quote_prefix(line_, true).c_str());
      } else {
        line_ += data[i];
      }
    }
  }
  // At the program's end: a last line without its newline counts.
  void finish() {
    if (fault_.empty() && !line_.empty()) end_line();
  }
  const std::string& fault() const { return fault_; }  // "" while the output keeps to the protocol
  const std::vector<double>& rewards() const { return rewards_; }

 private:
  void end_line() {
    const std::string text = trim(line_);
    char* stop = nullptr;
    const double v = std::strtod(text.c_str(), &stop);
    if (text.empty() || *stop != '\0' || !std::isfinite(v))
      fault_ = fmt("line %zu of its output is %s, not a finite number (one reward per line, in the order of the "
                   "input lines)", rewards_.size() + 1, quote_prefix(line_).c_str());
    else
      rewards_.push_back(v);
    line_.clear();
  }
  size_t expected_;
  std::vector<double> rewards_;
  std::string line_;  // the line being read, at most kMaxAnswerLineBytes
  std::string fault_;
};

// A pipe end above stderr (a rank whose stdin or stdout is closed gets those
// numbers back from pipe()), closed on exec.
int above_stdio(int fd) {
  if (fd > STDERR_FILENO) return fd;
  const int moved = fcntl(fd, F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
  close(fd);
  return moved;
}

bool is_stop_signal(int sig) { return sig == SIGUSR1 || sig == SIGTERM || sig == SIGINT; }

}  // namespace

// See reward.hpp. The pipes' ends above stderr.
pid_t spawn_shell(const std::string& command, const std::string& where, int* in_fd_out, int* out_fd_out) {
  int to_child[2], from_child[2];
  SHARDLM_CHECK(pipe2(to_child, O_CLOEXEC) == 0, "%s: pipe: %s", where.c_str(), std::strerror(errno));
  SHARDLM_CHECK(pipe2(from_child, O_CLOEXEC) == 0, "%s: pipe: %s", where.c_str(), std::strerror(errno));
  for (int* fd : {&to_child[0], &to_child[1], &from_child[0], &from_child[1]}) *fd = above_stdio(*fd);
  posix_spawn_file_actions_t files;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_adddup2(&files, to_child[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&files, from_child[1], STDOUT_FILENO);
  posix_spawnattr_init(&attr);
  // Its own process group; the signals a rank ignores or handles back at their defaults, none blocked.
  sigset_t defaults, none;
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGUSR1, SIGUSR2, SIGTERM, SIGINT, SIGHUP, SIGQUIT}) sigaddset(&defaults, sig);
  sigemptyset(&none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &none);
  std::string sh = "sh", dash_c = "-c", command_copy = command;
  char* argv[] = {sh.data(), dash_c.data(), command_copy.data(), nullptr};
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, "/bin/sh", &files, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  close(to_child[0]);
  close(from_child[1]);
  if (spawned != 0) {
    close(to_child[1]), close(from_child[0]);
    SHARDLM_FAIL("%s: cannot start /bin/sh: %s", where.c_str(), std::strerror(spawned));
  }
  *in_fd_out = to_child[1];
  *out_fd_out = from_child[0];
  return pid;
}

namespace {

// The reward the environment program gave the episode (src/infer/env.hpp).
class EnvReward final : public Reward {
 public:
  std::string name() const override { return "env"; }
  std::vector<double> score(const std::vector<RewardItem>& items, int64_t) override {
    std::vector<double> r;
    for (const RewardItem& it : items) r.push_back(it.env_reward);
    return r;
  }
};

// `/bin/sh -c PROGRAM` once per step: every completion as one JSON line on its
// stdin, then EOF; one reward per line back on its stdout; its stderr is ours.
// It runs in a process group of its own, so the stop signals that mpirun or a
// terminal sends to the rank's group are the job's (the trainers save and the
// job exits 75), not the program's. The exchange is bounded: the whole of it by
// rollout.reward_timeout_s (the program's exit included, not only its reads),
// its output by AnswerReader; at the end the program's whole group is killed,
// so nothing it left running holds on. Both pipes are served by one poll loop,
// so a program that answers while it reads cannot deadlock with us.
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
    Outcome run = exchange(input, items.size(), where);
    // Killed by a stop signal (Slurm signals every process of the job step,
    // whatever its group): the job is stopping, the answer was not given. The
    // trainers wait for this step's file before they save, so it runs again.
    if (run.stopped()) {
      std::fprintf(stderr, "%s was killed by signal %d (%s), a stop signal to the job: running it once more\n",
                   where.c_str(), WTERMSIG(run.status), strsignal(WTERMSIG(run.status)));
      run = exchange(input, items.size(), where);
      SHARDLM_CHECK(!run.stopped(), "%s was killed by signal %d (%s) twice: once may be the job's stop signal, "
                    "twice is the program's failure", where.c_str(), WTERMSIG(run.status),
                    strsignal(WTERMSIG(run.status)));
    }
    SHARDLM_CHECK(!run.timed_out, "%s gave no complete answer within rollout.reward_timeout_s = %g s (%zu "
                  "completions sent, %zu rewards read); it was killed, with its process group", where.c_str(),
                  timeout_s_, items.size(), run.answers.rewards().size());
    SHARDLM_CHECK(run.answers.fault().empty(), "%s: %s", where.c_str(), run.answers.fault().c_str());
    if (WIFSIGNALED(run.status))
      SHARDLM_FAIL("%s was killed by signal %d (%s)", where.c_str(), WTERMSIG(run.status),
                   strsignal(WTERMSIG(run.status)));
    SHARDLM_CHECK(WEXITSTATUS(run.status) != 127, "%s: the shell could not run it (exit 127: command not found?)",
                  where.c_str());
    SHARDLM_CHECK(WEXITSTATUS(run.status) == 0, "%s exited with status %d", where.c_str(), WEXITSTATUS(run.status));
    run.answers.finish();
    SHARDLM_CHECK(run.answers.fault().empty(), "%s: %s", where.c_str(), run.answers.fault().c_str());
    SHARDLM_CHECK(run.answers.rewards().size() == items.size(), "%s answered %zu rewards for %zu completions (one "
                  "line each)", where.c_str(), run.answers.rewards().size(), items.size());
    return run.answers.rewards();
  }

 private:
  struct Outcome {
    AnswerReader answers;
    bool timed_out = false;
    int status = 0;  // waitpid's, of /bin/sh
    bool stopped() const {
      return !timed_out && answers.fault().empty() && WIFSIGNALED(status) && is_stop_signal(WTERMSIG(status));
    }
  };

  // One run of the program, bounded. The program's end is its shell's exit
  // (what it printed by then is its answer), or a fault in its output, or the
  // timeout: the last two kill it.
  Outcome exchange(const std::string& input, size_t expected, const std::string& where) const {
    Outcome out{AnswerReader(expected)};
    int in_fd = -1, out_fd = -1;
    const pid_t pid = spawn_shell(command_, where, &in_fd, &out_fd);
    fcntl(in_fd, F_SETFL, O_NONBLOCK);
    fcntl(out_fd, F_SETFL, O_NONBLOCK);
    // A program that exits without reading all its input must not kill us with SIGPIPE.
    struct sigaction ignore {}, old {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &old);
    // What it has printed, up to a fault: Read::More when there may be more to read now.
    enum class Read { More, Empty, End };
    const auto read_output = [&] {
      char buf[65536];
      for (int reads = 0; reads < 16; ++reads) {
        if (!out.answers.fault().empty()) return Read::Empty;
        const ssize_t n = read(out_fd, buf, sizeof buf);
        if (n > 0) out.answers.feed(buf, size_t(n));
        else if (n < 0 && (errno == EAGAIN || errno == EINTR)) return Read::Empty;
        else return Read::End;
      }
      return Read::More;
    };
    size_t sent = 0;
    bool exited = false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    while (!exited && out.answers.fault().empty()) {
      if (in_fd >= 0 && sent == input.size()) close(in_fd), in_fd = -1;
      const auto left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               deadline - std::chrono::steady_clock::now()).count();
      if (left_ms <= 0) {
        out.timed_out = true;
        break;
      }
      // The trainers that ask where this rank is hear it is busy, scoring.
      answer_collective_queries("scoring: the reward program");
      // Its exit is looked for every kExitPollMs: a child it left behind may hold its stdout open.
      pollfd fds[2] = {{out_fd, POLLIN, 0}, {in_fd, POLLOUT, 0}};
      const int ready = poll(fds, 2, int(std::min<int64_t>(left_ms, kExitPollMs)));
      if (ready < 0 && errno != EINTR) {
        const int error = errno;
        sigaction(SIGPIPE, &old, nullptr);
        kill(-pid, SIGKILL);
        while (waitpid(pid, &out.status, 0) < 0 && errno == EINTR) {
        }
        SHARDLM_FAIL("%s: poll: %s", where.c_str(), std::strerror(error));
      }
      if (ready > 0 && in_fd >= 0 && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP))) {
        const ssize_t n = write(in_fd, input.data() + sent, input.size() - sent);
        if (n > 0) sent += size_t(n);
        else if (n < 0 && errno != EAGAIN && errno != EINTR) close(in_fd), in_fd = -1;  // it stopped reading
      }
      if (ready > 0 && out_fd >= 0 && (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) &&
          read_output() == Read::End)
        close(out_fd), out_fd = -1;  // its stdout's end; it may still be running
      siginfo_t info{};
      exited = waitid(P_PID, id_t(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
      // All it printed before it exited is in the pipe now (AnswerReader bounds
      // what a child it left behind may add).
      if (exited && out_fd >= 0)
        while (read_output() == Read::More) {
        }
    }
    sigaction(SIGPIPE, &old, nullptr);
    if (in_fd >= 0) close(in_fd);
    if (out_fd >= 0) close(out_fd);
    // The group first, while its leader is not yet reaped (so the group's id is not reused).
    kill(-pid, SIGKILL);
    while (waitpid(pid, &out.status, 0) < 0 && errno == EINTR) {
    }
    return out;
  }

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

std::vector<float> group_advantages(const std::vector<double>& rewards, int64_t n, const std::string& kind) {
  SHARDLM_CHECK(kind == "mean_std" || kind == "mean" || kind == "rloo" || kind == "batch_std",
                "rollout.advantage = \"%s\" is not one of \"mean_std\", \"mean\", \"rloo\", \"batch_std\"",
                kind.c_str());
  SHARDLM_CHECK(n >= 1 && int64_t(rewards.size()) % n == 0, "internal: %zu rewards in groups of %lld",
                rewards.size(), (long long)n);
  SHARDLM_CHECK(kind != "rloo" || n >= 2, "rollout.advantage = \"rloo\" needs groups of at least 2 samples, not %lld",
                (long long)n);
  auto mean_and_std = [](const double* r, size_t count) {
    double mean = 0, var = 0;
    for (size_t i = 0; i < count; ++i) mean += r[i];
    mean /= double(count);
    for (size_t i = 0; i < count; ++i) var += (r[i] - mean) * (r[i] - mean);
    return std::pair{mean, std::sqrt(var / double(count))};
  };
  const double batch_std = rewards.empty() ? 0.0 : mean_and_std(rewards.data(), rewards.size()).second;
  std::vector<float> adv(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += size_t(n)) {
    const auto [mean, std] = mean_and_std(rewards.data() + g, size_t(n));
    // rloo: r - (sum - r) / (n - 1) = n / (n - 1) (r - mean).
    const double scale = kind == "mean_std"    ? 1.0 / (std + 1e-6)
                         : kind == "batch_std" ? 1.0 / (batch_std + 1e-6)
                         : kind == "rloo"      ? double(n) / double(n - 1)
                                               : 1.0;
    for (int64_t i = 0; i < n; ++i) adv[g + size_t(i)] = float((rewards[g + size_t(i)] - mean) * scale);
  }
  return adv;
}

std::unique_ptr<Reward> make_reward(const std::string& kind, const RolloutSection& r) {
  if (kind == "exact") return std::make_unique<ExactReward>();
  if (kind == "numeric") return std::make_unique<NumericReward>();
  if (kind == "regex") return std::make_unique<RegexReward>(r.reward_regex);
  if (kind == "program") return std::make_unique<ProgramReward>(r.reward_program, r.reward_timeout_s);
  if (kind == "env") return std::make_unique<EnvReward>();
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
