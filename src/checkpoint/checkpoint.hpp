// checkpoint.hpp — HDF5 checkpoints: the collective sharded save, the verified
// load at any world size, the resume choice, inspect and export. What other
// files call; the pieces live in their own headers:
//   checkpoint/layout.hpp     the file layout: groups, datasets, attributes, names
//   checkpoint/io.hpp         how bytes move: MPI-IO or POSIX/O_DIRECT, durability
//   checkpoint/checksum.hpp   the world-size-independent per-dataset checksum
//   checkpoint/agree.hpp      every collective phase ends agreed by all ranks
//   checkpoint/retention.hpp  file names, retention, the order resume tries files
//   base/signals.hpp          SIGUSR1/SIGTERM stop flag and the exit codes
//
// Owns: the save protocol (all ranks write step_N.h5.tmp: metadata through
// parallel HDF5, raw data by collective MPI-IO across nodes or O_DIRECT pwrite
// on one node; close, fsync, rename, then update `latest`, then retention),
// the load with its mismatch report, the resume fallback past damaged files,
// inspect and export. Knows the TrainSession's state (parameter and optimizer
// shards, data position) and MPI; knows nothing about kernels, devices or the
// engine. Every rank of the trainer communicator calls the collective
// functions; any failure on any rank is agreed on, so all ranks return or
// throw together (never a hang).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/checksum.hpp"
#include "checkpoint/retention.hpp"
#include "base/signals.hpp"
#include "shardlm/config.hpp"
#include "data/data.hpp"
#include "shardlm/error.hpp"
#include "shardlm/model.hpp"
#include "shardlm/model_config.hpp"

namespace shardlm {

struct TrainSession;

// Format 2 adds `attributes_checksum` (root and group attributes); format 1
// files (without it) are still read.
constexpr int64_t kCheckpointFormat = 2;
constexpr int64_t kOldestReadableFormat = 1;

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

struct SaveResult {
  bool ok = false;
  bool background = false;          // written by the background writer (ckpt.async)
  std::filesystem::path path;       // the finished file (or the one that failed)
  std::string error;                // why it failed (the same text on every rank)
  double seconds = 0;               // the time the training loop was blocked by this save
  double checksum_s = 0;            // sync: directory preparation and checksums
  double write_s = 0;               // sync: HDF5 create, metadata, writes, close; async: the background
                                    //   writer's time (checksums, writes, fsync; slowest rank)
  double sync_s = 0;                // fsync of the file (one rank per node) before the rename
  double snapshot_s = 0, metadata_s = 0, finish_s = 0;  // async: the blocked parts
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

// `shardlm inspect FILE`: rank 0 prints what the file holds, checks that every
// dataset its own layout requires is there (and nothing else), verifies every
// checksum and the attributes' checksum; returns 0 when sound, 1 when damaged,
// 2 when there is no such file (same value on every rank).
int inspect_checkpoint(const std::filesystem::path& file, MPI_Comm comm, std::FILE* out);
// Streams /model of checkpoint `file` (a step_N.h5 or a run dir; serial HDF5,
// one process, no MPI) in chunks of at most 64 MiB: sink(param, first element,
// count, values) for every parameter of the checkpoint's own layout, in layout
// order; each parameter's checksum is verified after its last chunk (the sink
// has then already seen it: a caller keeps nothing on a throw). Throws
// CheckpointDamaged naming the file and dataset. Export and the inference
// model (src/infer/) read weights through it.
using ModelChunkSink = std::function<void(const ParamInfo&, int64_t, int64_t, const float*)>;
CheckpointInfo read_checkpoint_model(const std::filesystem::path& file, const ModelChunkSink& sink);
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

}  // namespace shardlm
