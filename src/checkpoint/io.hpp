// io.hpp — how a checkpoint's bytes move between shards and disk,
// and how a file becomes durable.
//
// Owns: the raw I/O modes (collective MPI-IO, independent MPI-IO, direct
// POSIX/O_DIRECT at HDF5's offsets) and the choice between them, hyperslab
// transfers in bounded calls, the RawFile that bypasses the page cache, file
// access property lists, fsync / atomic small-file writes / space
// reservation. Knows HDF5, MPI and POSIX; knows nothing about what the
// datasets mean (checkpoint/layout.hpp), the training state or retention.
#pragma once

#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "shardlm/h5util.hpp"

namespace shardlm::ckpt {

// Elements one rank moves in one H5Dwrite/H5Dread: MPI-IO counts in int, and
// HDF5 1.10 cannot move 2 GiB in one call. Every rank makes the same number of
// calls per dataset (empty selections where it has nothing left).
constexpr int64_t kMaxElemsPerCall = int64_t(1) << 26;  // 256 MiB of fp32
// Serial reads (inspect, export) stream in chunks of this many elements.
constexpr int64_t kChunkElems = int64_t(1) << 24;       // 64 MiB of fp32

// Calls per dataset of `numel` elements whose largest slice on any rank is at
// most `shard_numel`: the same on every rank (a pure function of the layout).
int rounds_for(int64_t numel, int64_t shard_numel);

// Selects elements [begin, begin + count) of the flattened dataset in `file_space`.
void select_flat(hid_t file_space, const std::vector<int64_t>& shape, int64_t begin, int64_t count);

// Moves elements [begin, begin + count) of the flattened dataset to (write) or
// from (read) `buffer`, in `rounds` calls that every rank makes.
template <class T>
void transfer(hid_t dset, const std::vector<int64_t>& shape, int64_t begin, int64_t count, T* buffer, int rounds,
              hid_t dxpl, hid_t mem_type, bool write) {
  T dummy{};
  for (int r = 0; r < rounds; ++r) {
    const int64_t lo = static_cast<int64_t>(r) * kMaxElemsPerCall;
    const int64_t n = std::clamp<int64_t>(count - lo, 0, kMaxElemsPerCall);
    h5::Handle file_space(H5_CHECK(H5Dget_space(dset)), H5Sclose);
    select_flat(file_space, shape, begin + lo, n);
    const hsize_t mem_n = static_cast<hsize_t>(std::max<int64_t>(n, 1));
    h5::Handle mem_space(H5_CHECK(H5Screate_simple(1, &mem_n, nullptr)), H5Sclose);
    if (n == 0) H5_CHECK(H5Sselect_none(mem_space));
    T* ptr = n > 0 ? buffer + lo : &dummy;
    if (write) H5_CHECK(H5Dwrite(dset, mem_type, mem_space, file_space, dxpl, ptr));
    else H5_CHECK(H5Dread(dset, mem_type, mem_space, file_space, dxpl, ptr));
  }
}

// Parallel HDF5 on `comm` with collective metadata reads and writes.
h5::Handle mpio_fapl(MPI_Comm comm);
// Serial read-only open without file locking (inspect, export, info).
h5::Handle open_serial(const std::filesystem::path& path);

// Nodes the communicator spans (ranks sharing memory count as one node).
int node_count(MPI_Comm comm);
// True on one rank per node of `comm` (collective).
bool node_leader(MPI_Comm comm);

// How ranks move raw data (SHARDLM_CKPT_XFER overrides the default):
//   collective  (default across nodes) collective MPI-IO: the MPI-IO layer
//               aggregates the ranks' pieces into large aligned requests,
//               which parallel file systems want;
//   direct      (default on one node) POSIX I/O at the offsets HDF5 allocated,
//               whole 4 KiB blocks with O_DIRECT (RawFile, below);
//   independent independent MPI-IO.
// Measured on one node in docs/benchmarks.md ("Checkpoint I/O").
enum class RawMode { Collective, Independent, Direct };
RawMode raw_mode(MPI_Comm comm);  // collective
h5::Handle transfer_plist(RawMode mode);

// Raw data of contiguous datasets moved with POSIX I/O at the byte offsets HDF5
// allocated (the file stays a plain HDF5 file). The whole 4 KiB blocks inside a
// piece go through O_DIRECT and a 4 KiB-aligned staging buffer: the page cache
// would cost a copy of every byte and, on the VMs we measured, a first touch of
// every page. The partial blocks at either end are written buffered: they may
// share a block with another rank's piece or with HDF5 metadata, and one
// node's page cache keeps those coherent, which is why direct mode is the
// single-node default only. Without O_DIRECT (tmpfs, some file systems) all of
// it is buffered.
class RawFile {
 public:
  static constexpr int64_t kBlock = 4096;
  static constexpr int64_t kStaging = int64_t(16) << 20;

  RawFile(const std::filesystem::path& path, bool write);
  ~RawFile();
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;

  void write(int64_t offset, const void* src, int64_t bytes) { move(offset, const_cast<void*>(src), bytes, true); }
  void read(int64_t offset, void* dst, int64_t bytes) { move(offset, dst, bytes, false); }
  // fsync: what this process wrote (and any other on this node) is on the disk.
  void sync();

 private:
  void all(int fd, char* p, int64_t n, int64_t off, bool write);
  void move(int64_t offset, void* buffer, int64_t bytes, bool write);

  std::filesystem::path path_;
  int buffered_ = -1, direct_ = -1;
  char* staging_ = nullptr;
};

// Byte offset of a dataset's data when RawFile can read it: contiguous,
// allocated, unfiltered little-endian float32 (what shardlm writes); -1 when
// not (a file rewritten by other tools), and HDF5 reads it instead.
int64_t raw_offset(hid_t dset);

// An HDF5 file id that is closed explicitly (and checked) on success, and
// closed quietly when an exception unwinds.
class FileId {
 public:
  FileId() = default;
  FileId(const FileId&) = delete;
  FileId& operator=(const FileId&) = delete;
  ~FileId() {
    if (id_ >= 0) H5Fclose(id_);
  }
  void reset(hid_t id) { id_ = id; }
  operator hid_t() const { return id_; }  // NOLINT
  void close() { H5_CHECK(H5Fclose(std::exchange(id_, H5I_INVALID_HID))); }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

// fsync a file or directory; ENOSPC and EIO of delayed allocation show up here.
void sync_path(const std::filesystem::path& path, bool directory);
// Writes `text` to dir/name atomically: name.tmp, fsync, rename, fsync dir.
void write_atomically(const std::filesystem::path& dir, const std::string& name, const std::string& text);
// Reserves the file's blocks so the raw-data writes cannot run out of space:
// a full disk shows up here, while the metadata is already on disk and clean.
// Filesystems without fallocate (some NFS, Lustre versions) skip it.
void reserve_space(const std::filesystem::path& path, int64_t bytes);
// "N MiB free on the filesystem of DIR", for messages about failed writes.
std::string free_space_text(const std::filesystem::path& dir);

}  // namespace shardlm::ckpt
