// tensorboard.hpp — TensorBoard event files, written natively (no TensorFlow, no protobuf library).
//
// Owns: CRC32C, the TFRecord framing (uint64 length, masked CRC32C of the length,
// the record, masked CRC32C of the record; all little-endian), and the protobuf
// encoding of the three Event kinds shardlm writes: the file_version header, a
// SessionLog START at the step a run (re)starts from, and Summary scalars
// (simple_value). Knows nothing about training: metrics.cpp hands it names and
// numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace shardlm {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses it.
uint32_t crc32c(const void* data, size_t n);
// TFRecord's masked form: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// Serialised tensorflow.Event messages (the fields TensorBoard reads).
std::string encode_file_version_event(double wall_time);
std::string encode_session_start_event(double wall_time, int64_t step);
std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& scalars);
// One TFRecord around `record`.
std::string tfrecord(const std::string& record);

class TensorBoardWriter {
 public:
  // Creates `dir` and dir/events.out.tfevents.<unix time>.<host>.<pid> (a new
  // file per start; TensorBoard reads them in name order as one run), writes the
  // file_version event and a SessionLog START at `start_step` (the first step
  // this start logs): TensorBoard then discards what earlier files logged at or
  // past that step (the rows of a timeline a resume abandons).
  TensorBoardWriter(const std::filesystem::path& dir, int64_t start_step);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Appends one event of scalars (NaN and Inf are written as they are) and
  // flushes; throws Error naming the file when the write fails.
  void scalars(int64_t step, double wall_time, const std::vector<std::pair<std::string, float>>& values);
  const std::filesystem::path& path() const { return path_; }

 private:
  void write(const std::string& record);
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace shardlm
