// shard.cpp — flat shards: segments, init, HF loading and export.
#include "train/shard.hpp"

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstring>
#include <set>

#include "cpu/adamw.hpp"
#include "shardlm/error.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/watchdog.hpp"

namespace shardlm {

ShardedModel::ShardedModel(const ModelConfig& config, int rank_, int world_, bool host_grads, int64_t expert_parallel)
    : layout(config, world_, expert_parallel), rank(rank_), world(world_) {
  for (const auto& u : layout.units) {
    param.emplace_back(Mem::ParamShard, u.shard_numel);
    grad.emplace_back(Mem::GradShard, host_grads ? u.shard_numel : 0);
    // Padding past the last parameter stays zero forever: it is gathered,
    // reduced and "updated" like the rest, and must never become NaN.
    const std::vector<ShardSegment> segs = segments(u);
    zero_shard_first_touch(param.back().data(), segs, u.shard_numel);
    if (host_grads) zero_shard_first_touch(grad.back().data(), segs, u.shard_numel);
  }
}

void zero_shard_first_touch(float* shard, const std::vector<ShardSegment>& segments, int64_t shard_numel) {
  int64_t cursor = 0;  // segments come in shard order; whatever lies between or after them is padding
  for (const auto& s : segments) {
    if (s.shard_offset > cursor) std::memset(shard + cursor, 0, sizeof(float) * size_t(s.shard_offset - cursor));
    cpu::zero_first_touch(shard + s.shard_offset, s.count);
    cursor = std::max(cursor, s.shard_offset + s.count);
  }
  if (shard_numel > cursor) std::memset(shard + cursor, 0, sizeof(float) * size_t(shard_numel - cursor));
}

std::vector<ShardSegment> ShardedModel::segments(const Unit& u) const {
  std::vector<ShardSegment> out;
  const int64_t begin = shard_begin(u), end = begin + u.shard_numel;
  for (const auto& p : u.params) {
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
    if (lo < hi) out.push_back({&p, lo - p.offset, lo - begin, hi - lo});
  }
  return out;
}

void ShardedModel::zero_grads() {
  for (auto& g : grad)
    if (g.size() > 0) std::memset(g.data(), 0, g.bytes());
}

void ShardedModel::init_seeded(uint64_t seed, double std) {
  for (size_t i = 0; i < layout.units.size(); ++i)
    for (const auto& s : segments(layout.units[i]))
      init_range(seed, *s.param, s.param_begin, s.count, std, param[i].data() + s.shard_offset);
}

void ShardedModel::load_hf(const SafetensorsReader& weights) {
  std::set<std::string> expected;
  for (const auto& [unit, p] : layout.all_params()) {
    expected.insert(p->name);
    SHARDLM_CHECK(weights.has(p->name), "the HF weights have no tensor '%s', which this %s model needs",
                  p->name.c_str(), layout.config.arch.c_str());
    const TensorInfo& info = weights.info(p->name);
    if (info.shape != p->shape) {
      auto show = [](const std::vector<int64_t>& s) {
        std::string out = "[";
        for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
        return out + "]";
      };
      SHARDLM_FAIL("tensor '%s' in %s has shape %s but config.json implies %s", p->name.c_str(),
                   info.file.c_str(), show(info.shape).c_str(), show(p->shape).c_str());
    }
  }
  std::vector<std::string> extra;
  for (const auto& name : weights.names())
    if (!expected.count(name) && !(layout.config.tie_word_embeddings && name == "lm_head.weight"))
      extra.push_back(name);
  if (!extra.empty())
    SHARDLM_FAIL("the HF weights hold %zu tensor%s this model does not use, first '%s' "
                 "(is config.json the one that belongs to these weights?)",
                 extra.size(), extra.size() == 1 ? "" : "s", extra[0].c_str());
  for (size_t i = 0; i < layout.units.size(); ++i)
    for (const auto& s : segments(layout.units[i]))
      weights.read_f32(s.param->name, s.param_begin, s.count, param[i].data() + s.shard_offset);
}

void export_hf(const ShardedModel& model, Comm& comm, const std::filesystem::path& dir, const std::string& dtype) {
  std::vector<TensorSpec> specs;
  // In the order of the model laid out without expert parallelism, so that the
  // file is the same whatever model.expert_parallel the run had.
  const ModelLayout unsplit(model.layout.config, 1);
  for (const auto& [unit, p] : unsplit.all_params()) specs.push_back({p->name, p->shape, dtype});
  std::unique_ptr<SafetensorsWriter> writer;
  if (comm.rank() == 0) {
    std::filesystem::create_directories(dir);
    write_hf_config(dir, model.layout.config, dtype == "BF16" ? "bfloat16" : "float32");
    writer = std::make_unique<SafetensorsWriter>(dir / "model.safetensors", specs);
  }
  int64_t max_padded = 0;
  for (const auto& u : model.layout.units) max_padded = std::max(max_padded, u.padded_numel);
  Buffer<float> full(Mem::Gathered, max_padded);
  // Watched: rank 0's writes and its fsync of the whole file (140 GB at 70B)
  // progress piece by piece, and the others, waiting in the barrier, keep
  // waiting while it does; a write that stops ends the job (watchdog.hpp).
  Activity exporting(fmt("export: writing %s", (dir / "model.safetensors").c_str()));
  for (size_t i = 0; i < model.layout.units.size(); ++i) {
    const Unit& u = model.layout.units[i];
    comm.all_gather(model.param[i].data(), full.data(), u.shard_numel).wait();
    if (writer)
      for (const auto& p : u.params) writer->write(p.name, 0, p.numel, full.data() + p.offset);
    exporting.progress();
  }
  // Tests (SHARDLM_FAULT=export_slow@R / export_stall@R): rank R's last part of
  // the export takes 6 s while progressing, or never progresses again.
  if (fault_armed("export_slow"))
    for (int i = 0; i < 30; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(200)), exporting.progress();
  if (fault_armed("export_stall"))
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  if (writer) writer->finish();
  comm.barrier();
}

std::vector<std::vector<float>> gather_all_params(const ShardedModel& model, Comm& comm) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < model.layout.units.size(); ++i) {
    const Unit& u = model.layout.units[i];
    std::vector<float> full(u.padded_numel);
    comm.all_gather(model.param[i].data(), full.data(), u.shard_numel).wait();
    for (const auto& p : u.params) out.emplace_back(full.begin() + p.offset, full.begin() + p.offset + p.numel);
  }
  return out;
}

}  // namespace shardlm
