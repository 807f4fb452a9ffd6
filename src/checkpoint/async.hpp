// checkpoint/async.hpp — the Checkpointer: what the training loop asks at the
// end of every step, and checkpoints that do not stop training (ckpt.async).
//
// Owns: the decision at the end of a step (save when due or signalled, what a
// failed save means under ckpt.on_error, the exit code the job script acts on:
// step_end.cpp) and the saves themselves: with ckpt.async = true the snapshot
// of the state, the background writer thread and the completion of its file.
// The step that saves copies what it must keep
// (device-resident state: to the host mirror, pinned, at the link's speed;
// host state, CPU backend or optim_cpu_offload: into a bounded snapshot pool,
// staged in pieces when the pool is smaller than the state), creates the file
// and all its metadata (rank 0 alone, serial HDF5 with no sync; the others
// learn the offsets), and returns; the writer thread reserves the file's
// blocks (rank 0, fallocate), writes the raw data, checksums it and fsyncs; the end of a later step (poll) patches the
// checksums in, renames, updates `latest` and applies retention. Same file
// format and the same tmp + fsync + rename + `latest` protocol as the
// synchronous save, checksums included.
//
// Threads: the writer thread makes no MPI and no HDF5 calls. MPI is
// initialised MPI_THREAD_FUNNELED (runtime.cpp), parallel HDF5 is not
// thread-safe, and the training thread keeps using both (collectives every
// step, rollout files in RL), so the writer moves bytes with POSIX
// pwrite/O_DIRECT at the offsets HDF5 allocated (checkpoint/io.hpp's RawFile),
// each rank its own pieces; every HDF5 and MPI call of a save, the agreement
// on its outcome included, happens on the training thread. Across nodes this
// relies on the file system applying disjoint byte-range writes from several
// clients correctly (Lustre, GPFS, BeeGFS and the Linux NFS client do).
//
// At most one save is in flight: the next save, a stop signal and the end of
// the run wait for it. A failed background write is reported at the end of
// the step that notices it, with the same SaveResult (and ckpt.on_error) as a
// failed synchronous save. Knows the TrainSession's shards, the backend's
// pin_host and the stop signal; knows nothing about kernels, metrics or the
// reports (the loop prints those).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>

#include "checkpoint/checkpoint.hpp"
#include "shardlm/model.hpp"

namespace shardlm {

// ckpt.async, and a save is due some time: with ckpt.interval = 0 and
// ckpt.save_final = false only a stop signal saves, synchronously, and no
// snapshot memory is held for it.
bool saves_async(const Config& config);
// Host bytes per rank the async snapshot pool holds (the memory plan's
// "ckpt snapshot" row): 0 with ckpt.async = false or device-resident state
// (the host mirror is the snapshot); else the rank's state (parameters and
// optimizer state), bounded by ckpt.async_host_gib when that is > 0.
int64_t checkpoint_snapshot_bytes(const Config& config, const ModelLayout& layout);
// The least the pool can be: one unit's shard of one array with ckpt.async_host_gib
// = 0 (the pool then shrinks to the host's room at start-up), else the bound given.
int64_t checkpoint_snapshot_floor(const Config& config, const ModelLayout& layout);
// Bytes of state one rank checkpoints (fp32 parameters + optimizer state shards).
int64_t checkpoint_state_bytes(const Config& config, const ModelLayout& layout);

// What the loop does after a step, as the Checkpointer decides it.
struct StepEnd {
  bool stop = false;  // leave the loop now
  int exit_code = 0;  // with stop: kExitRequeue (a stop signal, the state saved),
                      // kExitCheckpointFailed (a save failed under ckpt.on_error = "stop") or
                      // kExitRunDirInUse (run.lock taken by another run: nothing saved)
};

// How the run ends once the last save is written (or failed): Checkpointer::finish.
struct RunEnd {
  bool stopped = false;            // the loop stopped early, or the last save failed under "stop":
                                   // no export, no end-of-run report
  bool final_save_failed = false;  // ckpt.on_error = "continue" trained on to run.max_steps, but the
                                   // save of the run's end failed: the report, then exit 74
  int exit_code = 0;               // what `shardlm train` returns: 0 | kExitRequeue | kExitCheckpointFailed |
                                   // kExitRunDirInUse
  const char* status() const;      // "done" | "stopped" | "checkpoint_failed" | "run_dir_lost"
};

class Checkpointer {
 public:
  // Collective over `trainers`. With ckpt.async and device-resident state,
  // pins the host mirror once (the backend's pin_host; a no-op on the CPU).
  Checkpointer(TrainSession& session, MPI_Comm trainers);
  ~Checkpointer();  // a save still in flight (an exception unwinds) is abandoned: its .tmp stays, unread
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective, once at the end of every step, `steps_done` steps done: the
  // loop's one question. Completes a background save that has finished (poll),
  // agrees on a stop signal, saves when one is due (ckpt.interval,
  // ckpt.save_final) or signalled, applies ckpt.on_error to any save that
  // failed, and after a signal waits for the save and says "stopped by signal".
  StepEnd after_step(int64_t steps_done, int64_t tokens_seen);
  // Collective, after the loop: waits for the save still in flight (at
  // run.max_steps, the final one) and says how the run ends.
  RunEnd finish();

  // The parts after_step uses, for callers that drive saves themselves (tests).
  // Collective. Saves the state after `steps_done` steps. Sync: the whole save
  // (save_checkpoint). Async: waits for a save in flight first (returning its
  // result through `previous`), then snapshot + metadata; the result is
  // ok = true, background = true, pending until poll() or wait() completes
  // it, or ok = false when this blocking part failed (nothing in flight then).
  SaveResult save(int64_t steps_done, int64_t tokens_seen, std::optional<SaveResult>* previous = nullptr);
  // Collective (after_step calls it first): when a background save has finished
  // on every rank, completes it and returns its result (printed on rank 0);
  // otherwise nothing. One all-reduce while a save is in flight, none otherwise.
  std::optional<SaveResult> poll();
  // Collective: waits for the save in flight (if any) and completes it.
  std::optional<SaveResult> wait();
  bool in_flight() const;

  struct Writer;  // the background write in flight (async.cpp)

 private:
  SaveResult start(int64_t steps_done, int64_t tokens_seen);
  SaveResult complete();  // the background save in flight, written: checksums, rename, `latest`
  void join_retention();
  StepEnd decide(int64_t steps_done, int64_t tokens_seen);
  bool stops_run(const std::optional<SaveResult>& result) const;  // failed, and ckpt.on_error = "stop"

  TrainSession& session_;
  MPI_Comm comm_;
  bool async_ = false;
  std::unique_ptr<Writer> writer_;
  struct Pool;                      // the snapshot pool (host state)
  std::unique_ptr<Pool> pool_;
  // Rank 0, async: the older files retention removes, after `latest` names the
  // new one. Unlinking a 14 GiB file took seconds on the H200 machine's disk.
  std::thread retention_;
  // What after_step decided last, for finish().
  int64_t steps_done_ = 0;
  StepEnd end_;
  bool final_save_failed_ = false;
  std::chrono::steady_clock::time_point last_save_start_ = std::chrono::steady_clock::now();
  bool warned_writer_behind_ = false;  // "saves come faster than the writer", said once  // the save at run.max_steps failed (finish() reports it under "continue")
};

}  // namespace shardlm
