// checksum.hpp — the checkpoint's per-dataset checksum.
//
// Owns: the 64-bit checksum every dataset of a checkpoint carries (the formula
// is in docs/checkpoint.md, "Checksums"). It does not depend on how many ranks
// wrote or read the data: partial sums of any partition of a dataset add up
// (mod 2^64) to the checksum of the whole. Knows nothing about HDF5, MPI or
// the file layout.
#pragma once

#include <cstdint>
#include <string>

namespace shardlm {

// Sum over i of mix(first_index + i, bits(values[i])) mod 2^64: partial sums of
// any partition of a dataset add up to the checksum of the whole.
uint64_t checksum_f32(const float* values, int64_t first_index, int64_t count);
uint64_t checksum_i64(const int64_t* values, int64_t first_index, int64_t count);
// The same sum over the bytes of `text` (the root and group attributes' canonical text).
uint64_t checksum_text(const std::string& text);

}  // namespace shardlm
