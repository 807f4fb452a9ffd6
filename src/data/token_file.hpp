// token_file.hpp — one HDF5 token file (tools/make_dataset.py's format, rules
// in docs/data.md): opened, validated, its document index held in memory and
// its tokens and loss_mask read on demand.
//
// Owns: the format ('tokens' int32, 'offsets' int64, optional 'loss_mask'
// uint8, attributes vocab_size and tokenizer; contiguous, compact or chunked
// storage with deflate, shuffle and fletcher32) and reading element ranges
// with pread(2) at byte offsets found at open. HDF5 is called only while
// opening (it is not thread-safe), so reads are safe on the prefetch thread.
// Must not know: epochs, shuffling, packing documents into rows, mixing files,
// steps, ranks or micro-batches.
#pragma once

#include <hdf5.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::data {

// One filter of a chunked dataset's pipeline, in the order it was applied on write.
struct Filter {
  H5Z_filter_t id = 0;
};

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
  // "contiguous", "compact" or "chunked (N elements)" and its filters.
  std::string describe() const;

  // Elements [first, first + count) into `out`, in the stored byte order.
  void read(int64_t first, int64_t count, void* out);
  // The same, then each element in host byte order.
  void read_swapped(int64_t first, int64_t count, void* out);

 private:
  void pread_all(void* out, size_t bytes, int64_t at) const;
  // Brings chunk c into `plain`, undoing its filters in reverse order.
  void load_chunk(int64_t c);
};

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
  void read_tokens(int64_t first, int64_t count, int32_t* out);
  // loss_mask[first .. first+count) into out, each checked to be 0 or 1.
  void read_loss_mask(int64_t first, int64_t count, uint8_t* out);
};

// Opens `path` into `f` and checks everything but the token ids (checked as
// they are read) against the format and the model's `vocab_size`. Throws
// shardlm::Error naming the file and what is wrong.
void open_token_file(TokenFile& f, const std::string& path, int64_t vocab_size);

}  // namespace shardlm::data
