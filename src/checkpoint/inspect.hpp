// inspect.hpp — what inspect and export share: turning the path a
// user gives (a file, a checkpoints directory, a run directory) into a file.
//
// Owns: that resolution only. Knows the retention naming (the `latest`
// pointer); knows nothing about the training state or MPI.
#pragma once

#include <filesystem>

namespace shardlm::ckpt {

// A file as is; a run dir or checkpoints dir: the file its `latest` names (or
// its newest step file). Throws when the directory holds none.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& given);

}  // namespace shardlm::ckpt
