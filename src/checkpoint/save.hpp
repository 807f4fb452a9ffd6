// save.hpp — the steps of the save protocol that the synchronous
// save (save.cpp) and the background one (async.cpp)
// share, so both produce the same file the same way.
//
// Owns: directory preparation (stale .tmp removal, the free-space check), the
// test fault hooks, making a finished .tmp visible (fsync, rename, `latest`,
// retention) and the one log line per save. Knows the retention rules and the
// checkpoint/io.hpp durability helpers; knows nothing about where the bytes came
// from (live shards or a snapshot) or about threads.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "checkpoint/checkpoint.hpp"

namespace shardlm::ckpt {

// SHARDLM_CKPT_FAULT="<what>[:<step>]@<rank>": rank <rank> of the trainers, while
// writing step <step>'s checkpoint (any step when absent), after the first
// tensor: write = an I/O error (ENOSPC), kill = SIGKILL itself, stall = sleep
// until killed, slow = 300 ms (SHARDLM_CKPT_SLOW_MS) more per tensor (stretches
// a background write so a test can kill it or watch training go on). The fault tests use it to stop
// a save half-way, deterministically. `tensor` is the tensor just written.
// The environment is read when a save starts (save_fault_spec, on the training
// thread: getenv is not safe against a concurrent setenv), so the background
// writer is given the spec.
struct SaveFault {
  std::string what, spec;  // "" = none
  int slow_ms = 300;
};
SaveFault save_fault_spec(int rank, int64_t step);
void maybe_inject_save_fault(const SaveFault& fault, size_t tensor);

// Rank 0, before writing: the directory exists, partial files of crashed
// saves are gone, and the file fits on the disk.
void prepare_dir(const std::filesystem::path& dir, int64_t bytes_needed, int64_t keep_last);

// Bytes the free-space check asks for: the raw data plus room for metadata.
int64_t bytes_needed_for(int64_t data_bytes, size_t tensors);

// Collective: every node flushes its part of `tmp` (one rank per node), rank 0
// renames it to `final_path`, fsyncs the directory, updates `latest` and
// applies retention (unless `retention` is false: the caller does, later).
// Returns the file size (on every rank).
int64_t publish(MPI_Comm comm, const std::filesystem::path& tmp, const std::filesystem::path& final_path,
                int64_t steps_done, const CkptSection& ckpt, double* sync_s, bool retention = true);

// Rank 0: the line a save prints (saved: loop blocked, write time and speed;
// or FAILED with the reason and what is untouched).
void print_save_result(const SaveResult& r, const std::filesystem::path& dir);

}  // namespace shardlm::ckpt
