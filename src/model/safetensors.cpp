// safetensors.cpp — the safetensors reader and writer (see safetensors.hpp).
#include "model/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "shardlm/dtype.hpp"
#include "shardlm/error.hpp"
#include "shardlm/watchdog.hpp"

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; safetensors.cpp reads it in place");

namespace shardlm {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ============================================================================
// safetensors: shared helpers
// ============================================================================

namespace {

// Element size of every safetensors dtype (0 = not a safetensors dtype).
int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2" ||
      dtype == "F8_E8M0")
    return 1;
  return 0;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// numel with overflow check; -1 on overflow.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

bool as_nonnegative_i64(const json& v, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  int64_t s = v.get<int64_t>();
  if (s < 0) return false;
  *out = s;
  return true;
}

// pread until done; messages name the file and tensor.
void pread_all(int fd, void* buf, int64_t bytes, int64_t offset, const std::string& file, const std::string& what) {
  auto* p = static_cast<char*>(buf);
  while (bytes > 0) {
    size_t chunk = static_cast<size_t>(std::min<int64_t>(bytes, int64_t(1) << 30));
    ssize_t got = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      SHARDLM_FAIL("reading %s from %s at byte %lld failed: %s", what.c_str(), file.c_str(), (long long)offset,
                   std::strerror(errno));
    }
    if (got == 0)
      SHARDLM_FAIL("reading %s from %s: unexpected end of file at byte %lld (was the file truncated after it was "
                   "opened?)", what.c_str(), file.c_str(), (long long)offset);
    p += got;
    bytes -= got;
    offset += got;
  }
}

void pwrite_all(int fd, const void* buf, int64_t bytes, int64_t offset, const std::string& file) {
  const auto* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    size_t chunk = static_cast<size_t>(std::min<int64_t>(bytes, int64_t(1) << 30));
    ssize_t put = ::pwrite(fd, p, chunk, static_cast<off_t>(offset));
    if (put < 0) {
      if (errno == EINTR) continue;
      SHARDLM_FAIL("writing %s at byte %lld failed: %s", file.c_str(), (long long)offset, std::strerror(errno));
    }
    p += put;
    bytes -= put;
    offset += put;
  }
}

constexpr int64_t kMaxHeaderBytes = 100 * 1000 * 1000;  // the reference implementation's limit

// The safetensors rule: the tensors' data_offsets tile the data region
// [0, data_bytes) exactly, no overlap, no hole, nothing after the last one. A
// header whose q_proj points into the embedding's bytes would otherwise load
// and train with wrong weights.
template <class Span>
void check_spans_tile_data(std::vector<Span>& spans, int64_t data_bytes, const std::string& file) {
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  int64_t covered = 0;  // data bytes [0, covered) belong to the tensors seen so far
  const Span* previous = nullptr;
  for (const Span& s : spans) {
    if (s.begin < covered)
      SHARDLM_FAIL("%s: tensor '%s' has data_offsets [%lld, %lld], which overlap tensor '%s' [%lld, %lld]: the header "
                   "is corrupt (every tensor needs bytes of its own)", file.c_str(), s.name.c_str(), (long long)s.begin,
                   (long long)s.end, previous->name.c_str(), (long long)previous->begin, (long long)previous->end);
    if (s.begin > covered)
      SHARDLM_FAIL("%s: data bytes [%lld, %lld) belong to no tensor (before tensor '%s'): the header is corrupt or the "
                   "file is not safetensors", file.c_str(), (long long)covered, (long long)s.begin, s.name.c_str());
    covered = s.end;
    previous = &s;
  }
  if (covered != data_bytes)
    SHARDLM_FAIL("%s: the tensors' data ends at byte %lld of the data but the file holds %lld data bytes%s: the header "
                 "is corrupt or the file has trailing bytes", file.c_str(), (long long)covered, (long long)data_bytes,
                 previous ? fmt(" (last tensor '%s')", previous->name.c_str()).c_str() : "");
}
constexpr int64_t kConvertChunkElems = int64_t(1) << 16;  // staging buffer for bf16/f16 conversion

}  // namespace

// ============================================================================
// SafetensorsReader
// ============================================================================

SafetensorsReader::SafetensorsReader(const fs::path& dir) : dir_(dir) {
  const std::string dir_s = dir.string();
  SHARDLM_CHECK(fs::is_directory(dir), "%s is not a directory (expected a Hugging Face model directory)", dir_s.c_str());

  // Which files, and (with an index) which tensor lives where.
  std::vector<fs::path> paths;
  std::optional<std::map<std::string, std::string>> weight_map;
  const fs::path index_path = dir / "model.safetensors.index.json";
  const std::string index_s = index_path.string();
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    SHARDLM_CHECK(in.good(), "cannot open %s", index_s.c_str());
    json index;
    try {
      index = json::parse(in);
    } catch (const json::exception& e) {
      SHARDLM_FAIL("%s: not valid JSON: %s", index_s.c_str(), e.what());
    }
    SHARDLM_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                  "%s: no 'weight_map' object", index_s.c_str());
    weight_map.emplace();
    std::set<std::string> file_names;
    for (const auto& [name, file] : index["weight_map"].items()) {
      SHARDLM_CHECK(file.is_string(), "%s: weight_map['%s'] must be a file name", index_s.c_str(), name.c_str());
      std::string f = file.get<std::string>();
      SHARDLM_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
                    "%s: weight_map['%s'] = '%s' is not a file name in the directory", index_s.c_str(), name.c_str(),
                    f.c_str());
      (*weight_map)[name] = f;
      file_names.insert(f);
    }
    for (const auto& f : file_names) {
      SHARDLM_CHECK(fs::is_regular_file(dir / f), "%s names %s, which does not exist", index_s.c_str(),
                    (dir / f).string().c_str());
      paths.push_back(dir / f);
    }
  } else {
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.is_regular_file() && entry.path().extension() == ".safetensors") paths.push_back(entry.path());
    std::sort(paths.begin(), paths.end());
  }
  SHARDLM_CHECK(!paths.empty(), "no *.safetensors in %s", dir_s.c_str());

  try {
    for (const fs::path& path : paths) {
      const std::string file = path.string();
      OpenFile of;
      of.path = path;
      of.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      SHARDLM_CHECK(of.fd >= 0, "cannot open %s: %s", file.c_str(), std::strerror(errno));
      files_.push_back(of);
      const size_t file_index = files_.size() - 1;
      struct stat st {};
      SHARDLM_CHECK(::fstat(of.fd, &st) == 0, "cannot stat %s: %s", file.c_str(), std::strerror(errno));
      const int64_t size = static_cast<int64_t>(st.st_size);
      files_.back().size_bytes = size;

      SHARDLM_CHECK(size >= 8, "%s is %lld bytes: too short for a safetensors file (truncated?)", file.c_str(),
                    (long long)size);
      unsigned char len_bytes[8];
      pread_all(of.fd, len_bytes, 8, 0, file, "the header length");
      uint64_t header_len = 0;
      for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
      SHARDLM_CHECK(header_len <= uint64_t(size - 8),
                    "%s: header length %llu is larger than the file (%lld bytes): the file is truncated or not "
                    "safetensors", file.c_str(), (unsigned long long)header_len, (long long)size);
      SHARDLM_CHECK(header_len <= uint64_t(kMaxHeaderBytes), "%s: header length %llu exceeds 100 MB: not a safetensors file",
                    file.c_str(), (unsigned long long)header_len);
      std::string header(header_len, '\0');
      pread_all(of.fd, header.data(), static_cast<int64_t>(header_len), 8, file, "the header");
      json h;
      try {
        h = json::parse(header);
      } catch (const json::exception& e) {
        SHARDLM_FAIL("%s: header is not valid JSON (corrupt file?): %s", file.c_str(), e.what());
      }
      SHARDLM_CHECK(h.is_object(), "%s: header is not a JSON object (corrupt file?)", file.c_str());
      const int64_t data_start = 8 + static_cast<int64_t>(header_len);

      std::set<std::string> seen_here;
      struct Span { int64_t begin, end; std::string name; };
      std::vector<Span> spans;  // every tensor's data_offsets: they must tile the data exactly
      for (const auto& [name, t] : h.items()) {
        if (name == "__metadata__") continue;
        const char* n = name.c_str();
        SHARDLM_CHECK(t.is_object() && t.contains("dtype") && t["dtype"].is_string() && t.contains("shape") &&
                          t["shape"].is_array() && t.contains("data_offsets") && t["data_offsets"].is_array() &&
                          t["data_offsets"].size() == 2,
                      "%s: tensor '%s' needs dtype, shape and data_offsets [begin, end] (corrupt header)", file.c_str(), n);
        TensorInfo info;
        info.dtype = t["dtype"].get<std::string>();
        info.file = path;
        for (const auto& d : t["shape"]) {
          int64_t dim;
          SHARDLM_CHECK(as_nonnegative_i64(d, &dim), "%s: tensor '%s' has a bad shape %s", file.c_str(), n,
                        t["shape"].dump().c_str());
          info.shape.push_back(dim);
        }
        int64_t begin, end;
        SHARDLM_CHECK(as_nonnegative_i64(t["data_offsets"][0], &begin) &&
                          as_nonnegative_i64(t["data_offsets"][1], &end) && begin <= end,
                      "%s: tensor '%s' has bad data_offsets %s", file.c_str(), n, t["data_offsets"].dump().c_str());
        const int64_t esize = dtype_bytes(info.dtype);
        SHARDLM_CHECK(esize > 0, "%s: tensor '%s' has unknown dtype '%s' (corrupt header?)", file.c_str(), n,
                      info.dtype.c_str());
        info.numel = checked_numel(info.shape);
        SHARDLM_CHECK(info.numel >= 0 && info.numel <= std::numeric_limits<int64_t>::max() / esize,
                      "%s: tensor '%s' shape %s overflows", file.c_str(), n, shape_string(info.shape).c_str());
        SHARDLM_CHECK(end - begin == info.numel * esize,
                      "%s: tensor '%s' (%s %s) needs %lld bytes but its data_offsets [%lld, %lld] span %lld: the "
                      "header is corrupt", file.c_str(), n, info.dtype.c_str(), shape_string(info.shape).c_str(),
                      (long long)(info.numel * esize), (long long)begin, (long long)end, (long long)(end - begin));
        SHARDLM_CHECK(end <= size - data_start,
                      "%s: tensor '%s' ends at byte %lld but the file has only %lld bytes: the file is truncated",
                      file.c_str(), n, (long long)(data_start + end), (long long)size);
        info.data_offset_bytes = data_start + begin;
        seen_here.insert(name);
        spans.push_back({begin, end, name});

        if (weight_map) {
          auto it = weight_map->find(name);
          if (it == weight_map->end() || it->second != path.filename().string()) continue;  // the index rules
        }
        auto prev = tensors_.find(name);
        SHARDLM_CHECK(prev == tensors_.end(), "tensor '%s' is in both %s and %s", n, prev->second.file.string().c_str(),
                      file.c_str());
        tensors_.emplace(name, std::move(info));
        tensor_file_.emplace(name, file_index);
      }
      check_spans_tile_data(spans, size - data_start, file);
      if (weight_map) {
        for (const auto& [name, f] : *weight_map)
          SHARDLM_CHECK(f != path.filename().string() || seen_here.count(name),
                        "%s maps tensor '%s' to %s, which has no such tensor", index_s.c_str(), name.c_str(),
                        file.c_str());
      }
    }
  } catch (...) {
    close_all();
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() { close_all(); }

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : dir_(std::move(other.dir_)),
      files_(std::exchange(other.files_, {})),
      tensors_(std::exchange(other.tensors_, {})),
      tensor_file_(std::exchange(other.tensor_file_, {})) {}

SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& other) noexcept {
  if (this != &other) {
    close_all();
    dir_ = std::move(other.dir_);
    files_ = std::exchange(other.files_, {});
    tensors_ = std::exchange(other.tensors_, {});
    tensor_file_ = std::exchange(other.tensor_file_, {});
  }
  return *this;
}

void SafetensorsReader::close_all() noexcept {
  for (OpenFile& f : files_)
    if (f.fd >= 0) ::close(f.fd);
  files_.clear();
}

bool SafetensorsReader::has(const std::string& name) const { return tensors_.count(name) != 0; }

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = tensors_.find(name);
  SHARDLM_CHECK(it != tensors_.end(), "tensor '%s' not found in %s (%zu tensors present)", name.c_str(),
                dir_.string().c_str(), tensors_.size());
  return it->second;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) out.push_back(name);
  return out;
}

void SafetensorsReader::read_f32(const std::string& name, int64_t elem_begin, int64_t elem_count, float* out) const {
  const TensorInfo& t = info(name);
  const OpenFile& f = files_[tensor_file_.at(name)];
  const std::string file = f.path.string();
  SHARDLM_CHECK(elem_begin >= 0 && elem_count >= 0 && elem_begin <= t.numel - elem_count,
                "read of elements [%lld, %lld) of tensor '%s' in %s is outside its %lld elements", (long long)elem_begin,
                (long long)(elem_begin + elem_count), name.c_str(), file.c_str(), (long long)t.numel);
  if (elem_count == 0) return;
  const std::string what = "tensor '" + name + "'";
  if (t.dtype == "F32") {
    pread_all(f.fd, out, elem_count * 4, t.data_offset_bytes + elem_begin * 4, file, what);
    return;
  }
  SHARDLM_CHECK(t.dtype == "BF16" || t.dtype == "F16",
                "tensor '%s' in %s has dtype %s; shardlm reads BF16, F16 and F32 only", name.c_str(), file.c_str(),
                t.dtype.c_str());
  const bool is_bf16 = (t.dtype == "BF16");
  std::vector<uint16_t> staging(static_cast<size_t>(std::min(elem_count, kConvertChunkElems)));
  for (int64_t done = 0; done < elem_count;) {
    const int64_t n = std::min(elem_count - done, kConvertChunkElems);
    pread_all(f.fd, staging.data(), n * 2, t.data_offset_bytes + (elem_begin + done) * 2, file, what);
    if (is_bf16)
      for (int64_t i = 0; i < n; ++i) out[done + i] = bf16_to_f32(staging[i]);
    else
      for (int64_t i = 0; i < n; ++i) out[done + i] = f16_to_f32(staging[i]);
    done += n;
  }
}

// ============================================================================
// SafetensorsWriter
// ============================================================================

SafetensorsWriter::SafetensorsWriter(const fs::path& file, const std::vector<TensorSpec>& tensors,
                                     const std::map<std::string, std::string>& metadata, Open open)
    : file_(file), tmp_file_(fs::path(file.string() + ".tmp")) {
  const std::string file_s = file.string();
  std::vector<const TensorSpec*> order;
  for (const TensorSpec& t : tensors) {
    SHARDLM_CHECK(!t.name.empty() && t.name != "__metadata__", "%s: bad tensor name '%s'", file_s.c_str(),
                  t.name.c_str());
    SHARDLM_CHECK(t.dtype == "F32" || t.dtype == "BF16", "%s: tensor '%s' dtype '%s' is not F32 or BF16",
                  file_s.c_str(), t.name.c_str(), t.dtype.c_str());
    const int64_t numel = checked_numel(t.shape);
    SHARDLM_CHECK(numel >= 0 && numel <= std::numeric_limits<int64_t>::max() / 8, "%s: tensor '%s' has a bad shape %s",
                  file_s.c_str(), t.name.c_str(), shape_string(t.shape).c_str());
    auto [it, inserted] = slots_.emplace(t.name, Slot{t.dtype, numel, 0, 0});
    SHARDLM_CHECK(inserted, "%s: tensor '%s' given twice", file_s.c_str(), t.name.c_str());
    order.push_back(&t);
  }
  // Largest element first, then by name: every tensor starts aligned to its
  // element size (the data section starts 8-aligned).
  std::sort(order.begin(), order.end(), [](const TensorSpec* a, const TensorSpec* b) {
    int64_t sa = dtype_bytes(a->dtype), sb = dtype_bytes(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });

  json header = json::object();
  json meta = json::object();
  meta["format"] = "pt";  // transformers refuses safetensors without a known format
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  int64_t offset = 0;
  std::map<std::string, int64_t> begin_of;
  for (const TensorSpec* t : order) {
    const int64_t bytes = slots_[t->name].numel * dtype_bytes(t->dtype);
    header[t->name] = {{"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {offset, offset + bytes}}};
    begin_of[t->name] = offset;
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const int64_t data_start = 8 + static_cast<int64_t>(header_text.size());
  for (auto& [name, slot] : slots_) slot.data_offset_bytes = data_start + begin_of[name];

  const std::string tmp_s = tmp_file_.string();
  if (open == Open::Existing) {
    fd_ = ::open(tmp_s.c_str(), O_WRONLY | O_CLOEXEC);
    SHARDLM_CHECK(fd_ >= 0, "cannot open %s for shared writing: %s", tmp_s.c_str(), std::strerror(errno));
    finished_ = true;  // the creator owns FILE.tmp: never remove it from here
    participant_ = true;
    return;
  }
  fd_ = ::open(tmp_s.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  SHARDLM_CHECK(fd_ >= 0, "cannot create %s: %s", tmp_s.c_str(), std::strerror(errno));
  try {
    unsigned char len_bytes[8];
    uint64_t len = header_text.size();
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
    pwrite_all(fd_, len_bytes, 8, 0, tmp_s);
    pwrite_all(fd_, header_text.data(), static_cast<int64_t>(header_text.size()), 8, tmp_s);
    SHARDLM_CHECK(::ftruncate(fd_, static_cast<off_t>(data_start + offset)) == 0, "cannot size %s to %lld bytes: %s",
                  tmp_s.c_str(), (long long)(data_start + offset), std::strerror(errno));
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    std::error_code ec;
    fs::remove(tmp_file_, ec);
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) {
    std::error_code ec;
    fs::remove(tmp_file_, ec);
  }
}

void SafetensorsWriter::write(const std::string& name, int64_t elem_begin, int64_t elem_count, const float* data) {
  const std::string tmp_s = tmp_file_.string();
  SHARDLM_CHECK(fd_ >= 0 && (!finished_ || participant_), "%s: write after finish()", tmp_s.c_str());
  auto it = slots_.find(name);
  SHARDLM_CHECK(it != slots_.end(), "%s: tensor '%s' is not in the header", file_.string().c_str(), name.c_str());
  Slot& s = it->second;
  SHARDLM_CHECK(elem_begin >= 0 && elem_count >= 0 && elem_begin <= s.numel - elem_count,
                "%s: write of elements [%lld, %lld) of tensor '%s' is outside its %lld elements", file_.string().c_str(),
                (long long)elem_begin, (long long)(elem_begin + elem_count), name.c_str(), (long long)s.numel);
  if (elem_count == 0) return;
  SHARDLM_CHECK(data != nullptr, "%s: tensor '%s' has no data", file_.string().c_str(), name.c_str());
  if (s.dtype == "F32") {
    pwrite_all(fd_, data, elem_count * 4, s.data_offset_bytes + elem_begin * 4, tmp_s);
  } else {  // BF16
    std::vector<uint16_t> staging(static_cast<size_t>(std::min(elem_count, kConvertChunkElems)));
    for (int64_t done = 0; done < elem_count;) {
      const int64_t n = std::min(elem_count - done, kConvertChunkElems);
      for (int64_t i = 0; i < n; ++i) staging[i] = f32_to_bf16_rne(data[done + i]);
      pwrite_all(fd_, staging.data(), n * 2, s.data_offset_bytes + (elem_begin + done) * 2, tmp_s);
      done += n;
    }
  }
  s.elems_written += elem_count;
  SHARDLM_CHECK(s.elems_written <= s.numel, "%s: tensor '%s' written more than once (%lld of %lld elements)",
                file_.string().c_str(), name.c_str(), (long long)s.elems_written, (long long)s.numel);
}

void SafetensorsWriter::close_part() {
  SHARDLM_CHECK(participant_ && fd_ >= 0, "%s: close_part() is for shared-writing participants",
                tmp_file_.string().c_str());
  SHARDLM_CHECK(::fsync(fd_) == 0, "fsync of %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
  const int rc = ::close(fd_);
  fd_ = -1;
  SHARDLM_CHECK(rc == 0, "closing %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
}

void SafetensorsWriter::finish(bool check_complete) {
  const std::string file_s = file_.string();
  SHARDLM_CHECK(fd_ >= 0 && !finished_, "%s: finish() called twice", file_s.c_str());
  for (const auto& [name, s] : slots_)
    SHARDLM_CHECK(!check_complete || s.elems_written == s.numel, "%s: tensor '%s' has %lld of %lld elements written; not finishing",
                  file_s.c_str(), name.c_str(), (long long)s.elems_written, (long long)s.numel);
  SHARDLM_CHECK(fsync_in_pieces(fd_) == 0, "fsync of %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
  int rc = ::close(fd_);
  fd_ = -1;
  SHARDLM_CHECK(rc == 0, "closing %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
  std::error_code ec;
  fs::rename(tmp_file_, file_, ec);
  SHARDLM_CHECK(!ec, "cannot rename %s to %s: %s", tmp_file_.string().c_str(), file_s.c_str(), ec.message().c_str());
  finished_ = true;
  // Make the rename itself durable (best effort: some filesystems refuse).
  fs::path parent = file_.has_parent_path() ? file_.parent_path() : fs::path(".");
  int dir_fd = ::open(parent.string().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    (void)::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void write_safetensors(const fs::path& file, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorToWrite& t : tensors) specs.push_back({t.name, t.shape, t.dtype});
  SafetensorsWriter writer(file, specs, metadata);
  for (const TensorToWrite& t : tensors) writer.write(t.name, 0, checked_numel(t.shape), t.data);
  writer.finish();
}

}  // namespace shardlm
