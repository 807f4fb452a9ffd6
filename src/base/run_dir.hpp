// run_dir.hpp — what makes a run directory one run's: the lock, and the decks of every start.
//
// Owns: <run.dir>/run.lock (one run at a time per directory: held for the run,
// refused at once while a live run holds it, taken over with a message only when
// its holder is provably gone, watched by the heartbeat for another holder),
// config.toml (the deck of the latest start) and
// config-step<N>.toml (the deck of the start at step N, one per start, kept),
// and the comparison of two resolved decks (what changed on a resume, which keys
// a deck sets). Knows nothing about MPI, checkpoints or the model: main.cpp takes
// the lock on trainer rank 0 and tells the other ranks.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/error.hpp"

namespace shardlm {

// EX_CANTCREAT (sysexits.h): another run holds run.dir, at the start or (the
// heartbeat found its lock taken) during the run. Not 75: a requeue loop must not retry it.
constexpr int kExitRunDirInUse = 73;

// A live run holds the directory; the message names its host, pid and start.
struct RunDirInUse : Error {
  using Error::Error;
};

// What run.lock says about the run that holds it (key=value lines).
struct LockHolder {
  std::string host, boot_id, started, run_name, deck, slurm_job;
  std::string token;              // host:pid:proc_start:random, unique to one holder ("" in older locks)
  long pid = 0;
  long long proc_start = 0;       // /proc/<pid>/stat start time (clock ticks): tells a reused pid apart
};
LockHolder parse_lock_holder(const std::string& text);

// The lock of one run directory. A lock is taken over only when its holder is
// provably gone: flock() on the file (the kernel's answer on this host, and
// across hosts where the filesystem supports it); on this host, the holder's
// pid (same boot, same process start time); from another host, the heartbeat
// alone (the holder touches the file every kHeartbeatS seconds; one untouched
// for kStaleAfterS seconds is stale). The same Slurm job and step ids prove
// nothing (two srun steps, or a requeue racing its old allocation, share them):
// a requeued job on a new node finding such a lock waits for the heartbeat to
// go stale (at most kStaleAfterS + kHeartbeatS) and takes it, or is refused.
//
// The holder writes a token of its own (host, pid, process start, random); the
// heartbeat checks every beat that the file still carries it, and the
// destructor removes the file only then. When the file names another holder
// (a run on another host took it over while this one's heartbeat was held up,
// or someone wrote it), the heartbeat stops touching it and calls on_lost with
// that holder's description, once, from its thread; the file is left alone.
class RunDirLock {
 public:
  static constexpr int kHeartbeatS = 15;
  static constexpr int kStaleAfterS = 120;

  // Creates `dir` and takes <dir>/run.lock; throws RunDirInUse while a live run
  // holds it, Error when the directory or file cannot be made. The heartbeat's
  // period is kHeartbeatS, or SHARDLM_RUN_LOCK_HEARTBEAT_MS where set (tests).
  RunDirLock(const std::filesystem::path& dir, const std::string& run_name, const std::string& deck);
  ~RunDirLock();  // stops the heartbeat, removes run.lock if it still carries this holder's token
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::string& token() const { return token_; }
  // "" or the sentence saying whose stale lock was taken over, and why it was stale.
  const std::string& takeover_note() const { return takeover_note_; }
  // Called once, on the heartbeat thread, when run.lock names another holder;
  // the argument describes it ("pid 4242 on host n7, started ..."). Set it
  // right after construction; it must be safe to call from another thread.
  void on_lost(std::function<void(const std::string& holder)> callback);
  // The description of the holder that took the lock; "" while it is ours.
  std::string lost_to() const;

 private:
  void beat();  // one heartbeat: check the token, touch the file (with mutex_ held)

  std::filesystem::path path_;
  int fd_ = -1;
  std::string token_;
  std::string text_;  // what this holder wrote in run.lock
  std::string takeover_note_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::string lost_to_;
  std::function<void(const std::string&)> on_lost_;
  std::thread heartbeat_;
};

// One key whose value differs between two resolved decks ("" = absent in that deck).
struct DeckChange {
  std::string key, before, after;
};
// Every key of `before` and `after` (TOML texts, as resolved_deck() writes them)
// whose value differs, in `after`'s order; keys in only one of them too. Throws
// Error when a text does not parse (the name says which).
std::vector<DeckChange> deck_changes(const std::string& before, const std::string& after,
                                     const std::string& before_name = "the earlier deck");

// Writes `text` to <dir>/<name> as <name>.tmp, then renames it: a full disk
// leaves the old file, never a short one. Throws Error naming the file and why.
void write_file_atomically(const std::filesystem::path& dir, const std::string& name, const std::string& text);

// Rewrites the JSON-lines file `path` (metrics.jsonl, rollouts.jsonl) with only
// the rows whose integer "step" is below `end_step`: the rows of a timeline a
// resume abandons go, as do torn lines from a crash (atomically, and only when
// something goes). Returns how many lines went; a missing file is 0.
int64_t keep_jsonl_rows_before(const std::filesystem::path& path, int64_t end_step);

// Keeps the resolved deck of a start at `step` as config-step<step>.toml (beside
// config.toml, which main.cpp writes before setup and each start replaces). When
// that file exists with other text (a start at the same step with another deck),
// config-step<step>-2.toml, -3, ... are used so no earlier deck is lost. Returns
// the name it wrote (or found with the same text).
std::string keep_start_deck(const std::filesystem::path& dir, int64_t step, const std::string& text);

}  // namespace shardlm
