// save.cpp — the collective save: prepare the directory, checksum,
// metadata, raw data, close, fsync, rename, `latest`, retention (the protocol
// in docs/checkpoint.md, "Files"). The layout is checkpoint/layout.hpp's, the byte
// movement checkpoint/io.hpp's.
#include <sys/statvfs.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/agree.hpp"
#include "checkpoint/io.hpp"
#include "checkpoint/layout.hpp"
#include "checkpoint/save.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/watchdog.hpp"
#include "train/train.hpp"

namespace fs = std::filesystem;

namespace shardlm {

using namespace ckpt;


SaveFault ckpt::save_fault_spec(int rank, int64_t step) {
  SaveFault fault;
  const char* spec = std::getenv("SHARDLM_CKPT_FAULT");
  if (!spec || !*spec) return fault;
  const std::string s = spec;
  const size_t at = s.find('@');
  if (at == std::string::npos || std::atoi(s.c_str() + at + 1) != rank) return fault;
  std::string what = s.substr(0, at);
  if (const size_t colon = what.find(':'); colon != std::string::npos) {
    if (std::atoll(what.c_str() + colon + 1) != step) return fault;
    what.resize(colon);
  }
  fault.what = what;
  fault.spec = s;
  const char* ms = std::getenv("SHARDLM_CKPT_SLOW_MS");  // tests: a shorter stretch
  if (ms && *ms) fault.slow_ms = std::atoi(ms);
  return fault;
}

void ckpt::maybe_inject_save_fault(const SaveFault& fault, size_t tensor) {
  if (fault.what.empty()) return;
  if (fault.what == "slow") std::this_thread::sleep_for(std::chrono::milliseconds(fault.slow_ms));
  if (tensor != 0) return;
  if (fault.what == "write")
    SHARDLM_FAIL("injected write error (SHARDLM_CKPT_FAULT=%s): No space left on device", fault.spec.c_str());
  if (fault.what == "kill") raise(SIGKILL);
  if (fault.what == "stall")
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

int64_t ckpt::bytes_needed_for(int64_t data_bytes, size_t tensors) {
  return data_bytes + static_cast<int64_t>(tensors) * 4096 + (1 << 20);
}

int64_t ckpt::publish(MPI_Comm comm, const fs::path& tmp, const fs::path& final_path, int64_t steps_done,
                      const CkptSection& ckpt, double* sync_s, bool retention) {
  const int rank = comm_rank(comm);
  const fs::path dir = final_path.parent_path();
  const auto t0 = std::chrono::steady_clock::now();
  // Durable before visible: every node flushes its part, then rank 0 renames.
  const bool leader = node_leader(comm);
  agreed(comm, [&] {
    if (leader) sync_path(tmp, false);
  });
  if (sync_s) *sync_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t bytes = 0;
  agreed(comm, [&] {
    if (rank != 0) return;
    bytes = static_cast<int64_t>(fs::file_size(tmp));
    std::error_code ec;
    fs::rename(tmp, final_path, ec);
    SHARDLM_CHECK(!ec, "cannot rename %s to %s: %s", tmp.c_str(), final_path.c_str(), ec.message().c_str());
    sync_path(dir, true);
    write_atomically(dir, "latest", final_path.filename().string() + "\n");
  });
  if (rank == 0 && retention) apply_retention(dir, steps_done, ckpt);
  bcast(comm, &bytes, 1, MPI_INT64_T, 0);
  return bytes;
}

void ckpt::print_save_result(const SaveResult& r, const fs::path& dir) {
  const double mb_s = r.write_s > 0 ? static_cast<double>(r.bytes) / 1e6 / r.write_s : 0.0;
  if (r.ok && r.background)
    std::printf("checkpoint: saved %s (%s): loop blocked %.0f ms (snapshot %.0f ms, metadata %.0f ms, finish %.0f ms "
                "with fsync %.0f ms); background write %.2f s, %.0f MB/s (async)\n",
                r.path.c_str(), mib(static_cast<double>(r.bytes)).c_str(), 1e3 * r.seconds, 1e3 * r.snapshot_s,
                1e3 * r.metadata_s, 1e3 * r.finish_s, 1e3 * r.sync_s, r.write_s, mb_s);
  else if (r.ok)
    std::printf("checkpoint: saved %s (%s): loop blocked %.0f ms; write %.2f s, %.0f MB/s (sync; checksums %.2f s, "
                "fsync %.2f s)\n",
                r.path.c_str(), mib(static_cast<double>(r.bytes)).c_str(), 1e3 * r.seconds, r.write_s, mb_s,
                r.checksum_s, r.sync_s);
  else
    std::fprintf(stderr,
                 "shardlm: checkpoint %s FAILED: %s\n"
                 "shardlm: older checkpoints in %s are untouched; `latest` still names the previous one\n",
                 r.path.c_str(), r.error.c_str(), dir.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
}

// Rank 0, before writing: the directory exists, partial files of crashed
// saves are gone, and the file fits on the disk.
void ckpt::prepare_dir(const fs::path& dir, int64_t bytes_needed, int64_t keep_last) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  SHARDLM_CHECK(!ec && fs::is_directory(dir), "cannot create the checkpoint directory %s: %s", dir.c_str(),
                ec ? ec.message().c_str() : "a file of that name is in the way");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool stale = name == "latest.tmp" || (name.size() > 4 && name.substr(name.size() - 4) == ".tmp" &&
                                               checkpoint_step_of(name.substr(0, name.size() - 4)) >= 0);
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

namespace {

// The collective write. Order matters for failures: parallel HDF5 cannot close
// a file whose metadata flush failed on some ranks without hanging, so all
// metadata is created and flushed first, the file's space is reserved, and
// only then is raw data written; a failed raw write leaves clean metadata and
// a close that every rank completes.
void write_file(TrainSession& s, MPI_Comm comm, const fs::path& tmp, const std::vector<Tensor>& tensors,
                const SaveMetadata& meta, const std::vector<int64_t>& position) {
  const int rank = comm_rank(comm);
  FileId file;
  std::vector<h5::Handle> dsets;  // tensors', then /data/position
  agreed(comm, [&] {
    h5::Handle fapl = mpio_fapl(comm);
    file.reset(H5_CHECK(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)));
  });
  agreed(comm, [&] {
    dsets = write_metadata(file, s, tensors, meta);
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
  const SaveFault fault = save_fault_spec(rank, meta.steps_done);
  for (size_t i = 0; i < tensors.size(); ++i) {
    agreed(comm, [&] {
      const Tensor& t = tensors[i];
      try {
        const LocalRange r = local_range(s.model, t);
        float* base = (*t.shards)[t.unit].data() + r.shard_offset;
        if (raw) raw->write(offsets[i] + r.begin * 4, base, r.count * 4);
        else transfer<float>(dsets[i], t.param->shape, r.begin, r.count, base,
                             rounds_for(t.param->numel, s.model.layout.units[t.unit].shard_numel), dxpl,
                             H5T_NATIVE_FLOAT, true);
        maybe_inject_save_fault(fault, i);
        note_progress();
      } catch (const std::exception& e) {
        SHARDLM_FAIL("writing %s failed on rank %d: %s (%s)", t.path.c_str(), rank, e.what(),
                     free_space_text(tmp.parent_path()).c_str());
      }
    });
  }
  agreed(comm, [&] {
    std::vector<int64_t> values = position;
    transfer<int64_t>(dsets.back(), {static_cast<int64_t>(values.size())}, 0,
                      rank == 0 ? static_cast<int64_t>(values.size()) : 0, values.data(), 1, dxpl, H5T_NATIVE_INT64,
                      true);
  });
  agreed(comm, [&] {
    raw.reset();
    dsets.clear();
    file.close();
  });
}

}  // namespace

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
  // Watched: a write, fsync or HDF5 collective that makes no progress for comm.timeout_s ends the job.
  Activity saving(fmt("checkpoint: saving step %lld to %s", (long long)steps_done, tmp.c_str()));

  try {
    s.pull_state();  // device-resident state (GPU): refresh the host shards we write from
    int64_t data_bytes = 0;
    for (const auto& t : tensors) data_bytes += t.param->numel * 4;
    const int64_t bytes_needed = bytes_needed_for(data_bytes, tensors.size());
    agreed(comm, [&] {
      if (rank == 0) prepare_dir(dir, bytes_needed, s.config.ckpt.keep_last);
    });

    // Checksums of what this rank holds, summed over ranks in one all-reduce.
    std::vector<uint64_t> sums(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const LocalRange r = local_range(s.model, tensors[i]);
      sums[i] = checksum_f32((*tensors[i].shards)[tensors[i].unit].data() + r.shard_offset, r.begin, r.count);
    }
    allreduce(comm, MPI_IN_PLACE, sums.data(), static_cast<int>(sums.size()), MPI_UINT64_T, MPI_SUM);
    // RL reads rollout files by step: no sampler position beyond the step itself.
    const std::vector<int64_t> position =
        s.data ? s.data->position(steps_done).to_vector() : DataPosition{steps_done}.to_vector();
    const uint64_t position_sum = checksum_i64(position.data(), 0, static_cast<int64_t>(position.size()));
    const std::string saved_at = bcast_string(comm, rank == 0 ? now_text() : "");

    const auto t_written = std::chrono::steady_clock::now();
    result.checksum_s = std::chrono::duration<double>(t_written - t0).count();
    SaveMetadata meta;
    meta.steps_done = steps_done;
    meta.tokens_seen = tokens_seen;
    meta.world_size = comm_size(comm);
    meta.saved_at = saved_at;
    meta.sums = &sums;
    meta.position_sum = position_sum;
    meta.position_size = static_cast<int64_t>(position.size());
    write_file(s, comm, tmp, tensors, meta, position);
    const auto t_synced = std::chrono::steady_clock::now();
    result.write_s = std::chrono::duration<double>(t_synced - t_written).count();

    result.bytes = publish(comm, tmp, result.path, steps_done, s.config.ckpt, &result.sync_s);
    result.ok = true;
  } catch (const std::exception& e) {
    result.ok = false;
    result.error = e.what();
    if (rank == 0) {
      std::error_code ec;
      fs::remove(tmp, ec);
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0) print_save_result(result, dir);
  return result;
}

}  // namespace shardlm
