// tensorboard.cpp — CRC32C, TFRecord framing and the Event protobufs, by hand.
//
// Wire format (protobuf): each field is a varint key (field_number << 3 | wire
// type) followed by a varint (type 0), 8 little-endian bytes (type 1), a varint
// length and the bytes (type 2), or 4 little-endian bytes (type 5).
//   Event:        1 wall_time double, 2 step int64, 3 file_version string,
//                 5 summary Summary, 7 session_log SessionLog (6 is log_message)
//   Summary:      1 value repeated Summary.Value
//   Summary.Value 1 tag string, 2 simple_value float
//   SessionLog:   1 status enum (START = 1)
#include "app/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <ctime>

#include "shardlm/error.hpp"

namespace shardlm {
namespace fs = std::filesystem;

namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <class T>
void put_le(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}

void put_key(std::string& out, int field, int wire_type) { put_varint(out, static_cast<uint64_t>(field << 3 | wire_type)); }

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, 1);
  put_le(out, bits);
}

std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_double(e, 1, wall_time);
  put_key(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));  // int64: two's complement as a varint
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto& table = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string encode_file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string encode_session_start_event(double wall_time, int64_t step) {
  std::string session_log;
  put_key(session_log, 1, 0);
  put_varint(session_log, 1);  // SessionLog.START
  std::string e = event_head(wall_time, step);
  put_bytes(e, 7, session_log);
  return e;
}

std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    put_key(v, 2, 5);
    put_le(v, bits);
    put_bytes(summary, 1, v);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string tfrecord(const std::string& record) {
  std::string out, length;
  put_le(length, static_cast<uint64_t>(record.size()));
  out += length;
  put_le(out, masked_crc32c(length.data(), length.size()));
  out += record;
  put_le(out, masked_crc32c(record.data(), record.size()));
  return out;
}

TensorBoardWriter::TensorBoardWriter(const fs::path& dir, int64_t start_step) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  SHARDLM_CHECK(!ec, "cannot create the TensorBoard directory %s: %s", dir.c_str(), ec.message().c_str());
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "host");
  const double now = static_cast<double>(std::time(nullptr));
  path_ = dir / fmt("events.out.tfevents.%lld.%s.%ld", (long long)now, host, (long)getpid());
  file_ = std::fopen(path_.c_str(), "wb");
  SHARDLM_CHECK(file_, "cannot create %s: %s", path_.c_str(), std::strerror(errno));
  write(encode_file_version_event(now));
  write(encode_session_start_event(now, start_step));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::scalars(int64_t step, double wall_time,
                                const std::vector<std::pair<std::string, float>>& values) {
  write(encode_scalars_event(wall_time, step, values));
}

void TensorBoardWriter::write(const std::string& record) {
  const std::string framed = tfrecord(record);
  if (std::fwrite(framed.data(), 1, framed.size(), file_) != framed.size() || std::fflush(file_) != 0)
    SHARDLM_FAIL("cannot write %s: %s", path_.c_str(), std::strerror(errno));
}

}  // namespace shardlm
