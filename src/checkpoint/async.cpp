// async.cpp — the Checkpointer: synchronous saves, or a snapshot and
// a background writer (checkpoint/async.hpp says why the writer makes no MPI
// or HDF5 call).
#include "checkpoint/async.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include "checkpoint/agree.hpp"
#include "checkpoint/io.hpp"
#include "checkpoint/layout.hpp"
#include "checkpoint/retention.hpp"
#include "checkpoint/save.hpp"
#include "train/optim.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/watchdog.hpp"
#include "train/train.hpp"

namespace fs = std::filesystem;

namespace shardlm {

using namespace ckpt;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool device_resident(const Config& c) { return c.device.backend == "cuda" && !c.model.optim_cpu_offload; }

// Threads the writer's checksums use: enough to keep up with a disk, few
// enough to leave the training thread's cores alone.
constexpr int kWriterThreads = 4;

// MemAvailable of /proc/meminfo in bytes (0 when unknown).
int64_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

// A piece is one unit's shard of one array: the pool holds at least the largest.
int64_t largest_piece_bytes(const ModelLayout& layout) {
  int64_t largest = 0;
  for (const auto& u : layout.units) largest = std::max(largest, 4 * u.shard_numel);
  return largest;
}

}  // namespace

int64_t checkpoint_state_bytes(const Config& config, const ModelLayout& layout) {
  int64_t shard = 0;
  for (const auto& u : layout.units) shard += 4 * u.shard_numel;
  return shard * (1 + optimizer_states(config.optim));
}

bool saves_async(const Config& config) {
  return config.ckpt.async && (config.ckpt.interval > 0 || config.ckpt.save_final);
}

int64_t checkpoint_snapshot_bytes(const Config& config, const ModelLayout& layout) {
  if (!saves_async(config) || device_resident(config)) return 0;
  const int64_t state = checkpoint_state_bytes(config, layout);
  if (config.ckpt.async_host_gib <= 0) return state;
  return std::min(state, std::max(largest_piece_bytes(layout),
                                  static_cast<int64_t>(config.ckpt.async_host_gib * 1073741824.0)));
}

int64_t checkpoint_snapshot_floor(const Config& config, const ModelLayout& layout) {
  const int64_t snapshot = checkpoint_snapshot_bytes(config, layout);
  if (snapshot == 0 || config.ckpt.async_host_gib > 0) return snapshot;
  return std::min(snapshot, largest_piece_bytes(layout));
}

// One unit's shard of one array (the parameters or one optimizer state): what
// the snapshot copies at once and the writer frees at once.
struct Piece {
  const float* live = nullptr;     // the session's shard
  float* data = nullptr;           // what the writer reads: the snapshot (or the pinned mirror)
  int64_t numel = 0;
  int unit = 0;                    // the mirror's download of this unit is waited for before it is read
  std::vector<size_t> tensors;     // indices into Writer::tensors, in write order
};

// A ring of `capacity` floats that pieces take in order and the writer gives
// back in the same order; a piece waits for room (the save is then staged).
struct Checkpointer::Pool {
  Buffer<float> arena;
  int64_t capacity = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::pair<int64_t, int64_t>> live;  // (offset, numel), oldest first
  int64_t head = 0;                              // one past the newest piece
  int64_t waits = 0;                             // acquires that had to wait (staged saves)

  explicit Pool(int64_t floats) : arena(Mem::Snapshot, floats), capacity(floats) {}

  // nullptr once `abort` is set (the save is abandoned).
  float* acquire(int64_t n, const std::atomic<bool>& abort) {
    std::unique_lock<std::mutex> lock(m);
    bool waited = false;
    for (;;) {
      if (abort.load()) return nullptr;
      int64_t at = -1;
      if (live.empty()) {
        at = 0;
      } else {
        const int64_t tail = live.front().first;
        if (head > tail) at = capacity - head >= n ? head : (tail >= n ? 0 : -1);
        else at = tail - head >= n ? head : -1;
      }
      if (at >= 0) {
        live.emplace_back(at, n);
        head = at + n;
        waits += waited;
        return arena.data() + at;
      }
      waited = true;
      cv.wait_for(lock, std::chrono::milliseconds(100));
    }
  }
  void release() {
    std::lock_guard<std::mutex> lock(m);
    live.pop_front();
    if (live.empty()) head = 0;
    cv.notify_all();
  }
};

struct Checkpointer::Writer {
  std::thread thread;
  std::mutex m;
  std::condition_variable cv;
  size_t ready = 0;                  // pieces [0, ready) may be written
  std::atomic<bool> done{false}, abort{false};
  std::atomic<int64_t> progress{0};  // tensors written: the training thread follows it while it waits
  std::string error;                 // this rank's failure ("" = none); read after done
  std::vector<Piece> pieces;
  std::vector<Tensor> tensors;
  std::vector<LocalRange> ranges;
  std::vector<int64_t> offsets;      // byte offset of each tensor's data in the file
  std::vector<uint64_t> sums;        // this rank's partial checksums
  std::unique_ptr<RawFile> raw;
  int64_t reserve_end = 0;           // rank 0: the file's blocks to reserve before the first write (0 = none)
  Pool* pool = nullptr;
  HostShardReader* mirror_reader = nullptr;  // device state: the host mirror this writer reads, released after the last write
  TrainingState* downloading = nullptr;      // device state: the mirror fills on a copy stream (start_snapshot)
  // Host state: the copier thread fills the pool from the live shards, unit by
  // unit, each after the update in flight at the save (mark), opening the gate
  // of the next update unit by unit.
  std::thread copier;
  TrainingState* host_state = nullptr;
  int64_t mark = 0;

  void copy() {
    omp_set_num_threads(std::min(kWriterThreads, omp_get_max_threads()));  // this thread's copies only
    Activity activity(fmt("checkpoint: rank %d's copy of the state of step %lld into the snapshot", rank,
                          (long long)steps_done));
    HostSnapshotGate& gate = host_state->snapshot_gate;
    for (size_t p = 0; p < pieces.size() && !abort.load(); ++p) {
      Piece& piece = pieces[p];
      if (p == 0 || pieces[p - 1].unit != piece.unit) host_state->wait_unit_updated(piece.unit, mark);
      float* dst = pool->acquire(piece.numel, abort);  // waits for room when the pool is smaller than the state
      if (!dst) break;
      const int64_t n = piece.numel;
      const float* src = piece.live;
#pragma omp parallel for schedule(static) if (n > (1 << 20))
      for (int64_t c = 0; c < n; c += (1 << 18)) std::memcpy(dst + c, src + c, 4 * std::min<int64_t>(n - c, 1 << 18));
      piece.data = dst;
      // Tests (SHARDLM_CKPT_FAULT=slowcopy@R): a copier slower than the next
      // step, so that updates must wait for it.
      if (fault.what == "slowcopy") std::this_thread::sleep_for(std::chrono::milliseconds(fault.slow_ms));
      push(p + 1);
      if (p + 1 == pieces.size() || pieces[p + 1].unit != piece.unit) gate.copied(piece.unit + 1);
      activity.progress();
    }
    gate.end();
  }

  // Stops the save in flight: the threads end without writing more.
  void stop() {
    abort.store(true);
    cv.notify_all();
    if (copier.joinable()) copier.join();
    if (thread.joinable()) thread.join();
  }
  fs::path tmp;
  int rank = 0;
  int64_t steps_done = 0;
  SaveFault fault;                   // test hooks, read on the training thread
  double write_s = 0;
  SaveResult result;                 // pending: ok, path, the blocked parts so far

  void push(size_t n) {
    std::lock_guard<std::mutex> lock(m);
    ready = n;
    cv.notify_all();
  }

  void run() {
    const auto t0 = Clock::now();
    // Watched: a write or fsync that makes no progress for comm.timeout_s ends the job (watchdog.hpp).
    Activity activity(fmt("checkpoint: rank %d's background write of step %lld to %s", rank, (long long)steps_done,
                          tmp.c_str()));
    omp_set_num_threads(std::min(kWriterThreads, omp_get_max_threads()));  // this thread's checksums only
    size_t written = 0;
    // A full disk shows up here, before any raw byte, while the metadata is clean.
    if (reserve_end > 0) {
      try {
        reserve_space(tmp, reserve_end);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    for (size_t p = 0; p < pieces.size(); ++p) {
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return ready > p || abort.load(); });
        if (ready <= p) break;  // abandoned
      }
      // After a failure the rest is drained unwritten, so a staged snapshot
      // still gets its room back and the training thread never waits forever.
      if (downloading && error.empty() && !abort.load()) {
        try {
          downloading->wait_snapshot(pieces[p].unit);
        } catch (const std::exception& e) {
          error = fmt("the snapshot's download of the state failed on rank %d: %s", rank, e.what());
        }
      }
      if (error.empty() && !abort.load()) {
        for (size_t i : pieces[p].tensors) {
          const Tensor& t = tensors[i];
          try {
            const float* src = pieces[p].data + ranges[i].shard_offset;
            raw->write(offsets[i] + ranges[i].begin * 4, src, ranges[i].count * 4);
            sums[i] = checksum_f32(src, ranges[i].begin, ranges[i].count);
            maybe_inject_save_fault(fault, written++);
            activity.progress();
            progress.fetch_add(1);
          } catch (const std::exception& e) {
            error = fmt("writing %s failed on rank %d: %s (%s)", t.path.c_str(), rank, e.what(),
                        free_space_text(tmp.parent_path()).c_str());
            break;
          }
          if (abort.load()) break;
        }
      }
      if (pool) pool->release();
    }
    if (mirror_reader) mirror_reader->end();  // pull() may refresh the mirror again
    if (error.empty() && !abort.load()) {
      try {
        raw->sync();  // the data is durable before the rename; the training thread only fsyncs the patch
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    raw.reset();
    write_s = seconds_since(t0);
    done.store(true);
  }
};

Checkpointer::Checkpointer(TrainSession& session, MPI_Comm trainers)
    : session_(session), comm_(trainers), async_(saves_async(session.config)) {
  if (!async_) return;
  const int rank = comm_rank(comm_);
  if (session.state->placement() != StatePlacement::Device) {
    // Host state: the snapshot pool, allocated and touched now (start-up), not
    // at the first save, whose blocked time would otherwise include faulting
    // in every page of it.
    const auto t0 = Clock::now();
    int64_t floats = checkpoint_snapshot_bytes(session.config, session.model.layout) / 4;
    const int64_t largest = largest_piece_bytes(session.model.layout) / 4;
    // Never more than half of what the host has available, per rank on this node.
    MPI_Comm node = MPI_COMM_NULL;
    MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    const int local_ranks = comm_size(node);
    MPI_CHECK(MPI_Comm_free(&node));
    const int64_t room = host_memory_available() / 2 / std::max(local_ranks, 1) / 4;
    if (room > 0 && floats > room) {
      if (rank == 0)
        std::printf("checkpoint: the async snapshot (%s per rank) does not fit in half of the host's available "
                    "memory; it takes %s and saves are staged: the loop waits for the write of the rest\n",
                    mib(4.0 * static_cast<double>(floats)).c_str(),
                    mib(4.0 * static_cast<double>(std::max(room, largest))).c_str());
      floats = room;
    }
    pool_ = std::make_unique<Pool>(std::max(floats, largest));
    float* p = pool_->arena.data();
    const int64_t n = pool_->capacity;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < n; c += (1 << 18)) std::memset(p + c, 0, 4 * std::min<int64_t>(n - c, 1 << 18));
    if (rank == 0 && n > (int64_t(1) << 26)) {  // worth a line from 256 MiB
      std::printf("checkpoint: async snapshot pool of %s per rank ready in %.1f s\n",
                  mib(4.0 * static_cast<double>(n)).c_str(), seconds_since(t0));
      std::fflush(stdout);
    }
    return;
  }
  // Device-resident state: the host mirror is the snapshot. Pinned, the
  // download runs at the link's speed, and nothing else writes the mirror
  // while a save is in flight (the next save, export and the end of the run
  // wait for it; the GPU broadcast reads device memory).
  const auto t0 = Clock::now();
  const TrainingState::Pinned pinned = session.state->pin_host_shards();
  const int64_t pinned_bytes = pinned.bytes, wanted = pinned.wanted_bytes;
  if (rank == 0) {
    std::printf("checkpoint: async saves snapshot into the host mirror of the GPU state on a copy stream: pinned %s "
                "of %s in %.1f s; %s\n",
                mib(static_cast<double>(pinned_bytes)).c_str(), mib(static_cast<double>(wanted)).c_str(),
                seconds_since(t0),
                pinned.device_snapshot_bytes > 0
                    ? fmt("a device copy of the state (%s) lets training go on at once",
                          mib(static_cast<double>(pinned.device_snapshot_bytes)).c_str()).c_str()
                    : "no room on the GPU for a device copy: the update after a save waits for the download");
    std::fflush(stdout);
  }
}

Checkpointer::~Checkpointer() {
  join_retention();
  if (writer_) writer_->stop();
}

bool Checkpointer::in_flight() const { return writer_ != nullptr; }

void Checkpointer::join_retention() {
  if (retention_.joinable()) retention_.join();
}

SaveResult Checkpointer::save(int64_t steps_done, int64_t tokens_seen, std::optional<SaveResult>* previous) {
  const bool behind = writer_ && !writer_->done.load();
  const int64_t previous_step = writer_ ? writer_->steps_done : 0;
  const auto t_wait = Clock::now();
  std::optional<SaveResult> before = wait();  // at most one save in flight
  if (previous) *previous = before;
  const double waited_s = seconds_since(t_wait);
  // Saves due faster than the writer writes them: every save then blocks for
  // the rest of the one before. Say so once, with the interval that would not.
  if (behind && waited_s > 1.0 && before && before->ok && !warned_writer_behind_ && comm_rank(comm_) == 0 &&
      steps_done > previous_step) {
    const double steps_s = std::max(seconds_since(last_save_start_) - waited_s, 1e-3);  // the interval's steps
    const double step_s = steps_s / double(steps_done - previous_step);
    const int64_t enough = static_cast<int64_t>(std::ceil(1.1 * before->write_s / step_s));
    std::printf("checkpoint: saves come faster than the writer: the save of step %lld waited %.1f s for step %lld's "
                "(%s written in %.1f s, %.0f MB/s; %lld steps take %.1f s): ckpt.interval = %lld or more would not "
                "stall (said once)\n",
                (long long)steps_done, waited_s, (long long)previous_step,
                mib(static_cast<double>(before->bytes)).c_str(), before->write_s,
                before->write_s > 0 ? static_cast<double>(before->bytes) / 1e6 / before->write_s : 0.0,
                (long long)(steps_done - previous_step), steps_s, (long long)std::max<int64_t>(enough, 1));
    std::fflush(stdout);
    warned_writer_behind_ = true;
  }
  last_save_start_ = Clock::now();
  join_retention();  // the free-space check counts what retention removed
  if (!async_) return save_checkpoint(session_, comm_, steps_done, tokens_seen);
  return start(steps_done, tokens_seen);
}

std::optional<SaveResult> Checkpointer::poll() {
  if (!writer_) return std::nullopt;
  int all_done = writer_->done.load() ? 1 : 0;
  Activity agreeing(fmt("checkpoint: asking whether every rank finished writing step %lld",
                        (long long)writer_->steps_done));
  allreduce(comm_, MPI_IN_PLACE, &all_done, 1, MPI_INT, MPI_MIN);
  if (!all_done) return std::nullopt;
  return complete();
}

std::optional<SaveResult> Checkpointer::wait() {
  if (!writer_) return std::nullopt;
  return complete();
}

namespace {

// The file's HDF5 part of the save of w.steps_done steps, by rank 0 alone
// through the serial driver, with the checksums still 0: the same objects as a
// synchronous save, so complete() overwrites each checksum in place. The ranks
// write the raw data through RawFile, never through HDF5, so no collective
// metadata and no MPI-IO sync hold the loop. Every rank learns where each
// tensor's space is (w.offsets); rank 0's writer reserves it (w.reserve_end).
// Collective over `comm`.
void write_file_metadata(Checkpointer::Writer& w, TrainSession& s, MPI_Comm comm, int64_t tokens_seen) {
  const int rank = comm_rank(comm);
  const int64_t steps_done = w.steps_done;
  const std::vector<Tensor>& tensors = w.tensors;
  const std::vector<int64_t> position =
      s.data ? s.data->position(steps_done).to_vector() : DataPosition{steps_done}.to_vector();
  const std::vector<uint64_t> zeros(tensors.size(), 0);
  SaveMetadata meta;
  meta.steps_done = steps_done;
  meta.tokens_seen = tokens_seen;
  meta.world_size = comm_size(comm);
  meta.saved_at = bcast_string(comm, rank == 0 ? now_text() : "");
  meta.sums = &zeros;
  meta.position_sum = checksum_i64(position.data(), 0, static_cast<int64_t>(position.size()));
  meta.position_size = static_cast<int64_t>(position.size());
  w.offsets.resize(tensors.size());
  agreed(comm, [&] {
    if (rank != 0) return;
    h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
    H5_CHECK(H5Pset_file_locking(fapl, false, true));
    FileId file;
    file.reset(H5_CHECK(H5Fcreate(w.tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)));
    std::vector<h5::Handle> dsets = write_metadata(file, s, tensors, meta);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const haddr_t offset = H5Dget_offset(dsets[i]);
      SHARDLM_CHECK(offset != HADDR_UNDEF, "no file space for %s", tensors[i].path.c_str());
      w.offsets[i] = static_cast<int64_t>(offset);
      w.reserve_end = std::max(w.reserve_end, w.offsets[i] + tensors[i].param->numel * 4);
    }
    H5_CHECK(H5Dwrite(dsets.back(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, position.data()));
    dsets.clear();
    file.close();  // every HDF5 byte is written; the writers fill the space HDF5 allocated
  });
  bcast(comm, w.offsets.data(), static_cast<int>(w.offsets.size()), MPI_INT64_T, 0);
}

// The pieces the writer writes: one per (array, unit), in the order of
// tensors_of; what each reads (the pinned mirror of device state, or the pool
// the copier fills from host state) and the ranges of this rank's shards.
void lay_out_pieces(Checkpointer::Writer& w, TrainSession& s, bool mirror, int64_t mark, bool downloading) {
  const std::vector<Tensor>& tensors = w.tensors;
  w.ranges.resize(tensors.size());
  w.sums.assign(tensors.size(), 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    w.ranges[i] = local_range(s.model, t);
    const float* live = (*t.shards)[t.unit].data();
    if (w.pieces.empty() || w.pieces.back().live != live)
      w.pieces.push_back({live, nullptr, (*t.shards)[t.unit].size(), static_cast<int>(t.unit), {}});
    w.pieces.back().tensors.push_back(i);
  }
  w.mark = mark;
  if (!mirror) {  // unit-major, so that the copier opens each unit's next update as early as it can
    std::stable_sort(w.pieces.begin(), w.pieces.end(), [](const Piece& a, const Piece& b) { return a.unit < b.unit; });
    w.host_state = s.state.get();
  }
  w.downloading = downloading ? s.state.get() : nullptr;
  if (mirror) {
    for (auto& p : w.pieces) p.data = const_cast<float*>(p.live);
    // The writer reads the mirror after this returns: the filesystem
    // broadcast's pull_state() waits for it rather than overwrite it.
    w.mirror_reader = &s.state->host_reader;
    w.mirror_reader->begin(&w.progress);
  }
}

}  // namespace

SaveResult Checkpointer::start(int64_t steps_done, int64_t tokens_seen) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  TrainSession& s = session_;
  const auto t0 = Clock::now();
  const int rank = comm_rank(comm_);
  const fs::path dir = checkpoint_dir(s.config);
  auto w = std::make_unique<Writer>();
  SaveResult& result = w->result;
  result.background = true;
  result.path = checkpoint_path(dir, steps_done);
  w->tmp = result.path.string() + ".tmp";
  w->rank = rank;
  w->steps_done = steps_done;
  w->fault = save_fault_spec(rank, steps_done);
  w->tensors = tensors_of(s);
  const std::vector<Tensor>& tensors = w->tensors;
  Activity starting(fmt("checkpoint: starting the save of step %lld (snapshot, HDF5 metadata)", (long long)steps_done));
  bool downloading = false;
  try {
    // Device-resident state: the download into the pinned mirror runs on a
    // copy stream under the next steps (the writer waits per unit); otherwise
    // (offload: the CPU optimizer is idle; host state) the host shards are current.
    const bool mirror = s.state->placement() == StatePlacement::Device;
    downloading = mirror && s.state->start_snapshot();
    // Host state: no pull; the copier waits per unit for the update in flight.
    const int64_t mark = mirror ? 0 : s.state->snapshot_mark();
    if (mirror && !downloading) s.pull_state();
    const double pull_s = seconds_since(t0);
    const auto t_meta = Clock::now();
    int64_t data_bytes = 0;
    for (const auto& t : tensors) data_bytes += t.param->numel * 4;
    agreed(comm_, [&] {
      if (rank == 0) prepare_dir(dir, bytes_needed_for(data_bytes, tensors.size()), s.config.ckpt.keep_last);
    });
    write_file_metadata(*w, s, comm_, tokens_seen);
    const char* skip = std::getenv("SHARDLM_CKPT_SKIP_SPACE_CHECK");  // tests: reach ENOSPC in the writes
    if (rank != 0 || (skip && *skip)) w->reserve_end = 0;
    agreed(comm_, [&] { w->raw = std::make_unique<RawFile>(w->tmp, true); });
    result.metadata_s = seconds_since(t_meta);

    const auto t_snap = Clock::now();
    w->pool = mirror ? nullptr : pool_.get();
    lay_out_pieces(*w, s, mirror, mark, downloading);
    Writer* writer = w.get();
    writer->thread = std::thread([writer] { writer->run(); });
    writer_ = std::move(w);
    if (mirror) {
      writer->push(writer->pieces.size());
    } else {
      s.state->snapshot_gate.begin(mark);  // the updates after the mark wait for the copier, unit by unit
      writer->copier = std::thread([writer] { writer->copy(); });
    }
    writer->result.snapshot_s = pull_s + seconds_since(t_snap);
    writer->result.ok = true;  // pending: complete() decides
    writer->result.seconds = seconds_since(t0);
    return writer->result;
  } catch (const std::exception& e) {
    SaveResult failed = w ? w->result : writer_->result;
    failed.ok = false;
    failed.error = e.what();
    if (downloading && !writer_)  // nothing reads the mirror, but the copy stream still writes it: let it finish
      s.state->wait_snapshot(static_cast<int>(s.model.layout.units.size()) - 1);
    if (writer_) {  // cannot happen after the threads started (nothing there throws), but never leave them running
      writer_->stop();
      writer_.reset();
    }
    if (rank == 0) {
      std::error_code ec;
      fs::remove(failed.path.string() + ".tmp", ec);
    }
    failed.seconds = seconds_since(t0);
    if (rank == 0) print_save_result(failed, dir);
    return failed;
  }
}

SaveResult Checkpointer::complete() {
  const auto t0 = Clock::now();
  Writer& w = *writer_;
  {
    // Bounded by the writer's own progress: while it writes, this waits; when
    // it stalls for comm.timeout_s, the watchdog ends the job (watchdog.hpp).
    Activity waiting(fmt("checkpoint: waiting for rank %d's background write of step %lld", w.rank,
                         (long long)w.steps_done));
    wait_following(waiting, [&] { return w.done.load(); }, w.progress);
  }
  w.thread.join();
  if (w.copier.joinable()) w.copier.join();  // done before the writer: it pushed every piece
  Activity completing(fmt("checkpoint: completing step %lld (checksums, fsync, rename, `latest`)",
                          (long long)w.steps_done));
  SaveResult result = w.result;
  const int rank = comm_rank(comm_);
  const fs::path dir = result.path.parent_path();
  try {
    agreed(comm_, [&] {
      if (!w.error.empty()) throw Error(w.error);
    });
    allreduce(comm_, MPI_IN_PLACE, w.sums.data(), static_cast<int>(w.sums.size()), MPI_UINT64_T, MPI_SUM);
    double write_s = w.write_s;
    allreduce(comm_, MPI_IN_PLACE, &write_s, 1, MPI_DOUBLE, MPI_MAX);
    result.write_s = write_s;
    // The checksums into the attributes made with 0: same size, rewritten in place.
    agreed(comm_, [&] {
      if (rank != 0) return;
      h5::Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)), H5Pclose);
      H5_CHECK(H5Pset_file_locking(fapl, false, true));
      FileId file;
      file.reset(H5_CHECK(H5Fopen(w.tmp.c_str(), H5F_ACC_RDWR, fapl)));
      for (size_t i = 0; i < w.tensors.size(); ++i) {
        h5::Handle d(H5_CHECK(H5Dopen2(file, w.tensors[i].path.c_str(), H5P_DEFAULT)), H5Dclose);
        h5::Handle a(H5_CHECK(H5Aopen(d, "checksum", H5P_DEFAULT)), H5Aclose);
        H5_CHECK(H5Awrite(a, H5T_NATIVE_UINT64, &w.sums[i]));
      }
      file.close();
    });
    result.bytes = publish(comm_, w.tmp, result.path, w.steps_done, session_.config.ckpt, &result.sync_s,
                           /*retention=*/false);
    result.ok = true;
    if (rank == 0)  // the new file is `latest`: removing older ones need not hold the loop
      retention_ = std::thread([dir, step = w.steps_done, ckpt = session_.config.ckpt] {
        apply_retention(dir, step, ckpt);
      });
  } catch (const std::exception& e) {
    result.ok = false;
    result.error = e.what();
    if (rank == 0) {
      std::error_code ec;
      fs::remove(w.tmp, ec);
    }
  }
  result.finish_s = seconds_since(t0);
  result.seconds += result.finish_s;
  if (rank == 0) print_save_result(result, dir);
  writer_.reset();
  return result;
}

}  // namespace shardlm
