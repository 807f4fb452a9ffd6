// data.cpp — token files read on demand, the per-epoch packing, mixing files
// by weight, and cutting the row stream into steps and micro-batches, with the
// next micro-batch read on a background thread. Rules: docs/data.md.
//
// Threading: HDF5 here is not thread-safe (the parallel build never is), so
// HDF5 is called only while opening a file, on the caller's thread. What the
// prefetch thread reads it reads with pread(2) at byte offsets found at open
// (contiguous datasets, or each chunk's address), inflating deflate chunks
// with zlib itself. The caller's thread and the prefetch thread never work at
// once: every public call first waits until the thread is idle.
#include "data/data.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>

#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"
#include "shardlm/memory.hpp"

namespace shardlm {

namespace {

constexpr int64_t kPositionFormat = 2;
constexpr size_t kPositionFormat1Values = 7;
constexpr int64_t kRowsPerStart = 256;    // packing: one saved row start per this many rows
constexpr int64_t kRowsPerMixBlock = 1024;  // mixing: per-file counts saved every this many rows

// ---------------------------------------------------------------- HDF5 checks

bool is_integer(hid_t type, size_t bytes, bool is_signed) {
  return H5Tget_class(type) == H5T_INTEGER && H5Tget_size(type) == bytes &&
         (H5Tget_sign(type) == H5T_SGN_2) == is_signed;
}

bool has_link(hid_t file, const char* name) { return H5_CHECK(H5Lexists(file, name, H5P_DEFAULT)) > 0; }

bool has_attribute(hid_t file, const char* name) { return H5_CHECK(H5Aexists(file, name)) > 0; }

int64_t read_int_attribute(hid_t file, const std::string& path, const char* name) {
  h5::Handle attr(H5_CHECK(H5Aopen(file, name, H5P_DEFAULT)), H5Aclose);
  h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
  h5::Handle space(H5_CHECK(H5Aget_space(attr)), H5Sclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_INTEGER && H5Sget_simple_extent_npoints(space) == 1,
                "data file '%s': attribute '%s' must be one integer, found %s with %ld values",
                path.c_str(), name, h5::dtype_name(type).c_str(),
                static_cast<long>(H5Sget_simple_extent_npoints(space)));
  int64_t value = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_INT64, &value));
  return value;
}

std::string read_string_attribute(hid_t file, const std::string& path, const char* name) {
  h5::Handle attr(H5_CHECK(H5Aopen(file, name, H5P_DEFAULT)), H5Aclose);
  h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
  h5::Handle space(H5_CHECK(H5Aget_space(attr)), H5Sclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_STRING && H5Sget_simple_extent_npoints(space) == 1,
                "data file '%s': attribute '%s' must be one string, found %s", path.c_str(),
                name, h5::dtype_name(type).c_str());
  return h5::read_string_attribute_value(attr, type);
}

// ------------------------------------------------------------ document order

// splitmix64 (Steele, Lea, Flood 2014): a fixed, portable generator, so the
// order is the same with every compiler and standard library.
uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t mix64(uint64_t x) { return splitmix64_next(x); }

// Uniform in [0, bound) without modulo bias: reject the lowest 2^64 mod bound values.
uint64_t uniform_below(uint64_t& state, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = splitmix64_next(state);
    if (r >= threshold) return r % bound;
  }
}

// ------------------------------------------------------------- stored arrays

// One filter of a chunked dataset's pipeline, in the order it was applied on write.
struct Filter {
  H5Z_filter_t id = 0;
};

// Where one 1-D dataset's elements lie in its file, and reading a range of
// them with pread(2) (no HDF5 call: safe on the prefetch thread).
struct StoredArray {
  std::string file, name;  // for messages
  int fd = -1;
  size_t elem = 0;          // bytes per element
  bool swap_bytes = false;  // stored big-endian
  int64_t length = 0;
  enum class Layout { Contiguous, Chunked, Resident } layout = Layout::Contiguous;
  int64_t offset = 0;                  // contiguous: byte offset of element 0 in the file
  std::vector<char> resident;          // compact datasets (at most 64 KiB) are read whole
  int64_t chunk_elems = 0;             // chunked: elements per chunk
  std::vector<int64_t> chunk_address;  // byte offset in the file, per chunk in logical order
  std::vector<int64_t> chunk_stored;   // stored (filtered) bytes per chunk
  std::vector<uint32_t> chunk_skipped; // filter mask per chunk: bit i set = filter i not applied
  std::vector<Filter> filters;
  int64_t cached_chunk = -1;           // the chunk in `plain` (filtered datasets)
  std::vector<char> plain, stored, scratch;

  bool filtered() const { return layout == Layout::Chunked && !filters.empty(); }
  int64_t buffer_bytes() const {
    return static_cast<int64_t>(resident.capacity() + plain.capacity() + stored.capacity() + scratch.capacity() +
                                chunk_address.capacity() * 8 + chunk_stored.capacity() * 8 +
                                chunk_skipped.capacity() * 4);
  }
  std::string describe() const {
    if (layout == Layout::Contiguous) return "contiguous";
    if (layout == Layout::Resident) return "compact";
    std::string out = fmt("chunked (%lld elements)", static_cast<long long>(chunk_elems));
    for (const Filter& f : filters)
      out += f.id == H5Z_FILTER_DEFLATE ? ", deflate" : f.id == H5Z_FILTER_SHUFFLE ? ", shuffle" : ", fletcher32";
    return out;
  }

  void pread_all(void* out, size_t bytes, int64_t at) const {
    char* dst = static_cast<char*>(out);
    while (bytes > 0) {
      const ssize_t got = ::pread(fd, dst, bytes, static_cast<off_t>(at));
      if (got < 0 && errno == EINTR) continue;
      SHARDLM_CHECK(got >= 0, "data file '%s': reading '%s' at byte %lld failed: %s", file.c_str(), name.c_str(),
                    static_cast<long long>(at), std::strerror(errno));
      SHARDLM_CHECK(got > 0, "data file '%s' ends at byte %lld, inside dataset '%s' (truncated file?)", file.c_str(),
                    static_cast<long long>(at), name.c_str());
      dst += got, bytes -= static_cast<size_t>(got), at += got;
    }
  }

  // Brings chunk c into `plain`, undoing its filters in reverse order.
  void load_chunk(int64_t c) {
    if (cached_chunk == c) return;
    const size_t plain_bytes = static_cast<size_t>(chunk_elems) * elem;
    stored.resize(static_cast<size_t>(chunk_stored[c]));
    pread_all(stored.data(), stored.size(), chunk_address[c]);
    std::vector<char>* in = &stored;
    std::vector<char>* out = &scratch;
    for (int i = static_cast<int>(filters.size()) - 1; i >= 0; --i) {
      if (chunk_skipped[c] & (1u << i)) continue;
      const H5Z_filter_t id = filters[static_cast<size_t>(i)].id;
      if (id == H5Z_FILTER_FLETCHER32) {  // a 4-byte checksum appended to the chunk
        SHARDLM_CHECK(in->size() >= 4, "data file '%s': chunk %lld of '%s' is too short for its checksum",
                      file.c_str(), static_cast<long long>(c), name.c_str());
        in->resize(in->size() - 4);
        continue;
      }
      out->resize(plain_bytes);
      if (id == H5Z_FILTER_DEFLATE) {
        uLongf produced = static_cast<uLongf>(plain_bytes);
        const int rc = ::uncompress(reinterpret_cast<Bytef*>(out->data()), &produced,
                                    reinterpret_cast<const Bytef*>(in->data()), static_cast<uLong>(in->size()));
        SHARDLM_CHECK(rc == Z_OK && produced == plain_bytes,
                      "data file '%s': chunk %lld of '%s' does not inflate to %zu bytes (zlib %d, %lu bytes)",
                      file.c_str(), static_cast<long long>(c), name.c_str(), plain_bytes, rc,
                      static_cast<unsigned long>(produced));
      } else {  // H5Z_FILTER_SHUFFLE: byte b of element i was stored at b * n + i
        SHARDLM_CHECK(in->size() == plain_bytes, "data file '%s': chunk %lld of '%s' holds %zu bytes, expected %zu",
                      file.c_str(), static_cast<long long>(c), name.c_str(), in->size(), plain_bytes);
        const size_t n = plain_bytes / elem;
        for (size_t b = 0; b < elem; ++b)
          for (size_t i = 0; i < n; ++i) (*out)[i * elem + b] = (*in)[b * n + i];
      }
      std::swap(in, out);
    }
    SHARDLM_CHECK(in->size() == plain_bytes, "data file '%s': chunk %lld of '%s' holds %zu bytes, expected %zu",
                  file.c_str(), static_cast<long long>(c), name.c_str(), in->size(), plain_bytes);
    if (in != &plain) plain.swap(*in);
    cached_chunk = c;
  }

  // Elements [first, first + count) into `out`, in the stored byte order.
  void read(int64_t first, int64_t count, void* out) {
    char* dst = static_cast<char*>(out);
    if (layout == Layout::Resident) {
      std::memcpy(dst, resident.data() + first * elem, static_cast<size_t>(count) * elem);
      return;
    }
    if (layout == Layout::Contiguous) {
      pread_all(dst, static_cast<size_t>(count) * elem, offset + first * static_cast<int64_t>(elem));
      return;
    }
    while (count > 0) {
      const int64_t c = first / chunk_elems, within = first % chunk_elems;
      const int64_t take = std::min(count, chunk_elems - within);
      if (filters.empty()) {
        pread_all(dst, static_cast<size_t>(take) * elem, chunk_address[c] + within * static_cast<int64_t>(elem));
      } else {
        load_chunk(c);
        std::memcpy(dst, plain.data() + within * elem, static_cast<size_t>(take) * elem);
      }
      dst += take * static_cast<int64_t>(elem), first += take, count -= take;
    }
  }

  void read_swapped(int64_t first, int64_t count, void* out) {
    read(first, count, out);
    if (!swap_bytes || elem == 1) return;
    char* p = static_cast<char*>(out);
    for (int64_t i = 0; i < count; ++i) std::reverse(p + i * elem, p + (i + 1) * elem);
  }
};

// Opens dataset `name`, checks it is 1-D with an integer type of `bytes` and
// signedness `is_signed`, and finds where its elements are.
StoredArray open_array(hid_t file, int fd, int64_t userblock, const std::string& path, const char* name,
                       const char* expected, size_t bytes, bool is_signed, hid_t mem_type) {
  h5::Handle dset = h5::open_dataset(file, name, fmt("data file '%s'", path.c_str()));
  h5::Handle type(H5_CHECK(H5Dget_type(dset)), H5Tclose);
  SHARDLM_CHECK(is_integer(type, bytes, is_signed), "data file '%s': dataset '%s' has dtype %s, expected %s",
                path.c_str(), name, h5::dtype_name(type).c_str(), expected);
  h5::Handle space(H5_CHECK(H5Dget_space(dset)), H5Sclose);
  const int rank = H5_CHECK(H5Sget_simple_extent_ndims(space));
  SHARDLM_CHECK(rank == 1, "data file '%s': dataset '%s' has rank %d, expected a 1-D array", path.c_str(), name,
                rank);
  hsize_t length = 0;
  H5_CHECK(H5Sget_simple_extent_dims(space, &length, nullptr));

  StoredArray a;
  a.file = path;
  a.name = name;
  a.fd = fd;
  a.elem = bytes;
  a.length = static_cast<int64_t>(length);
  a.swap_bytes = bytes > 1 && (H5Tget_order(type) == H5T_ORDER_BE) != (std::endian::native == std::endian::big);
  if (length == 0) {
    a.layout = StoredArray::Layout::Resident;
    return a;
  }
  h5::Handle dcpl(H5_CHECK(H5Dget_create_plist(dset)), H5Pclose);
  const H5D_layout_t layout = H5Pget_layout(dcpl);
  SHARDLM_CHECK(H5Pget_external_count(dcpl) == 0,
                "data file '%s': dataset '%s' keeps its data in external files; rewrite it with "
                "tools/make_dataset.py (contiguous or chunked storage)",
                path.c_str(), name);
  if (layout == H5D_COMPACT) {  // at most 64 KiB, in the object header: read it now
    a.layout = StoredArray::Layout::Resident;
    a.resident.resize(static_cast<size_t>(length) * bytes);
    H5_CHECK(H5Dread(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, a.resident.data()));
    a.swap_bytes = false;  // HDF5 converted it to native order
    return a;
  }
  if (layout == H5D_CONTIGUOUS) {
    const haddr_t address = H5Dget_offset(dset);
    SHARDLM_CHECK(address != HADDR_UNDEF,
                  "data file '%s': dataset '%s' has %lld elements but none were ever written", path.c_str(), name,
                  static_cast<long long>(length));
    a.layout = StoredArray::Layout::Contiguous;
    a.offset = static_cast<int64_t>(address) + userblock;
    return a;
  }
  SHARDLM_CHECK(layout == H5D_CHUNKED,
                "data file '%s': dataset '%s' has a storage layout shardlm cannot read (virtual?); accepted: "
                "contiguous, chunked, compact",
                path.c_str(), name);
  a.layout = StoredArray::Layout::Chunked;
  hsize_t chunk = 0;
  H5_CHECK(H5Pget_chunk(dcpl, 1, &chunk));
  a.chunk_elems = static_cast<int64_t>(chunk);
  const int n_filters = H5_CHECK(H5Pget_nfilters(dcpl));
  for (int i = 0; i < n_filters; ++i) {
    unsigned flags = 0;
    size_t n_values = 0;
    char filter_name[64] = {0};
    unsigned filter_config = 0;
    const H5Z_filter_t filter = H5Pget_filter2(dcpl, static_cast<unsigned>(i), &flags, &n_values, nullptr,
                                               sizeof filter_name, filter_name, &filter_config);
    SHARDLM_CHECK(filter == H5Z_FILTER_DEFLATE || filter == H5Z_FILTER_SHUFFLE || filter == H5Z_FILTER_FLETCHER32,
                  "data file '%s': dataset '%s' is compressed with filter %d (%s), which shardlm does not read; "
                  "accepted: gzip (deflate), shuffle, fletcher32 (tools/make_dataset.py --compression gzip)",
                  path.c_str(), name, static_cast<int>(filter), filter_name[0] ? filter_name : "unnamed");
    a.filters.push_back({filter});
  }
  const int64_t n_chunks = (a.length + a.chunk_elems - 1) / a.chunk_elems;
  hsize_t allocated = 0;
  H5_CHECK(H5Dget_num_chunks(dset, space, &allocated));
  SHARDLM_CHECK(static_cast<int64_t>(allocated) == n_chunks,
                "data file '%s': dataset '%s' has %lld of its %lld chunks written; a dataset with unwritten "
                "chunks cannot be a token file",
                path.c_str(), name, static_cast<long long>(allocated), static_cast<long long>(n_chunks));
  a.chunk_address.assign(static_cast<size_t>(n_chunks), -1);
  a.chunk_stored.assign(static_cast<size_t>(n_chunks), 0);
  a.chunk_skipped.assign(static_cast<size_t>(n_chunks), 0);
  for (hsize_t i = 0; i < allocated; ++i) {
    hsize_t coord = 0, size = 0;
    unsigned skipped = 0;
    haddr_t address = HADDR_UNDEF;
    H5_CHECK(H5Dget_chunk_info(dset, space, i, &coord, &skipped, &address, &size));
    const int64_t c = static_cast<int64_t>(coord) / a.chunk_elems;
    SHARDLM_CHECK(c >= 0 && c < n_chunks && address != HADDR_UNDEF,
                  "data file '%s': dataset '%s' chunk %llu is not where its index says", path.c_str(), name,
                  static_cast<unsigned long long>(i));
    a.chunk_address[c] = static_cast<int64_t>(address) + userblock;
    a.chunk_stored[c] = static_cast<int64_t>(size);
    a.chunk_skipped[c] = skipped;
  }
  if (a.filtered()) {  // one chunk cached: room reserved now, so reading allocates nothing
    size_t largest = 0;
    for (int64_t s : a.chunk_stored) largest = std::max(largest, static_cast<size_t>(s));
    const size_t plain_bytes = static_cast<size_t>(a.chunk_elems) * bytes;
    a.stored.reserve(std::max(largest, plain_bytes));
    a.plain.reserve(std::max(largest, plain_bytes));
    a.scratch.reserve(std::max(largest, plain_bytes));
  }
  return a;
}

// ---------------------------------------------------------------- token files

// One token file: its document index in memory, tokens and loss_mask on disk.
struct TokenFile {
  std::string path;
  int fd = -1;
  StoredArray tokens, loss_mask;
  bool has_loss_mask = false;
  std::vector<int64_t> offsets;  // (file documents + 1)
  std::vector<int64_t> kept;     // kept document -> file document; empty when every document is kept
  int64_t documents = 0;         // documents with >= 2 tokens
  int64_t pairs = 0;             // (input, target) pairs over them
  int64_t vocab_attribute = 0;
  std::string tokenizer;
  int64_t vocab_size = 0;        // the model's

  TokenFile() = default;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile() {
    if (fd >= 0) ::close(fd);
  }

  int64_t doc_file_index(int64_t k) const { return kept.empty() ? k : kept[static_cast<size_t>(k)]; }
  int64_t doc_first(int64_t k) const { return offsets[static_cast<size_t>(doc_file_index(k))]; }
  int64_t doc_pairs(int64_t k) const {
    const auto d = static_cast<size_t>(doc_file_index(k));
    return offsets[d + 1] - offsets[d] - 1;
  }
  int64_t index_bytes() const { return static_cast<int64_t>(offsets.capacity() * 8 + kept.capacity() * 8); }

  // tokens[first .. first+count) into out, each checked against the vocabulary.
  void read_tokens(int64_t first, int64_t count, int32_t* out) {
    tokens.read_swapped(first, count, out);
    for (int64_t i = 0; i < count; ++i)
      SHARDLM_CHECK(out[i] >= 0 && out[i] < vocab_size,
                    "data file '%s': tokens[%lld] = %d is outside the model's vocabulary [0, %lld)", path.c_str(),
                    static_cast<long long>(first + i), out[i], static_cast<long long>(vocab_size));
  }
  void read_loss_mask(int64_t first, int64_t count, uint8_t* out) {
    loss_mask.read(first, count, out);
    for (int64_t i = 0; i < count; ++i)
      SHARDLM_CHECK(out[i] <= 1, "data file '%s': loss_mask[%lld] = %d; values must be 0 or 1", path.c_str(),
                    static_cast<long long>(first + i), out[i]);
  }
};

void open_token_file(TokenFile& f, const std::string& path, int64_t vocab_size) {
  const char* p = path.c_str();
  f.path = path;
  f.vocab_size = vocab_size;
  std::error_code ec;
  SHARDLM_CHECK(std::filesystem::exists(path, ec), "data file '%s' does not exist", p);
  SHARDLM_CHECK(!std::filesystem::is_directory(path, ec), "data file '%s' is a directory; data.path names HDF5 token "
                "files", p);
  SHARDLM_CHECK(std::filesystem::is_regular_file(path, ec), "data file '%s' is not a regular file (a device, pipe or "
                "socket); data.path names HDF5 token files", p);
  h5::silence_error_stack();
  const htri_t is_hdf5 = H5Fis_hdf5(p);
  H5Eclear2(H5E_DEFAULT);
  SHARDLM_CHECK(is_hdf5 > 0, "data file '%s' is not an HDF5 file (make one with tools/make_dataset.py)", p);

  // Read-only and without file locking: every rank opens the file at once, and
  // parallel file systems often do not support flock. No MPI-IO: each rank
  // reads the file with the serial driver, so this works without MPI_Init too.
  h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  H5_CHECK(H5Pset_file_locking(fapl, false, true));
  h5::Handle file(H5_CHECK(H5Fopen(p, H5F_ACC_RDONLY, fapl)), H5Fclose);
  hsize_t userblock = 0;
  {
    h5::Handle fcpl(H5_CHECK(H5Fget_create_plist(file)), H5Pclose);
    H5_CHECK(H5Pget_userblock(fcpl, &userblock));
  }
  f.fd = ::open(p, O_RDONLY | O_CLOEXEC);
  SHARDLM_CHECK(f.fd >= 0, "data file '%s' cannot be opened for reading: %s", p, std::strerror(errno));

  for (const char* name : {"tokens", "offsets"})
    SHARDLM_CHECK(has_link(file, name),
                  "data file '%s' has no dataset '%s' (expected 'tokens' int32 and 'offsets' int64; "
                  "see docs/data.md)",
                  p, name);
  const auto ub = static_cast<int64_t>(userblock);
  f.tokens = open_array(file, f.fd, ub, path, "tokens", "int32", 4, true, H5T_NATIVE_INT32);
  {  // the document index is read whole: 8 bytes per document
    StoredArray offsets = open_array(file, f.fd, ub, path, "offsets", "int64", 8, true, H5T_NATIVE_INT64);
    f.offsets.resize(static_cast<size_t>(offsets.length));
    if (offsets.length > 0) offsets.read_swapped(0, offsets.length, f.offsets.data());
  }
  f.has_loss_mask = has_link(file, "loss_mask");
  if (f.has_loss_mask) f.loss_mask = open_array(file, f.fd, ub, path, "loss_mask", "uint8", 1, false, H5T_NATIVE_UINT8);
  if (has_attribute(file, "vocab_size")) f.vocab_attribute = read_int_attribute(file, path, "vocab_size");
  if (has_attribute(file, "tokenizer")) f.tokenizer = read_string_attribute(file, path, "tokenizer");

  const std::vector<int64_t>& offsets = f.offsets;
  const int64_t n_tokens = f.tokens.length;
  SHARDLM_CHECK(!offsets.empty(),
                "data file '%s': dataset 'offsets' is empty; it must hold at least [0, len(tokens)]", p);
  SHARDLM_CHECK(offsets[0] == 0, "data file '%s': offsets[0] = %ld, expected 0", p, offsets[0]);
  int64_t short_documents = 0;
  for (size_t i = 1; i < offsets.size(); ++i) {
    SHARDLM_CHECK(offsets[i] >= offsets[i - 1],
                  "data file '%s': offsets decrease at index %zu (offsets[%zu] = %ld > offsets[%zu] = %ld)", p, i,
                  i - 1, offsets[i - 1], i, offsets[i]);
    short_documents += offsets[i] - offsets[i - 1] < 2;
  }
  SHARDLM_CHECK(offsets.back() == n_tokens,
                "data file '%s': offsets ends at %ld but 'tokens' has %ld elements; the last offset "
                "must be len(tokens)",
                p, offsets.back(), n_tokens);
  if (f.has_loss_mask)
    SHARDLM_CHECK(f.loss_mask.length == n_tokens, "data file '%s': 'loss_mask' has %ld elements but 'tokens' has %ld",
                  p, f.loss_mask.length, n_tokens);
  SHARDLM_CHECK(!has_attribute(file, "vocab_size") || f.vocab_attribute > 0,
                "data file '%s': attribute vocab_size = %lld; it must be the tokenizer's vocabulary size (> 0)", p,
                (long long)f.vocab_attribute);
  SHARDLM_CHECK(f.vocab_attribute <= vocab_size,
                "data file '%s' was tokenized for a vocabulary of %ld ids (attribute vocab_size%s%s) "
                "but the model has vocab_size %ld; use a file made with the model's tokenizer",
                p, f.vocab_attribute, f.tokenizer.empty() ? "" : ", tokenizer ", f.tokenizer.c_str(), vocab_size);

  const auto file_documents = static_cast<int64_t>(offsets.size()) - 1;
  f.documents = file_documents - short_documents;
  int64_t pairs = 0;
  if (short_documents > 0) f.kept.reserve(static_cast<size_t>(f.documents));
  for (int64_t d = 0; d < file_documents; ++d) {
    const int64_t n = offsets[d + 1] - offsets[d];
    if (n < 2) continue;  // a single token has nothing to predict
    if (short_documents > 0) f.kept.push_back(d);
    pairs += n - 1;
  }
  f.pairs = pairs;
  SHARDLM_CHECK(f.documents > 0,
                "data file '%s' has no document with at least 2 tokens (%ld documents, %ld tokens); "
                "there is nothing to train on",
                p, file_documents, n_tokens);
  SHARDLM_CHECK(f.documents <= static_cast<int64_t>(UINT32_MAX),
                "data file '%s' has %ld documents; at most 2^32-1 are supported in one file (split it and list the "
                "parts in data.path)",
                p, f.documents);
}

}  // namespace

void validate_token_file(const std::string& path, int64_t model_vocab_size) {
  TokenFile file;
  open_token_file(file, path, model_vocab_size);
}

namespace {

// ---------------------------------------------------------------- packing

// Where a row starts in an epoch's document order: document `index` of the
// order, `consumed` of its pairs already placed in earlier rows.
struct RowStart {
  int64_t index = 0;
  int64_t consumed = 0;
};

struct EpochPacking {
  int64_t epoch = -1;
  std::vector<uint32_t> order;   // (documents) permutation; empty without shuffling
  std::vector<RowStart> starts;  // start of rows 0, R, 2R, ... (R = kRowsPerStart)
  int64_t rows = 0;
  int64_t cursor_row = -1;       // the row after the last one walked, and where it starts
  RowStart cursor;
};

// One file of the mix: the file, its shuffle seed and its epochs' packings.
struct Source {
  TokenFile file;
  uint64_t seed = 0;
  bool shuffle = true;
  int64_t seq_len = 0;
  EpochPacking cache[2];           // the two most recently used epochs
  int next_slot = 0;
  std::vector<int64_t> epoch_row_begin{0};  // row of this file's stream where epoch e starts

  int64_t doc_at(const EpochPacking& p, int64_t i) const {
    return p.order.empty() ? i : static_cast<int64_t>(p.order[static_cast<size_t>(i)]);
  }

  void fill_order(int64_t epoch, std::vector<uint32_t>& order) const {
    order.clear();
    if (!shuffle) return;
    order.resize(static_cast<size_t>(file.documents));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
    // Fisher-Yates driven by splitmix64 seeded from (seed, epoch).
    uint64_t state = mix64(seed ^ mix64(static_cast<uint64_t>(epoch) + 0xD1B54A32D192ED03ull));
    for (size_t i = order.size(); i > 1; --i) {
      const uint64_t j = uniform_below(state, i);
      std::swap(order[i - 1], order[j]);
    }
  }

  // Greedy packing of one row from `s`. A document of p <= seq_len pairs is
  // never split: if it does not fit in the row, the rest of the row is padding
  // and it starts the next row. A document of p > seq_len pairs fills the rest
  // of the row with its first piece and continues in the next rows. Calls
  // emit(first_token, pairs) per piece; returns where the next row starts.
  template <class Emit>
  RowStart walk_row(const EpochPacking& p, RowStart s, Emit&& emit) const {
    int64_t used = 0;
    while (s.index < file.documents) {
      const int64_t d = doc_at(p, s.index);
      const int64_t pairs = file.doc_pairs(d);
      if (s.consumed == 0 && pairs <= seq_len && used + pairs > seq_len) break;
      const int64_t take = std::min(pairs - s.consumed, seq_len - used);
      emit(file.doc_first(d) + s.consumed, take);
      used += take;
      s.consumed += take;
      if (s.consumed == pairs) ++s.index, s.consumed = 0;
      if (used == seq_len) break;
    }
    return s;
  }

  void pack(int64_t epoch, EpochPacking& p) const {
    p.epoch = epoch;
    fill_order(epoch, p.order);
    p.starts.clear();
    p.rows = 0;
    RowStart s;
    while (s.index < file.documents) {
      if (p.rows % kRowsPerStart == 0) p.starts.push_back(s);
      s = walk_row(p, s, [](int64_t, int64_t) {});
      ++p.rows;
    }
    p.cursor_row = -1;
  }

  EpochPacking& packing(int64_t epoch) {
    if (!shuffle) {  // every epoch is the file order: one packing serves all
      if (cache[0].epoch < 0) pack(0, cache[0]);
      return cache[0];
    }
    for (EpochPacking& cached : cache)
      if (cached.epoch == epoch) return cached;
    EpochPacking& slot = cache[next_slot];
    next_slot ^= 1;
    pack(epoch, slot);
    return slot;
  }

  int64_t rows_in_epoch(int64_t epoch) { return packing(epoch).rows; }

  // This file's stream row -> (epoch, row within the epoch).
  void locate(int64_t row_in_stream, int64_t& epoch, int64_t& row) {
    while (epoch_row_begin.back() <= row_in_stream) {
      const auto next_epoch = static_cast<int64_t>(epoch_row_begin.size()) - 1;
      epoch_row_begin.push_back(epoch_row_begin.back() + rows_in_epoch(next_epoch));
    }
    const auto it = std::upper_bound(epoch_row_begin.begin(), epoch_row_begin.end(), row_in_stream);
    epoch = (it - epoch_row_begin.begin()) - 1;
    row = row_in_stream - epoch_row_begin[static_cast<size_t>(epoch)];
  }

  // Calls emit(first_token, pairs) for each piece of row `row_in_stream`.
  template <class Emit>
  void walk_stream_row(int64_t row_in_stream, Emit&& emit) {
    int64_t epoch = 0, row = 0;
    locate(row_in_stream, epoch, row);
    EpochPacking& p = packing(epoch);
    RowStart s;
    if (p.cursor_row == row) {
      s = p.cursor;
    } else {  // replay from the nearest saved row start
      s = p.starts[static_cast<size_t>(row / kRowsPerStart)];
      for (int64_t r = row / kRowsPerStart * kRowsPerStart; r < row; ++r) s = walk_row(p, s, [](int64_t, int64_t) {});
    }
    p.cursor = walk_row(p, s, emit);
    p.cursor_row = row + 1;
  }

  // The most the packing caches hold: two epochs' orders and row starts.
  int64_t order_bytes_bound() const {
    const int64_t rows_bound = file.documents + file.pairs / seq_len + 1;
    const int64_t starts = (rows_bound / kRowsPerStart + 1) * static_cast<int64_t>(sizeof(RowStart));
    const int64_t orders = shuffle ? file.documents * 4 : 0;
    return (shuffle ? 2 : 1) * (orders + starts);
  }
  int64_t order_bytes() const {
    int64_t total = 0;
    for (const EpochPacking& p : cache)
      total += static_cast<int64_t>(p.order.capacity() * 4 + p.starts.capacity() * sizeof(RowStart));
    return total + static_cast<int64_t>(epoch_row_begin.capacity() * 8);
  }
};

}  // namespace

// ------------------------------------------------------------------ position

// Format 2: [2, step, rows_consumed, seq_len, seed, documents, shuffle, files,
// then per file: documents, rows_consumed]. Format 1 (one file): the first 7.
std::vector<int64_t> DataPosition::to_vector() const {
  std::vector<int64_t> v{kPositionFormat, step, rows_consumed, seq_len, static_cast<int64_t>(seed),
                         documents, shuffle ? 1 : 0, static_cast<int64_t>(sources.size())};
  for (const SourcePosition& s : sources) v.push_back(s.documents), v.push_back(s.rows_consumed);
  return v;
}

DataPosition DataPosition::from_vector(std::span<const int64_t> values) {
  const bool format1 = values.size() == kPositionFormat1Values && values[0] == 1;
  const bool format2 = values.size() >= 8 && values[0] == kPositionFormat && values[7] >= 0 &&
                       values.size() == 8 + 2 * static_cast<size_t>(values[7]);
  SHARDLM_CHECK(format1 || format2,
                "data position: expected format 1 (7 values) or format 2 (8 + 2 per file), got %zu values%s",
                values.size(), values.empty() ? "" : fmt(" starting with %ld", static_cast<long>(values[0])).c_str());
  DataPosition pos;
  pos.step = values[1];
  pos.rows_consumed = values[2];
  pos.seq_len = values[3];
  pos.seed = static_cast<uint64_t>(values[4]);
  pos.documents = values[5];
  pos.shuffle = values[6] != 0;
  if (format1) {
    pos.sources = {{pos.documents, pos.rows_consumed}};
  } else {
    for (int64_t k = 0; k < values[7]; ++k) pos.sources.push_back({values[8 + 2 * k], values[9 + 2 * k]});
  }
  return pos;
}

// ------------------------------------------------------------------- the reader

struct TokenDataset::Impl {
  DataSpec spec;
  std::vector<std::unique_ptr<Source>> sources;

  // The mix: stream row i comes from file k with probability weight_k, drawn
  // from (seed, i); its row in file k's stream is the number of earlier rows
  // that came from k. Counted from the anchor (a restored position) on.
  std::vector<uint64_t> thresholds;    // cumulative weights scaled to 2^53
  int64_t anchor_step = 0, anchor_row = 0;
  std::vector<int64_t> anchor_counts;  // (files) rows of each file before anchor_row
  std::vector<int64_t> block_counts;   // (blocks + 1, files): rows of each file in [anchor_row, anchor_row + b*B)

  std::vector<int32_t> stage_tokens;   // (seq_len + 1) one piece's tokens
  std::vector<uint8_t> stage_mask;     // (seq_len + 1) and its loss_mask

  // Prefetch: at most one job, run by `worker`; the caller's thread touches the
  // state above only while no job runs.
  struct Key {
    int64_t step = -1;
    int accum = 0, rank = 0, world = 0;
    bool operator==(const Key&) const = default;
  };
  std::thread worker;
  std::mutex mutex;
  std::condition_variable wake, idle;
  bool stop = false, job_pending = false, job_running = false, job_ready = false, job_failed = false;
  Key job_key;
  bool job_counts = false;           // the job also counts job_key.step's rows of the rank
  StepCounts counts;                 // ... here
  MicroBatch spare;                  // the prefetched micro-batch
  int64_t tracked_bytes = 0;         // what memory.hpp's counters hold for this reader

  int64_t files() const { return static_cast<int64_t>(sources.size()); }

  int64_t source_of(int64_t row) const {
    if (sources.size() == 1) return 0;
    const uint64_t draw = mix64(spec.seed ^ mix64(static_cast<uint64_t>(row) + 0xA24BAED4963EE407ull)) >> 11;
    for (size_t k = 0; k + 1 < thresholds.size(); ++k)
      if (draw < thresholds[k]) return static_cast<int64_t>(k);
    return static_cast<int64_t>(thresholds.size()) - 1;
  }

  // The mix's per-file counts at the start of every block up to the one holding `row`.
  void extend_blocks(int64_t row) {
    SHARDLM_CHECK(row >= anchor_row, "internal: data row %lld before the restored row %lld", (long long)row,
                  (long long)anchor_row);
    const int64_t K = files();
    const int64_t block = (row - anchor_row) / kRowsPerMixBlock;
    while (static_cast<int64_t>(block_counts.size()) / K <= block) {
      const int64_t b = static_cast<int64_t>(block_counts.size()) / K - 1;
      for (int64_t k = 0; k < K; ++k) block_counts.push_back(block_counts[b * K + k]);
      for (int64_t r = anchor_row + b * kRowsPerMixBlock; r < anchor_row + (b + 1) * kRowsPerMixBlock; ++r)
        ++block_counts[(b + 1) * K + source_of(r)];
    }
  }

  // Rows of each file in the stream before `row`.
  std::vector<int64_t> rows_of_each_file_before(int64_t row) {
    if (sources.size() == 1) return {row};
    extend_blocks(row);
    const int64_t K = files();
    const int64_t block = (row - anchor_row) / kRowsPerMixBlock;
    std::vector<int64_t> out(sources.size());
    for (int64_t k = 0; k < K; ++k) out[k] = anchor_counts[k] + block_counts[block * K + k];
    for (int64_t r = anchor_row + block * kRowsPerMixBlock; r < row; ++r) ++out[source_of(r)];
    return out;
  }

  // Stream row -> (file, row of that file's stream).
  void locate(int64_t row, int64_t& file, int64_t& file_row) {
    if (sources.size() == 1) {
      file = 0, file_row = row;
      return;
    }
    extend_blocks(row);
    const int64_t K = files();
    const int64_t block = (row - anchor_row) / kRowsPerMixBlock;
    file = source_of(row);
    int64_t count = block_counts[block * K + file];
    for (int64_t r = anchor_row + block * kRowsPerMixBlock; r < row; ++r) count += source_of(r) == file;
    file_row = anchor_counts[file] + count;
  }

  int64_t first_row_of_step(int64_t step) const {
    SHARDLM_CHECK(step >= anchor_step, "data: step %ld comes before the restored position (step %ld)", step,
                  anchor_step);
    return anchor_row + (step - anchor_step) * spec.global_batch;
  }

  // Writes stream row `row` into out[slot]; seq_id continues from `next_seq_id`.
  void fill_row(int64_t row, int64_t slot, int32_t& next_seq_id, MicroBatch& out) {
    int64_t k = 0, file_row = 0;
    locate(row, k, file_row);
    Source& src = *sources[static_cast<size_t>(k)];
    TokenFile& file = src.file;
    const int64_t seq_len = spec.seq_len;
    const int64_t base = slot * seq_len;
    int64_t used = 0;
    src.walk_stream_row(file_row, [&](int64_t first, int64_t pairs) {
      // inputs tokens[first .. first+pairs), targets one further; loss at the target
      file.read_tokens(first, pairs + 1, stage_tokens.data());
      if (file.has_loss_mask) file.read_loss_mask(first + 1, pairs, stage_mask.data());
      for (int64_t j = 0; j < pairs; ++j) {
        const int64_t at = base + used + j;
        const float weight = file.has_loss_mask ? static_cast<float>(stage_mask[static_cast<size_t>(j)]) : 1.0f;
        out.tokens[at] = stage_tokens[static_cast<size_t>(j)];
        out.targets[at] = stage_tokens[static_cast<size_t>(j + 1)];
        out.weights[at] = weight;
        out.positions[at] = static_cast<int32_t>(j);
        out.seq_ids[at] = next_seq_id;
        out.loss_tokens += weight > 0.0f;
      }
      used += pairs;
      ++next_seq_id;
    });
    pad_row(base + used, base + seq_len, next_seq_id, out);
  }

  // Padding: one sequence of its own that nothing attends into.
  static void pad_row(int64_t from, int64_t to, int32_t& next_seq_id, MicroBatch& out) {
    if (from >= to) return;
    for (int64_t at = from; at < to; ++at) {
      out.tokens[at] = 0;
      out.targets[at] = -1;
      out.weights[at] = 0.0f;
      out.positions[at] = 0;
      out.seq_ids[at] = next_seq_id;
    }
    ++next_seq_id;
  }

  void size_micro_batch(MicroBatch& out) const {
    const int64_t numel = spec.micro_batch * spec.seq_len;
    out.rows = spec.micro_batch;
    out.seq_len = spec.seq_len;
    out.tokens.resize(numel);
    out.targets.resize(numel);
    out.weights.resize(numel);
    out.positions.resize(numel);
    out.seq_ids.resize(numel);
    out.loss_tokens = 0;
  }

  // `rows` stream rows from `first_row`, then empty rows up to micro_batch.
  void fill_rows(int64_t first_row, int64_t rows, MicroBatch& out) {
    size_micro_batch(out);
    int32_t next_seq_id = 0;
    for (int64_t i = 0; i < rows; ++i) fill_row(first_row + i, i, next_seq_id, out);
    for (int64_t i = rows; i < spec.micro_batch; ++i)
      pad_row(i * spec.seq_len, (i + 1) * spec.seq_len, next_seq_id, out);
  }

  void fill_micro_batch(const Key& key, MicroBatch& out) {
    const int64_t number = static_cast<int64_t>(key.accum) * key.world + key.rank;
    fill_rows(first_row_of_step(key.step) + number * spec.micro_batch, spec.micro_batch, out);
  }

  void count_row(int64_t row, StepCounts& c) {
    int64_t k = 0, file_row = 0;
    locate(row, k, file_row);
    Source& src = *sources[static_cast<size_t>(k)];
    src.walk_stream_row(file_row, [&](int64_t first, int64_t pairs) {
      c.tokens += pairs;
      if (!src.file.has_loss_mask) {
        c.loss_tokens += pairs;
        return;
      }
      src.file.read_loss_mask(first + 1, pairs, stage_mask.data());
      for (int64_t j = 0; j < pairs; ++j) c.loss_tokens += stage_mask[static_cast<size_t>(j)];
    });
  }

  StepCounts rank_counts(int64_t step, int rank, int world) {
    const int64_t per_rank = spec.global_batch / world;  // rows
    const int64_t accum_steps = per_rank / spec.micro_batch;
    StepCounts c;
    c.positions = per_rank * spec.seq_len;
    const int64_t first = first_row_of_step(step);
    for (int64_t a = 0; a < accum_steps; ++a) {
      const int64_t number = a * world + rank;
      for (int64_t i = 0; i < spec.micro_batch; ++i) count_row(first + number * spec.micro_batch + i, c);
    }
    return c;
  }

  DataMemory memory(bool bound) const {
    DataMemory m;
    for (const auto& s : sources) {
      m.index += s->file.index_bytes();
      m.order += bound ? s->order_bytes_bound() : s->order_bytes();
      m.buffers += s->file.tokens.buffer_bytes() + s->file.loss_mask.buffer_bytes();
    }
    // The caller's micro-batch and the prefetched one: 5 arrays of 4 bytes per position.
    const int64_t micro_batch_bytes = 20 * spec.micro_batch * spec.seq_len;
    m.buffers += (spec.prefetch ? 2 : 1) * micro_batch_bytes +
                 static_cast<int64_t>(stage_tokens.capacity() * 4 + stage_mask.capacity() +
                                      block_counts.capacity() * 8 + thresholds.capacity() * 8 +
                                      anchor_counts.capacity() * 8);
    return m;
  }

  // memory.hpp's counters follow what the reader holds (caller's thread only).
  void retrack() {
    const int64_t now = memory(false).total();
    host_mem_track(Mem::Data, now - tracked_bytes);
    tracked_bytes = now;
  }

  void run_worker() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      wake.wait(lock, [&] { return stop || job_pending; });
      if (stop) return;
      job_pending = false;
      job_running = true;
      const Key key = job_key;
      const bool with_counts = job_counts;
      lock.unlock();
      bool failed = false;
      try {
        fill_micro_batch(key, spare);
        if (with_counts) counts = rank_counts(key.step, key.rank, key.world);
      } catch (...) {
        failed = true;  // the caller's thread reads it again itself and gets the error there
      }
      lock.lock();
      job_running = false;
      job_ready = true;
      job_failed = failed;
      idle.notify_all();
    }
  }
};

TokenDataset::TokenDataset(const DataSpec& spec) : spec_(spec), impl_(std::make_unique<Impl>()) {
  SHARDLM_CHECK(spec.seq_len >= 2,
                "data.seq_len = %ld: a row needs at least 2 positions (one input, one target)", spec.seq_len);
  SHARDLM_CHECK(spec.micro_batch >= 1, "data.micro_batch = %ld: must be at least 1", spec.micro_batch);
  SHARDLM_CHECK(spec.global_batch >= 1 && spec.global_batch % spec.micro_batch == 0,
                "data.global_batch = %ld must be a positive multiple of data.micro_batch = %ld",
                spec.global_batch, spec.micro_batch);
  // positions and seq_ids are int32 across one micro-batch.
  SHARDLM_CHECK(spec.micro_batch * spec.seq_len <= INT32_MAX,
                "data.micro_batch * data.seq_len = %ld positions exceeds 2^31-1", spec.micro_batch * spec.seq_len);
  SHARDLM_CHECK(spec.vocab_size >= 1, "data: vocab_size = %ld, the model's vocabulary size must be set",
                spec.vocab_size);
  SHARDLM_CHECK(!spec.paths.empty(), "data.path is empty: give a token file (see docs/data.md)");
  SHARDLM_CHECK(spec.paths.size() <= 4096, "data.path lists %zu files; at most 4096 can be mixed (the checkpoint's "
                "position holds two numbers per file): merge some with tools/make_dataset.py", spec.paths.size());
  SHARDLM_CHECK(spec.weights.empty() || spec.weights.size() == spec.paths.size(),
                "data.weights has %zu entries but data.path has %zu files; give one weight per file",
                spec.weights.size(), spec.paths.size());
  Impl& m = *impl_;
  m.spec = spec;
  for (size_t k = 0; k < spec.paths.size(); ++k) {
    auto src = std::make_unique<Source>();
    open_token_file(src->file, spec.paths[k], spec.vocab_size);
    // File k shuffles with seed + k: the first (or only) file's order is the
    // seed's, as with a single data.path.
    src->seed = spec.seed + k;
    src->shuffle = spec.shuffle;
    src->seq_len = spec.seq_len;
    m.sources.push_back(std::move(src));
  }
  if (spec.paths.size() > 1) {
    std::vector<double> w = spec.weights;
    if (w.empty())  // in proportion to each file's targets, as if they were one file
      for (const auto& s : m.sources) w.push_back(static_cast<double>(s->file.pairs));
    double total = 0;
    for (size_t k = 0; k < w.size(); ++k) {
      SHARDLM_CHECK(w[k] >= 0 && std::isfinite(w[k]), "data.weights[%zu] = %g: weights must be >= 0", k, w[k]);
      total += w[k];
    }
    SHARDLM_CHECK(total > 0, "data.weights are all 0: at least one file must have a positive weight");
    double cumulative = 0;
    for (size_t k = 0; k < w.size(); ++k) {
      cumulative += w[k];
      const double scaled = cumulative / total * 9007199254740992.0;  // 2^53
      m.thresholds.push_back(k + 1 == w.size() ? (uint64_t(1) << 53) : static_cast<uint64_t>(scaled));
    }
  }
  m.anchor_counts.assign(spec.paths.size(), 0);
  m.block_counts.assign(spec.paths.size(), 0);
  m.stage_tokens.resize(static_cast<size_t>(spec.seq_len + 1));
  m.stage_mask.resize(static_cast<size_t>(spec.seq_len + 1));
  m.spare.tokens.reserve(static_cast<size_t>(spec.micro_batch * spec.seq_len));
  // Both epochs' orders and row tables are reserved now (memory is planned:
  // later epochs reuse them), and epoch 0 is packed so the first step does
  // not pay for it.
  for (const auto& s : m.sources) {
    const int64_t rows_bound = s->file.documents + s->file.pairs / spec.seq_len + 1;
    for (int slot = 0; slot < (spec.shuffle ? 2 : 1); ++slot) {
      if (spec.shuffle) s->cache[slot].order.reserve(static_cast<size_t>(s->file.documents));
      s->cache[slot].starts.reserve(static_cast<size_t>(rows_bound / kRowsPerStart + 1));
    }
    (void)s->rows_in_epoch(0);
  }
  m.retrack();
  if (spec.prefetch) m.worker = std::thread([this] { impl_->run_worker(); });
}

TokenDataset::~TokenDataset() {
  if (impl_->worker.joinable()) {
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->stop = true;
    }
    impl_->wake.notify_all();
    impl_->worker.join();
  }
  host_mem_track(Mem::Data, -impl_->tracked_bytes);
}

void TokenDataset::wait_idle() {
  Impl& m = *impl_;
  if (m.worker.joinable()) {
    std::unique_lock<std::mutex> lock(m.mutex);
    m.idle.wait(lock, [&] { return !m.job_pending && !m.job_running; });
  }
  m.retrack();
}

void TokenDataset::schedule_after(int64_t step, int accum_index, int rank, int world) {
  Impl& m = *impl_;
  if (!m.worker.joinable()) return;
  Impl::Key next{step, accum_index + 1, rank, world};
  bool with_counts = false;
  if (next.accum >= micro_batches_per_rank(world)) next = {step + 1, 0, rank, world}, with_counts = true;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.job_key = next;
    m.job_counts = with_counts;
    m.job_ready = false;
    m.job_pending = true;
  }
  m.wake.notify_one();
}

// ------------------------------------------------------------ steps, batches

int64_t TokenDataset::micro_batches_per_rank(int world) const {
  const int64_t per_step = spec_.micro_batch * world;
  SHARDLM_CHECK(world >= 1 && spec_.global_batch % per_step == 0,
                "data.global_batch = %ld rows cannot be split into micro-batches of %ld rows over %d "
                "ranks; make it a multiple of micro_batch * ranks = %ld",
                spec_.global_batch, spec_.micro_batch, world, per_step);
  return spec_.global_batch / per_step;
}

void TokenDataset::micro_batch(int64_t step, int accum_index, int rank, int world, MicroBatch& out) {
  const int64_t accum_steps = micro_batches_per_rank(world);
  SHARDLM_CHECK(rank >= 0 && rank < world && accum_index >= 0 && accum_index < accum_steps,
                "data: micro-batch for rank %d of %d, accumulation index %d of %ld is out of range", rank, world,
                accum_index, accum_steps);
  wait_idle();
  Impl& m = *impl_;
  const Impl::Key key{step, accum_index, rank, world};
  if (m.job_ready && !m.job_failed && m.job_key == key) {
    // the prefetched buffers become the caller's; the caller's become the next spare
    out.rows = m.spare.rows, out.seq_len = m.spare.seq_len, out.loss_tokens = m.spare.loss_tokens;
    out.tokens.swap(m.spare.tokens);
    out.targets.swap(m.spare.targets);
    out.weights.swap(m.spare.weights);
    out.positions.swap(m.spare.positions);
    out.seq_ids.swap(m.spare.seq_ids);
    m.job_ready = m.job_counts;  // the counts stay until asked for
    if (m.job_counts) m.job_key.accum = -1;  // the micro-batch part is taken
  } else {
    m.fill_micro_batch(key, out);
  }
  schedule_after(step, accum_index, rank, world);
}

MicroBatch TokenDataset::micro_batch(int64_t step, int accum_index, int rank, int world) {
  MicroBatch out;
  micro_batch(step, accum_index, rank, world, out);
  return out;
}

StepCounts TokenDataset::rank_step_counts(int64_t step, int rank, int world) {
  (void)micro_batches_per_rank(world);
  SHARDLM_CHECK(rank >= 0 && rank < world, "data: rank %d of %d is out of range", rank, world);
  wait_idle();
  Impl& m = *impl_;
  if (m.job_ready && !m.job_failed && m.job_counts && m.job_key.step == step && m.job_key.rank == rank &&
      m.job_key.world == world)
    return m.counts;
  return m.rank_counts(step, rank, world);
}

StepCounts TokenDataset::step_counts(int64_t step) {
  wait_idle();
  StepCounts c = impl_->rank_counts(step, 0, 1);
  return c;
}

void TokenDataset::read_rows(int64_t first_row, int64_t rows, MicroBatch& out) {
  SHARDLM_CHECK(first_row >= 0 && rows >= 0 && rows <= spec_.micro_batch,
                "data: read_rows(%lld, %lld) with micro_batch %lld", (long long)first_row, (long long)rows,
                (long long)spec_.micro_batch);
  wait_idle();
  impl_->fill_rows(first_row, rows, out);
}

DataPosition TokenDataset::position(int64_t step) {
  wait_idle();
  Impl& m = *impl_;
  DataPosition pos;
  pos.step = step;
  pos.rows_consumed = m.first_row_of_step(step);
  pos.seq_len = spec_.seq_len;
  pos.seed = spec_.seed;
  pos.documents = documents();
  pos.shuffle = spec_.shuffle;
  const std::vector<int64_t> rows = m.rows_of_each_file_before(pos.rows_consumed);
  for (size_t k = 0; k < m.sources.size(); ++k) pos.sources.push_back({m.sources[k]->file.documents, rows[k]});
  return pos;
}

void TokenDataset::restore(const DataPosition& pos) {
  wait_idle();
  Impl& m = *impl_;
  SHARDLM_CHECK(pos.step >= 0 && pos.rows_consumed >= 0, "data position: step %ld, rows consumed %ld; both must be >= 0",
                pos.step, pos.rows_consumed);
  std::string changed;
  if (pos.seq_len != spec_.seq_len) {
    changed = fmt("data.seq_len was %ld then and is %ld now", pos.seq_len, spec_.seq_len);
  } else if (pos.sources.size() != m.sources.size()) {
    changed = fmt("data.path had %zu file%s then and has %zu now", pos.sources.size(),
                  pos.sources.size() == 1 ? "" : "s", m.sources.size());
  } else if (pos.shuffle != spec_.shuffle) {
    changed = fmt("shuffling was %s then and is %s now", pos.shuffle ? "on" : "off", spec_.shuffle ? "on" : "off");
  } else if ((pos.shuffle || m.sources.size() > 1) && pos.seed != spec_.seed) {
    changed = fmt("the seed was %lu then and is %lu now", static_cast<unsigned long>(pos.seed),
                  static_cast<unsigned long>(spec_.seed));
  }
  for (size_t k = 0; changed.empty() && k < m.sources.size(); ++k)
    if (pos.sources[k].documents != m.sources[k]->file.documents)
      changed = fmt("data.path had %ld documents then and has %ld now%s", pos.sources[k].documents,
                    m.sources[k]->file.documents,
                    m.sources.size() > 1 ? fmt(" in file %zu ('%s')", k, m.sources[k]->file.path.c_str()).c_str() : "");
  SHARDLM_CHECK(changed.empty(),
                "cannot continue the data order saved at step %ld: %s, so the saved row position "
                "would point at other rows",
                pos.step, changed.c_str());
  m.anchor_step = pos.step;
  m.anchor_row = pos.rows_consumed;
  for (size_t k = 0; k < m.sources.size(); ++k) m.anchor_counts[k] = pos.sources[k].rows_consumed;
  m.block_counts.assign(m.sources.size(), 0);
  m.job_ready = false;  // anything prefetched was read from the old anchor
}

// ------------------------------------------------------------------ inspection

int64_t TokenDataset::documents() const {
  int64_t n = 0;
  for (const auto& s : impl_->sources) n += s->file.documents;
  return n;
}

int64_t TokenDataset::total_tokens() const {
  int64_t n = 0;
  for (const auto& s : impl_->sources) n += s->file.tokens.length;
  return n;
}

int64_t TokenDataset::sources() const { return impl_->files(); }
int64_t TokenDataset::file_vocab_size() const { return impl_->sources[0]->file.vocab_attribute; }
const std::string& TokenDataset::tokenizer() const { return impl_->sources[0]->file.tokenizer; }

std::string TokenDataset::storage() const { return impl_->sources[0]->file.tokens.describe(); }

int64_t TokenDataset::rows_in_epoch(int64_t epoch) {
  wait_idle();
  return impl_->sources[0]->rows_in_epoch(epoch);
}

std::vector<int64_t> TokenDataset::document_order(int64_t epoch) const {
  const Source& s = *impl_->sources[0];
  std::vector<uint32_t> order;
  s.fill_order(epoch, order);
  std::vector<int64_t> out(static_cast<size_t>(s.file.documents));
  for (size_t i = 0; i < out.size(); ++i) out[i] = order.empty() ? static_cast<int64_t>(i) : order[i];
  return out;
}

DataMemory TokenDataset::memory() const { return impl_->memory(/*bound=*/true); }

}  // namespace shardlm
