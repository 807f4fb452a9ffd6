// run_dir.cpp — run.lock, the decks of every start, deck comparison.
#include "base/run_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

namespace shardlm {
namespace fs = std::filesystem;

namespace {

std::string this_host() {
  char name[256] = {0};
  if (gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

std::string first_line_of(const char* file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string boot_id() { return first_line_of("/proc/sys/kernel/random/boot_id"); }

// Field `n` (3 = state, 22 = start time after boot in clock ticks) of
// /proc/<pid>/stat; "" when unreadable.
std::string stat_field(long pid, int n) {
  const std::string stat = first_line_of(fmt("/proc/%ld/stat", pid).c_str());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return "";
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  for (int i = 3; i <= n && fields >> field; ++i)
    if (i == n) return field;
  return "";
}
long long process_start(long pid) { return std::atoll(stat_field(pid, 22).c_str()); }

std::string utc_text(std::time_t t) {
  std::tm tm{};
  gmtime_r(&t, &tm);
  char text[64];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return text;
}

std::string slurm_step() {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job || !*job) return "";
  const char* step = std::getenv("SLURM_STEP_ID");
  return std::string(job) + "." + (step && *step ? step : "batch");
}

std::string read_all(int fd) {
  std::string text;
  char buffer[4096];
  for (off_t at = 0;;) {
    const ssize_t n = pread(fd, buffer, sizeof buffer, at);
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
    at += n;
  }
  return text;
}

// host:pid:process start:64 random bits: no two holders write the same one.
std::string new_token() {
  std::random_device random;
  const unsigned long long bits = (static_cast<unsigned long long>(random()) << 32) ^ random();
  return fmt("%s:%ld:%lld:%016llx", this_host().c_str(), (long)getpid(), process_start(getpid()), bits);
}

std::chrono::milliseconds heartbeat_period() {
  const char* ms = std::getenv("SHARDLM_RUN_LOCK_HEARTBEAT_MS");  // tests: a lost lock noticed in a second
  if (ms && std::atoll(ms) > 0) return std::chrono::milliseconds(std::atoll(ms));
  return std::chrono::seconds(RunDirLock::kHeartbeatS);
}

bool blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

std::string describe(const LockHolder& h) {
  std::string text = fmt("pid %ld on host %s, started %s", h.pid, h.host.c_str(), h.started.c_str());
  if (!h.run_name.empty() || !h.deck.empty())
    text += fmt(" (run '%s', deck %s)", h.run_name.c_str(), h.deck.c_str());
  if (!h.slurm_job.empty()) text += ", Slurm job step " + h.slurm_job;
  return text;
}

// "" while the holder may still run; else why its lock is stale. `flocked`:
// this process got the file's flock, which a live holder on this host keeps
// for its whole run; without flocks (some parallel filesystems) the process
// itself is asked. `touched` is the file's mtime, the holder's last heartbeat.
std::string stale_reason(const LockHolder& h, std::time_t touched, bool flocked) {
  const std::string me = this_host();
  if (h.host == me) {
    const std::string boot = boot_id();
    if (!h.boot_id.empty() && !boot.empty() && h.boot_id != boot) return "the host has rebooted since";
    const bool exists = h.pid > 0 && (kill(static_cast<pid_t>(h.pid), 0) == 0 || errno == EPERM);
    if (!exists) return "that process is no longer running";
    if (stat_field(h.pid, 3) == "Z") return "that process has exited (a zombie no one has reaped)";
    const long long start = process_start(h.pid);
    if (h.proc_start != 0 && start != 0 && start != h.proc_start) return "that pid now belongs to another process";
    if (flocked) return "no process holds its flock any more";
    return "";
  }
  // Another host: its processes cannot be asked, only the heartbeat tells. The
  // same Slurm job and step ids prove nothing: a requeued job can start on a new
  // node while the old allocation still runs, and both carry the same ids.
  const long long age = static_cast<long long>(std::time(nullptr) - touched);
  if (age > RunDirLock::kStaleAfterS)
    return fmt("its holder on another host has not touched it for %lld s (a live run touches it every %d s)", age,
               RunDirLock::kHeartbeatS);
  return "";
}

}  // namespace

LockHolder parse_lock_holder(const std::string& text) {
  LockHolder h;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "host") h.host = value;
    else if (key == "pid") h.pid = std::atol(value.c_str());
    else if (key == "proc_start") h.proc_start = std::atoll(value.c_str());
    else if (key == "boot_id") h.boot_id = value;
    else if (key == "started") h.started = value;
    else if (key == "run_name") h.run_name = value;
    else if (key == "deck") h.deck = value;
    else if (key == "slurm_job_step") h.slurm_job = value;
    else if (key == "token") h.token = value;
  }
  return h;
}

RunDirLock::RunDirLock(const fs::path& dir, const std::string& run_name, const std::string& deck) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  SHARDLM_CHECK(!ec, "cannot create run.dir '%s': %s", dir.c_str(), ec.message().c_str());
  path_ = dir / "run.lock";
  const char* wait_s = std::getenv("SHARDLM_RUN_LOCK_WAIT_S");  // tests: a shorter wait for a lock with our Slurm ids
  const int own_ids_wait_s = wait_s && *wait_s ? std::atoi(wait_s) : kStaleAfterS + kHeartbeatS;
  const auto wait_until = std::chrono::steady_clock::now() + std::chrono::seconds(own_ids_wait_s);
  bool said_waiting = false;
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    SHARDLM_CHECK(fd >= 0, "cannot open %s: %s", path_.c_str(), std::strerror(errno));
    // EWOULDBLOCK: a process on this host (or, where the filesystem shares flocks,
    // on any host) holds it. Other errors: no flock on this filesystem; the file's
    // text decides alone.
    const bool flocked = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    const int flock_errno = errno;
    const std::string text = read_all(fd);
    if (!flocked && flock_errno == EWOULDBLOCK) {
      ::close(fd);
      throw RunDirInUse(fmt("run.dir %s is in use: %s is held by %s. Give this run its own run.dir "
                            "(--set run.dir=...), or wait for that run to end",
                            dir.c_str(), path_.c_str(), describe(parse_lock_holder(text)).c_str()));
    }
    // The holder before us may have removed the file between our open and flock:
    // then we hold a lock on a deleted file; open the path again.
    struct stat by_fd {}, by_path {};
    if (fstat(fd, &by_fd) != 0 || stat(path_.c_str(), &by_path) != 0 || by_fd.st_ino != by_path.st_ino ||
        by_fd.st_dev != by_path.st_dev) {
      ::close(fd);
      SHARDLM_CHECK(attempt < 10, "cannot take %s: it keeps being replaced by another process", path_.c_str());
      continue;
    }
    if (!blank(text)) {
      const LockHolder holder = parse_lock_holder(text);
      const std::string why = stale_reason(holder, by_fd.st_mtime, flocked);
      // This Slurm job step's ids from another host: most likely this job before
      // a requeue, killed with its node, but possibly a start still running
      // there. Only the heartbeat can tell: wait until the lock is stale, or has
      // been touched for longer than a stale one could be (then refused).
      const bool own_ids_elsewhere =
          !holder.slurm_job.empty() && holder.slurm_job == slurm_step() && holder.host != this_host();
      if (why.empty() && own_ids_elsewhere && std::chrono::steady_clock::now() < wait_until) {
        if (!std::exchange(said_waiting, true)) {
          std::printf("run dir: %s is held by %s, with this Slurm job step's ids, on another host: waiting up to "
                      "%d s for its heartbeat to go stale (a live run there keeps it; then this start is refused)\n",
                      path_.c_str(), describe(holder).c_str(), own_ids_wait_s);
          std::fflush(stdout);
        }
        ::close(fd);
        std::this_thread::sleep_for(std::chrono::seconds(1));
        --attempt;  // not a replaced file
        continue;
      }
      if (why.empty()) {
        ::close(fd);
        const bool here = holder.host == this_host();
        throw RunDirInUse(fmt("run.dir %s is in use: %s is held by %s%s. Give this run its own run.dir "
                              "(--set run.dir=...), or wait for that run to end%s",
                              dir.c_str(), path_.c_str(), describe(holder).c_str(),
                              here ? "" : fmt("; touched %lld s ago", (long long)(std::time(nullptr) - by_fd.st_mtime)).c_str(),
                              here ? "" : fmt(" (a lock from another host untouched for %d s is taken over)",
                                              kStaleAfterS).c_str()));
      }
      takeover_note_ = fmt("took over %s, left by %s: %s", path_.c_str(), describe(holder).c_str(), why.c_str());
    }
    token_ = new_token();
    const std::string mine = fmt("host=%s\npid=%ld\nproc_start=%lld\nboot_id=%s\nstarted=%s\nrun_name=%s\ndeck=%s\n"
                                 "slurm_job_step=%s\ntoken=%s\n",
                                 this_host().c_str(), (long)getpid(), process_start(getpid()), boot_id().c_str(),
                                 utc_text(std::time(nullptr)).c_str(), run_name.c_str(), deck.c_str(),
                                 slurm_step().c_str(), token_.c_str());
    text_ = mine;
    const bool written = ftruncate(fd, 0) == 0 && pwrite(fd, mine.data(), mine.size(), 0) == ssize_t(mine.size()) &&
                         fsync(fd) == 0;
    if (!written) {
      const int e = errno;
      ::close(fd);
      SHARDLM_FAIL("cannot write %s: %s", path_.c_str(), std::strerror(e));
    }
    fd_ = fd;
    break;
  }
  // The heartbeat lets a run on another host tell a live lock from one whose
  // holder died, and tells this run when its lock has been taken.
  const std::chrono::milliseconds period = heartbeat_period();
  heartbeat_ = std::thread([this, period] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, period, [this] { return stopping_; })) {
      beat();
      if (lost_to_.empty()) continue;
      const auto callback = on_lost_;
      const std::string holder = lost_to_;
      lock.unlock();  // the callback may ask lost_to()
      if (callback) callback(holder);
      return;  // the file is another run's now: never touched again
    }
  });
}

void RunDirLock::beat() {
  std::string text;
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    text = read_all(fd);
    ::close(fd);
  } else if (errno == ENOENT) {
    // Removed under a live run (by hand, or by an older shardlm's exit): put it
    // back, flocked, so that the directory stays this run's.
    const int again = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (again < 0) return;  // someone else made it first: the next beat reads theirs
    if (::flock(again, LOCK_EX | LOCK_NB) != 0 ||
        pwrite(again, text_.data(), text_.size(), 0) != ssize_t(text_.size())) {
      ::close(again);
      return;
    }
    fsync(again);
    ::close(fd_);
    fd_ = again;
    std::fprintf(stderr, "shardlm: %s was removed while this run held it; written again\n", path_.c_str());
    return;
  } else {
    return;  // unreadable for now (a filesystem hiccup): ask again at the next beat
  }
  if (blank(text)) return;  // a run taking it over is writing it: decided at the next beat
  const LockHolder holder = parse_lock_holder(text);
  if (holder.token != token_) {
    lost_to_ = describe(holder);
    return;
  }
  futimens(fd_, nullptr);
}

void RunDirLock::on_lost(std::function<void(const std::string&)> callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_lost_ = std::move(callback);
}

std::string RunDirLock::lost_to() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lost_to_;
}

RunDirLock::~RunDirLock() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  // Remove the file only while it still carries this holder's token: never a
  // lock another run has taken over (in place, or as a new file).
  std::string text;
  if (const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC); fd >= 0) {
    text = read_all(fd);
    ::close(fd);
  }
  if (!text.empty() && parse_lock_holder(text).token == token_) ::unlink(path_.c_str());
  ::close(fd_);
}

// ---------------------------------------------------------------- decks

namespace {

struct DeckEntry {
  std::string value;
  uint32_t line = 0;
};

// The shortest text that reads back as `v` (0.1, not 0.10000000000000001).
std::string shortest(double v) {
  std::string out;
  for (int digits = 6; digits <= 17; ++digits) {
    out = fmt("%.*g", digits, v);
    if (std::strtod(out.c_str(), nullptr) == v) break;
  }
  return out;
}

std::map<std::string, DeckEntry> flatten(const std::string& text, const std::string& name) {
  toml::table root;
  try {
    root = toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    SHARDLM_FAIL("%s does not parse as TOML (line %u): %s", name.c_str(), e.source().begin.line,
                 std::string(e.description()).c_str());
  }
  std::map<std::string, DeckEntry> out;
  for (auto&& [section, node] : root) {
    const toml::table* table = node.as_table();
    if (!table) continue;
    for (auto&& [key, value] : *table) {
      std::ostringstream shown;
      if (auto s = value.as_string()) shown << '"' << s->get() << '"';
      else if (auto f = value.as_floating_point()) shown << shortest(f->get());
      else value.visit([&](auto&& v) { shown << v; });
      out[std::string(section.str()) + "." + std::string(key.str())] = {shown.str(), key.source().begin.line};
    }
  }
  return out;
}

}  // namespace

std::vector<DeckChange> deck_changes(const std::string& before, const std::string& after,
                                     const std::string& before_name) {
  const auto old_keys = flatten(before, before_name), new_keys = flatten(after, "this run's deck");
  std::vector<std::pair<uint32_t, DeckChange>> found;
  for (const auto& [key, entry] : new_keys) {
    const auto it = old_keys.find(key);
    if (it == old_keys.end() || it->second.value != entry.value)
      found.push_back({entry.line, {key, it == old_keys.end() ? "" : it->second.value, entry.value}});
  }
  for (const auto& [key, entry] : old_keys)
    if (!new_keys.count(key)) found.push_back({UINT32_MAX, {key, entry.value, ""}});
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<DeckChange> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

int64_t keep_jsonl_rows_before(const fs::path& path, int64_t end_step) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return 0;
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    bool keep = false;
    try {
      const auto row = nlohmann::json::parse(line);
      keep = row.is_object() && row.contains("step") && row["step"].is_number_integer() &&
             row["step"].get<int64_t>() < end_step;
    } catch (const nlohmann::json::exception&) {
    }
    if (keep) kept += line + "\n";
    else ++dropped;
  }
  SHARDLM_CHECK(!in.bad(), "cannot read %s: %s", path.c_str(), std::strerror(errno));
  if (dropped > 0) write_file_atomically(path.parent_path(), path.filename().string(), kept);
  return dropped;
}

void write_file_atomically(const fs::path& dir, const std::string& name, const std::string& text) {
  const fs::path file = dir / name, tmp = dir / (name + ".tmp");
  std::FILE* out = std::fopen(tmp.c_str(), "w");
  SHARDLM_CHECK(out, "cannot write %s: %s", file.c_str(), std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), out) == text.size() && std::fflush(out) == 0 &&
                  fsync(fileno(out)) == 0;
  const int write_errno = errno;
  const bool closed = std::fclose(out) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    SHARDLM_FAIL("cannot write %s: %s", file.c_str(), std::strerror(ok ? errno : write_errno));
  }
  if (std::rename(tmp.c_str(), file.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    SHARDLM_FAIL("cannot rename %s to %s: %s", tmp.c_str(), file.c_str(), std::strerror(e));
  }
}

std::string keep_start_deck(const fs::path& dir, int64_t step, const std::string& text) {
  for (int copy = 1;; ++copy) {
    const std::string name = fmt("config-step%lld%s.toml", (long long)step, copy == 1 ? "" : fmt("-%d", copy).c_str());
    std::ifstream in(dir / name, std::ios::binary);
    if (!in) {
      write_file_atomically(dir, name, text);
      return name;
    }
    std::ostringstream existing;
    existing << in.rdbuf();
    if (existing.str() == text) return name;
  }
}

}  // namespace shardlm
