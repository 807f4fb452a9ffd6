// export.cpp — `shardlm export`: /model of a checkpoint streamed into
// a Hugging Face directory (config.json + model.safetensors), checksums
// verified on the way. Serial HDF5 on rank 0; knows nothing about the training
// state.
#include "checkpoint/agree.hpp"
#include "checkpoint/checkpoint.hpp"
#include "checkpoint/inspect.hpp"
#include "checkpoint/io.hpp"
#include "checkpoint/layout.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "model/tokenizer_files.hpp"
#include "shardlm/config.hpp"
#include "shardlm/model.hpp"

namespace fs = std::filesystem;

namespace shardlm {

using namespace ckpt;

namespace {

std::string export_dtype(const std::string& d) {
  if (d == "bf16" || d == "BF16" || d == "bfloat16") return "BF16";
  if (d == "fp32" || d == "F32" || d == "f32" || d == "float32") return "F32";
  SHARDLM_FAIL("--dtype '%s' is not one of bf16, fp32", d.c_str());
}

}  // namespace

CheckpointInfo read_checkpoint_model(const fs::path& given, const ModelChunkSink& sink) {
  h5::silence_error_stack();  // failures become one shardlm::Error line
  const fs::path path = resolve_checkpoint(given);
  const CheckpointInfo info = read_checkpoint_info(path);
  const ModelLayout layout(info.arch, 1);
  h5::Handle file = open_serial(path);
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
        sink(*p, lo, c, chunk.data());
      }
      SHARDLM_CHECK(sum == want, "checksum mismatch (stored %016llx, read %016llx)", (unsigned long long)want,
                    (unsigned long long)sum);
    } catch (const std::exception& e) {
      throw_damaged(path, fmt("%s: %s", name.c_str(), e.what()));
    }
  }
  return info;
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
    SafetensorsWriter writer(out_dir / "model.safetensors", specs,
                             {{"shardlm_checkpoint", path.string()}, {"step", std::to_string(info.step)}});
    read_checkpoint_model(path, [&](const ParamInfo& p, int64_t begin, int64_t count, const float* values) {
      writer.write(p.name, begin, count, values);
    });
    writer.finish();
    write_hf_config(out_dir, info.arch, dtype == "BF16" ? "bfloat16" : "float32");
    const std::string tokenizer = copy_tokenizer_files(parse_deck_text(info.deck, path, {}, 0).config.model.hf, out_dir);
    std::printf("export: %s (step %lld) -> %s (config.json, model.safetensors, %s; %s)\n", path.c_str(),
                (long long)info.step, out_dir.c_str(), dtype == "BF16" ? "bf16" : "fp32", tokenizer.c_str());
    std::fflush(stdout);
  });
}

}  // namespace shardlm
