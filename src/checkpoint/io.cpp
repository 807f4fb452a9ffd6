// io.cpp — raw I/O modes, RawFile, durability (checkpoint/io.hpp).
#include "checkpoint/io.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "checkpoint/agree.hpp"
#include "checkpoint/layout.hpp"
#include "shardlm/watchdog.hpp"

namespace fs = std::filesystem;

namespace shardlm::ckpt {

int rounds_for(int64_t numel, int64_t shard_numel) {
  const int64_t most = std::min(numel, shard_numel);
  return static_cast<int>(std::max<int64_t>(1, (most + kMaxElemsPerCall - 1) / kMaxElemsPerCall));
}

void select_flat(hid_t file_space, const std::vector<int64_t>& shape, int64_t begin, int64_t count) {
  const auto boxes = flat_range_boxes(shape, begin, count);
  if (boxes.empty()) {
    H5_CHECK(H5Sselect_none(file_space));
    return;
  }
  for (size_t i = 0; i < boxes.size(); ++i) {
    std::vector<hsize_t> start(boxes[i].start.begin(), boxes[i].start.end());
    std::vector<hsize_t> cnt(boxes[i].count.begin(), boxes[i].count.end());
    H5_CHECK(H5Sselect_hyperslab(file_space, i == 0 ? H5S_SELECT_SET : H5S_SELECT_OR, start.data(), nullptr,
                                 cnt.data(), nullptr));
  }
}

// Moves elements [begin, begin + count) of the flattened dataset to (write) or

h5::Handle mpio_fapl(MPI_Comm comm) {
  h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  H5_CHECK(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL));
  // Metadata: read by one rank and broadcast, written collectively: a
  // thousand ranks must not each read the same object headers.
  H5_CHECK(H5Pset_all_coll_metadata_ops(fapl, true));
  H5_CHECK(H5Pset_coll_metadata_write(fapl, true));
  return fapl;
}

// Nodes the communicator spans (ranks sharing memory count as one node).
int node_count(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, comm_rank(comm), MPI_INFO_NULL, &node));
  int leader = comm_rank(node) == 0 ? 1 : 0, nodes = 0;
  MPI_CHECK(MPI_Comm_free(&node));
  allreduce(comm, &leader, &nodes, 1, MPI_INT, MPI_SUM);
  return nodes;
}

// How ranks move raw data (SHARDLM_CKPT_XFER overrides the default):
//   collective  (default across nodes) collective MPI-IO: the MPI-IO layer
//               aggregates the ranks' pieces into large aligned requests,
//               which parallel file systems want;
//   direct      (default on one node) POSIX I/O at the offsets HDF5 allocated,
//               whole 4 KiB blocks with O_DIRECT (RawFile, below);
//   independent independent MPI-IO.

bool node_leader(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, comm_rank(comm), MPI_INFO_NULL, &node));
  const int node_rank = comm_rank(node);
  MPI_CHECK(MPI_Comm_free(&node));
  return node_rank == 0;
}

RawMode raw_mode(MPI_Comm comm) {
  const char* mode = std::getenv("SHARDLM_CKPT_XFER");
  const std::string forced = mode ? mode : "";
  if (forced == "collective") return RawMode::Collective;
  if (forced == "independent") return RawMode::Independent;
  if (forced == "direct") return RawMode::Direct;
  return node_count(comm) > 1 ? RawMode::Collective : RawMode::Direct;
}

h5::Handle transfer_plist(RawMode mode) {
  h5::Handle dxpl(H5_CHECK(H5Pcreate(H5P_DATASET_XFER)), H5Pclose);
  H5_CHECK(H5Pset_dxpl_mpio(dxpl, mode == RawMode::Collective ? H5FD_MPIO_COLLECTIVE : H5FD_MPIO_INDEPENDENT));
  return dxpl;
}

RawFile::RawFile(const fs::path& path, bool write) : path_(path) {
  const int flags = write ? O_WRONLY : O_RDONLY;
  buffered_ = ::open(path.c_str(), flags);
  SHARDLM_CHECK(buffered_ >= 0, "cannot open %s: %s", path.c_str(), std::strerror(errno));
  direct_ = ::open(path.c_str(), flags | O_DIRECT);
  if (direct_ >= 0) staging_ = static_cast<char*>(std::aligned_alloc(kBlock, kStaging));
  SHARDLM_CHECK(direct_ < 0 || staging_, "cannot allocate the %lld-byte checkpoint staging buffer",
                (long long)kStaging);
}

RawFile::~RawFile() {
  if (buffered_ >= 0) ::close(buffered_);
  if (direct_ >= 0) ::close(direct_);
  std::free(staging_);
}

void RawFile::sync() {
  SHARDLM_CHECK(fsync_in_pieces(buffered_) == 0, "fsync of %s failed: %s", path_.c_str(), std::strerror(errno));
}

void RawFile::all(int fd, char* p, int64_t n, int64_t off, bool write) {
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<int64_t>(n, int64_t(1) << 30));
    const ssize_t done = write ? ::pwrite(fd, p, chunk, off) : ::pread(fd, p, chunk, off);
    if (done < 0 && errno == EINTR) continue;
    SHARDLM_CHECK(done >= 0, "%s %s at byte %lld: %s", write ? "writing" : "reading", path_.c_str(),
                  (long long)off, std::strerror(errno));
    SHARDLM_CHECK(done > 0, "%s ends at byte %lld, before the data it should hold (truncated file)",
                  path_.c_str(), (long long)off);
    p += done, n -= done, off += done;
  }
}

void RawFile::move(int64_t offset, void* buffer, int64_t bytes, bool write) {
  char* p = static_cast<char*>(buffer);
  const int64_t end = offset + bytes;
  const int64_t a = (offset + kBlock - 1) / kBlock * kBlock, b = end / kBlock * kBlock;
  if (direct_ < 0 || a >= b) return all(buffered_, p, bytes, offset, write);
  if (a > offset) all(buffered_, p, a - offset, offset, write);
  for (int64_t x = a; x < b; x += kStaging) {
    const int64_t n = std::min(kStaging, b - x);
    if (write) std::memcpy(staging_, p + (x - offset), static_cast<size_t>(n));
    all(direct_, staging_, n, x, write);
    if (!write) std::memcpy(p + (x - offset), staging_, static_cast<size_t>(n));
  }
  if (end > b) all(buffered_, p + (b - offset), end - b, b, write);
}

// Byte offset of a dataset's data when RawFile can read it: contiguous,
// allocated, unfiltered little-endian float32 (what shardlm writes); -1 when
// not (a file rewritten by other tools), and HDF5 reads it instead.
int64_t raw_offset(hid_t dset) {
  h5::Handle dcpl(H5_CHECK(H5Dget_create_plist(dset)), H5Pclose);
  h5::Handle type(H5_CHECK(H5Dget_type(dset)), H5Tclose);
  if (H5Pget_layout(dcpl) != H5D_CONTIGUOUS || H5Pget_nfilters(dcpl) != 0) return -1;
  if (H5_CHECK(H5Tequal(type, H5T_IEEE_F32LE)) <= 0) return -1;
  const haddr_t offset = H5Dget_offset(dset);
  return offset == HADDR_UNDEF ? -1 : static_cast<int64_t>(offset);
}

h5::Handle open_serial(const fs::path& path) {
  h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
  H5_CHECK(H5Pset_file_locking(fapl, false, true));
  return h5::Handle(H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl)), H5Fclose);
}

// fsync a file or directory; ENOSPC and EIO of delayed allocation show up here.
void sync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  SHARDLM_CHECK(fd >= 0, "cannot open %s to sync it: %s", path.c_str(), std::strerror(errno));
  const int rc = fsync_in_pieces(fd);
  const int err = errno;
  ::close(fd);
  SHARDLM_CHECK(rc == 0, "fsync of %s failed: %s", path.c_str(), std::strerror(err));
}

// Writes `text` to dir/name atomically: name.tmp, fsync, rename, fsync dir.
void write_atomically(const fs::path& dir, const std::string& name, const std::string& text) {
  const fs::path tmp = dir / (name + ".tmp"), final_path = dir / name;
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    SHARDLM_CHECK(out.good(), "cannot write %s: %s", tmp.c_str(), std::strerror(errno));
  }
  sync_path(tmp, false);
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  SHARDLM_CHECK(!ec, "cannot rename %s to %s: %s", tmp.c_str(), final_path.c_str(), ec.message().c_str());
  sync_path(dir, true);
}

// "N MiB free on the filesystem of DIR", for messages about failed writes.
std::string free_space_text(const fs::path& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return "free space unknown";
  return mib(static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize)) + " free on the filesystem of " +
         dir.string();
}

// Reserves the file's blocks so the raw-data writes cannot run out of space:
// a full disk shows up here, while the metadata is already on disk and clean.
// Filesystems without fallocate (some NFS, Lustre versions) skip it.
void reserve_space(const fs::path& path, int64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  SHARDLM_CHECK(fd >= 0, "cannot open %s: %s", path.c_str(), std::strerror(errno));
  const int rc = ::fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(bytes));
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EOPNOTSUPP && err != ENOSYS)
    SHARDLM_FAIL("cannot reserve %s for %s: %s", mib(static_cast<double>(bytes)).c_str(), path.c_str(),
                 std::strerror(err));
}

}  // namespace shardlm::ckpt

namespace shardlm {

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t count) {
  std::vector<Box> out;
  if (count <= 0) return out;
  if (shape.size() <= 1) {
    out.push_back({{begin}, {count}});
    return out;
  }
  const std::vector<int64_t> inner_shape(shape.begin() + 1, shape.end());
  const int64_t inner = ckpt::numel_of(inner_shape);
  const int64_t end = begin + count;
  auto prefixed = [&](int64_t row, int64_t b, int64_t e) {
    for (Box& box : flat_range_boxes(inner_shape, b, e - b)) {
      box.start.insert(box.start.begin(), row);
      box.count.insert(box.count.begin(), 1);
      out.push_back(std::move(box));
    }
  };
  int64_t first_row = begin / inner;
  const int64_t last_row = (end - 1) / inner;
  if (first_row == last_row) {
    prefixed(first_row, begin - first_row * inner, end - first_row * inner);
    return out;
  }
  if (begin % inner != 0) {  // partial first row
    prefixed(first_row, begin % inner, inner);
    ++first_row;
  }
  const int64_t full_end = end / inner;  // rows [first_row, full_end) are whole
  if (full_end > first_row) {
    Box box;
    box.start.assign(shape.size(), 0);
    box.count = shape;
    box.start[0] = first_row;
    box.count[0] = full_end - first_row;
    out.push_back(std::move(box));
  }
  if (end % inner != 0) prefixed(full_end, 0, end % inner);  // partial last row
  return out;
}

}  // namespace shardlm
