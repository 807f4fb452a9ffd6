// broadcast.cpp — weight broadcast over the broadcast communicator or the
// filesystem, and the reference receiver.
//
// The communicator path, on the wire (MPI on rt.broadcast_comm unless noted):
//   start-up:  hello header (does the payload come from GPU memory?); on GPUs
//              every member then picks the device Comm (select_broadcast_comm)
//   broadcast: weights header (step, units, bytes); on GPUs, the first time,
//              the device Comm is made (NCCL's unique id goes by MPI); then per
//              unit: names and shapes, the bf16 payload (host: MPI; GPU: the
//              device Comm's broadcast of a device buffer), its checksum
//   end:       done header, with the trainers' exit code (the receivers exit
//              with it: 75 when a stop signal ended the run, so the job requeues)
//
// The filesystem path, with receivers in the job: a hello header at start-up
// (after trainer rank 0 removed an earlier job's DONE); each receiver sends
// trainer rank 0 an acknowledgement (kAckTag: the step, 0) once it has read and
// checked a step directory, and a last one (its last step, 1) after DONE, when
// it reads nothing more. Retention removes only what every receiver acknowledged.
#include "broadcast/broadcast.hpp"
#include "shardlm/checksum_term.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "model/tokenizer_files.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/memory.hpp"
#include "base/signals.hpp"  // kExitRequeue, stop_signal
#include "train/engine.hpp"
#include "train/train.hpp"

namespace shardlm {
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMagic = 0x73686172646c6d31ULL;  // "shardlm1"
enum : int64_t { kWeights = 1, kDone = 2, kHello = 3 };
constexpr int kAckTag = 2704;  // filesystem path: receiver -> trainer rank 0, {step, finished}

// What the root sends before each broadcast; POD, sent as bytes.
struct Header {
  uint64_t magic = kMagic;
  int64_t kind = kWeights;
  int64_t step = 0;
  int64_t units = 0;
  int64_t bytes = 0;  // bf16 payload of the whole model
  int64_t device = 0; // kHello: 1 when the units come from GPU memory (receive them on a GPU)
  int64_t exit_code = 0;  // kDone: the trainers' exit code (75: stopped by a signal), the receivers' too
};

// From trainer rank 0 to the receivers over the link (MPI counts are int: big
// payloads go in chunks). Watched as every wait for the other side is
// (comm.hpp): a peer stopped in the middle of a transfer is named, not waited
// for. watch_peers false for the hello, sent while the trainers set up.
void bcast_bytes(void* data, int64_t bytes, MPI_Comm comm, bool watch_peers = true) {
  auto* p = static_cast<char*>(data);
  for (int64_t done = 0; done < bytes;) {
    const int n = static_cast<int>(std::min<int64_t>(bytes - done, INT_MAX / 2));
    MPI_Request r;
    MPI_CHECK(MPI_Ibcast(p + done, n, MPI_BYTE, 0, comm, &r));
    wait_for_other_side(comm, &r, "weight broadcast transfer", 0, watch_peers);
    done += n;
  }
}

// The header of a broadcast, from trainer rank 0 to the receivers, then a
// barrier: the units that follow go to receivers that are all there, never to
// one still sampling (the trainers would wait on it in a collective of theirs).
// A wait for the other side of the job (comm.hpp): watched by its progress,
// bounded by `bound_s`; `watch_peers` false while the trainers may still be
// setting up (the first broadcast).
// The barrier after the header (its second half; a receiver that posted the
// header's broadcast itself, to poll it, calls this once it has arrived).
void header_barrier(MPI_Comm link, double bound_s, bool watch_peers) {
  MPI_Request r;
  MPI_CHECK(MPI_Ibarrier(link, &r));
  wait_for_other_side(link, &r, "weight broadcast start", bound_s, watch_peers);
}

void exchange_header(Header& h, MPI_Comm link, double bound_s, bool watch_peers) {
  MPI_Request r;
  MPI_CHECK(MPI_Ibcast(&h, sizeof h, MPI_BYTE, 0, link, &r));
  wait_for_other_side(link, &r, "weight broadcast header", bound_s, watch_peers);
  header_barrier(link, bound_s, watch_peers);
}

int64_t max_padded(const ModelLayout& l) {
  int64_t n = 0;
  for (const auto& u : l.units) n = std::max(n, u.padded_numel);
  return n;
}

std::string describe_unit(const Unit& u) {
  std::string text;
  for (const auto& p : u.params) {
    text += p.name + " ";
    for (size_t i = 0; i < p.shape.size(); ++i) text += (i ? "," : "") + std::to_string(p.shape[i]);
    text += "\n";
  }
  return text;
}

fs::path step_dir(const std::string& dir, int64_t step) { return fs::path(dir) / ("step_" + std::to_string(step)); }

std::string hex(uint64_t v) { return fmt("%016llx", (unsigned long long)v); }

// WeightBroadcaster::wait_for_receivers: how a wait for the receivers ended.
enum : int64_t { kWaited = 0, kWaitOn = 1, kTimedOut = 2, kSignalled = 3 };

// The weights a receiver holds: bf16 values per parameter, in layout order.
struct ReceivedModel {
  std::map<std::string, std::vector<uint16_t>> tensors;
};

void write_received(const ReceivedModel& m, const ModelLayout& layout, const fs::path& out) {
  fs::create_directories(out);
  write_hf_config(out, layout.config, "bfloat16");
  std::vector<TensorSpec> specs;
  for (const auto& [unit, p] : layout.all_params()) specs.push_back({p->name, p->shape, "BF16"});
  SafetensorsWriter writer(out / "model.safetensors", specs);
  std::vector<float> f32;
  for (const auto& [unit, p] : layout.all_params()) {
    const auto& v = m.tensors.at(p->name);
    f32.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) f32[i] = bf16_to_f32(v[i]);  // exact; RNE back is the identity
    writer.write(p->name, 0, p->numel, f32.data());
  }
  writer.finish();
}

}  // namespace

int64_t output_workspace_bytes(const Config& config, const ModelLayout& layout) {
  const int64_t unit = max_padded(layout);
  const bool gpu = config.device.backend == "cuda";
  const int64_t bcast = config.broadcast.backend == "nccl" && !gpu ? unit * (4 + 2) : 0;  // a GPU hashes on the GPU
  const int64_t exported = config.run.export_dir.empty() ? 0 : unit * 4;
  return std::max(bcast, exported);  // never at the same time
}

namespace {
// A bf16 unit in device memory as the broadcast holds one (trainer rank 0's
// gathered unit, a receiver's arrival buffer), and after it, 256-byte aligned,
// the scratch its checksum kernel sums into.
int64_t unit_payload_offset(const ModelLayout& layout) { return (2 * max_padded(layout) + 255) / 256 * 256; }
int64_t device_unit_bytes(const ModelLayout& layout) { return unit_payload_offset(layout) + kChecksumScratchBytes; }
void* checksum_scratch(void* unit, const ModelLayout& layout) {
  return static_cast<char*>(unit) + unit_payload_offset(layout);
}
}  // namespace

int64_t broadcast_device_bytes(const Config& config, const ModelLayout& layout) {
  return config.broadcast.backend == "nccl" && config.device.backend == "cuda" ? device_unit_bytes(layout) : 0;
}

uint64_t bf16_checksum(const uint16_t* values, int64_t begin, int64_t n) {
  // A sum mod 2^64 of per-element hashes: the same for any split over threads
  // (1.2 G values a step at 1B: one core would take ~1 s on each side).
  uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static) if (n > (int64_t(1) << 20))
  for (int64_t i = 0; i < n; ++i) sum += bf16_checksum_term(static_cast<uint64_t>(begin + i), values[i]);
  return sum;
}

WeightBroadcaster::WeightBroadcaster(const Config& config, const Runtime& rt, Comm& train_comm)
    : config_(config), rt_(rt), comm_(train_comm), enabled_(config.broadcast.backend != "none") {
  if (config.broadcast.backend == "filesystem" && rt.num_receivers > 0) {
    if (comm_.rank() != 0) return;
    // A DONE an earlier launch left would end the receivers at once, and its
    // step directories hold weights this launch may not have (a resume starts
    // at its checkpoint, before them): all go before the hello lets the
    // receivers look; start() writes the starting weights again.
    std::error_code ec;
    fs::create_directories(config.broadcast.dir, ec);
    fs::remove(fs::path(config.broadcast.dir) / "DONE", ec);
    remove_step_dirs_after(-1);
    acked_.assign(static_cast<size_t>(rt.num_receivers), -1);
    receiver_done_.assign(static_cast<size_t>(rt.num_receivers), 0);
    Header hello;
    hello.kind = kHello;
    bcast_bytes(&hello, sizeof hello, rt.broadcast_comm, /*watch_peers=*/false);
    return;
  }
  if (config.broadcast.backend != "nccl") return;
  SHARDLM_CHECK(rt.num_receivers > 0,
                "broadcast.backend = \"nccl\" but this job has no receiver ranks; launch trainers and receivers "
                "together: mpirun -np N shardlm train DECK : -np 1 shardlm receive DECK");
  device_ = rt.backend == "cuda";
  if (comm_.rank() != 0) return;
  // Said at start-up, so a receiver without a GPU fails now and not at the first broadcast.
  Header hello;
  hello.kind = kHello;
  hello.device = device_;
  bcast_bytes(&hello, sizeof hello, rt.broadcast_comm, /*watch_peers=*/false);
  if (!device_) return;
  device_kind_ = select_broadcast_comm(rt);
  host_bcast_ = make_mpi_comm(rt.broadcast_comm);
}

WeightBroadcaster::~WeightBroadcaster() {
  try {
    release_gathered_unit();  // normally finish() did; here only on the way out of an error
  } catch (...) {
  }
}

void WeightBroadcaster::release_gathered_unit() {
  cuda_free(Mem::Workspace, gathered_unit_, gathered_bytes_);  // waits for the device work still using it
  gathered_unit_ = nullptr;
  gathered_bytes_ = 0;
}

int64_t WeightBroadcaster::comm_staging_bytes() const { return staging_bytes_; }

namespace {
using Clock = std::chrono::steady_clock;
// Adds the seconds since `t` to `into` and moves `t` on: consecutive phases of one loop.
void lap(Clock::time_point& t, double& into) {
  const Clock::time_point now = Clock::now();
  into += std::chrono::duration<double>(now - t).count();
  t = now;
}
}  // namespace

std::string WeightBroadcaster::timing_summary() const {
  const BroadcastTiming& t = timing_;
  if (t.count == 0) return "";
  const double n = double(t.count);
  return fmt("broadcast: %lld sends, %.3f s each: gathering the units %.3f, rank 0's %s %.3f, "
             "over the %s communicator (waits for the receivers included) %.3f",
             (long long)t.count, t.total_s() / n, t.gather_s / n,
             device_ ? "checksums on the GPU" : "host copy and checksums", t.host_s / n,
             device_ ? (device_kind_ == "mpi" ? "staged device" : device_kind_.c_str()) : "MPI", t.transfer_s / n);
}

bool WeightBroadcaster::due(int64_t steps_done) const {
  return enabled_ && steps_done % config_.broadcast.interval == 0;
}

void WeightBroadcaster::start(TrainSession& session, int64_t start_step) {
  // Readers outside the job: the steps past this launch's start are an earlier
  // launch's future, which this one will write again (or never, differently).
  if (config_.broadcast.backend == "filesystem" && comm_.rank() == 0) remove_step_dirs_after(start_step);
  if (enabled_ && rt_.num_generators > 0) send(session, start_step);
}

void WeightBroadcaster::remove_step_dirs_after(int64_t step) {
  std::vector<int64_t> removed;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(config_.broadcast.dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step_", 0) != 0) continue;
    const int64_t s = std::atoll(name.c_str() + 5);
    if (s <= step) continue;
    fs::remove_all(e.path(), ec);
    SHARDLM_CHECK(!ec, "broadcast: cannot remove %s, an earlier launch's weights: %s", e.path().c_str(),
                  ec.message().c_str());
    removed.push_back(s);
  }
  if (removed.empty()) return;
  std::sort(removed.begin(), removed.end());
  std::printf("broadcast: removed %zu step director%s an earlier launch left in %s (steps %lld..%lld%s): the "
              "receivers take this launch's weights only\n", removed.size(), removed.size() == 1 ? "y" : "ies",
              config_.broadcast.dir.c_str(), (long long)removed.front(), (long long)removed.back(),
              step >= 0 ? fmt(", past the start at step %lld", (long long)step).c_str() : "");
  std::fflush(stdout);
}

void WeightBroadcaster::send(TrainSession& session, int64_t steps_done) {
  if (device_) return send_from_device(session.engine, session.model.layout, steps_done);
  session.pull_state();  // the host paths read the fp32 masters
  if (config_.broadcast.backend == "nccl") send_over_comm(session.model, steps_done);
  else if (config_.broadcast.backend == "filesystem") send_to_filesystem(session.model, steps_done);
}

void WeightBroadcaster::send_over_comm(const ShardedModel& model, int64_t step) {
  const ModelLayout& layout = model.layout;
  const bool root = comm_.rank() == 0;
  const MPI_Comm bcomm = rt_.broadcast_comm;
  Header h;
  h.step = step;
  h.units = static_cast<int64_t>(layout.units.size());
  for (const auto& u : layout.units) h.bytes += 2 * u.numel;
  if (root) exchange_header(h, bcomm, config_.data.rollout_timeout_s, true);
  // Transient memory: one gathered unit (fp32 here) and its bf16 copy.
  Buffer<float> full(Mem::Workspace, max_padded(layout));
  Buffer<uint16_t> bf16(Mem::Workspace, max_padded(layout));
  Clock::time_point t = Clock::now();
  for (size_t ui = 0; ui < layout.units.size(); ++ui) {
    const Unit& u = layout.units[ui];
    comm_.all_gather(model.param[ui].data(), full.data(), u.shard_numel).wait();
    lap(t, timing_.gather_s);
    if (!root) continue;
    for (int64_t i = 0; i < u.numel; ++i) bf16[i] = f32_to_bf16_rne(full[i]);
    std::string text = describe_unit(u);
    int64_t text_len = static_cast<int64_t>(text.size());
    uint64_t checksum = bf16_checksum(bf16.data(), 0, u.numel);
    lap(t, timing_.host_s);
    bcast_bytes(&text_len, sizeof text_len, bcomm);
    bcast_bytes(text.data(), text_len, bcomm);
    bcast_bytes(bf16.data(), 2 * u.numel, bcomm);
    bcast_bytes(&checksum, sizeof checksum, bcomm);
    lap(t, timing_.transfer_s);
  }
  ++timing_.count;
}

// DESIGN.md rule 4: what the device Comm broadcasts is the device buffer the
// unit was gathered into from the backend's bf16 shards, with device-resident
// state and with optim_cpu_offload alike (the fp32 masters are not read). Rank
// 0's checksum is of those same bf16 values, computed where they lie (on the
// GPU, cuda_bf16_checksum: no copy of the unit to the host).
void WeightBroadcaster::send_from_device(Engine& engine, const ModelLayout& layout, int64_t step) {
  const bool root = comm_.rank() == 0;
  const MPI_Comm bcomm = rt_.broadcast_comm;
  Backend& backend = engine.backend();
  Header h;
  h.step = step;
  h.units = static_cast<int64_t>(layout.units.size());
  for (const auto& u : layout.units) h.bytes += 2 * u.numel;
  if (root) {
    exchange_header(h, bcomm, config_.data.rollout_timeout_s, true);
    if (!device_bcast_) {  // collective with the receivers, which make theirs on this header
      device_bcast_ = make_device_comm(*host_bcast_, device_kind_, backend.stream(), 2 * max_padded(layout),
                                       config_.comm.timeout_s);
      // The staged Comm's two pinned buffers of one bf16 unit stay until finish().
      if (device_kind_ == "mpi") staging_bytes_ = 2 * 2 * max_padded(layout);
      std::printf("broadcast: bf16 units gathered on the GPU, sent over the %s device communicator%s\n",
                  device_kind_.c_str(),
                  device_kind_ == "mpi" ? " (staged through host memory: two of its ranks share a GPU)" : "");
      std::fflush(stdout);
    }
  }
  // One gathered bf16 unit on the device on every rank (broadcast_device_bytes),
  // made at the first broadcast and kept until finish(): no allocation, and no
  // device synchronisation of a free, per broadcast. Its host copy on rank 0 is
  // transient (output_workspace_bytes).
  if (!gathered_unit_) {
    gathered_bytes_ = device_unit_bytes(layout);
    gathered_unit_ = cuda_malloc(Mem::Workspace, gathered_bytes_);
  }
  void* gathered_unit = gathered_unit_;
  // Phases timed on rank 0 (the gather's time is its wait in the checksum's
  // synchronisation when the gather is asynchronous: it is timed to the checksum's start).
  Clock::time_point t = Clock::now();
  for (size_t ui = 0; ui < layout.units.size(); ++ui) {
    const Unit& u = layout.units[ui];
    engine.gather_unit_bf16(static_cast<int>(ui), gathered_unit);
    if (!root) continue;
    lap(t, timing_.gather_s);
    std::string text = describe_unit(u);
    int64_t text_len = static_cast<int64_t>(text.size());
    uint64_t checksum = cuda_bf16_checksum(gathered_unit, 0, u.numel, checksum_scratch(gathered_unit, layout),
                                           backend.stream());
    lap(t, timing_.host_s);
    bcast_bytes(&text_len, sizeof text_len, bcomm);
    bcast_bytes(text.data(), text_len, bcomm);
    // wait() orders the compute stream after the broadcast, so the next unit's
    // gather into the same buffer (queued behind it) cannot overwrite it early,
    // and the two NCCL communicators on this GPU never run at once.
    device_bcast_->broadcast(gathered_unit, u.numel, DType::BF16, 0).wait();
    bcast_bytes(&checksum, sizeof checksum, bcomm);
    lap(t, timing_.transfer_s);
  }
  if (root) ++timing_.count;
}

void WeightBroadcaster::send_to_filesystem(const ShardedModel& model, int64_t step) {
  const ModelLayout& layout = model.layout;
  const fs::path dir = step_dir(config_.broadcast.dir, step), file = dir / "model.safetensors";
  // Checksums first: each rank hashes its own slices, one all-reduce adds them.
  const auto params = layout.all_params();
  std::vector<int64_t> sums(params.size(), 0);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index[params[i].param->name] = i;
  std::vector<uint16_t> bf16;
  for (size_t ui = 0; ui < layout.units.size(); ++ui)
    for (const auto& s : model.segments(layout.units[ui])) {
      bf16.resize(s.count);
      for (int64_t i = 0; i < s.count; ++i) bf16[i] = f32_to_bf16_rne(model.param[ui][s.shard_offset + i]);
      sums[index[s.param->name]] += static_cast<int64_t>(bf16_checksum(bf16.data(), s.param_begin, s.count));
    }
  comm_.all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  std::map<std::string, std::string> metadata{{"shardlm_step", std::to_string(step)}};
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < params.size(); ++i) {
    specs.push_back({params[i].param->name, params[i].param->shape, "BF16"});
    metadata["shardlm_checksum." + params[i].param->name] = hex(static_cast<uint64_t>(sums[i]));
  }

  // Rank 0 lays out the file; every rank writes the bytes it owns; rank 0 publishes.
  std::unique_ptr<SafetensorsWriter> writer;
  if (comm_.rank() == 0) {
    fs::create_directories(dir);
    write_hf_config(dir, layout.config, "bfloat16");
    const std::string tokenizer = copy_tokenizer_files(config_.model.hf, dir);  // servable as it is
    if (!std::exchange(tokenizer_noted_, true)) std::printf("broadcast: %s\n", tokenizer.c_str());
    writer = std::make_unique<SafetensorsWriter>(file, specs, metadata);
  }
  comm_.barrier();
  if (comm_.rank() != 0)
    writer = std::make_unique<SafetensorsWriter>(file, specs, metadata, SafetensorsWriter::Open::Existing);
  for (size_t ui = 0; ui < layout.units.size(); ++ui)
    for (const auto& s : model.segments(layout.units[ui]))
      writer->write(s.param->name, s.param_begin, s.count, model.param[ui].data() + s.shard_offset);
  if (comm_.rank() != 0) writer->close_part();
  comm_.barrier();
  if (comm_.rank() == 0) {
    writer->finish(/*check_complete=*/false);
    std::ofstream(dir / "STABLE") << step << "\n";
  }
  if (rt_.num_receivers == 0) {  // no reader this job knows of: the newest broadcast.keep steps stay
    if (comm_.rank() == 0) retire_step_dirs();
    return;
  }
  // Retention removes only what every receiver has read. A receiver with more
  // than broadcast.keep directories still to read holds the trainers back here
  // (the disk holds at most keep + 1 steps), for at most comm.timeout_s; then
  // its directories are kept, a line says so, and training goes on without
  // waiting for it until it has caught up.
  const size_t keep = static_cast<size_t>(config_.broadcast.keep);
  const int outcome = wait_for_receivers(
      [&] {
        const size_t left = retire_step_dirs();
        if (lagging_ && left <= keep) {
          lagging_ = false;
          std::printf("broadcast: step %lld: the receivers have caught up (%zu step directories, broadcast.keep = "
                      "%zu): retention and waiting resume\n", (long long)step, left, keep);
          std::fflush(stdout);
        }
        return !lagging_ && left > keep;
      },
      /*signal_ends=*/true);
  if (comm_.rank() != 0 || outcome == kWaited) return;
  if (outcome == kTimedOut) lagging_ = true;
  std::printf("broadcast: step %lld: %s, more than broadcast.keep = %zu step directories behind; %s: its "
              "directories are kept (none is removed before every receiver has read it)%s\n",
              (long long)step, slowest_receiver().c_str(), keep,
              outcome == kTimedOut ? fmt("it did not catch up within comm.timeout_s = %g s", config_.comm.timeout_s).c_str()
                                   : "a stop signal came while waiting for it",
              outcome == kTimedOut ? " and training goes on without waiting for it until it catches up" : "");
  std::fflush(stdout);
}

void WeightBroadcaster::take_acks() {
  for (;;) {
    int arrived = 0;
    MPI_Status status;
    MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kAckTag, rt_.broadcast_comm, &arrived, &status));
    if (!arrived) return;
    int64_t ack[2] = {0, 0};  // step, finished
    MPI_CHECK(MPI_Recv(ack, 2, MPI_INT64_T, status.MPI_SOURCE, kAckTag, rt_.broadcast_comm, MPI_STATUS_IGNORE));
    const size_t r = static_cast<size_t>(status.MPI_SOURCE - 1);  // broadcast_comm: rank 0 is trainer rank 0
    acked_[r] = std::max(acked_[r], ack[0]);
    if (ack[1]) receiver_done_[r] = 1;
  }
}

size_t WeightBroadcaster::retire_step_dirs() {
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (const auto& e : fs::directory_iterator(config_.broadcast.dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step_", 0) == 0) steps.emplace_back(std::atoll(name.c_str() + 5), e.path());
  }
  std::sort(steps.begin(), steps.end());
  // Receivers read the steps in order, so what they all acknowledged is a prefix.
  int64_t read_by_all = INT64_MAX;
  for (const int64_t a : acked_) read_by_all = std::min(read_by_all, a);
  size_t left = steps.size();
  for (size_t i = 0; i + config_.broadcast.keep < steps.size() && steps[i].first <= read_by_all; ++i) {
    fs::remove_all(steps[i].second);
    --left;
  }
  return left;
}

template <class Waiting>
int WeightBroadcaster::wait_for_receivers(Waiting waiting, bool signal_ends) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    int64_t outcome = kWaited;  // decided on rank 0, told to every trainer
    if (comm_.rank() == 0) {
      take_acks();
      const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!waiting()) outcome = kWaited;
      else if (signal_ends && stop_signal() != 0) outcome = kSignalled;
      else if (waited_s > config_.comm.timeout_s) outcome = kTimedOut;
      else outcome = kWaitOn;
    }
    comm_.broadcast(&outcome, sizeof outcome, 0);  // the others wait here, in a watched collective, never long
    if (outcome != kWaitOn) return static_cast<int>(outcome);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string WeightBroadcaster::slowest_receiver() const {
  size_t slowest = 0;
  for (size_t r = 1; r < acked_.size(); ++r)
    if (acked_[r] < acked_[slowest]) slowest = r;
  const int world_rank = rt_.num_trainers + static_cast<int>(slowest);
  return acked_[slowest] < 0
             ? fmt("the receiver at world rank %d (%s) has not finished reading any step yet", world_rank,
                   world_rank_host(world_rank))
             : fmt("the receiver at world rank %d (%s) has finished reading step %lld", world_rank,
                   world_rank_host(world_rank), (long long)acked_[slowest]);
}

void WeightBroadcaster::finish(int exit_code) {
  if (!enabled_) return;
  if (config_.broadcast.backend == "nccl") {
    if (comm_.rank() == 0) {
      Header h;
      h.kind = kDone;
      h.exit_code = exit_code;
      exchange_header(h, rt_.broadcast_comm, config_.data.rollout_timeout_s, true);
    }
    device_bcast_.reset();
    release_gathered_unit();
  } else {
    if (comm_.rank() == 0) std::ofstream(fs::path(config_.broadcast.dir) / "DONE") << "done\n" << exit_code << "\n";
    if (rt_.num_receivers == 0) return;
    // The receivers read what is left, then say they are done: every step
    // directory read is retired, every acknowledgement taken before MPI ends.
    const int outcome = wait_for_receivers(
        [&] {
          retire_step_dirs();
          return std::find(receiver_done_.begin(), receiver_done_.end(), 0) != receiver_done_.end();
        },
        /*signal_ends=*/false);
    if (comm_.rank() == 0 && outcome == kTimedOut) {
      std::printf("broadcast: %s and has not finished within comm.timeout_s = %g s after the end of training: "
                  "its step directories are kept\n", slowest_receiver().c_str(), config_.comm.timeout_s);
      std::fflush(stdout);
    }
  }
}

// ---------------------------------------------------------------- receiver

namespace {

void report(const Runtime& rt, int64_t step, int64_t tensors, int64_t bytes, double seconds,
            const BroadcastTiming& t = {}) {
  std::string phases;  // the communicator path: where the time went
  if (t.count > 0)
    phases = fmt(" (transfer %.1f, %scheck %.1f, load %.1f ms)", t.transfer_s * 1e3,
                 t.host_s > 0 ? fmt("to host %.1f, ", t.host_s * 1e3).c_str() : "", t.check_s * 1e3, t.load_s * 1e3);
  std::printf("receive[%d]: step %lld: %lld tensors, %.2f MiB in %.1f ms (%.2f GB/s)%s, checksums ok\n", rt.rank,
              (long long)step, (long long)tensors, double(bytes) / 1048576.0, seconds * 1e3,
              seconds > 0 ? double(bytes) / seconds / 1e9 : 0.0, phases.c_str());
  std::fflush(stdout);
}

// The receiving end of the GPU path: the device Comm (made at the first
// weights header, with rank 0) and one unit's device buffer. The receiver has
// no backend: it computes nothing, and orders everything on the default stream.
struct DeviceReceive {
  std::string kind;                   // "nccl" | "mpi" (select_broadcast_comm)
  std::unique_ptr<Comm> host, device;
  void* unit = nullptr;               // (max padded numel) bf16, device
  int64_t unit_bytes = 0;
  ~DeviceReceive() {
    device.reset();
    cuda_free(Mem::Workspace, unit, unit_bytes);
  }
};

// DONE holds "done" and the trainers' exit code (no code: an older trainer, 0).
int done_exit_code(const fs::path& done) {
  std::ifstream in(done);
  std::string word;
  int code = 0;
  in >> word >> code;
  return code;
}

// SHARDLM_FAULT=receive_slow@R: receiver R takes SHARDLM_RECEIVE_SLOW_MS (500)
// longer over each step directory, after it found it and before it reads it;
// over the first SHARDLM_RECEIVE_SLOW_STEPS directories only, where that is set.
void maybe_receive_slowly(int64_t received) {
  if (!fault_armed("receive_slow")) return;
  const char* steps = std::getenv("SHARDLM_RECEIVE_SLOW_STEPS");
  if (steps && *steps && received >= std::atoll(steps)) return;
  const char* ms = std::getenv("SHARDLM_RECEIVE_SLOW_MS");
  std::this_thread::sleep_for(std::chrono::milliseconds(ms && *ms ? std::atoi(ms) : 500));
}

}  // namespace

struct WeightReceiver::State {
  std::optional<DeviceReceive> dev;  // the communicator path from GPU memory
  std::vector<uint16_t> data;        // one unit (communicator) or one parameter (filesystem), bf16
  std::vector<float> f32;
  int64_t last = -1;                 // filesystem: the last step read (acknowledged)
  // Communicator: the next header's receive, posted by a poll (next with wait
  // = false) and tested by the later ones until it arrives.
  Header header;
  MPI_Request header_request = MPI_REQUEST_NULL;
  // From GPU memory to a host sink, `data` holds the largest unit from the
  // start (no reallocation after) and is page-locked: the unit's copy down, and
  // a GPU decoder's copy back up, run at the link's speed (pageable: ~8 GB/s).
  // With a device sink it stays empty.
  bool data_pinned = false;
  ~State() {
    if (data_pinned) cuda_unpin_host(data.data());
  }
};

WeightReceiver::WeightReceiver(const Config& config, Runtime& rt, const ModelLayout& layout)
    : config_(config), rt_(rt), layout_(layout), filesystem_(config.broadcast.backend == "filesystem"),
      state_(std::make_unique<State>()) {
  SHARDLM_CHECK(config.broadcast.backend != "none",
                "receive: the deck has broadcast.backend = \"none\"; set \"nccl\" or \"filesystem\"");
  // Trainer rank 0 says hello at start-up (on the filesystem path once it has removed an earlier job's DONE).
  Header hello;
  bcast_bytes(&hello, sizeof hello, rt.broadcast_comm, /*watch_peers=*/false);
  SHARDLM_CHECK(hello.magic == kMagic && hello.kind == kHello,
                "receive: the trainer sent a header that is not shardlm's");
  if (!filesystem_ && hello.device) {
    SHARDLM_CHECK(cuda_device_count() > 0,
                  "receive: the trainer broadcasts from GPU memory (CUDA backend), but no CUDA device is visible on "
                  "%s%s: run the receivers on GPU nodes",
                  rt.hostname.c_str(), cuda_built() ? "" : " (this shardlm was built without CUDA)");
    select_device(rt, "cuda");
    state_->dev.emplace();
    state_->dev->kind = select_broadcast_comm(rt);
  }
}

WeightReceiver::~WeightReceiver() = default;

WeightReceiver::Got WeightReceiver::next(bool wait, bool newest_only, const Sink& sink, const DeviceSink& device_sink) {
  if (done_) return Got::Done;
  return filesystem_ ? next_from_filesystem(wait, newest_only, sink) : next_over_comm(wait, sink, device_sink);
}

WeightReceiver::Got WeightReceiver::next_over_comm(bool wait, const Sink& sink, const DeviceSink& device_sink) {
  State& st = *state_;
  // The header's receive (exchange_header's first half), posted here or by an
  // earlier poll; a poll returns while it has not arrived.
  if (st.header_request == MPI_REQUEST_NULL)
    MPI_CHECK(MPI_Ibcast(&st.header, sizeof st.header, MPI_BYTE, 0, rt_.broadcast_comm, &st.header_request));
  if (!wait) {
    int arrived = 0;  // the request is MPI_REQUEST_NULL once it has
    MPI_CHECK(MPI_Test(&st.header_request, &arrived, MPI_STATUS_IGNORE));
    if (!arrived) return Got::Nothing;
  }
  // Sampling ranks wait for the trainers at most data.rollout_timeout_s (the
  // first weights after the trainers' setup, the next after a step); a
  // `receive` rank waits as long as the trainers train between broadcasts.
  const bool sampler = rt_.role == Role::Generate;
  const double bound_s = sampler ? config_.data.rollout_timeout_s : 0;
  if (st.header_request != MPI_REQUEST_NULL)
    wait_for_other_side(rt_.broadcast_comm, &st.header_request, "weight broadcast header", bound_s, received_ > 0);
  const Header h = st.header;
  header_barrier(rt_.broadcast_comm, bound_s, received_ > 0);
  maybe_inject_fault("receive");
  SHARDLM_CHECK(h.magic == kMagic, "receive: the trainer sent a header that is not shardlm's");
  if (h.kind == kDone) {
    exit_code_ = static_cast<int>(h.exit_code);
    done_ = true;
    return Got::Done;
  }
  SHARDLM_CHECK(h.units == int64_t(layout_.units.size()),
                "receive: the trainer sends %lld units but this deck's model has %zu (same deck on both sides?)",
                (long long)h.units, layout_.units.size());
  if (st.dev && !st.dev->device) {  // rank 0 makes its end on this same header
    st.dev->unit_bytes = device_unit_bytes(layout_);
    st.dev->host = make_mpi_comm(rt_.broadcast_comm);
    st.dev->device = make_device_comm(*st.dev->host, st.dev->kind, nullptr, st.dev->unit_bytes, config_.comm.timeout_s);
    st.dev->unit = cuda_malloc(Mem::Workspace, st.dev->unit_bytes);
    if (!device_sink) {  // a device sink takes each unit where it arrived: no host copy to stage
      st.data.reserve(size_t(max_padded(layout_)));
      st.data_pinned = cuda_pin_host(st.data.data(), int64_t(st.data.capacity() * sizeof(uint16_t)));
    }
    std::printf("receive[%d]: units arrive in GPU memory (device %d, %s) over the %s device communicator\n",
                rt_.rank, rt_.device, rt_.device_name.c_str(), st.dev->kind.c_str());
    std::fflush(stdout);
  }
  const auto t0 = Clock::now();
  Clock::time_point t = t0;
  timing_ = {};
  timing_.count = 1;
  int64_t tensors = 0;
  for (const auto& u : layout_.units) {
    int64_t text_len = 0;
    bcast_bytes(&text_len, sizeof text_len, rt_.broadcast_comm);
    std::string text(static_cast<size_t>(text_len), '\0');
    bcast_bytes(text.data(), text_len, rt_.broadcast_comm);
    SHARDLM_CHECK(text == describe_unit(u), "receive: unit %s arrived with other names or shapes than the deck's "
                                            "model has:\n%s", u.name.c_str(), text.c_str());
    uint64_t got = 0;  // the checksum of what arrived
    const bool on_device = st.dev && device_sink;  // the sink takes device memory: no host copy
    if (st.dev) {
      // Into device memory: the checksum computed there, of exactly the bytes
      // that arrived on the GPU, then (for a host sink and --out) one copy to the host.
      st.dev->device->broadcast(st.dev->unit, u.numel, DType::BF16, 0).wait();
      lap(t, timing_.transfer_s);
      got = cuda_bf16_checksum(st.dev->unit, 0, u.numel, checksum_scratch(st.dev->unit, layout_), nullptr);
      lap(t, timing_.check_s);
      if (!on_device) {
        st.data.resize(u.numel);
        cuda_copy_async(st.data.data(), st.dev->unit, 2 * u.numel, nullptr);
        cuda_synchronize(nullptr);
        lap(t, timing_.host_s);
      }
    } else {
      st.data.resize(u.numel);
      bcast_bytes(st.data.data(), 2 * u.numel, rt_.broadcast_comm);
      lap(t, timing_.transfer_s);
      got = bf16_checksum(st.data.data(), 0, u.numel);
      lap(t, timing_.check_s);
    }
    uint64_t checksum = 0;
    bcast_bytes(&checksum, sizeof checksum, rt_.broadcast_comm);
    SHARDLM_CHECK(checksum == got, "receive: step %lld, unit %s: checksum mismatch (data damaged in transfer)",
                  (long long)h.step, u.name.c_str());
    lap(t, timing_.check_s);
    for (const auto& p : u.params) {
      if (on_device) device_sink(p, static_cast<const uint16_t*>(st.dev->unit) + p.offset);
      else sink(p, st.data.data() + p.offset);
      ++tensors;
    }
    lap(t, timing_.load_s);
  }
  step_ = h.step;
  ++received_;
  report(rt_, h.step, tensors, h.bytes, std::chrono::duration<double>(Clock::now() - t0).count(), timing_);
  return Got::Weights;
}

WeightReceiver::Got WeightReceiver::next_from_filesystem(bool wait, bool newest_only, const Sink& sink) {
  State& st = *state_;
  // What this receiver has finished with, to trainer rank 0: until then retention keeps it.
  const auto acknowledge = [&](int64_t step, int64_t finished) {
    int64_t ack[2] = {step, finished};
    MPI_CHECK(MPI_Send(ack, 2, MPI_INT64_T, 0, kAckTag, rt_.broadcast_comm));
  };
  const fs::path root = config_.broadcast.dir;
  for (;;) {
    const bool done = fs::exists(root / "DONE");  // read before scanning: nothing new follows DONE
    std::vector<int64_t> ready;
    if (fs::exists(root))
      for (const auto& e : fs::directory_iterator(root)) {
        const std::string name = e.path().filename().string();
        if (name.rfind("step_", 0) != 0) continue;
        const int64_t s = std::atoll(name.c_str() + 5);
        if (s > st.last && fs::exists(e.path() / "STABLE")) ready.push_back(s);  // <= last: acknowledged, may go
      }
    if (!ready.empty()) {
      const int64_t s = newest_only ? *std::max_element(ready.begin(), ready.end())
                                    : *std::min_element(ready.begin(), ready.end());
      maybe_receive_slowly(received_);
      const auto t0 = std::chrono::steady_clock::now();
      const fs::path dir = step_dir(config_.broadcast.dir, s);
      SafetensorsReader reader(dir);
      std::ifstream meta_probe(dir / "model.safetensors", std::ios::binary);
      uint64_t header_len = 0;
      meta_probe.read(reinterpret_cast<char*>(&header_len), 8);
      std::string header(header_len, '\0');
      meta_probe.read(header.data(), static_cast<std::streamsize>(header_len));
      int64_t bytes = 0;
      for (const auto& [unit, p] : layout_.all_params()) {
        SHARDLM_CHECK(reader.has(p->name) && reader.info(p->name).shape == p->shape,
                      "receive: %s lacks '%s' with the deck's shape", dir.c_str(), p->name.c_str());
        st.f32.resize(p->numel);
        reader.read_f32(p->name, 0, p->numel, st.f32.data());
        st.data.resize(p->numel);
        for (int64_t i = 0; i < p->numel; ++i) st.data[i] = f32_to_bf16_rne(st.f32[i]);
        const std::string key = "\"shardlm_checksum." + p->name + "\":\"";
        const size_t at = header.find(key);
        SHARDLM_CHECK(at != std::string::npos, "receive: %s has no checksum for '%s'", dir.c_str(), p->name.c_str());
        SHARDLM_CHECK(header.compare(at + key.size(), 16, hex(bf16_checksum(st.data.data(), 0, p->numel))) == 0,
                      "receive: %s: checksum mismatch for '%s'", dir.c_str(), p->name.c_str());
        sink(*p, st.data.data());
        bytes += 2 * p->numel;
      }
      st.last = s;
      step_ = s;
      ++received_;
      report(rt_, s, int64_t(layout_.all_params().size()), bytes,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      acknowledge(s, 0);
      return Got::Weights;
    }
    if (done) {
      exit_code_ = done_exit_code(root / "DONE");
      acknowledge(st.last, 1);
      done_ = true;
      return Got::Done;
    }
    if (!wait) return Got::Nothing;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

int run_receiver(const Config& config, Runtime& rt, const std::string& out_dir) {
  const ModelLayout layout(model_config_for(config), 1);
  ReceivedModel model;
  WeightReceiver receiver(config, rt, layout);
  while (receiver.next(/*wait=*/true, /*newest_only=*/false, [&](const ParamInfo& p, const uint16_t* bf16) {
    model.tensors[p.name].assign(bf16, bf16 + p.numel);
  }) == WeightReceiver::Got::Weights) {
  }
  const int64_t received = receiver.received();
  const int exit_code = receiver.exit_code();
  std::printf("receive[%d]: trainer finished; %lld broadcast%s received\n", rt.rank, (long long)received,
              received == 1 ? "" : "s");
  if (exit_code != 0)
    std::printf("receive[%d]: the trainers ended with exit %d%s; so does this receiver\n", rt.rank, exit_code,
                exit_code == kExitRequeue ? " (stopped by a signal: requeue and resume)" : "");
  if (!out_dir.empty() && received > 0 && rt.rank == 0) {
    write_received(model, layout, out_dir);
    std::printf("receive[%d]: last weights written to %s (%s)\n", rt.rank, out_dir.c_str(),
                copy_tokenizer_files(config.model.hf, out_dir).c_str());
  }
  std::fflush(stdout);
  return exit_code;
}

}  // namespace shardlm
