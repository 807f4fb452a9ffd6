// load.cpp — the collective, verified load at any world size, the
// report of everything that does not fit this run, and resume's fallback past
// damaged files.
#include <algorithm>
#include <set>
#include <type_traits>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/agree.hpp"
#include "checkpoint/io.hpp"
#include "checkpoint/layout.hpp"
#include "shardlm/model_config.hpp"
#include "shardlm/watchdog.hpp"
#include "train/train.hpp"

namespace fs = std::filesystem;

namespace shardlm {

using namespace ckpt;

namespace {

// Runs `read` on checkpoint `path`: a failure already named (damage, or a
// mismatch with this run) passes through; any other becomes damage of the file.
template <class Read>
auto as_damage(const fs::path& path, Read&& read) -> decltype(read()) {
  try {
    return read();
  } catch (const CheckpointDamaged&) {
    throw;
  } catch (const CheckpointMismatch&) {
    throw;
  } catch (const std::exception& e) {
    throw_damaged(path, e.what());
  }
}

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
  for (const ModelField& f : model_fields())
    if (f.shapes_weights)
      visit_member(f, theirs, [&](const auto& saved) {
        using T = std::decay_t<decltype(saved)>;
        const T& now = member_of<T>(f, mine);
        if constexpr (std::is_same_v<T, bool>) cmp(f.name, static_cast<int>(saved), static_cast<int>(now));
        else cmp(f.name, saved, now);
      });

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

}  // namespace

CheckpointInfo load_checkpoint(TrainSession& s, MPI_Comm comm, const fs::path& path) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  const int rank = comm_rank(comm);
  const std::vector<Tensor> tensors = tensors_of(s);
  Activity loading(fmt("checkpoint: loading %s", path.c_str()));  // watched, like a save
  h5::Handle file;
  CheckpointInfo info;
  std::vector<uint64_t> stored(tensors.size());
  std::vector<int64_t> position;

  agreed(comm, [&] {
    if (rank == 0 && !fs::exists(path)) SHARDLM_FAIL("checkpoint %s does not exist", path.c_str());
  });
  agreed(comm, [&] {
    as_damage(path, [&] {
      h5::Handle fapl = mpio_fapl(comm);
      file = h5::Handle(H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl)), H5Fclose);
      info = read_info(file, path);
      // Complete by its own account: a dataset missing or renamed is damage
      // (the previous file is tried), not a mismatch with this run.
      if (const auto missing = layout_problems(file, info); !missing.empty()) {
        const size_t shown = std::min<size_t>(missing.size(), 5);
        SHARDLM_FAIL("%zu dataset problem%s: %s%s", missing.size(), missing.size() == 1 ? "" : "s",
                     join(std::vector<std::string>(missing.begin(), missing.begin() + shown), "; ").c_str(),
                     missing.size() > shown ? "; ..." : "");
      }
      h5::Handle d(H5_CHECK(H5Dopen2(file, "/data/position", H5P_DEFAULT)), H5Dclose);
      const auto shape = dataset_shape(d);
      SHARDLM_CHECK(shape.size() == 1 && shape[0] > 0 && shape[0] <= 8 + 2 * 4096, "/data/position has shape %s",
                    show_shape(shape).c_str());
      position.resize(static_cast<size_t>(shape[0]));
      H5_CHECK(H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, position.data()));
      const uint64_t want = read_u64(d, "checksum");
      if (checksum_i64(position.data(), 0, shape[0]) != want)
        SHARDLM_FAIL("checksum mismatch in /data/position");
      const DataPosition saved = DataPosition::from_vector(position);
      // An RL step makes loss.epochs x loss.mini_batches optimizer updates: the saved run's deck's, or this one's.
      const int64_t updates = std::max(updates_per_step(s.config),
                                       updates_per_step(parse_deck_text(info.deck, path.string(), {}, 1).config));
      SHARDLM_CHECK(saved.step == info.step && info.optimizer_steps >= 0 && info.optimizer_steps <= info.step * updates,
                    "the counters disagree: step %lld, /data/position's step %lld, /optim steps_taken %lld",
                    (long long)info.step, (long long)saved.step, (long long)info.optimizer_steps);
    });
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
        else transfer<float>(d, t.param->shape, r.begin, r.count, base, rounds_for(t.param->numel, s.model.layout.units[t.unit].shard_numel), dxpl,
                             H5T_NATIVE_FLOAT, false);
        sums[i] = checksum_f32(base, r.begin, r.count);
        loading.progress();
      } catch (const std::exception& e) {
        throw_damaged(path, fmt("%s: %s", tensors[i].path.c_str(), e.what()));
      }
    });
  }
  raw.reset();
  dxpl.reset();
  file.reset();
  allreduce(comm, MPI_IN_PLACE, sums.data(), static_cast<int>(sums.size()), MPI_UINT64_T, MPI_SUM);
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
  std::error_code ec;
  SHARDLM_CHECK(fs::exists(path, ec), "checkpoint %s: no such file", path.c_str());  // not damage: nothing is there
  return as_damage(path, [&] {
    h5::Handle file = open_serial(path);
    CheckpointInfo info = read_info(file, path);
    h5::Handle d(H5_CHECK(H5Dopen2(file, "/data/position", H5P_DEFAULT)), H5Dclose);
    std::vector<int64_t> position(static_cast<size_t>(numel_of(dataset_shape(d))));
    H5_CHECK(H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, position.data()));
    info.data = DataPosition::from_vector(position);
    return info;
  });
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

}  // namespace shardlm
