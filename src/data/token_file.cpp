// token_file.cpp — opening, validating and reading HDF5 token files (see
// token_file.hpp; rules: docs/data.md).
#include "data/token_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>

#include "data/data.hpp"
#include "shardlm/error.hpp"
#include "shardlm/h5util.hpp"

namespace shardlm::data {

namespace {

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

}  // namespace

// ------------------------------------------------------------- stored arrays

std::string StoredArray::describe() const {
  if (layout == Layout::Contiguous) return "contiguous";
  if (layout == Layout::Resident) return "compact";
  std::string out = fmt("chunked (%lld elements)", static_cast<long long>(chunk_elems));
  for (const Filter& f : filters)
    out += f.id == H5Z_FILTER_DEFLATE ? ", deflate" : f.id == H5Z_FILTER_SHUFFLE ? ", shuffle" : ", fletcher32";
  return out;
}

void StoredArray::pread_all(void* out, size_t bytes, int64_t at) const {
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

void StoredArray::load_chunk(int64_t c) {
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

void StoredArray::read(int64_t first, int64_t count, void* out) {
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

void StoredArray::read_swapped(int64_t first, int64_t count, void* out) {
  read(first, count, out);
  if (!swap_bytes || elem == 1) return;
  char* p = static_cast<char*>(out);
  for (int64_t i = 0; i < count; ++i) std::reverse(p + i * elem, p + (i + 1) * elem);
}

namespace {

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
  struct stat st {};
  SHARDLM_CHECK(::fstat(fd, &st) == 0, "data file '%s': fstat failed: %s", path.c_str(), std::strerror(errno));
  const std::string what = fmt("data file '%s'", path.c_str());
  h5::check_declared_size(dset, name, static_cast<int64_t>(length), bytes, static_cast<int64_t>(st.st_size), what);

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
  // One plain chunk is allocated to inflate into: no larger than the dataset
  // (already checked against the file) or 64 MiB, whichever is more.
  constexpr int64_t kMaxChunkBytes = int64_t(64) << 20;
  SHARDLM_CHECK(a.chunk_elems >= 1 && (a.chunk_elems <= a.length ||
                                       a.chunk_elems <= kMaxChunkBytes / static_cast<int64_t>(bytes)),
                "data file '%s': dataset '%s' declares chunks of %lld elements for %lld elements: a damaged or "
                "forged header; nothing was allocated for it",
                path.c_str(), name, static_cast<long long>(a.chunk_elems), static_cast<long long>(a.length));
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

}  // namespace

// ---------------------------------------------------------------- token files

void TokenFile::read_tokens(int64_t first, int64_t count, int32_t* out) {
  tokens.read_swapped(first, count, out);
  for (int64_t i = 0; i < count; ++i)
    SHARDLM_CHECK(out[i] >= 0 && out[i] < vocab_size,
                  "data file '%s': tokens[%lld] = %d is outside the model's vocabulary [0, %lld)", path.c_str(),
                  static_cast<long long>(first + i), out[i], static_cast<long long>(vocab_size));
}

void TokenFile::read_loss_mask(int64_t first, int64_t count, uint8_t* out) {
  loss_mask.read(first, count, out);
  for (int64_t i = 0; i < count; ++i)
    SHARDLM_CHECK(out[i] <= 1, "data file '%s': loss_mask[%lld] = %d; values must be 0 or 1", path.c_str(),
                  static_cast<long long>(first + i), out[i]);
}

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

}  // namespace shardlm::data

namespace shardlm {

void validate_token_file(const std::string& path, int64_t model_vocab_size) {
  data::TokenFile file;
  data::open_token_file(file, path, model_vocab_size);
}

}  // namespace shardlm
