// inspect.cpp — `shardlm inspect`: what a checkpoint holds, every
// dataset the layout requires checked by name, every checksum verified.
// Serial HDF5 on rank 0; knows nothing about the training state.
#include <algorithm>
#include <chrono>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/agree.hpp"
#include "checkpoint/inspect.hpp"
#include "checkpoint/io.hpp"
#include "checkpoint/layout.hpp"
#include "shardlm/model_config.hpp"

namespace fs = std::filesystem;

namespace shardlm {

using namespace ckpt;

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

}  // namespace

fs::path ckpt::resolve_checkpoint(const fs::path& p) {
  if (!fs::is_directory(p)) return p;
  const fs::path dir = fs::is_directory(p / "checkpoints") ? p / "checkpoints" : p;
  const auto c = resume_candidates(dir);
  SHARDLM_CHECK(!c.empty(), "%s holds no checkpoint (step_<N>.h5)", dir.c_str());
  return c.front();
}

int inspect_checkpoint(const fs::path& given, MPI_Comm comm, std::FILE* out) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  int rc = 0;
  if (comm_rank(comm) == 0) {
    fs::path path = given;
    std::error_code ec;
    if (!fs::exists(given, ec)) {
      std::fprintf(out, "shardlm inspect: %s: no such file or directory\n", given.c_str());
      rc = 2;
    } else try {
      path = resolve_checkpoint(given);
      const CheckpointInfo info = read_checkpoint_info(path);
      const ModelConfig& a = info.arch;
      std::string sizes;  // "vocab_size 256, hidden_size 64, ...": the table's names, as in the deck
      for (const ModelSizeField& f : model_size_fields())
        sizes += fmt("%s%s %lld", sizes.empty() ? "" : ", ", f.name, (long long)member_of<int64_t>(f, a));
      std::string options;  // the options that are on, in the table's words: the tied embedding, then the layers'
      for (const char* name : {"tie_word_embeddings", "attention_bias", "qk_norm"})
        if (const ModelField& f = *model_field(name); member_of<bool>(f, a)) options += fmt(", %s", f.note);
      std::fprintf(out,
                   "checkpoint %s\n"
                   "  format %lld, written by shardlm %s at %s\n"
                   "  step %lld (steps completed), tokens seen %lld, world size at save %lld\n"
                   "  model %s: %s%s\n"
                   "  %lld parameters in %lld tensors\n"
                   "  optimizer %s, state [%s], %lld steps taken; bad steps %lld in a row, %lld total\n"
                   "  data: step %lld starts at row %lld; seq_len %lld, seed %llu, %lld documents, shuffle %s\n",
                   path.c_str(), (long long)info.format, info.shardlm_version.c_str(), info.saved_at.c_str(),
                   (long long)info.step, (long long)info.tokens_seen, (long long)info.world_size_at_save,
                   a.arch.c_str(), sizes.c_str(), options.c_str(), (long long)info.parameter_count, (long long)info.tensors,
                   info.optimizer.c_str(), join(info.optimizer_states, ", ").c_str(), (long long)info.optimizer_steps,
                   (long long)info.bad_steps_in_a_row, (long long)info.bad_steps_total, (long long)info.data.step,
                   (long long)info.data.rows_consumed, (long long)info.data.seq_len,
                   (unsigned long long)info.data.seed, (long long)info.data.documents,
                   info.data.shuffle ? "on" : "off");
      std::fflush(out);
      // What the file's own attributes say it must hold, by name (a renamed or
      // deleted dataset is damage), and every dataset there verified.
      h5::Handle file = open_serial(path);
      std::vector<std::string> problems = layout_problems(file, info);
      std::vector<std::string> expected = expected_datasets(info);
      int64_t elements = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& name : expected) {
        std::string why;
        try {
          if (link_exists(file, name)) why = verify_dataset(file, name, &elements);  // missing: listed above
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
        std::fprintf(out, "  datasets: %zu problem%s (of %zu expected):\n", problems.size(),
                     problems.size() == 1 ? "" : "s", expected.size());
        for (const auto& p : problems) std::fprintf(out, "    %s\n", p.c_str());
        std::fprintf(out, "DAMAGED: %s\n", path.c_str());
      }
    } catch (const std::exception& e) {
      rc = 1;
      std::fprintf(out, "DAMAGED: %s\n", e.what());
    }
    std::fflush(out);
  }
  MPI_CHECK(MPI_Bcast(&rc, 1, MPI_INT, 0, comm));
  return rc;
}

}  // namespace shardlm
