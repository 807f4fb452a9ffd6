// checkpoint.cpp — HDF5 checkpoints: layout, checksums, collective save and
// load, resume choice, retention, stop signals, inspect and export.
// Layout and protocol: docs/checkpoint.md.
#include "shardlm/checkpoint.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <type_traits>

#include "shardlm/h5util.hpp"
#include "shardlm/hf.hpp"
#include "shardlm/model.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/train.hpp"

namespace fs = std::filesystem;

namespace shardlm {
namespace {

// Elements one rank moves in one H5Dwrite/H5Dread: MPI-IO counts in int, and
// HDF5 1.10 cannot move 2 GiB in one call. Every rank makes the same number of
// calls per dataset (empty selections where it has nothing left).
constexpr int64_t kMaxElemsPerCall = int64_t(1) << 26;  // 256 MiB of fp32
// Serial reads (inspect, export) stream in chunks of this many elements.
constexpr int64_t kChunkElems = int64_t(1) << 24;       // 64 MiB of fp32

std::string show_shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string mib(double bytes) { return fmt("%.1f MiB", bytes / 1048576.0); }

// ------------------------------------------------------------ agreement
//
// Every collective phase runs on every rank and is followed by one all-reduce:
// if any rank failed, every rank throws the lowest failing rank's error, with
// its type, so no rank walks into the next collective alone.

enum class FaultKind : int { None = 0, Error = 1, Damaged = 2, Mismatch = 3 };

struct Outcome {
  FaultKind kind = FaultKind::None;
  std::string message;
};

void rethrow_agreed(MPI_Comm comm, const Outcome& mine) {
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int candidate = mine.kind == FaultKind::None ? size : rank, first = size;
  MPI_CHECK(MPI_Allreduce(&candidate, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == size) return;
  int kind = static_cast<int>(mine.kind);
  int64_t length = static_cast<int64_t>(mine.message.size());
  MPI_CHECK(MPI_Bcast(&kind, 1, MPI_INT, first, comm));
  MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT64_T, first, comm));
  std::string message = mine.message;
  message.resize(static_cast<size_t>(length));
  MPI_CHECK(MPI_Bcast(message.data(), static_cast<int>(length), MPI_CHAR, first, comm));
  switch (static_cast<FaultKind>(kind)) {
    case FaultKind::Damaged: throw CheckpointDamaged(message);
    case FaultKind::Mismatch: throw CheckpointMismatch(message);
    default: throw Error(message);
  }
}

template <class F>
void agreed(MPI_Comm comm, F&& phase) {
  Outcome mine;
  try {
    phase();
  } catch (const CheckpointMismatch& e) {
    mine = {FaultKind::Mismatch, e.what()};
  } catch (const CheckpointDamaged& e) {
    mine = {FaultKind::Damaged, e.what()};
  } catch (const std::exception& e) {
    mine = {FaultKind::Error, e.what()};
  }
  rethrow_agreed(comm, mine);
}

int comm_rank(MPI_Comm comm) {
  int r = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &r));
  return r;
}
int comm_size(MPI_Comm comm) {
  int s = 1;
  MPI_CHECK(MPI_Comm_size(comm, &s));
  return s;
}

std::string bcast_string(MPI_Comm comm, std::string value, int root = 0) {
  int64_t length = static_cast<int64_t>(value.size());
  MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT64_T, root, comm));
  value.resize(static_cast<size_t>(length));
  MPI_CHECK(MPI_Bcast(value.data(), static_cast<int>(length), MPI_CHAR, root, comm));
  return value;
}

// ------------------------------------------------------------ fault injection
//
// SHARDLM_CKPT_FAULT="<what>[:<step>]@<rank>": rank <rank> of the trainers, while
// writing step <step>'s checkpoint (any step when absent), after the first
// tensor: write = an I/O error, kill = SIGKILL itself, stall = sleep until killed.
// The fault tests use it to stop a save half-way, deterministically.
void maybe_inject_save_fault(int rank, int64_t step) {
  const char* spec = std::getenv("SHARDLM_CKPT_FAULT");
  if (!spec || !*spec) return;
  const std::string s = spec;
  const size_t at = s.find('@');
  if (at == std::string::npos || std::atoi(s.c_str() + at + 1) != rank) return;
  std::string what = s.substr(0, at);
  if (const size_t colon = what.find(':'); colon != std::string::npos) {
    if (std::atoll(what.c_str() + colon + 1) != step) return;
    what.resize(colon);
  }
  if (what == "write") SHARDLM_FAIL("injected write error (SHARDLM_CKPT_FAULT=%s): No space left on device", spec);
  if (what == "kill") raise(SIGKILL);
  if (what == "stall")
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// ------------------------------------------------------------ HDF5 attributes

h5::Handle scalar_space() { return h5::Handle(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose); }

void write_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* value) {
  h5::Handle space = scalar_space();
  h5::Handle attr(H5_CHECK(H5Acreate2(obj, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
  H5_CHECK(H5Awrite(attr, mem_type, value));
}
void attr_i64(hid_t obj, const char* name, int64_t v) { write_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v); }
void attr_u64(hid_t obj, const char* name, uint64_t v) { write_attr(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &v); }
void attr_f64(hid_t obj, const char* name, double v) { write_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v); }
// Variable-length UTF-8: h5py reads it as str.
void attr_str(hid_t obj, const char* name, const std::string& v) {
  h5::Handle type(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_size(type, H5T_VARIABLE));
  H5_CHECK(H5Tset_cset(type, H5T_CSET_UTF8));
  const char* text = v.c_str();
  write_attr(obj, name, type, type, &text);
}

h5::Handle open_attr(hid_t obj, const char* name) {
  SHARDLM_CHECK(H5_CHECK(H5Aexists(obj, name)) > 0, "attribute '%s' is missing", name);
  return h5::Handle(H5_CHECK(H5Aopen(obj, name, H5P_DEFAULT)), H5Aclose);
}
int64_t read_i64(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  int64_t v = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_INT64, &v));
  return v;
}
uint64_t read_u64(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  uint64_t v = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_UINT64, &v));
  return v;
}
double read_f64(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  double v = 0;
  H5_CHECK(H5Aread(attr, H5T_NATIVE_DOUBLE, &v));
  return v;
}
std::string read_str(hid_t obj, const char* name) {
  h5::Handle attr = open_attr(obj, name);
  h5::Handle type(H5_CHECK(H5Aget_type(attr)), H5Tclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_STRING, "attribute '%s' is not a string", name);
  h5::Handle mem(H5_CHECK(H5Tcopy(H5T_C_S1)), H5Tclose);
  H5_CHECK(H5Tset_cset(mem, H5Tget_cset(type)));  // HDF5 does not convert between ASCII and UTF-8
  if (H5_CHECK(H5Tis_variable_str(type)) > 0) {
    H5_CHECK(H5Tset_size(mem, H5T_VARIABLE));
    char* text = nullptr;
    H5_CHECK(H5Aread(attr, mem, &text));
    std::string out = text ? text : "";
    H5free_memory(text);
    return out;
  }
  const size_t size = H5Tget_size(type);
  H5_CHECK(H5Tset_size(mem, size + 1));
  std::string out(size + 1, '\0');
  H5_CHECK(H5Aread(attr, mem, out.data()));
  out.resize(std::strlen(out.c_str()));
  return out;
}

// The architecture as attributes of /model: enough to rebuild the layout
// (export, inspect) without the deck or model.hf.
void write_arch(hid_t g, const ModelConfig& a, int64_t parameter_count, int64_t tensors) {
  attr_str(g, "arch", a.arch);
  attr_i64(g, "vocab_size", a.vocab_size);
  attr_i64(g, "hidden_size", a.hidden_size);
  attr_i64(g, "intermediate_size", a.intermediate_size);
  attr_i64(g, "num_layers", a.num_layers);
  attr_i64(g, "num_heads", a.num_heads);
  attr_i64(g, "num_kv_heads", a.num_kv_heads);
  attr_i64(g, "head_dim", a.head_dim);
  attr_i64(g, "max_position_embeddings", a.max_position_embeddings);
  attr_f64(g, "rms_norm_eps", a.rms_norm_eps);
  attr_f64(g, "rope_theta", a.rope_theta);
  attr_str(g, "rope_scaling_type", a.rope_scaling.type);
  attr_f64(g, "rope_scaling_factor", a.rope_scaling.factor);
  attr_f64(g, "rope_scaling_low_freq_factor", a.rope_scaling.low_freq_factor);
  attr_f64(g, "rope_scaling_high_freq_factor", a.rope_scaling.high_freq_factor);
  attr_i64(g, "rope_scaling_original_max_position_embeddings", a.rope_scaling.original_max_position_embeddings);
  attr_i64(g, "attention_bias", a.attention_bias);
  attr_i64(g, "qk_norm", a.qk_norm);
  attr_i64(g, "tie_word_embeddings", a.tie_word_embeddings);
  attr_i64(g, "bos_token_id", a.bos_token_id);
  attr_i64(g, "eos_token_id", a.eos_token_id);
  attr_i64(g, "parameter_count", parameter_count);
  attr_i64(g, "tensors", tensors);
}

ModelConfig read_arch(hid_t g) {
  ModelConfig a;
  a.arch = read_str(g, "arch");
  a.vocab_size = read_i64(g, "vocab_size");
  a.hidden_size = read_i64(g, "hidden_size");
  a.intermediate_size = read_i64(g, "intermediate_size");
  a.num_layers = read_i64(g, "num_layers");
  a.num_heads = read_i64(g, "num_heads");
  a.num_kv_heads = read_i64(g, "num_kv_heads");
  a.head_dim = read_i64(g, "head_dim");
  a.max_position_embeddings = read_i64(g, "max_position_embeddings");
  a.rms_norm_eps = read_f64(g, "rms_norm_eps");
  a.rope_theta = read_f64(g, "rope_theta");
  a.rope_scaling.type = read_str(g, "rope_scaling_type");
  a.rope_scaling.factor = read_f64(g, "rope_scaling_factor");
  a.rope_scaling.low_freq_factor = read_f64(g, "rope_scaling_low_freq_factor");
  a.rope_scaling.high_freq_factor = read_f64(g, "rope_scaling_high_freq_factor");
  a.rope_scaling.original_max_position_embeddings = read_i64(g, "rope_scaling_original_max_position_embeddings");
  a.attention_bias = read_i64(g, "attention_bias") != 0;
  a.qk_norm = read_i64(g, "qk_norm") != 0;
  a.tie_word_embeddings = read_i64(g, "tie_word_embeddings") != 0;
  a.bos_token_id = read_i64(g, "bos_token_id");
  a.eos_token_id = read_i64(g, "eos_token_id");
  return a;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = s.find(sep, start);
    const std::string piece = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!piece.empty()) out.push_back(piece);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

CheckpointInfo read_info(hid_t file, const fs::path& path) {
  CheckpointInfo info;
  info.path = path;
  info.format = read_i64(file, "format_version");
  if (info.format != kCheckpointFormat)  // sound, but not ours to read: refused, never skipped as damage
    throw CheckpointMismatch(fmt("checkpoint %s is in format %lld; this shardlm (%s) reads format %lld",
                                 path.c_str(), (long long)info.format, shardlm_version(),
                                 (long long)kCheckpointFormat));
  info.step = read_i64(file, "step");
  info.tokens_seen = read_i64(file, "tokens_seen");
  info.world_size_at_save = read_i64(file, "world_size_at_save");
  info.shardlm_version = read_str(file, "shardlm_version");
  info.saved_at = read_str(file, "saved_at");
  info.deck = read_str(file, "deck");
  info.bad_steps_in_a_row = read_i64(file, "bad_steps_in_a_row");
  info.bad_steps_total = read_i64(file, "bad_steps_total");
  {
    h5::Handle g(H5_CHECK(H5Gopen2(file, "model", H5P_DEFAULT)), H5Gclose);
    info.arch = read_arch(g);
    info.parameter_count = read_i64(g, "parameter_count");
    info.tensors = read_i64(g, "tensors");
  }
  {
    h5::Handle g(H5_CHECK(H5Gopen2(file, "optim", H5P_DEFAULT)), H5Gclose);
    info.optimizer = read_str(g, "name");
    info.optimizer_states = split(read_str(g, "states"), ',');
    info.optimizer_steps = read_i64(g, "steps_taken");
  }
  {
    h5::Handle g(H5_CHECK(H5Gopen2(file, "rng", H5P_DEFAULT)), H5Gclose);
    info.seed = static_cast<uint64_t>(read_i64(g, "seed"));
  }
  return info;
}

// ------------------------------------------------------------ what a checkpoint holds

// The optimizer's state arrays by their checkpoint names, in order.
std::vector<std::string> state_names(const Optimizer& optimizer) {
  std::vector<std::string> out;
  for (int k = 0; k < optimizer.states(); ++k) out.push_back(optimizer.state_name(k));
  return out;
}

// One fp32 dataset of the checkpoint and the shard buffers it comes from.
struct Tensor {
  std::string path;                   // /model/<name> or /optim/<name>/<state>
  size_t unit = 0;
  const ParamInfo* param = nullptr;
  std::vector<Buffer<float>>* shards = nullptr;  // [unit] (shard_numel)
};

std::vector<Tensor> tensors_of(TrainSession& s) {
  std::vector<Tensor> out;
  const auto& units = s.model.layout.units;
  for (size_t u = 0; u < units.size(); ++u)
    for (const auto& p : units[u].params) out.push_back({"/model/" + p.name, u, &p, &s.model.param});
  // Muon keeps one state on its matrices: an empty name means "no such array here".
  for (int k = 0; k < s.optimizer.states(); ++k)
    for (size_t u = 0; u < units.size(); ++u)
      for (const auto& p : units[u].params)
        if (const std::string name = s.optimizer.state_name(k, units[u], p); !name.empty())
          out.push_back({"/optim/" + p.name + "/" + name, u, &p, &s.optimizer.state(k)});
  return out;
}

// This rank's part of tensor t: elements [begin, begin + count) of the
// flattened parameter, at `shard_offset` in the unit's shard.
struct LocalRange {
  int64_t begin = 0, count = 0, shard_offset = 0;
};

LocalRange local_range(const ShardedModel& model, const Tensor& t) {
  const Unit& u = model.layout.units[t.unit];
  for (const auto& seg : model.segments(u))
    if (seg.param == t.param) return {seg.param_begin, seg.count, seg.shard_offset};
  return {};
}

// Calls per dataset: the same on every rank (a pure function of the layout).
int rounds_for(const ShardedModel& model, const Tensor& t) {
  const int64_t most = std::min(t.param->numel, model.layout.units[t.unit].shard_numel);
  return static_cast<int>(std::max<int64_t>(1, (most + kMaxElemsPerCall - 1) / kMaxElemsPerCall));
}

// ------------------------------------------------------------ hyperslab transfer

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

std::vector<int64_t> dataset_shape(hid_t dset) {
  h5::Handle space(H5_CHECK(H5Dget_space(dset)), H5Sclose);
  const int nd = H5_CHECK(H5Sget_simple_extent_ndims(space));
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  H5_CHECK(H5Sget_simple_extent_dims(space, dims.data(), nullptr));
  return std::vector<int64_t>(dims.begin(), dims.end());
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool link_exists(hid_t loc, const std::string& path) {
  // Every intermediate group must exist for H5Lexists on a nested path.
  size_t pos = 0;
  while ((pos = path.find('/', pos + 1)) != std::string::npos)
    if (H5_CHECK(H5Lexists(loc, path.substr(0, pos).c_str(), H5P_DEFAULT)) <= 0) return false;
  return H5_CHECK(H5Lexists(loc, path.c_str(), H5P_DEFAULT)) > 0;
}

// ------------------------------------------------------------ files

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
  MPI_CHECK(MPI_Allreduce(&leader, &nodes, 1, MPI_INT, MPI_SUM, comm));
  return nodes;
}

// How ranks move raw data (SHARDLM_CKPT_XFER overrides the default):
//   collective  (default across nodes) collective MPI-IO: the MPI-IO layer
//               aggregates the ranks' pieces into large aligned requests,
//               which parallel file systems want;
//   direct      (default on one node) POSIX I/O at the offsets HDF5 allocated,
//               whole 4 KiB blocks with O_DIRECT (RawFile, below);
//   independent independent MPI-IO.
// Measured on one node in docs/benchmarks.md ("Checkpoint I/O").
enum class RawMode { Collective, Independent, Direct };

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

  RawFile(const fs::path& path, bool write) : path_(path) {
    const int flags = write ? O_WRONLY : O_RDONLY;
    buffered_ = ::open(path.c_str(), flags);
    SHARDLM_CHECK(buffered_ >= 0, "cannot open %s: %s", path.c_str(), std::strerror(errno));
    direct_ = ::open(path.c_str(), flags | O_DIRECT);
    if (direct_ >= 0) staging_ = static_cast<char*>(std::aligned_alloc(kBlock, kStaging));
    SHARDLM_CHECK(direct_ < 0 || staging_, "cannot allocate the %lld-byte checkpoint staging buffer",
                  (long long)kStaging);
  }
  ~RawFile() {
    if (buffered_ >= 0) ::close(buffered_);
    if (direct_ >= 0) ::close(direct_);
    std::free(staging_);
  }
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;

  void write(int64_t offset, const void* src, int64_t bytes) { move(offset, const_cast<void*>(src), bytes, true); }
  void read(int64_t offset, void* dst, int64_t bytes) { move(offset, dst, bytes, false); }

 private:
  void all(int fd, char* p, int64_t n, int64_t off, bool write) {
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
  void move(int64_t offset, void* buffer, int64_t bytes, bool write) {
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

  fs::path path_;
  int buffered_ = -1, direct_ = -1;
  char* staging_ = nullptr;
};

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

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// fsync a file or directory; ENOSPC and EIO of delayed allocation show up here.
void sync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  SHARDLM_CHECK(fd >= 0, "cannot open %s to sync it: %s", path.c_str(), std::strerror(errno));
  const int rc = ::fsync(fd);
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

// step_<N>.h5 -> N, or -1 for any other name.
int64_t step_of(const std::string& name) {
  if (name.size() < 9 || name.rfind("step_", 0) != 0 || name.substr(name.size() - 3) != ".h5") return -1;
  const std::string digits = name.substr(5, name.size() - 8);
  if (digits.empty() || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

std::map<int64_t, fs::path> step_files(const fs::path& dir) {
  std::map<int64_t, fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0 && e.is_regular_file()) out[step] = e.path();
  }
  return out;
}

// Rank 0, before writing: the directory exists, partial files of crashed
// saves are gone, and the file fits on the disk.
void prepare_dir(const fs::path& dir, int64_t bytes_needed, int64_t keep_last) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  SHARDLM_CHECK(!ec && fs::is_directory(dir), "cannot create the checkpoint directory %s: %s", dir.c_str(),
                ec ? ec.message().c_str() : "a file of that name is in the way");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool stale = name == "latest.tmp" || (name.size() > 4 && name.substr(name.size() - 4) == ".tmp" &&
                                               step_of(name.substr(0, name.size() - 4)) >= 0);
    if (stale) {
      std::error_code rm;
      fs::remove(e.path(), rm);
      std::printf("checkpoint: removed %s, left by an interrupted save\n", e.path().c_str());
    }
  }
  // Tests: SHARDLM_CKPT_SKIP_SPACE_CHECK=1 skips this and the reservation, so a
  // save runs into a real ENOSPC in its writes;
  // SHARDLM_CKPT_FAKE_FREE_BYTES=N pretends the disk has N bytes free.
  const char* skip = std::getenv("SHARDLM_CKPT_SKIP_SPACE_CHECK");
  const char* fake = std::getenv("SHARDLM_CKPT_FAKE_FREE_BYTES");
  struct statvfs st {};
  if ((!skip || !*skip) && ((fake && *fake) || ::statvfs(dir.c_str(), &st) == 0)) {
    const double free_bytes = fake && *fake ? std::atof(fake)
                                            : static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize);
    SHARDLM_CHECK(free_bytes >= static_cast<double>(bytes_needed),
                  "not enough free space in %s: a checkpoint needs about %s and %s are free (ckpt.keep_last = %lld "
                  "keeps that many files plus the one being written); free space, lower ckpt.keep_last or move "
                  "run.dir",
                  dir.c_str(), mib(static_cast<double>(bytes_needed)).c_str(), mib(free_bytes).c_str(),
                  (long long)keep_last);
  }
}

// Rank 0, after a save: delete what retention does not keep.
void apply_retention(const fs::path& dir, int64_t current, const CkptSection& ckpt) {
  std::vector<int64_t> present;
  const auto files = step_files(dir);
  for (const auto& [step, path] : files) present.push_back(step);
  for (int64_t step : checkpoints_to_delete(present, current, ckpt.keep_last, ckpt.keep_interval)) {
    std::error_code ec;
    fs::remove(files.at(step), ec);
    if (ec)
      std::fprintf(stderr, "shardlm: warning: retention could not remove %s: %s\n", files.at(step).c_str(),
                   ec.message().c_str());
  }
}

// ------------------------------------------------------------ save

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

// The collective write. Order matters for failures: parallel HDF5 cannot close
// a file whose metadata flush failed on some ranks without hanging, so all
// metadata is created and flushed first, the file's space is reserved, and
// only then is raw data written; a failed raw write leaves clean metadata and
// a close that every rank completes.
void write_file(TrainSession& s, MPI_Comm comm, const fs::path& tmp, int64_t steps_done, int64_t tokens_seen,
                const std::vector<Tensor>& tensors, const std::vector<uint64_t>& sums, uint64_t position_sum,
                const std::vector<int64_t>& position, const std::string& saved_at) {
  const int rank = comm_rank(comm);
  FileId file;
  std::vector<h5::Handle> dsets;
  h5::Handle position_dset;
  agreed(comm, [&] {
    h5::Handle fapl = mpio_fapl(comm);
    file.reset(H5_CHECK(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)));
  });
  agreed(comm, [&] {
    // Metadata: every rank makes the same calls with the same values. No
    // timestamps in object headers: the same state gives the same bytes.
    h5::Handle gcpl(H5_CHECK(H5Pcreate(H5P_GROUP_CREATE)), H5Pclose);
    H5_CHECK(H5Pset_obj_track_times(gcpl, false));
    auto group = [&](hid_t parent, const std::string& name) {
      return h5::Handle(H5_CHECK(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, gcpl, H5P_DEFAULT)), H5Gclose);
    };
    attr_i64(file, "format_version", kCheckpointFormat);
    attr_i64(file, "step", steps_done);
    attr_i64(file, "tokens_seen", tokens_seen);
    attr_i64(file, "world_size_at_save", comm_size(comm));
    attr_str(file, "shardlm_version", std::string(shardlm_version()) + " (" + shardlm_git_rev() + ")");
    attr_str(file, "saved_at", saved_at);
    attr_str(file, "deck", resolved_deck(s.config));
    attr_i64(file, "bad_steps_in_a_row", s.bad_steps_in_a_row);
    attr_i64(file, "bad_steps_total", s.bad_steps_total);
    const ModelLayout& layout = s.model.layout;
    int64_t n_params = 0;
    for (const auto& u : layout.units) n_params += static_cast<int64_t>(u.params.size());
    const auto names = state_names(s.optimizer);
    {
      h5::Handle g = group(file, "model");
      write_arch(g, layout.config, layout.parameter_count(), n_params);
      h5::Handle o = group(file, "optim");
      attr_str(o, "name", s.optimizer.name());
      attr_str(o, "states", join(names, ","));
      attr_i64(o, "steps_taken", s.optimizer.steps_taken());
      const OptimSection& oc = s.config.optim;
      attr_f64(o, "lr", oc.lr);
      attr_f64(o, "beta1", oc.beta1);
      attr_f64(o, "beta2", oc.beta2);
      attr_f64(o, "eps", oc.eps);
      attr_f64(o, "weight_decay", oc.weight_decay);
      attr_f64(o, "momentum", oc.momentum);
      std::set<std::string> made;
      for (const auto& t : tensors)
        if (t.path.rfind("/optim/", 0) == 0 && made.insert(t.param->name).second) group(o, t.param->name);
      h5::Handle d = group(file, "data");
      attr_str(d, "position_fields", "format, step, rows_consumed, seq_len, seed, documents, shuffle");
      h5::Handle r = group(file, "rng");
      attr_i64(r, "seed", s.config.run.seed);
      attr_str(r, "note",
               "counter-based: initial weights = f(seed, name, index), data order = f(seed, epoch); "
               "no other generator state");
    }
    // Raw data is written once, by the ranks: no fill values, space allocated now.
    h5::Handle dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)), H5Pclose);
    H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
    H5_CHECK(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
    H5_CHECK(H5Pset_obj_track_times(dcpl, false));
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& shape = tensors[i].param->shape;
      std::vector<hsize_t> dims(shape.begin(), shape.end());
      h5::Handle space(H5_CHECK(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr)), H5Sclose);
      dsets.emplace_back(H5_CHECK(H5Dcreate2(file, tensors[i].path.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT,
                                             dcpl, H5P_DEFAULT)),
                         H5Dclose);
      attr_u64(dsets.back(), "checksum", sums[i]);
    }
    const hsize_t n = position.size();
    h5::Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
    position_dset = h5::Handle(
        H5_CHECK(H5Dcreate2(file, "/data/position", H5T_STD_I64LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT)),
        H5Dclose);
    attr_u64(position_dset, "checksum", position_sum);
    H5_CHECK(H5Fflush(file, H5F_SCOPE_GLOBAL));
  });
  std::vector<int64_t> offsets(tensors.size());
  agreed(comm, [&] {
    int64_t end = 0;  // past the last byte of raw data: every dataset's space is allocated by now
    for (size_t i = 0; i < tensors.size(); ++i) {
      const haddr_t offset = H5Dget_offset(dsets[i]);
      SHARDLM_CHECK(offset != HADDR_UNDEF, "no file space for %s", tensors[i].path.c_str());
      offsets[i] = static_cast<int64_t>(offset);
      end = std::max(end, offsets[i] + tensors[i].param->numel * 4);
    }
    const char* skip = std::getenv("SHARDLM_CKPT_SKIP_SPACE_CHECK");  // tests: reach ENOSPC in the writes
    if (rank == 0 && !(skip && *skip)) reserve_space(tmp, end);
  });

  const RawMode mode = raw_mode(comm);
  h5::Handle dxpl = transfer_plist(mode);
  std::unique_ptr<RawFile> raw;
  if (mode == RawMode::Direct) agreed(comm, [&] { raw = std::make_unique<RawFile>(tmp, true); });
  for (size_t i = 0; i < tensors.size(); ++i) {
    agreed(comm, [&] {
      const Tensor& t = tensors[i];
      try {
        const LocalRange r = local_range(s.model, t);
        float* base = (*t.shards)[t.unit].data() + r.shard_offset;
        if (raw) raw->write(offsets[i] + r.begin * 4, base, r.count * 4);
        else transfer<float>(dsets[i], t.param->shape, r.begin, r.count, base, rounds_for(s.model, t), dxpl,
                             H5T_NATIVE_FLOAT, true);
        if (i == 0) maybe_inject_save_fault(rank, steps_done);
      } catch (const std::exception& e) {
        SHARDLM_FAIL("writing %s failed on rank %d: %s (%s)", t.path.c_str(), rank, e.what(),
                     free_space_text(tmp.parent_path()).c_str());
      }
    });
  }
  agreed(comm, [&] {
    std::vector<int64_t> values = position;
    transfer<int64_t>(position_dset, {static_cast<int64_t>(values.size())}, 0,
                      rank == 0 ? static_cast<int64_t>(values.size()) : 0, values.data(), 1, dxpl, H5T_NATIVE_INT64,
                      true);
  });
  agreed(comm, [&] {
    raw.reset();
    position_dset.reset();
    dsets.clear();
    file.close();
  });
}

}  // namespace

// ------------------------------------------------------------ pure pieces

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t count) {
  std::vector<Box> out;
  if (count <= 0) return out;
  if (shape.size() <= 1) {
    out.push_back({{begin}, {count}});
    return out;
  }
  const std::vector<int64_t> inner_shape(shape.begin() + 1, shape.end());
  const int64_t inner = numel_of(inner_shape);
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

namespace {
// splitmix64's finaliser over (index, value bits): for a fixed index it is a
// bijection of the bits, so changing any one element always changes the sum.
inline uint64_t mix(uint64_t index, uint64_t bits) {
  uint64_t x = bits ^ (index * 0x9E3779B97F4A7C15ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  return x;
}
}  // namespace

uint64_t checksum_f32(const float* values, int64_t first_index, int64_t count) {
  uint64_t sum = 0;  // unsigned: wraps mod 2^64, so any split and order give the same sum
#pragma omp parallel for reduction(+ : sum) schedule(static) if (count > (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, sizeof(bits));
    sum += mix(static_cast<uint64_t>(first_index + i), bits);
  }
  return sum;
}

uint64_t checksum_i64(const int64_t* values, int64_t first_index, int64_t count) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < count; ++i) sum += mix(static_cast<uint64_t>(first_index + i), static_cast<uint64_t>(values[i]));
  return sum;
}

std::vector<int64_t> checkpoints_to_delete(const std::vector<int64_t>& present, int64_t current, int64_t keep_last,
                                           int64_t keep_interval) {
  std::vector<int64_t> older;
  for (int64_t s : present)
    if (s <= current) older.push_back(s);
  std::sort(older.rbegin(), older.rend());
  std::vector<int64_t> out;
  int64_t kept = 0;
  for (int64_t s : older) {
    const bool newest = kept < std::max<int64_t>(keep_last, 1) || s == current;
    if (newest) {
      ++kept;
      continue;
    }
    if (keep_interval > 0 && s % keep_interval == 0) continue;
    out.push_back(s);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<fs::path> resume_candidates(const fs::path& dir, std::string* note) {
  std::vector<fs::path> out;
  const auto files = step_files(dir);
  int64_t newest_allowed = INT64_MAX;
  std::ifstream in(dir / "latest");
  if (in) {
    std::string name;
    std::getline(in, name);
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    const int64_t step = step_of(name);
    if (step >= 0 && files.count(step)) {
      out.push_back(files.at(step));
      newest_allowed = step - 1;
    } else if (note) {
      *note = fmt("%s names '%s', which is not a checkpoint file there; trying the newest step files",
                  (dir / "latest").c_str(), name.c_str());
    }
  } else if (note && !files.empty()) {
    *note = fmt("%s is missing; trying the newest step files", (dir / "latest").c_str());
  }
  for (auto it = files.rbegin(); it != files.rend(); ++it)
    if (it->first <= newest_allowed) out.push_back(it->second);
  return out;
}

fs::path checkpoint_dir(const Config& config) { return fs::path(config.run.dir) / "checkpoints"; }

fs::path checkpoint_path(const fs::path& dir, int64_t step) {
  return dir / ("step_" + std::to_string(step) + ".h5");
}

bool checkpoint_due(const CkptSection& ckpt, int64_t steps_done, int64_t max_steps) {
  if (steps_done <= 0) return false;
  if (steps_done == max_steps) return ckpt.save_final;
  return ckpt.interval > 0 && steps_done % ckpt.interval == 0;
}

// ------------------------------------------------------------ save

SaveResult save_checkpoint(TrainSession& s, MPI_Comm comm, int64_t steps_done, int64_t tokens_seen) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  const auto t0 = std::chrono::steady_clock::now();
  const int rank = comm_rank(comm);
  const fs::path dir = checkpoint_dir(s.config);
  SaveResult result;
  result.path = checkpoint_path(dir, steps_done);
  const fs::path tmp = result.path.string() + ".tmp";
  const std::vector<Tensor> tensors = tensors_of(s);

  try {
    s.pull_state();  // device-resident state (GPU): refresh the host shards we write from
    int64_t data_bytes = 0;
    for (const auto& t : tensors) data_bytes += t.param->numel * 4;
    const int64_t bytes_needed = data_bytes + static_cast<int64_t>(tensors.size()) * 4096 + (1 << 20);
    agreed(comm, [&] {
      if (rank == 0) prepare_dir(dir, bytes_needed, s.config.ckpt.keep_last);
    });

    // Checksums of what this rank holds, summed over ranks in one all-reduce.
    std::vector<uint64_t> sums(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const LocalRange r = local_range(s.model, tensors[i]);
      sums[i] = checksum_f32((*tensors[i].shards)[tensors[i].unit].data() + r.shard_offset, r.begin, r.count);
    }
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), static_cast<int>(sums.size()), MPI_UINT64_T, MPI_SUM, comm));
    // RL reads rollout files by step: no sampler position beyond the step itself.
    const std::vector<int64_t> position =
        s.data ? s.data->position(steps_done).to_vector() : DataPosition{steps_done}.to_vector();
    const uint64_t position_sum = checksum_i64(position.data(), 0, static_cast<int64_t>(position.size()));
    const std::string saved_at = bcast_string(comm, rank == 0 ? now_text() : "");

    const auto t_written = std::chrono::steady_clock::now();
    result.checksum_s = std::chrono::duration<double>(t_written - t0).count();
    write_file(s, comm, tmp, steps_done, tokens_seen, tensors, sums, position_sum, position, saved_at);
    const auto t_synced = std::chrono::steady_clock::now();
    result.write_s = std::chrono::duration<double>(t_synced - t_written).count();

    // Durable before visible: every node flushes its part, then rank 0 renames.
    agreed(comm, [&] {
      MPI_Comm node = MPI_COMM_NULL;
      MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
      const int node_rank = comm_rank(node);
      MPI_CHECK(MPI_Comm_free(&node));
      if (node_rank == 0) sync_path(tmp, false);
    });
    result.sync_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_synced).count();
    agreed(comm, [&] {
      if (rank != 0) return;
      result.bytes = static_cast<int64_t>(fs::file_size(tmp));
      std::error_code ec;
      fs::rename(tmp, result.path, ec);
      SHARDLM_CHECK(!ec, "cannot rename %s to %s: %s", tmp.c_str(), result.path.c_str(), ec.message().c_str());
      sync_path(dir, true);
      write_atomically(dir, "latest", result.path.filename().string() + "\n");
    });
    if (rank == 0) apply_retention(dir, steps_done, s.config.ckpt);
    result.ok = true;
  } catch (const std::exception& e) {
    result.ok = false;
    result.error = e.what();
    if (rank == 0) {
      std::error_code ec;
      fs::remove(tmp, ec);
    }
  }
  MPI_CHECK(MPI_Bcast(&result.bytes, 1, MPI_INT64_T, 0, comm));
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0) {
    if (result.ok)
      std::printf("checkpoint: saved %s (%s) in %.2f s, %.0f MiB/s (checksums %.2f s, write %.2f s, fsync %.2f s)\n",
                  result.path.c_str(), mib(static_cast<double>(result.bytes)).c_str(), result.seconds,
                  static_cast<double>(result.bytes) / 1048576.0 / std::max(result.seconds, 1e-9), result.checksum_s,
                  result.write_s, result.sync_s);
    else
      std::fprintf(stderr,
                   "shardlm: checkpoint %s FAILED: %s\n"
                   "shardlm: older checkpoints in %s are untouched; `latest` still names the previous one\n",
                   result.path.c_str(), result.error.c_str(), dir.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
  }
  return result;
}

// ------------------------------------------------------------ load

namespace {

std::vector<std::string> mismatches_of(TrainSession& s, hid_t file, const CheckpointInfo& info,
                                       const std::vector<Tensor>& tensors) {
  std::vector<std::string> out;
  const ModelConfig& mine = s.model.layout.config;
  const ModelConfig& theirs = info.arch;
  auto cmp = [&](const char* key, const auto& saved, const auto& now) {
    if (saved == now) return;
    std::string a, b;
    if constexpr (std::is_same_v<std::decay_t<decltype(saved)>, std::string>) a = saved, b = now;
    else a = std::to_string(saved), b = std::to_string(now);
    out.push_back(fmt("model.%s: %s in the checkpoint, %s in this run", key, a.c_str(), b.c_str()));
  };
  cmp("arch", theirs.arch, mine.arch);
  cmp("vocab_size", theirs.vocab_size, mine.vocab_size);
  cmp("hidden_size", theirs.hidden_size, mine.hidden_size);
  cmp("intermediate_size", theirs.intermediate_size, mine.intermediate_size);
  cmp("num_layers", theirs.num_layers, mine.num_layers);
  cmp("num_heads", theirs.num_heads, mine.num_heads);
  cmp("num_kv_heads", theirs.num_kv_heads, mine.num_kv_heads);
  cmp("head_dim", theirs.head_dim, mine.head_dim);
  cmp("attention_bias", static_cast<int>(theirs.attention_bias), static_cast<int>(mine.attention_bias));
  cmp("qk_norm", static_cast<int>(theirs.qk_norm), static_cast<int>(mine.qk_norm));
  cmp("tie_word_embeddings", static_cast<int>(theirs.tie_word_embeddings), static_cast<int>(mine.tie_word_embeddings));

  // Tensors: each one this run needs, with its shape; /model entries this run does not know.
  const auto names = state_names(s.optimizer);
  if (info.optimizer != s.optimizer.name())
    out.push_back(fmt("optim.name: %s in the checkpoint, %s in this run (optimizer state cannot carry over)",
                      info.optimizer.c_str(), s.optimizer.name().c_str()));
  else if (info.optimizer_states != names)
    out.push_back(fmt("optimizer state: [%s] in the checkpoint, [%s] in this run (optim.momentum changed between 0 "
                      "and > 0?)",
                      join(info.optimizer_states, ", ").c_str(), join(names, ", ").c_str()));
  std::vector<std::string> shape_problems;
  for (const auto& t : tensors) {
    if (t.path.rfind("/optim/", 0) == 0 && info.optimizer_states != names) continue;  // reported above
    if (!link_exists(file, t.path)) {
      shape_problems.push_back(fmt("%s: missing in the checkpoint (this run's shape %s)", t.path.c_str(),
                                   show_shape(t.param->shape).c_str()));
      continue;
    }
    h5::Handle d(H5_CHECK(H5Dopen2(file, t.path.c_str(), H5P_DEFAULT)), H5Dclose);
    h5::Handle type(H5_CHECK(H5Dget_type(d)), H5Tclose);
    const auto shape = dataset_shape(d);
    if (shape != t.param->shape)
      shape_problems.push_back(fmt("%s: shape %s in the checkpoint, %s in this run", t.path.c_str(),
                                   show_shape(shape).c_str(), show_shape(t.param->shape).c_str()));
    else if (H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != 4)
      shape_problems.push_back(fmt("%s: dtype %s in the checkpoint, float32 expected", t.path.c_str(),
                                   h5::dtype_name(type).c_str()));
  }
  {
    std::set<std::string> expected;
    for (const auto& t : tensors) expected.insert(t.path.substr(7));  // strip "/model/"
    std::vector<std::string> names_in_file;
    h5::Handle g(H5_CHECK(H5Gopen2(file, "model", H5P_DEFAULT)), H5Gclose);
    auto collect = [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
      static_cast<std::vector<std::string>*>(data)->push_back(name);
      return 0;
    };
    H5_CHECK(H5Literate(g, H5_INDEX_NAME, H5_ITER_INC, nullptr, collect, &names_in_file));
    for (const auto& n : names_in_file)
      if (!expected.count(n)) shape_problems.push_back(fmt("/model/%s: in the checkpoint, not in this model", n.c_str()));
  }
  const size_t kShow = 12;
  for (size_t i = 0; i < shape_problems.size() && i < kShow; ++i) out.push_back(shape_problems[i]);
  if (shape_problems.size() > kShow)
    out.push_back(fmt("... and %zu more tensor mismatches", shape_problems.size() - kShow));
  return out;
}

[[noreturn]] void throw_damaged(const fs::path& file, const std::string& why) {
  throw CheckpointDamaged(fmt("checkpoint %s is damaged or unreadable: %s", file.c_str(), why.c_str()));
}

}  // namespace

CheckpointInfo load_checkpoint(TrainSession& s, MPI_Comm comm, const fs::path& path) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  const int rank = comm_rank(comm);
  const std::vector<Tensor> tensors = tensors_of(s);
  h5::Handle file;
  CheckpointInfo info;
  std::vector<uint64_t> stored(tensors.size());
  std::vector<int64_t> position;

  agreed(comm, [&] {
    if (rank == 0 && !fs::exists(path)) SHARDLM_FAIL("checkpoint %s does not exist", path.c_str());
  });
  agreed(comm, [&] {
    try {
      h5::Handle fapl = mpio_fapl(comm);
      file = h5::Handle(H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl)), H5Fclose);
      info = read_info(file, path);
      h5::Handle d(H5_CHECK(H5Dopen2(file, "/data/position", H5P_DEFAULT)), H5Dclose);
      const auto shape = dataset_shape(d);
      SHARDLM_CHECK(shape.size() == 1 && shape[0] > 0 && shape[0] <= 8 + 2 * 4096, "/data/position has shape %s",
                    show_shape(shape).c_str());
      position.resize(static_cast<size_t>(shape[0]));
      H5_CHECK(H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, position.data()));
      const uint64_t want = read_u64(d, "checksum");
      if (checksum_i64(position.data(), 0, shape[0]) != want)
        SHARDLM_FAIL("checksum mismatch in /data/position");
    } catch (const CheckpointDamaged&) {
      throw;
    } catch (const CheckpointMismatch&) {
      throw;
    } catch (const std::exception& e) {
      throw_damaged(path, e.what());
    }
  });

  agreed(comm, [&] {
    std::vector<std::string> problems;
    try {
      problems = mismatches_of(s, file, info, tensors);
    } catch (const std::exception& e) {
      throw_damaged(path, e.what());
    }
    // The data order last: restore() only moves the sampler when it fits.
    try {
      info.data = DataPosition::from_vector(position);
      if (s.data) s.data->restore(info.data);
    } catch (const Error& e) {
      problems.push_back(e.what());
    }
    if (!problems.empty())
      throw CheckpointMismatch(fmt("checkpoint %s (step %lld) does not fit this run; %zu mismatch%s:\n  - %s\n"
                                   "Resume with the deck it was saved with (`shardlm inspect %s` prints it), or set "
                                   "ckpt.resume = \"none\" to start over",
                                   path.c_str(), (long long)info.step, problems.size(),
                                   problems.size() == 1 ? "" : "es", join(problems, "\n  - ").c_str(), path.c_str()));
  });

  // Tensor data: each rank reads its shards' intersection with every dataset.
  const RawMode mode = raw_mode(comm);
  h5::Handle dxpl = transfer_plist(mode);
  std::unique_ptr<RawFile> raw;
  if (mode == RawMode::Direct)
    agreed(comm, [&] {
      try {
        raw = std::make_unique<RawFile>(path, false);
      } catch (const std::exception& e) {
        throw_damaged(path, e.what());
      }
    });
  std::vector<uint64_t> sums(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    agreed(comm, [&] {
      try {
        const Tensor& t = tensors[i];
        h5::Handle d(H5_CHECK(H5Dopen2(file, t.path.c_str(), H5P_DEFAULT)), H5Dclose);
        stored[i] = read_u64(d, "checksum");
        const LocalRange r = local_range(s.model, t);
        float* base = (*t.shards)[t.unit].data() + r.shard_offset;
        const int64_t offset = raw ? raw_offset(d) : -1;  // the same on every rank: metadata
        if (offset >= 0) raw->read(offset + r.begin * 4, base, r.count * 4);
        else transfer<float>(d, t.param->shape, r.begin, r.count, base, rounds_for(s.model, t), dxpl,
                             H5T_NATIVE_FLOAT, false);
        sums[i] = checksum_f32(base, r.begin, r.count);
      } catch (const std::exception& e) {
        throw_damaged(path, fmt("%s: %s", tensors[i].path.c_str(), e.what()));
      }
    });
  }
  raw.reset();
  dxpl.reset();
  file.reset();
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), static_cast<int>(sums.size()), MPI_UINT64_T, MPI_SUM, comm));
  std::vector<std::string> bad;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (sums[i] != stored[i])
      bad.push_back(fmt("%s (stored %016llx, read %016llx)", tensors[i].path.c_str(), (unsigned long long)stored[i],
                        (unsigned long long)sums[i]));
  if (!bad.empty()) {
    const size_t shown = std::min<size_t>(bad.size(), 5);
    throw_damaged(path, fmt("checksum mismatch in %zu dataset%s: %s%s", bad.size(), bad.size() == 1 ? "" : "s",
                            join(std::vector<std::string>(bad.begin(), bad.begin() + shown), ", ").c_str(),
                            bad.size() > shown ? ", ..." : ""));
  }
  s.optimizer.set_steps_taken(info.optimizer_steps);
  s.bad_steps_in_a_row = info.bad_steps_in_a_row;
  s.bad_steps_total = info.bad_steps_total;
  s.push_state();  // device-resident state (GPU): the host shards we read into go to the device
  return info;
}

CheckpointInfo read_checkpoint_info(const fs::path& path) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  try {
    SHARDLM_CHECK(fs::exists(path), "no such file");
    h5::Handle file = open_serial(path);
    CheckpointInfo info = read_info(file, path);
    h5::Handle d(H5_CHECK(H5Dopen2(file, "/data/position", H5P_DEFAULT)), H5Dclose);
    std::vector<int64_t> position(static_cast<size_t>(numel_of(dataset_shape(d))));
    H5_CHECK(H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, position.data()));
    info.data = DataPosition::from_vector(position);
    return info;
  } catch (const CheckpointDamaged&) {
    throw;
  } catch (const CheckpointMismatch&) {
    throw;
  } catch (const std::exception& e) {
    throw_damaged(path, e.what());
  }
}

// ------------------------------------------------------------ resume

ResumePoint resume(TrainSession& s, MPI_Comm comm) {
  const int rank = comm_rank(comm);
  const std::string mode = s.config.ckpt.resume;
  ResumePoint point;
  auto loaded = [&](const CheckpointInfo& info) {
    point.path = info.path;
    point.step = info.step;
    point.tokens_seen = info.tokens_seen;
    if (rank == 0) {
      std::printf("checkpoint: resumed from %s at step %lld (saved on %lld rank%s, %s)\n", info.path.c_str(),
                  (long long)info.step, (long long)info.world_size_at_save, info.world_size_at_save == 1 ? "" : "s",
                  info.saved_at.c_str());
      std::fflush(stdout);
    }
  };
  if (mode == "none") return point;
  if (mode != "latest") {
    loaded(load_checkpoint(s, comm, mode));
    return point;
  }
  const fs::path dir = checkpoint_dir(s.config);
  std::string listed, note;
  if (rank == 0) {
    for (const auto& p : resume_candidates(dir, &note)) listed += p.string() + "\n";
    if (!note.empty()) std::fprintf(stderr, "shardlm: %s\n", note.c_str());
  }
  const std::vector<std::string> candidates = split(bcast_string(comm, listed), '\n');
  if (candidates.empty()) {
    if (rank == 0) std::printf("checkpoint: none in %s; starting at step 0\n", dir.c_str());
    return point;
  }
  for (const auto& c : candidates) {
    try {
      loaded(load_checkpoint(s, comm, c));
      return point;
    } catch (const CheckpointDamaged& e) {
      point.skipped.push_back(e.what());
      if (rank == 0) {
        std::fprintf(stderr, "shardlm: %s; trying the previous checkpoint\n", e.what());
        std::fflush(stderr);
      }
    }
  }
  SHARDLM_FAIL("every checkpoint in %s is damaged:\n  %s\nset ckpt.resume = \"none\" to start over, or "
               "ckpt.resume = \"<file>\" to pick one",
               dir.c_str(), join(point.skipped, "\n  ").c_str());
}

// ------------------------------------------------------------ stop signals

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) {
  if (sig == SIGINT && g_stop_signal != 0) {  // a second interrupt: stop at once, as an unhandled SIGINT does
    static const char now[] = "\nshardlm: second interrupt: stopping now, without a checkpoint\n";
    (void)!write(STDERR_FILENO, now, sizeof now - 1);
    signal(SIGINT, SIG_DFL);
    raise(SIGINT);
    return;
  }
  if (sig == SIGINT) {  // someone at a terminal: say what happens next
    static const char later[] = "\nshardlm: interrupt: saving a checkpoint after this step, then exit 75 "
                                "(interrupt again to stop at once)\n";
    (void)!write(STDERR_FILENO, later, sizeof later - 1);
  }
  g_stop_signal = sig;
}
}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // MPI's and HDF5's system calls carry on
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

bool stop_requested(MPI_Comm comm) {
  int mine = g_stop_signal, any = 0;
  MPI_CHECK(MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm));
  if (any && !g_stop_signal) g_stop_signal = any;
  return any != 0;
}

int stop_signal() { return g_stop_signal; }
void clear_stop_request() { g_stop_signal = 0; }

// ------------------------------------------------------------ inspect, export

namespace {

// Verifies one dataset by streaming it (serial); returns "" or the problem.
std::string verify_dataset(hid_t file, const std::string& path, int64_t* elements) {
  h5::Handle d(H5_CHECK(H5Dopen2(file, path.c_str(), H5P_DEFAULT)), H5Dclose);
  if (H5_CHECK(H5Aexists(d, "checksum")) <= 0) return "no checksum attribute";
  const uint64_t want = read_u64(d, "checksum");
  const auto shape = dataset_shape(d);
  const int64_t n = numel_of(shape);
  h5::Handle type(H5_CHECK(H5Dget_type(d)), H5Tclose);
  const bool is_float = H5Tget_class(type) == H5T_FLOAT && H5Tget_size(type) == 4;
  const bool is_i64 = H5Tget_class(type) == H5T_INTEGER && H5Tget_size(type) == 8;
  if (!is_float && !is_i64) return "unexpected dtype " + h5::dtype_name(type);
  uint64_t sum = 0;
  std::vector<float> f(is_float ? static_cast<size_t>(std::min(n, kChunkElems)) : 0);
  std::vector<int64_t> q(is_i64 ? static_cast<size_t>(std::min(n, kChunkElems)) : 0);
  for (int64_t lo = 0; lo < n; lo += kChunkElems) {
    const int64_t c = std::min(kChunkElems, n - lo);
    if (is_float) transfer<float>(d, shape, lo, c, f.data(), 1, H5P_DEFAULT, H5T_NATIVE_FLOAT, false);
    else transfer<int64_t>(d, shape, lo, c, q.data(), 1, H5P_DEFAULT, H5T_NATIVE_INT64, false);
    sum += is_float ? checksum_f32(f.data(), lo, c) : checksum_i64(q.data(), lo, c);
  }
  *elements += n;
  if (sum != want) return fmt("checksum mismatch (stored %016llx, read %016llx)", (unsigned long long)want, (unsigned long long)sum);
  return "";
}

// Paths (relative to `group`) of every dataset below it.
std::vector<std::string> datasets_under(hid_t file, const char* group) {
  std::vector<std::string> links, out;
  h5::Handle g(H5_CHECK(H5Gopen2(file, group, H5P_DEFAULT)), H5Gclose);
  auto collect = [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
    static_cast<std::vector<std::string>*>(data)->push_back(name);
    return 0;
  };
  H5_CHECK(H5Lvisit(g, H5_INDEX_NAME, H5_ITER_INC, collect, &links));
  for (const auto& name : links) {
    h5::Handle obj(H5_CHECK(H5Oopen(g, name.c_str(), H5P_DEFAULT)), H5Oclose);
    if (H5Iget_type(obj) == H5I_DATASET) out.push_back(name);
  }
  return out;
}

fs::path resolve_checkpoint(const fs::path& p) {
  SHARDLM_CHECK(fs::exists(p), "%s: no such file or directory", p.c_str());
  if (!fs::is_directory(p)) return p;
  const fs::path dir = fs::is_directory(p / "checkpoints") ? p / "checkpoints" : p;
  const auto c = resume_candidates(dir);
  SHARDLM_CHECK(!c.empty(), "%s holds no checkpoint (step_<N>.h5)", dir.c_str());
  return c.front();
}

std::string export_dtype(const std::string& d) {
  if (d == "bf16" || d == "BF16" || d == "bfloat16") return "BF16";
  if (d == "fp32" || d == "F32" || d == "f32" || d == "float32") return "F32";
  SHARDLM_FAIL("--dtype '%s' is not one of bf16, fp32", d.c_str());
}

}  // namespace

int inspect_checkpoint(const fs::path& given, MPI_Comm comm, std::FILE* out) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  int rc = 0;
  if (comm_rank(comm) == 0) {
    fs::path path = given;
    try {
      path = resolve_checkpoint(given);
      const CheckpointInfo info = read_checkpoint_info(path);
      const ModelConfig& a = info.arch;
      std::fprintf(out,
                   "checkpoint %s\n"
                   "  format %lld, written by shardlm %s at %s\n"
                   "  step %lld (steps completed), tokens seen %lld, world size at save %lld\n"
                   "  model %s: %lld layers, hidden %lld, intermediate %lld, heads %lld (kv %lld), vocab %lld%s%s%s\n"
                   "  %lld parameters in %lld tensors\n"
                   "  optimizer %s, state [%s], %lld steps taken; bad steps %lld in a row, %lld total\n"
                   "  data: step %lld starts at row %lld; seq_len %lld, seed %llu, %lld documents, shuffle %s\n",
                   path.c_str(), (long long)info.format, info.shardlm_version.c_str(), info.saved_at.c_str(),
                   (long long)info.step, (long long)info.tokens_seen, (long long)info.world_size_at_save,
                   a.arch.c_str(), (long long)a.num_layers, (long long)a.hidden_size, (long long)a.intermediate_size,
                   (long long)a.num_heads, (long long)a.num_kv_heads, (long long)a.vocab_size,
                   a.tie_word_embeddings ? ", tied embeddings" : "", a.attention_bias ? ", qkv bias" : "",
                   a.qk_norm ? ", qk norm" : "", (long long)info.parameter_count, (long long)info.tensors,
                   info.optimizer.c_str(), join(info.optimizer_states, ", ").c_str(), (long long)info.optimizer_steps,
                   (long long)info.bad_steps_in_a_row, (long long)info.bad_steps_total, (long long)info.data.step,
                   (long long)info.data.rows_consumed, (long long)info.data.seq_len,
                   (unsigned long long)info.data.seed, (long long)info.data.documents,
                   info.data.shuffle ? "on" : "off");
      std::fflush(out);
      // Every dataset the layout implies must be there, and every dataset must verify.
      h5::Handle file = open_serial(path);
      const ModelLayout layout(info.arch, 1);
      // Every optimizer dataset in the file (Muon keeps one state on its matrices,
      // two elsewhere, so the layout alone cannot name them), at least one per
      // parameter when the optimizer has state.
      const std::vector<std::string> optim_datasets = datasets_under(file, "optim");
      std::vector<std::string> expected{"/data/position"}, problems;
      for (const auto& [unit, p] : layout.all_params()) {
        expected.push_back("/model/" + p->name);
        const std::string prefix = p->name + "/";
        const bool has_state = std::any_of(optim_datasets.begin(), optim_datasets.end(),
                                           [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
        if (!info.optimizer_states.empty() && !has_state) problems.push_back("/optim/" + p->name + ": missing");
      }
      for (const auto& n : optim_datasets) expected.push_back("/optim/" + n);
      int64_t elements = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& name : expected) {
        std::string why;
        try {
          why = link_exists(file, name) ? verify_dataset(file, name, &elements) : "missing";
        } catch (const std::exception& e) {
          why = e.what();
        }
        if (!why.empty()) problems.push_back(name + ": " + why);
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (problems.empty()) {
        std::fprintf(out, "  checksums: all %zu datasets match (%s read in %.2f s)\nOK\n", expected.size(),
                     mib(static_cast<double>(elements) * 4).c_str(), secs);
      } else {
        rc = 1;
        std::fprintf(out, "  checksums: %zu of %zu datasets do not verify:\n", problems.size(), expected.size());
        for (const auto& p : problems) std::fprintf(out, "    %s\n", p.c_str());
        std::fprintf(out, "DAMAGED: %s\n", path.c_str());
      }
    } catch (const std::exception& e) {
      const bool there = fs::exists(given);  // a path that is not there is a mistake, not a damaged checkpoint
      rc = there ? 1 : 2;
      std::fprintf(out, "%s%s\n", there ? "DAMAGED: " : "", e.what());
    }
    std::fflush(out);
  }
  MPI_CHECK(MPI_Bcast(&rc, 1, MPI_INT, 0, comm));
  return rc;
}

void export_checkpoint(const fs::path& given, const fs::path& out_dir, const std::string& dtype_arg, MPI_Comm comm) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  agreed(comm, [&] {
    if (comm_rank(comm) != 0) return;
    const std::string dtype = export_dtype(dtype_arg);
    const fs::path path = resolve_checkpoint(given);
    const CheckpointInfo info = read_checkpoint_info(path);
    const ModelLayout layout(info.arch, 1);
    std::vector<TensorSpec> specs;
    for (const auto& [unit, p] : layout.all_params()) specs.push_back({p->name, p->shape, dtype});
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    SHARDLM_CHECK(!ec, "cannot create %s: %s", out_dir.c_str(), ec.message().c_str());
    h5::Handle file = open_serial(path);
    SafetensorsWriter writer(out_dir / "model.safetensors", specs,
                             {{"shardlm_checkpoint", path.string()}, {"step", std::to_string(info.step)}});
    std::vector<float> chunk;
    for (const auto& [unit, p] : layout.all_params()) {
      const std::string name = "/model/" + p->name;
      try {
        h5::Handle d(H5_CHECK(H5Dopen2(file, name.c_str(), H5P_DEFAULT)), H5Dclose);
        SHARDLM_CHECK(dataset_shape(d) == p->shape, "shape %s, the layout says %s",
                      show_shape(dataset_shape(d)).c_str(), show_shape(p->shape).c_str());
        const uint64_t want = read_u64(d, "checksum");
        chunk.resize(static_cast<size_t>(std::min(p->numel, kChunkElems)));
        uint64_t sum = 0;
        for (int64_t lo = 0; lo < p->numel; lo += kChunkElems) {
          const int64_t c = std::min(kChunkElems, p->numel - lo);
          transfer<float>(d, p->shape, lo, c, chunk.data(), 1, H5P_DEFAULT, H5T_NATIVE_FLOAT, false);
          sum += checksum_f32(chunk.data(), lo, c);
          writer.write(p->name, lo, c, chunk.data());
        }
        SHARDLM_CHECK(sum == want, "checksum mismatch (stored %016llx, read %016llx)", (unsigned long long)want,
                      (unsigned long long)sum);
      } catch (const std::exception& e) {
        throw_damaged(path, fmt("%s: %s", name.c_str(), e.what()));
      }
    }
    writer.finish();
    write_hf_config(out_dir, info.arch, dtype == "BF16" ? "bfloat16" : "float32");
    const std::string tokenizer = copy_tokenizer_files(parse_deck_text(info.deck, path, {}, 0).config.model.hf, out_dir);
    std::printf("export: %s (step %lld) -> %s (config.json, model.safetensors, %s; %s)\n", path.c_str(),
                (long long)info.step, out_dir.c_str(), dtype == "BF16" ? "bf16" : "fp32", tokenizer.c_str());
    std::fflush(stdout);
  });
}

}  // namespace shardlm
