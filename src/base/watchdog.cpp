// watchdog.cpp — activities and the monitor thread that bounds them (shardlm/watchdog.hpp).
#include "shardlm/watchdog.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <list>
#include <mutex>
#include <thread>

#include "base/signals.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/error.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {

namespace {

using Clock = std::chrono::steady_clock;
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

}  // namespace

// One live activity as the monitor sees it. `covered` while an inner activity
// of the same thread runs: only the innermost one's clock counts.
struct Activity::Slot {
  std::string what;
  std::atomic<int64_t> last_progress_ns{0};
  Slot* outer = nullptr;
  bool covered = false;  // under the registry's mutex
  bool watched = true;   // false: a collective's wait (InCollective), bounded by its own clock
};

namespace {

struct Registry {
  std::mutex m;
  std::list<Activity::Slot> slots;  // stable addresses
  double timeout_s = 0;
  std::thread::id main_thread;
  std::thread monitor;
  std::condition_variable cv;
  bool stopping = false;

  ~Registry() {
    {
      std::lock_guard<std::mutex> lock(m);
      stopping = true;
    }
    cv.notify_all();
    if (monitor.joinable()) monitor.join();
  }

  // Every 100 ms (or a tenth of the bound): the innermost activity of each
  // thread that has not moved for the whole bound ends the job.
  void watch() {
    std::unique_lock<std::mutex> lock(m);
    const auto period = std::chrono::milliseconds(std::clamp<int64_t>(int64_t(timeout_s * 100), 10, 100));
    while (!cv.wait_for(lock, period, [&] { return stopping; })) {
      const int64_t now = now_ns();
      for (const auto& slot : slots) {
        if (slot.covered || !slot.watched) continue;
        const double idle_s = 1e-9 * double(now - slot.last_progress_ns.load());
        if (idle_s <= timeout_s) continue;
        const int code = hang_exit_code();
        const std::string message =
            fmt("%s has made no progress for %.1f s (comm.timeout_s = %g): stuck in I/O or waiting for a rank that "
                "is; ending the job%s",
                slot.what.c_str(), idle_s, timeout_s,
                code == kExitRequeue ? " with exit 75 (a stop signal is pending; `latest` names the last complete "
                                       "checkpoint)"
                                     : "");
        lock.unlock();
        fatal(message, code);  // MPI_Abort from this thread: the job ends; nothing here returns
      }
    }
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

thread_local Activity::Slot* t_innermost = nullptr;

}  // namespace

void start_watchdog(double timeout_s) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  r.main_thread = std::this_thread::get_id();
  r.timeout_s = timeout_s > 0 ? timeout_s : 0;
  if (r.timeout_s > 0 && !r.monitor.joinable()) r.monitor = std::thread([&r] { r.watch(); });
}

double watchdog_timeout_s() { return registry().timeout_s; }

int hang_exit_code() { return stop_signal() != 0 ? kExitRequeue : 1; }

namespace {

// This thread's new innermost slot.
Activity::Slot* push_slot(const std::string& what, bool watched) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  Activity::Slot& slot = r.slots.emplace_back();
  slot.what = what;
  slot.watched = watched;
  slot.last_progress_ns.store(now_ns());
  slot.outer = t_innermost;
  if (slot.outer) slot.outer->covered = true;
  t_innermost = &slot;
  return &slot;
}

void pop_slot(Activity::Slot* slot) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  t_innermost = slot->outer;
  if (slot->outer) {
    slot->outer->covered = false;
    slot->outer->last_progress_ns.store(now_ns());  // the inner work was the outer's progress
  }
  r.slots.remove_if([slot](const Activity::Slot& s) { return &s == slot; });
}

}  // namespace

Activity::Activity(std::string what) : what_(std::move(what)), slot_(push_slot(what_, true)) {}
Activity::~Activity() { pop_slot(slot_); }

// Only under an activity: the hot loop's collectives outside any cost nothing here.
InCollective::InCollective() : slot_(t_innermost ? push_slot("a collective", false) : nullptr) {}
InCollective::~InCollective() {
  if (slot_) pop_slot(slot_);
}

void Activity::progress() {
  slot_->last_progress_ns.store(now_ns());
  if (std::this_thread::get_id() == registry().main_thread) answer_collective_queries(what_.c_str());
}

void Activity::follow(const std::atomic<int64_t>& counter) {
  const int64_t seen = counter.load();
  if (seen != followed_) {
    followed_ = seen;
    slot_->last_progress_ns.store(now_ns());
  }
  if (std::this_thread::get_id() == registry().main_thread) answer_collective_queries(what_.c_str());
}

void note_progress() {
  if (t_innermost) t_innermost->last_progress_ns.store(now_ns());
  if (std::this_thread::get_id() == registry().main_thread && t_innermost)
    answer_collective_queries(t_innermost->what.c_str());
}

int fsync_in_pieces(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    constexpr off64_t kPiece = off64_t(64) << 20;
    for (off64_t at = 0; at < st.st_size; at += kPiece) {
      // Not every file system has it (some network ones): fsync alone then.
      if (::sync_file_range(fd, at, kPiece,
                            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0)
        break;
      note_progress();
    }
  }
  return ::fsync(fd);
}

void wait_following(Activity& activity, const std::function<bool()>& done, const std::atomic<int64_t>& counter) {
  while (!done()) {
    activity.follow(counter);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace shardlm
