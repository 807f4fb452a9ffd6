// checkpoint.hpp — HDF5 checkpoints: collective sharded save, verified load at
// any world size, the resume choice, retention, inspect/export, stop signals.
//
// Owns: the checkpoint file layout (docs/checkpoint.md), the per-dataset
// checksum that does not depend on the world size, the save protocol (all
// ranks write step_N.h5.tmp: metadata through parallel HDF5, raw data by
// collective MPI-IO across nodes or O_DIRECT pwrite on one node; close, fsync,
// rename, then update `latest`, then retention), the choice of the checkpoint to resume from
// (falling back past damaged ones), the SIGUSR1/SIGTERM stop flag and the exit
// codes the job scripts act on. Knows the TrainSession's state (parameter and
// optimizer shards, data position) and MPI; knows nothing about kernels,
// devices or the engine. Every rank of the trainer communicator calls the
// collective functions; any failure on any rank is agreed on, so all ranks
// return or throw together (never a hang).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "shardlm/config.hpp"
#include "shardlm/data.hpp"
#include "shardlm/error.hpp"
#include "shardlm/model_config.hpp"

namespace shardlm {

struct TrainSession;

constexpr int64_t kCheckpointFormat = 1;
// Exit codes of `shardlm train` (sysexits.h): the job scripts requeue on 75.
constexpr int kExitRequeue = 75;           // EX_TEMPFAIL: stopped by SIGUSR1/SIGTERM, checkpoint saved
constexpr int kExitCheckpointFailed = 74;  // EX_IOERR: a save failed and ckpt.on_error = "stop"

// A checkpoint that cannot be trusted: HDF5 could not read it, or a checksum
// does not match. resume() falls back to the previous checkpoint on this.
struct CheckpointDamaged : Error {
  using Error::Error;
};
// A sound checkpoint that does not fit this run (model shape, optimizer, data
// order): never skipped silently; the message lists every mismatch.
struct CheckpointMismatch : Error {
  using Error::Error;
};

// What a checkpoint says about itself (root and group attributes; no tensors).
struct CheckpointInfo {
  std::filesystem::path path;
  int64_t format = 0;
  int64_t step = 0;                 // optimizer steps completed = the 0-based step to continue with
  int64_t tokens_seen = 0;
  int64_t world_size_at_save = 0;
  std::string shardlm_version, saved_at, deck;
  ModelConfig arch;
  int64_t parameter_count = 0;
  int64_t tensors = 0;
  std::string optimizer;            // adamw | sgd
  std::vector<std::string> optimizer_states;  // exp_avg, exp_avg_sq | momentum_buffer | none
  int64_t optimizer_steps = 0;
  int64_t bad_steps_in_a_row = 0, bad_steps_total = 0;
  DataPosition data;
  uint64_t seed = 0;
};

// Reads the attributes of `file` (serial HDF5, any process). Throws
// CheckpointDamaged naming the file when HDF5 cannot read it.
CheckpointInfo read_checkpoint_info(const std::filesystem::path& file);

// <run.dir>/checkpoints and <dir>/step_<N>.h5.
std::filesystem::path checkpoint_dir(const Config& config);
std::filesystem::path checkpoint_path(const std::filesystem::path& dir, int64_t step);

// True when a checkpoint is due after `steps_done` steps: every ckpt.interval
// steps, and at the end of the run (steps_done == max_steps).
bool checkpoint_due(const CkptSection& ckpt, int64_t steps_done, int64_t max_steps);

struct SaveResult {
  bool ok = false;
  std::filesystem::path path;       // the finished file (or the one that failed)
  std::string error;                // why it failed (the same text on every rank)
  double seconds = 0;               // the time the training loop was blocked, of which:
  double checksum_s = 0;            //   directory preparation and checksums
  double write_s = 0;               //   HDF5 create, metadata, reservation, collective writes, close
  double sync_s = 0;                //   fsync of the file (one rank per node)
  int64_t bytes = 0;                // file size
};

// Collective over `trainers` (the communicator session.comm wraps). Saves the
// state after `steps_done` steps as <run.dir>/checkpoints/step_<steps_done>.h5:
// removes stale *.tmp, writes .tmp, closes, fsyncs, renames, updates `latest`,
// applies ckpt.keep_last / ckpt.keep_interval. On failure nothing older is
// touched, the .tmp is removed, rank 0 prints the reason and every rank gets
// ok = false; the caller decides (ckpt.on_error). Rank 0 prints one line.
SaveResult save_checkpoint(TrainSession& session, MPI_Comm trainers, int64_t steps_done, int64_t tokens_seen);

// Collective. Loads `file` into the session: every rank reads the intersection
// of its shards with each dataset (any world size), checksums are verified over
// all ranks, the data sampler and optimizer step count are restored. Throws
// CheckpointMismatch (all mismatches listed) before touching the session, or
// CheckpointDamaged (the session's state is then undefined: load another).
CheckpointInfo load_checkpoint(TrainSession& session, MPI_Comm trainers, const std::filesystem::path& file);

// Where training starts, per ckpt.resume: "none" -> step 0; a path -> that file
// (no fallback); "latest" -> the file `latest` names, then older ones in step
// order past damaged ones (each reported on rank 0 with its name and reason);
// no checkpoint at all -> step 0; all damaged -> Error listing them.
struct ResumePoint {
  std::filesystem::path path;       // empty: fresh start
  int64_t step = 0, tokens_seen = 0;
  std::vector<std::string> skipped; // "FILE: reason" for every damaged file passed over
};
ResumePoint resume(TrainSession& session, MPI_Comm trainers);

// SIGUSR1, SIGTERM and SIGINT set a flag; a second SIGINT ends the process at once
// (the handler only writes one line to stderr and sets the flag).
void install_stop_signal_handlers();
// Collective: true on every rank when any rank has seen a stop signal.
bool stop_requested(MPI_Comm trainers);
int stop_signal();                  // the signal seen (0 = none), for the log
void clear_stop_request();          // tests

// `shardlm inspect FILE`: rank 0 prints what the file holds and verifies every
// checksum; returns 0 when sound, 1 when damaged (same value on every rank).
int inspect_checkpoint(const std::filesystem::path& file, MPI_Comm comm, std::FILE* out);
// `shardlm export FILE --out DIR --dtype bf16|fp32`: rank 0 streams /model into
// DIR/config.json + DIR/model.safetensors (memory: one 64 MiB chunk), verifying
// checksums on the way; throws (on every rank) on a damaged file.
void export_checkpoint(const std::filesystem::path& file, const std::filesystem::path& out_dir,
                       const std::string& dtype, MPI_Comm comm);

// ---- pieces with no MPI, exposed for the unit tests -------------------------

// A flat element range [begin, begin + count) of a row-major array of `shape`
// as a union of boxes (start, count per dimension): at most 2 * rank - 1.
struct Box {
  std::vector<int64_t> start, count;
};
std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t count);

// Sum over i of mix(first_index + i, bits(values[i])) mod 2^64: partial sums of
// any partition of a dataset add up to the checksum of the whole.
uint64_t checksum_f32(const float* values, int64_t first_index, int64_t count);
uint64_t checksum_i64(const int64_t* values, int64_t first_index, int64_t count);

// Steps of the checkpoints retention deletes after saving `current`, given the
// steps present: the newest keep_last with step <= current are kept, every
// multiple of keep_interval (> 0) is kept, `current` is kept, and files with a
// larger step (another timeline, from before a resume from an older one) are
// left alone.
std::vector<int64_t> checkpoints_to_delete(const std::vector<int64_t>& present, int64_t current, int64_t keep_last,
                                           int64_t keep_interval);

// The files resume "latest" tries, in order: the one `latest` names, then the
// step files older than it, newest first; without a usable `latest`, every
// step file newest first (`note` then says why).
std::vector<std::filesystem::path> resume_candidates(const std::filesystem::path& dir, std::string* note = nullptr);

}  // namespace shardlm
