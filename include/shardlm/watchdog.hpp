// watchdog.hpp — no wait in a shardlm job lasts forever: comm.timeout_s bounds
// every operation that can hang.
//
// One clock, two ways to be watched. The MPI Comm's collectives watch
// themselves (comm/mpi.cpp): a rank waiting past the bound asks the others
// where they are and ends the job naming the ranks that never arrived.
// Everything else that can block — a checkpoint write or fsync, HDF5's
// collective calls, the wait for the background writer, the export's fsync —
// runs inside an Activity: a named scope whose clock restarts whenever its
// work advances. A monitor thread ends the job when any thread's innermost
// Activity has made no progress for comm.timeout_s, with one line naming the
// rank, its host and the activity. On the main thread an Activity that makes
// progress also answers the other ranks' "where are you?" as busy in it, so a
// rank waiting in a collective for a peer that is still working (rank 0
// syncing a 140 GB export) keeps waiting, and one waiting for a peer that is
// stuck ends when the peer's monitor (or its own collective clock) fires.
//
// The job's exit code after a hang: 75 (requeue) when a stop signal is
// pending — the allocation was ending anyway, and `latest` still names the
// last complete checkpoint, since files become visible only after they are
// durable — else 1.
//
// Knows MPI only through comm.hpp's query answering and fatal(); knows
// nothing about checkpoints, files or the model.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace shardlm {

// Starts the monitor thread (once per process, from the main thread, which is
// the one MPI calls come from): comm.timeout_s, 0 = activities are not watched.
void start_watchdog(double timeout_s);
double watchdog_timeout_s();

class Activity {
 public:
  // Becomes this thread's innermost activity; the clock starts now. `what` says
  // what this thread is doing, for the message ("checkpoint: writing step 10 to ...").
  explicit Activity(std::string what);
  ~Activity();
  Activity(const Activity&) = delete;
  Activity& operator=(const Activity&) = delete;

  // The work advanced: the clock restarts. On the main thread, also answers
  // the other ranks' queries (busy in this activity).
  void progress();
  // Progress made elsewhere (a counter another thread advances): restarts the
  // clock when `counter` moved since the last call; answers queries either way.
  void follow(const std::atomic<int64_t>& counter);
  const std::string& what() const { return what_; }

  struct Slot;  // the monitor's view (watchdog.cpp)

 private:
  std::string what_;
  Slot* slot_;
  int64_t followed_ = -1;
};

// Waits until done() holds, inside `activity`, following `counter` (the
// progress of the thread being waited for), polling every millisecond or so.
void wait_following(Activity& activity, const std::function<bool()>& done, const std::atomic<int64_t>& counter);

// While a thread waits in a watched collective (comm/mpi.cpp), its
// activities' clocks pause: the collective's own clock bounds that wait, and it
// knows to ask the other ranks where they are before it ends the job.
class InCollective {
 public:
  InCollective();
  ~InCollective();
  InCollective(const InCollective&) = delete;
  InCollective& operator=(const InCollective&) = delete;

 private:
  Activity::Slot* slot_ = nullptr;
};

// Restarts the clock of this thread's innermost activity, if any (I/O code
// deep below the Activity that names it: a write loop, fsync_in_pieces).
void note_progress();

// fsync(fd) with progress: the file's dirty pages are written back in 64 MiB
// pieces (sync_file_range), each noted, then fsync makes it all durable. A
// healthy 140 GB sync on slow storage keeps its Activity alive; a hung one
// does not. Returns fsync's result (0, or -1 with errno).
int fsync_in_pieces(int fd);

// 75 with a stop signal pending, else 1: the exit code of a job the watchdog
// (or a collective's clock) ends.
int hang_exit_code();

}  // namespace shardlm
