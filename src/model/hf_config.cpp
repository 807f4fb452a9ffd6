// hf_config.cpp — config.json read and write, RoPE included (see hf_config.hpp).
#include "model/hf_config.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

#include "shardlm/error.hpp"

namespace shardlm {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// ============================================================================
// config.json
// ============================================================================

namespace {

// One config.json being read: every message names the file.
struct ConfigReader {
  std::string file;
  const json& root;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt("%s: %s", file.c_str(), what.c_str()));
  }

  static std::string show(const json& v) {
    std::string s = v.dump();
    if (s.size() > 80) s = s.substr(0, 77) + "...";
    return s;
  }

  // nullptr when the key is absent or null (transformers treats both as unset).
  static const json* find(const json& obj, const std::string& key) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }

  int64_t to_int(const json& v, const std::string& key) const {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        fail(fmt("'%s' = %s is out of range", key.c_str(), show(v).c_str()));
      return v.get<int64_t>();
    }
    if (v.is_number_float()) {  // 4096.0 is accepted; 4096.5 is not
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
    }
    fail(fmt("'%s' must be an integer, got %s", key.c_str(), show(v).c_str()));
  }

  double to_double(const json& v, const std::string& key) const {
    if (!v.is_number()) fail(fmt("'%s' must be a number, got %s", key.c_str(), show(v).c_str()));
    const double d = v.get<double>();
    if (!std::isfinite(d)) fail(fmt("'%s' must be a finite number, got %s", key.c_str(), show(v).c_str()));
    return d;
  }

  int64_t required_int(const std::string& key) const {
    const json* v = find(root, key);
    if (!v) fail(fmt("required key '%s' is missing", key.c_str()));
    return to_int(*v, key);
  }

  // A size: 1 .. max (model_config.hpp's limits), named by its config.json key.
  int64_t positive_int(const std::string& key, int64_t max, std::optional<int64_t> fallback = std::nullopt) const {
    const json* v = find(root, key);
    int64_t n;
    if (v) {
      n = to_int(*v, key);
    } else {
      if (!fallback) fail(fmt("required key '%s' is missing", key.c_str()));
      n = *fallback;
    }
    if (n <= 0) fail(fmt("'%s' must be positive, got %lld", key.c_str(), (long long)n));
    if (n > max)
      fail(fmt("'%s' = %lld is out of range: shardlm accepts 1 to %lld", key.c_str(), (long long)n, (long long)max));
    return n;
  }

  bool boolean(const std::string& key, bool fallback) const {
    const json* v = find(root, key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(fmt("'%s' must be true or false, got %s", key.c_str(), show(*v).c_str()));
    return v->get<bool>();
  }

  // bos/eos: absent/null -> -1; an int; or a list of ints (first taken).
  int64_t token_id(const std::string& key) const {
    const json* v = find(root, key);
    if (!v) return -1;
    if (v->is_array()) {
      if (v->empty()) return -1;
      return to_int((*v)[0], key + "[0]");
    }
    return to_int(*v, key);
  }
};

// RoPE as described by one dict (4.x rope_scaling or 5.x rope_parameters).
struct RopeDesc {
  std::optional<double> theta;
  RopeScaling scaling;
};

bool same_rope(const RopeScaling& a, const RopeScaling& b) {
  return a.type == b.type && a.factor == b.factor && a.low_freq_factor == b.low_freq_factor &&
         a.high_freq_factor == b.high_freq_factor &&
         a.original_max_position_embeddings == b.original_max_position_embeddings;
}

RopeDesc parse_rope_dict(const ConfigReader& cr, const std::string& key, const json& dict_in) {
  if (!dict_in.is_object()) cr.fail(fmt("'%s' must be an object or null, got %s", key.c_str(), ConfigReader::show(dict_in).c_str()));
  std::string where = key;
  const json* dict = &dict_in;
  // transformers 5.x nests per-layer-type parameters for models with several
  // attention kinds; a Llama/Qwen model has only full attention.
  if (!dict->contains("rope_type") && !dict->contains("type") && !dict->contains("rope_theta") &&
      dict->contains("full_attention")) {
    for (const auto& [layer_type, value] : dict->items())
      if (layer_type != "full_attention")
        cr.fail(fmt("'%s' has RoPE parameters for layer type '%s'; shardlm runs full attention only", key.c_str(),
                    layer_type.c_str()));
    dict = &(*dict)["full_attention"];
    where = key + ".full_attention";
    if (!dict->is_object()) cr.fail(fmt("'%s' must be an object", where.c_str()));
  }

  RopeDesc out;
  std::string type = "default";
  const json* t = ConfigReader::find(*dict, "rope_type");
  if (!t) t = ConfigReader::find(*dict, "type");
  if (t) {
    if (!t->is_string()) cr.fail(fmt("'%s.rope_type' must be a string, got %s", where.c_str(), ConfigReader::show(*t).c_str()));
    type = t->get<std::string>();
  }
  if (const json* th = ConfigReader::find(*dict, "rope_theta")) out.theta = cr.to_double(*th, where + ".rope_theta");
  if (const json* p = ConfigReader::find(*dict, "partial_rotary_factor")) {
    if (cr.to_double(*p, where + ".partial_rotary_factor") != 1.0)
      cr.fail(fmt("'%s.partial_rotary_factor' = %s is not supported (shardlm rotates the whole head)", where.c_str(),
                  ConfigReader::show(*p).c_str()));
  }

  if (type == "default") {
    out.scaling.type = "none";
  } else if (type == "llama3") {
    auto need = [&](const char* k) -> const json& {
      const json* v = ConfigReader::find(*dict, k);
      if (!v) cr.fail(fmt("'%s' has rope_type llama3 but no '%s'", where.c_str(), k));
      return *v;
    };
    out.scaling.type = "llama3";
    out.scaling.factor = cr.to_double(need("factor"), where + ".factor");
    out.scaling.low_freq_factor = cr.to_double(need("low_freq_factor"), where + ".low_freq_factor");
    out.scaling.high_freq_factor = cr.to_double(need("high_freq_factor"), where + ".high_freq_factor");
    const json* omax = ConfigReader::find(*dict, "original_max_position_embeddings");
    if (!omax) omax = ConfigReader::find(cr.root, "original_max_position_embeddings");  // 5.x may keep it outside
    if (!omax) cr.fail(fmt("'%s' has rope_type llama3 but no 'original_max_position_embeddings'", where.c_str()));
    out.scaling.original_max_position_embeddings = cr.to_int(*omax, where + ".original_max_position_embeddings");
    if (out.scaling.original_max_position_embeddings > kMaxPositions)
      cr.fail(fmt("'%s.original_max_position_embeddings' = %lld is out of range: shardlm accepts 1 to %lld",
                  where.c_str(), (long long)out.scaling.original_max_position_embeddings, (long long)kMaxPositions));
    if (!(out.scaling.factor > 0) || !(out.scaling.low_freq_factor > 0) || !(out.scaling.high_freq_factor > 0) ||
        out.scaling.original_max_position_embeddings <= 0)
      cr.fail(fmt("'%s': llama3 factor, low_freq_factor, high_freq_factor and original_max_position_embeddings must be "
                  "positive, got %s", where.c_str(), ConfigReader::show(*dict).c_str()));
    if (out.scaling.high_freq_factor == out.scaling.low_freq_factor)
      cr.fail(fmt("'%s': llama3 high_freq_factor must differ from low_freq_factor (both %g)", where.c_str(),
                  out.scaling.low_freq_factor));
  } else {
    cr.fail(fmt("'%s.rope_type' = '%s' is not supported (shardlm implements 'default' and 'llama3' RoPE; "
                "linear, dynamic, yarn, longrope and others are not)", where.c_str(), type.c_str()));
  }
  return out;
}

const char* hf_architecture(const std::string& model_type) {
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  return nullptr;
}

std::string model_type_of_architecture(const std::string& arch) {
  for (const char* mt : {"llama", "qwen2", "qwen3"})
    if (arch == hf_architecture(mt)) return mt;
  return "";
}

}  // namespace

ModelConfig read_hf_config(const fs::path& dir) {
  const fs::path path = dir / "config.json";
  const std::string file = path.string();
  std::ifstream in(path);
  SHARDLM_CHECK(in.good(), "%s: cannot open (is %s a Hugging Face model directory?)", file.c_str(),
                dir.string().c_str());
  json root;
  try {
    root = json::parse(in);
  } catch (const json::exception& e) {
    SHARDLM_FAIL("%s: not valid JSON: %s", file.c_str(), e.what());
  }
  SHARDLM_CHECK(root.is_object(), "%s: the top level must be a JSON object", file.c_str());
  const ConfigReader cr{file, root};

  // --- architecture
  std::string model_type;
  std::string architecture;
  if (const json* a = ConfigReader::find(root, "architectures")) {
    if (!a->is_array() || (!a->empty() && !(*a)[0].is_string()))
      cr.fail(fmt("'architectures' must be a list of strings, got %s", ConfigReader::show(*a).c_str()));
    if (a->size() > 1) cr.fail(fmt("'architectures' = %s names several models; expected one", ConfigReader::show(*a).c_str()));
    if (!a->empty()) architecture = (*a)[0].get<std::string>();
  }
  if (const json* m = ConfigReader::find(root, "model_type")) {
    if (!m->is_string()) cr.fail(fmt("'model_type' must be a string, got %s", ConfigReader::show(*m).c_str()));
    model_type = m->get<std::string>();
  } else if (!architecture.empty()) {
    model_type = model_type_of_architecture(architecture);
    if (model_type.empty())
      cr.fail(fmt("architecture '%s' is not supported (shardlm runs LlamaForCausalLM, Qwen2ForCausalLM, "
                  "Qwen3ForCausalLM)", architecture.c_str()));
  } else {
    cr.fail("required key 'model_type' is missing");
  }
  const char* expected_arch = hf_architecture(model_type);
  if (!expected_arch)
    cr.fail(fmt("model_type '%s' is not supported (shardlm runs llama, qwen2 and qwen3)", model_type.c_str()));
  if (!architecture.empty() && architecture != expected_arch)
    cr.fail(fmt("architecture '%s' is not supported for model_type '%s' (expected '%s')", architecture.c_str(),
                model_type.c_str(), expected_arch));

  // --- features shardlm does not implement: refuse rather than run something else
  if (ConfigReader::find(root, "quantization_config"))
    cr.fail("'quantization_config' is set: quantized checkpoints are not supported; use a bf16/fp16/fp32 one");
  if (const json* act = ConfigReader::find(root, "hidden_act")) {
    if (!act->is_string() || act->get<std::string>() != "silu")
      cr.fail(fmt("'hidden_act' = %s is not supported (shardlm's MLP is SwiGLU with silu)", ConfigReader::show(*act).c_str()));
  }
  if (cr.boolean("mlp_bias", false)) cr.fail("'mlp_bias' = true is not supported (shardlm's MLP has no biases)");
  if (cr.boolean("use_sliding_window", false))
    cr.fail("'use_sliding_window' = true is not supported (shardlm runs full causal attention)");
  if (const json* lt = ConfigReader::find(root, "layer_types")) {
    if (!lt->is_array()) cr.fail(fmt("'layer_types' must be a list, got %s", ConfigReader::show(*lt).c_str()));
    for (const auto& t : *lt)
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        cr.fail(fmt("'layer_types' contains %s; shardlm runs full attention in every layer", ConfigReader::show(t).c_str()));
  }

  ModelConfig c;
  c.arch = model_type;
  for (const ModelSizeField& f : model_size_fields()) {
    std::optional<int64_t> fallback;  // for the sizes config.json may leave out
    if (f.member == &ModelConfig::num_kv_heads) fallback = c.num_heads;  // no grouped-query attention
    if (f.member == &ModelConfig::head_dim) {
      if (!ConfigReader::find(root, f.hf_key) && c.hidden_size % c.num_heads != 0)
        cr.fail(fmt("no 'head_dim' and hidden_size %lld is not divisible by num_attention_heads %lld",
                    (long long)c.hidden_size, (long long)c.num_heads));
      fallback = c.hidden_size / c.num_heads;
    }
    c.*f.member = cr.positive_int(f.hf_key, f.max, fallback);
  }
  c.max_position_embeddings = cr.positive_int("max_position_embeddings", kMaxPositions);
  if (check_model_sizes(c).rule == ModelSizeProblem::Rule::HeadsNotMultipleOfKvHeads)
    cr.fail(fmt("num_attention_heads %lld is not divisible by num_key_value_heads %lld", (long long)c.num_heads,
                (long long)c.num_kv_heads));
  {
    const json* eps = ConfigReader::find(root, "rms_norm_eps");
    if (!eps) cr.fail("required key 'rms_norm_eps' is missing");
    c.rms_norm_eps = cr.to_double(*eps, "rms_norm_eps");
    if (!(c.rms_norm_eps > 0)) cr.fail(fmt("'rms_norm_eps' must be positive, got %g", c.rms_norm_eps));
  }
  c.tie_word_embeddings = cr.boolean("tie_word_embeddings", false);

  // Qwen2 always has q/k/v biases (and none on o_proj), whatever the config says.
  // In Llama and Qwen3, attention_bias also puts a bias on o_proj, which
  // ModelConfig::attention_bias (q/k/v only) does not describe: refuse it.
  if (model_type == "qwen2") {
    c.attention_bias = true;
  } else if (cr.boolean("attention_bias", false)) {
    cr.fail(fmt("'attention_bias' = true is not supported for %s (it also adds an o_proj bias, which shardlm does "
                "not implement)", model_type.c_str()));
  }
  c.qk_norm = (model_type == "qwen3");
  c.bos_token_id = cr.token_id("bos_token_id");
  c.eos_token_id = cr.token_id("eos_token_id");

  // --- RoPE: 5.x rope_parameters and/or 4.x rope_theta + rope_scaling
  std::optional<double> top_theta;
  if (const json* th = ConfigReader::find(root, "rope_theta")) top_theta = cr.to_double(*th, "rope_theta");
  std::optional<RopeDesc> from_params, from_scaling;
  if (const json* p = ConfigReader::find(root, "rope_parameters")) from_params = parse_rope_dict(cr, "rope_parameters", *p);
  if (const json* s = ConfigReader::find(root, "rope_scaling")) from_scaling = parse_rope_dict(cr, "rope_scaling", *s);
  if (const json* p = ConfigReader::find(root, "partial_rotary_factor")) {
    if (cr.to_double(*p, "partial_rotary_factor") != 1.0)
      cr.fail(fmt("'partial_rotary_factor' = %s is not supported (shardlm rotates the whole head)",
                  ConfigReader::show(*p).c_str()));
  }
  std::optional<double> theta = top_theta;
  RopeScaling scaling;
  for (const std::optional<RopeDesc>* d : {&from_scaling, &from_params}) {  // rope_parameters last: it wins
    if (!*d) continue;
    if ((*d)->theta) {
      if (theta && *theta != *(*d)->theta)
        cr.fail(fmt("RoPE base given twice with different values (%g and %g) in 'rope_theta', 'rope_scaling' or "
                    "'rope_parameters'", *theta, *(*d)->theta));
      theta = (*d)->theta;
    }
  }
  if (from_params && from_scaling && !same_rope(from_params->scaling, from_scaling->scaling))
    cr.fail("'rope_parameters' and 'rope_scaling' are both set and disagree; keep one");
  if (from_params) scaling = from_params->scaling;
  else if (from_scaling) scaling = from_scaling->scaling;
  if (!theta) cr.fail("required key 'rope_theta' is missing (neither 'rope_theta' nor 'rope_parameters.rope_theta' is set)");
  if (!(*theta > 0)) cr.fail(fmt("'rope_theta' must be positive, got %g", *theta));
  c.rope_theta = *theta;
  c.rope_scaling = scaling;
  // Every size is in range; their product (the parameter count) must be too.
  if (const std::string e = model_size_error(c); !e.empty()) cr.fail(e);
  return c;
}

void write_hf_config(const fs::path& dir, const ModelConfig& c, const std::string& torch_dtype) {
  const std::string file = (dir / "config.json").string();
  SHARDLM_CHECK(fs::is_directory(dir), "write_hf_config: %s is not a directory", dir.string().c_str());
  SHARDLM_CHECK(torch_dtype == "float32" || torch_dtype == "bfloat16" || torch_dtype == "float16",
                "write_hf_config: torch_dtype '%s' is not one of float32, bfloat16, float16", torch_dtype.c_str());
  const char* architecture = hf_architecture(c.arch);
  SHARDLM_CHECK(architecture, "write_hf_config: arch '%s' has no Hugging Face equivalent (llama, qwen2, qwen3)",
                c.arch.c_str());
  // Only write what the named transformers class computes exactly.
  SHARDLM_CHECK(c.arch != "qwen2" || c.attention_bias,
                "write_hf_config: a qwen2 model always has q/k/v biases; this one has attention_bias = false");
  SHARDLM_CHECK(c.arch == "qwen2" || !c.attention_bias,
                "write_hf_config: %s with attention_bias = true would mean an o_proj bias too in transformers; "
                "only qwen2 expresses q/k/v-only biases", c.arch.c_str());
  SHARDLM_CHECK(c.qk_norm == (c.arch == "qwen3"),
                "write_hf_config: qk_norm = %s cannot be expressed for arch '%s' (q/k norms exist in qwen3 only)",
                c.qk_norm ? "true" : "false", c.arch.c_str());
  const bool sizes_positive =
      c.max_position_embeddings > 0 &&
      std::ranges::all_of(model_size_fields(), [&](const ModelSizeField& f) { return c.*f.member > 0; });
  SHARDLM_CHECK(sizes_positive && check_model_sizes(c).rule != ModelSizeProblem::Rule::HeadsNotMultipleOfKvHeads,
                "write_hf_config: sizes must be positive and num_heads (%lld) divisible by num_kv_heads (%lld)",
                (long long)c.num_heads, (long long)c.num_kv_heads);
  SHARDLM_CHECK(c.rope_scaling.type == "none" || c.rope_scaling.type == "llama3",
                "write_hf_config: rope_scaling.type '%s' is not none or llama3", c.rope_scaling.type.c_str());

  ordered_json j;
  j["architectures"] = {architecture};
  j["model_type"] = c.arch;
  for (const ModelSizeField& f : model_size_fields()) j[f.hf_key] = c.*f.member;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.type == "llama3") {
    j["rope_scaling"] = ordered_json{
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling.factor},
        {"low_freq_factor", c.rope_scaling.low_freq_factor},
        {"high_freq_factor", c.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings},
    };
  } else {
    j["rope_scaling"] = nullptr;
  }
  if (c.arch != "qwen2") j["attention_bias"] = c.attention_bias;  // qwen2's biases are implied
  if (c.arch == "llama") j["mlp_bias"] = false;
  if (c.arch != "llama") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_layers;
  }
  j["attention_dropout"] = 0.0;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  j["torch_dtype"] = torch_dtype;
  j["use_cache"] = true;

  const fs::path tmp = dir / "config.json.tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    SHARDLM_CHECK(out.good(), "write_hf_config: cannot create %s", tmp.string().c_str());
    out << j.dump(2) << "\n";
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      SHARDLM_FAIL("write_hf_config: writing %s failed (disk full?)", tmp.string().c_str());
    }
  }
  std::error_code ec;
  fs::rename(tmp, dir / "config.json", ec);
  if (ec) {
    fs::remove(tmp, ec);
    SHARDLM_FAIL("write_hf_config: cannot rename %s to %s", tmp.string().c_str(), file.c_str());
  }
}

}  // namespace shardlm
