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
    // Every number of the table's rope_scaling rows is required: factor,
    // low_freq_factor, high_freq_factor, original_max_position_embeddings
    // (read into a ModelConfig, where the rows point).
    ModelConfig read;
    read.rope_scaling.type = "llama3";
    for (const ModelField& f : model_fields()) {
      if (f.hf != HfForm::RopeScaling || field_is<std::string>(f)) continue;  // rope_type: read above
      const json* v = ConfigReader::find(*dict, f.hf_key);
      if (!v && std::string_view(f.hf_key) == "original_max_position_embeddings")
        v = ConfigReader::find(cr.root, f.hf_key);  // 5.x may keep it outside
      if (!v) cr.fail(fmt("'%s' has rope_type llama3 but no '%s'", where.c_str(), f.hf_key));
      const std::string key = where + "." + f.hf_key;
      if (field_is<double>(f)) {
        member_of<double>(f, read) = cr.to_double(*v, key);
        continue;
      }
      const int64_t n = member_of<int64_t>(f, read) = cr.to_int(*v, key);
      if (n > f.max)
        cr.fail(fmt("'%s' = %lld is out of range: shardlm accepts 1 to %lld", key.c_str(), (long long)n,
                    (long long)f.max));
    }
    out.scaling = read.rope_scaling;
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
  if (model_type == "qwen2_moe") return "Qwen2MoeForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  return nullptr;
}

// Qwen2's attention (q/k/v biases) and Qwen3's (q/k norms), dense or experts.
bool qwen2_attention(const std::string& model_type) { return model_type == "qwen2" || model_type == "qwen2_moe"; }
bool qwen3_attention(const std::string& model_type) { return model_type == "qwen3" || model_type == "qwen3_moe"; }
bool has_experts(const std::string& model_type) { return model_type == "qwen2_moe" || model_type == "qwen3_moe"; }

std::string model_type_of_architecture(const std::string& arch) {
  for (const char* mt : {"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
    if (arch == hf_architecture(mt)) return mt;
  return "";
}

// config.json's model_type, checked against its architectures entry.
std::string read_model_type(const ConfigReader& cr, const json& root) {
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
                  "Qwen3ForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)", architecture.c_str()));
  } else {
    cr.fail("required key 'model_type' is missing");
  }
  const char* expected_arch = hf_architecture(model_type);
  if (!expected_arch)
    cr.fail(fmt("model_type '%s' is not supported (shardlm runs llama, qwen2, qwen3, qwen2_moe and qwen3_moe)",
                model_type.c_str()));
  if (!architecture.empty() && architecture != expected_arch)
    cr.fail(fmt("architecture '%s' is not supported for model_type '%s' (expected '%s')", architecture.c_str(),
                model_type.c_str(), expected_arch));

  return model_type;
}

// Features shardlm does not implement: refused rather than run as something else.
void refuse_unsupported(const ConfigReader& cr, const json& root) {
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
  if (const json* m = ConfigReader::find(root, "mlp_only_layers")) {
    if (!m->is_array() || !m->empty())
      cr.fail(fmt("'mlp_only_layers' = %s is not supported (shardlm places dense layers by decoder_sparse_step "
                  "only; it takes [])", ConfigReader::show(*m).c_str()));
  }

}

// The integers first (the sizes, then max_position_embeddings): a size
// config.json leaves out comes from those before it, and the heads' rule
// needs them all.
void read_sizes(const ConfigReader& cr, const json& root, ModelConfig& c) {
  for (const ModelField& f : model_fields()) {
    if (f.hf != HfForm::Integer) continue;
    int64_t& size = member_of<int64_t>(f, c);
    std::optional<int64_t> fallback;  // for the sizes config.json may leave out
    if (&size == &c.num_kv_heads) fallback = c.num_heads;  // no grouped-query attention
    if (&size == &c.head_dim) {
      if (!ConfigReader::find(root, f.hf_key) && c.hidden_size % c.num_heads != 0)
        cr.fail(fmt("no 'head_dim' and hidden_size %lld is not divisible by num_attention_heads %lld",
                    (long long)c.hidden_size, (long long)c.num_heads));
      fallback = c.hidden_size / c.num_heads;
    }
    size = cr.positive_int(f.hf_key, (int64_t)f.max, fallback);
  }
  if (check_model_sizes(c).rule == ModelSizeProblem::Rule::HeadsNotMultipleOfKvHeads)
    cr.fail(fmt("num_attention_heads %lld is not divisible by num_key_value_heads %lld", (long long)c.num_heads,
                (long long)c.num_kv_heads));
}

// One of the experts' members of a qwen2_moe / qwen3_moe config.json:
// num_experts, num_experts_per_tok and moe_intermediate_size required, the
// shared expert's size qwen2_moe's only, decoder_sparse_step 1 and
// router_aux_loss_coef 0.001 when absent (transformers' defaults), the flags
// false. moe_config_error checks them together after.
void read_moe_member(const ConfigReader& cr, const json& root, const std::string& model_type, const ModelField& f,
                     ModelConfig& c) {
  const json* v = ConfigReader::find(root, f.hf_key);
  if (field_is<bool>(f)) {
    member_of<bool>(f, c) = cr.boolean(f.hf_key, false);
  } else if (field_is<double>(f)) {
    double& number = member_of<double>(f, c);
    if (v) number = cr.to_double(*v, f.hf_key);
    if (!(number >= 0)) cr.fail(fmt("'%s' must be at least 0, got %g", f.hf_key, number));
  } else {
    int64_t& size = member_of<int64_t>(f, c);
    const bool shared = &size == &c.shared_expert_intermediate_size;
    if (shared && model_type != "qwen2_moe") return;  // Qwen3-MoE has no shared expert
    if (!v && &size == &c.decoder_sparse_step) return;  // 1
    // transformers 5 saves Qwen3-MoE's expert count as num_local_experts (the
    // published checkpoints say num_experts, and so does the export).
    const json* local = &size == &c.num_experts ? ConfigReader::find(root, "num_local_experts") : nullptr;
    const int64_t local_count = local ? cr.positive_int("num_local_experts", (int64_t)f.max) : 0;
    size = v || !local ? cr.positive_int(f.hf_key, (int64_t)f.max) : local_count;
    if (local && local_count != size)
      cr.fail(fmt("'num_experts' %lld and 'num_local_experts' %lld disagree", (long long)size, (long long)local_count));
  }
}

// The members after the sizes, in the table's order (RoPE's apart).
void read_members(const ConfigReader& cr, const json& root, const std::string& model_type, ModelConfig& c) {
  for (const ModelField& f : model_fields()) {
    switch (f.hf) {
      case HfForm::ModelType:
        member_of<std::string>(f, c) = model_type;
        break;
      case HfForm::Integer:  // above
      case HfForm::RopeTheta:  // below, from any of RoPE's three forms
      case HfForm::RopeScaling:
        break;
      case HfForm::Number: {
        const json* v = ConfigReader::find(root, f.hf_key);
        if (!v) cr.fail(fmt("required key '%s' is missing", f.hf_key));
        double& number = member_of<double>(f, c);
        number = cr.to_double(*v, f.hf_key);
        if (!(number > 0)) cr.fail(fmt("'%s' must be positive, got %g", f.hf_key, number));
        break;
      }
      case HfForm::Flag:
        member_of<bool>(f, c) = cr.boolean(f.hf_key, false);
        break;
      // Qwen2 always has q/k/v biases (and none on o_proj), whatever the config says.
      // In Llama and Qwen3, attention_bias also puts a bias on o_proj, which
      // ModelConfig::attention_bias (q/k/v only) does not describe: refuse it.
      case HfForm::AttentionBias:
        if (qwen2_attention(model_type)) {
          member_of<bool>(f, c) = true;
        } else if (cr.boolean(f.hf_key, false)) {
          cr.fail(fmt("'%s' = true is not supported for %s (it also adds an o_proj bias, which shardlm does "
                      "not implement)", f.hf_key, model_type.c_str()));
        }
        break;
      case HfForm::QkNorm:
        member_of<bool>(f, c) = qwen3_attention(model_type);
        break;
      case HfForm::Moe:
        if (has_experts(model_type)) read_moe_member(cr, root, model_type, f, c);
        break;
      case HfForm::TokenId:
        member_of<int64_t>(f, c) = cr.token_id(f.hf_key);
        break;
    }
  }

}

// RoPE: 5.x rope_parameters and/or 4.x rope_theta + rope_scaling.
void read_rope(const ConfigReader& cr, const json& root, ModelConfig& c) {
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

  const std::string model_type = read_model_type(cr, root);
  refuse_unsupported(cr, root);
  ModelConfig c;
  read_sizes(cr, root, c);
  read_members(cr, root, model_type, c);
  read_rope(cr, root, c);
  // Every size is in range; their product (the parameter count) must be too.
  if (const std::string e = model_size_error(c); !e.empty()) cr.fail(e);
  if (const std::string e = moe_config_error(c); !e.empty()) cr.fail(e);
  return c;
}

void write_hf_config(const fs::path& dir, const ModelConfig& c, const std::string& torch_dtype) {
  const std::string file = (dir / "config.json").string();
  SHARDLM_CHECK(fs::is_directory(dir), "write_hf_config: %s is not a directory", dir.string().c_str());
  SHARDLM_CHECK(torch_dtype == "float32" || torch_dtype == "bfloat16" || torch_dtype == "float16",
                "write_hf_config: torch_dtype '%s' is not one of float32, bfloat16, float16", torch_dtype.c_str());
  const char* architecture = hf_architecture(c.arch);
  SHARDLM_CHECK(architecture,
                "write_hf_config: arch '%s' has no Hugging Face equivalent (llama, qwen2, qwen3, qwen2_moe, qwen3_moe)",
                c.arch.c_str());
  // Only write what the named transformers class computes exactly.
  if (const std::string e = hf_attention_error(c); !e.empty()) SHARDLM_FAIL("write_hf_config: %s", e.c_str());
  if (const std::string e = moe_config_error(c); !e.empty()) SHARDLM_FAIL("write_hf_config: %s", e.c_str());
  const bool sizes_positive = std::ranges::all_of(
      model_fields(), [&](const ModelField& f) { return f.hf != HfForm::Integer || member_of<int64_t>(f, c) > 0; });
  SHARDLM_CHECK(sizes_positive && check_model_sizes(c).rule != ModelSizeProblem::Rule::HeadsNotMultipleOfKvHeads,
                "write_hf_config: sizes must be positive and num_heads (%lld) divisible by num_kv_heads (%lld)",
                (long long)c.num_heads, (long long)c.num_kv_heads);
  SHARDLM_CHECK(c.rope_scaling.type == "none" || c.rope_scaling.type == "llama3",
                "write_hf_config: rope_scaling.type '%s' is not none or llama3", c.rope_scaling.type.c_str());

  ordered_json j;
  j["architectures"] = {architecture};
  for (const ModelField& f : model_fields()) {
    const ordered_json value = visit_member(f, c, [](const auto& v) { return ordered_json(v); });
    switch (f.hf) {
      case HfForm::ModelType:
      case HfForm::Integer:
      case HfForm::Number:
      case HfForm::RopeTheta:
      case HfForm::Flag:
        j[f.hf_key] = value;
        break;
      case HfForm::RopeScaling:  // one object (the 4.x form vLLM reads), or null without scaling
        if (c.rope_scaling.type == "none") j["rope_scaling"] = nullptr;
        else j["rope_scaling"][f.hf_key] = value;
        break;
      case HfForm::AttentionBias:
        if (!qwen2_attention(c.arch)) j[f.hf_key] = value;  // qwen2's biases are implied
        break;
      case HfForm::Moe:
        if (has_experts(c.arch) &&
            (std::string_view(f.hf_key) != "shared_expert_intermediate_size" || c.arch == "qwen2_moe"))
          j[f.hf_key] = value;
        break;
      case HfForm::QkNorm:  // implied by model_type (checked above)
        break;
      case HfForm::TokenId:
        if (value.get<int64_t>() >= 0) j[f.hf_key] = value;
        break;
    }
  }
  // What every shardlm model is, in transformers' words; then the file's dtype.
  j["hidden_act"] = "silu";
  if (c.arch == "llama") j["mlp_bias"] = false;
  if (c.arch != "llama") {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_layers;
  }
  if (has_experts(c.arch)) j["mlp_only_layers"] = ordered_json::array();
  j["attention_dropout"] = 0.0;
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
