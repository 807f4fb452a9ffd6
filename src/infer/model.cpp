// model.cpp — loading the whole model for sampling (HF directory or checkpoint).
#include "infer/model.hpp"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/inspect.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/config.hpp"

namespace fs = std::filesystem;

namespace shardlm {

namespace {

void add_id(std::vector<int32_t>& ids, int64_t id) {
  if (id >= 0 && id <= INT32_MAX && std::find(ids.begin(), ids.end(), int32_t(id)) == ids.end())
    ids.push_back(static_cast<int32_t>(id));
}

const float* param_ptr(const ShardedModel& m, const Unit& u, const std::string& name) {
  return m.param[size_t(&u - m.layout.units.data())].data() + u.param(name).offset;
}

}  // namespace

std::vector<int32_t> generation_config_eos(const fs::path& dir) {
  const fs::path file = dir / "generation_config.json";
  std::vector<int32_t> ids;
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return ids;
  std::ifstream in(file);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  SHARDLM_CHECK(!j.is_discarded() && j.is_object(), "%s: not a JSON object", file.c_str());
  const auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return ids;
  if (it->is_number_integer()) add_id(ids, it->get<int64_t>());
  else if (it->is_array())
    for (const auto& v : *it)
      if (v.is_number_integer()) add_id(ids, v.get<int64_t>());
  return ids;
}

InferenceModel InferenceModel::from_hf(const fs::path& dir) {
  std::error_code ec;
  SHARDLM_CHECK(fs::is_directory(dir, ec), "--hf %s: no such directory (an HF model directory holds config.json "
                "and *.safetensors)", dir.c_str());
  InferenceModel m;
  const ModelConfig config = read_hf_config(dir);
  m.weights = std::make_unique<ShardedModel>(config, 0, 1, /*host_grads=*/false);
  m.weights->load_hf(SafetensorsReader(dir));
  m.source = "HF directory " + dir.string();
  m.tokenizer_dir = dir;
  add_id(m.eos_ids, config.eos_token_id);
  for (int32_t id : generation_config_eos(dir)) add_id(m.eos_ids, id);
  return m;
}

InferenceModel InferenceModel::for_broadcast(const ModelConfig& config, const std::string& hf_dir) {
  InferenceModel m;
  m.weights = std::make_unique<ShardedModel>(config, 0, 1, /*host_grads=*/false);
  m.source = "the trainers' weight broadcast";
  if (!hf_dir.empty()) {
    m.tokenizer_dir = hf_dir;
    for (int32_t id : generation_config_eos(hf_dir)) add_id(m.eos_ids, id);
  }
  add_id(m.eos_ids, config.eos_token_id);
  return m;
}

void InferenceModel::load_bf16(const ParamInfo& p, const uint16_t* values) {
  const ModelLayout::Located at = weights->layout.find(p.name);
  SHARDLM_CHECK(at.unit && at.param->numel == p.numel, "internal: broadcast parameter %s is not in the model's layout",
                p.name.c_str());
  float* dst = weights->param[size_t(at.unit - weights->layout.units.data())].data() + at.param->offset;
#pragma omp parallel for schedule(static) if (p.numel > (int64_t(1) << 20))
  for (int64_t i = 0; i < p.numel; ++i) dst[i] = bf16_to_f32(values[i]);
}

InferenceModel InferenceModel::from_checkpoint(const fs::path& given) {
  const fs::path path = ckpt::resolve_checkpoint(given);
  const CheckpointInfo info = read_checkpoint_info(path);
  InferenceModel m;
  m.weights = std::make_unique<ShardedModel>(info.arch, 0, 1, /*host_grads=*/false);
  ShardedModel& w = *m.weights;
  read_checkpoint_model(path, [&](const ParamInfo& p, int64_t begin, int64_t count, const float* values) {
    const ModelLayout::Located at = w.layout.find(p.name);
    SHARDLM_CHECK(at.unit, "internal: checkpoint parameter %s is not in the model's layout", p.name.c_str());
    float* dst = w.param[size_t(at.unit - w.layout.units.data())].data() + at.param->offset + begin;
    std::copy(values, values + count, dst);
  });
  m.source = fmt("checkpoint %s (step %lld)", path.c_str(), (long long)info.step);
  const DeckResult deck = parse_deck_text(info.deck, path, {}, 0);
  if (deck.ok() && !deck.config.model.hf.empty()) m.tokenizer_dir = deck.config.model.hf;
  add_id(m.eos_ids, info.arch.eos_token_id);
  return m;
}

const float* InferenceModel::embedding() const {
  return param_ptr(*weights, weights->layout.embed(), "model.embed_tokens.weight");
}

LayerWeights<const float> InferenceModel::layer(int l) const {
  const Unit& u = weights->layout.layer(l);
  return layer_weights(u, static_cast<const float*>(weights->param[size_t(1 + l)].data()));
}

const float* InferenceModel::final_norm() const {
  return param_ptr(*weights, weights->layout.head(), "model.norm.weight");
}

const float* InferenceModel::lm_head() const {
  return config().tie_word_embeddings ? embedding() : param_ptr(*weights, weights->layout.head(), "lm_head.weight");
}

int64_t InferenceModel::bytes() const {
  int64_t b = 0;
  for (const auto& u : weights->layout.units) b += u.padded_numel * int64_t(sizeof(float));
  return b;
}

}  // namespace shardlm
