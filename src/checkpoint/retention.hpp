// retention.hpp — which checkpoint files exist, which to keep, and
// which one a resume tries first.
//
// Owns: the step_<N>.h5 naming of a checkpoint directory, the retention rule
// (ckpt.keep_last, ckpt.keep_interval), the order resume "latest" tries files
// in (the `latest` pointer, then older step files) and when a save is due.
// Pure file-name and number logic: knows nothing about HDF5, MPI, the file's
// contents or the training state (loading a candidate is checkpoint/load.cpp's).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "shardlm/config.hpp"

namespace shardlm {

// <run.dir>/checkpoints and <dir>/step_<N>.h5.
std::filesystem::path checkpoint_dir(const Config& config);
std::filesystem::path checkpoint_path(const std::filesystem::path& dir, int64_t step);
// step_<N>.h5 -> N, or -1 for any other name.
int64_t checkpoint_step_of(const std::string& file_name);
// The step files of `dir` by step.
std::map<int64_t, std::filesystem::path> checkpoint_step_files(const std::filesystem::path& dir);

// True when a checkpoint is due after `steps_done` steps: every ckpt.interval
// steps, and at the end of the run (steps_done == max_steps).
bool checkpoint_due(const CkptSection& ckpt, int64_t steps_done, int64_t max_steps);

// Steps of the checkpoints retention deletes after saving `current`, given the
// steps present: the newest keep_last with step <= current are kept, every
// multiple of keep_interval (> 0) is kept, `current` is kept, and files with a
// larger step (another timeline, from before a resume from an older one) are
// left alone.
std::vector<int64_t> checkpoints_to_delete(const std::vector<int64_t>& present, int64_t current, int64_t keep_last,
                                           int64_t keep_interval);
// Deletes (from `dir`) what checkpoints_to_delete names; a file that cannot be
// removed is a warning on stderr, never an error. One process calls it.
void apply_retention(const std::filesystem::path& dir, int64_t current, const CkptSection& ckpt);

// The files resume "latest" tries, in order: the one `latest` names, then the
// step files older than it, newest first; without a usable `latest`, every
// step file newest first (`note` then says why).
std::vector<std::filesystem::path> resume_candidates(const std::filesystem::path& dir, std::string* note = nullptr);

}  // namespace shardlm
