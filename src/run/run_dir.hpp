// run_dir.hpp — what makes a run directory one run's: the lock, and the decks of every start.
//
// Owns: <run.dir>/run.lock (one run at a time per directory: held for the run,
// refused at once while a live run holds it, taken over with a message when its
// holder is gone), config.toml (the deck of the latest start) and
// config-step<N>.toml (the deck of the start at step N, one per start, kept),
// and the comparison of two resolved decks (what changed on a resume, which keys
// a deck sets). Knows nothing about MPI, checkpoints or the model: main.cpp takes
// the lock on trainer rank 0 and tells the other ranks.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/error.hpp"

namespace shardlm {

// EX_CANTCREAT (sysexits.h): another run holds run.dir. Not 75: a requeue loop must not retry it.
constexpr int kExitRunDirInUse = 73;

// A live run holds the directory; the message names its host, pid and start.
struct RunDirInUse : Error {
  using Error::Error;
};

// What run.lock says about the run that holds it (key=value lines).
struct LockHolder {
  std::string host, boot_id, started, run_name, deck, slurm_job;
  long pid = 0;
  long long proc_start = 0;       // /proc/<pid>/stat start time (clock ticks): tells a reused pid apart
};
LockHolder parse_lock_holder(const std::string& text);

// The lock of one run directory. Liveness, in order: flock() on the file (the
// kernel's answer on this host, and across hosts where the filesystem supports
// it); the holder's pid on this host (same boot, same process start time); the
// same Slurm job (a requeued job takes its own lock back on any node); a
// heartbeat (the holder touches the file every kHeartbeatS seconds; a lock from
// another host untouched for kStaleAfterS seconds is stale).
class RunDirLock {
 public:
  static constexpr int kHeartbeatS = 15;
  static constexpr int kStaleAfterS = 120;

  // Creates `dir` and takes <dir>/run.lock; throws RunDirInUse while a live run
  // holds it, Error when the directory or file cannot be made.
  RunDirLock(const std::filesystem::path& dir, const std::string& run_name, const std::string& deck);
  ~RunDirLock();  // stops the heartbeat, removes run.lock
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // "" or the sentence saying whose stale lock was taken over, and why it was stale.
  const std::string& takeover_note() const { return takeover_note_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::string takeover_note_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
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

// Keeps the resolved deck of a start at `step` as config-step<step>.toml (beside
// config.toml, which main.cpp writes before setup and each start replaces). When
// that file exists with other text (a start at the same step with another deck),
// config-step<step>-2.toml, -3, ... are used so no earlier deck is lost. Returns
// the name it wrote (or found with the same text).
std::string keep_start_deck(const std::filesystem::path& dir, int64_t step, const std::string& text);

}  // namespace shardlm
