// hf.cpp — config.json and safetensors I/O (see hf.hpp).
#include "model/hf.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "shardlm/error.hpp"

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; hf.cpp reads it in place");

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
  c.vocab_size = cr.positive_int("vocab_size", kMaxVocabSize);
  c.hidden_size = cr.positive_int("hidden_size", kMaxHiddenSize);
  c.intermediate_size = cr.positive_int("intermediate_size", kMaxIntermediateSize);
  c.num_layers = cr.positive_int("num_hidden_layers", kMaxLayers);
  c.num_heads = cr.positive_int("num_attention_heads", kMaxHeads);
  c.num_kv_heads = cr.positive_int("num_key_value_heads", kMaxHeads, c.num_heads);
  if (!ConfigReader::find(root, "head_dim") && c.hidden_size % c.num_heads != 0)
    cr.fail(fmt("no 'head_dim' and hidden_size %lld is not divisible by num_attention_heads %lld",
                (long long)c.hidden_size, (long long)c.num_heads));
  c.head_dim = cr.positive_int("head_dim", kMaxHeadDim, c.hidden_size / c.num_heads);
  c.max_position_embeddings = cr.positive_int("max_position_embeddings", kMaxPositions);
  if (c.num_heads % c.num_kv_heads != 0)
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
  SHARDLM_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0 &&
                    c.num_heads > 0 && c.num_kv_heads > 0 && c.head_dim > 0 && c.max_position_embeddings > 0 &&
                    c.num_heads % c.num_kv_heads == 0,
                "write_hf_config: sizes must be positive and num_heads (%lld) divisible by num_kv_heads (%lld)",
                (long long)c.num_heads, (long long)c.num_kv_heads);
  SHARDLM_CHECK(c.rope_scaling.type == "none" || c.rope_scaling.type == "llama3",
                "write_hf_config: rope_scaling.type '%s' is not none or llama3", c.rope_scaling.type.c_str());

  ordered_json j;
  j["architectures"] = {architecture};
  j["model_type"] = c.arch;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
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

// ============================================================================
// safetensors: shared helpers
// ============================================================================

namespace {

// Element size of every safetensors dtype (0 = not a safetensors dtype).
int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2" ||
      dtype == "F8_E8M0")
    return 1;
  return 0;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// numel with overflow check; -1 on overflow.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

bool as_nonnegative_i64(const json& v, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  int64_t s = v.get<int64_t>();
  if (s < 0) return false;
  *out = s;
  return true;
}

// pread until done; messages name the file and tensor.
void pread_all(int fd, void* buf, int64_t bytes, int64_t offset, const std::string& file, const std::string& what) {
  auto* p = static_cast<char*>(buf);
  while (bytes > 0) {
    size_t chunk = static_cast<size_t>(std::min<int64_t>(bytes, int64_t(1) << 30));
    ssize_t got = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      SHARDLM_FAIL("reading %s from %s at byte %lld failed: %s", what.c_str(), file.c_str(), (long long)offset,
                   std::strerror(errno));
    }
    if (got == 0)
      SHARDLM_FAIL("reading %s from %s: unexpected end of file at byte %lld (was the file truncated after it was "
                   "opened?)", what.c_str(), file.c_str(), (long long)offset);
    p += got;
    bytes -= got;
    offset += got;
  }
}

void pwrite_all(int fd, const void* buf, int64_t bytes, int64_t offset, const std::string& file) {
  const auto* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    size_t chunk = static_cast<size_t>(std::min<int64_t>(bytes, int64_t(1) << 30));
    ssize_t put = ::pwrite(fd, p, chunk, static_cast<off_t>(offset));
    if (put < 0) {
      if (errno == EINTR) continue;
      SHARDLM_FAIL("writing %s at byte %lld failed: %s", file.c_str(), (long long)offset, std::strerror(errno));
    }
    p += put;
    bytes -= put;
    offset += put;
  }
}

constexpr int64_t kMaxHeaderBytes = 100 * 1000 * 1000;  // the reference implementation's limit

// The safetensors rule: the tensors' data_offsets tile the data region
// [0, data_bytes) exactly, no overlap, no hole, nothing after the last one. A
// header whose q_proj points into the embedding's bytes would otherwise load
// and train with wrong weights.
template <class Span>
void check_spans_tile_data(std::vector<Span>& spans, int64_t data_bytes, const std::string& file) {
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  int64_t covered = 0;  // data bytes [0, covered) belong to the tensors seen so far
  const Span* previous = nullptr;
  for (const Span& s : spans) {
    if (s.begin < covered)
      SHARDLM_FAIL("%s: tensor '%s' has data_offsets [%lld, %lld], which overlap tensor '%s' [%lld, %lld]: the header "
                   "is corrupt (every tensor needs bytes of its own)", file.c_str(), s.name.c_str(), (long long)s.begin,
                   (long long)s.end, previous->name.c_str(), (long long)previous->begin, (long long)previous->end);
    if (s.begin > covered)
      SHARDLM_FAIL("%s: data bytes [%lld, %lld) belong to no tensor (before tensor '%s'): the header is corrupt or the "
                   "file is not safetensors", file.c_str(), (long long)covered, (long long)s.begin, s.name.c_str());
    covered = s.end;
    previous = &s;
  }
  if (covered != data_bytes)
    SHARDLM_FAIL("%s: the tensors' data ends at byte %lld of the data but the file holds %lld data bytes%s: the header "
                 "is corrupt or the file has trailing bytes", file.c_str(), (long long)covered, (long long)data_bytes,
                 previous ? fmt(" (last tensor '%s')", previous->name.c_str()).c_str() : "");
}
constexpr int64_t kConvertChunkElems = int64_t(1) << 16;  // staging buffer for bf16/f16 conversion

}  // namespace

// ============================================================================
// SafetensorsReader
// ============================================================================

SafetensorsReader::SafetensorsReader(const fs::path& dir) : dir_(dir) {
  const std::string dir_s = dir.string();
  SHARDLM_CHECK(fs::is_directory(dir), "%s is not a directory (expected a Hugging Face model directory)", dir_s.c_str());

  // Which files, and (with an index) which tensor lives where.
  std::vector<fs::path> paths;
  std::optional<std::map<std::string, std::string>> weight_map;
  const fs::path index_path = dir / "model.safetensors.index.json";
  const std::string index_s = index_path.string();
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    SHARDLM_CHECK(in.good(), "cannot open %s", index_s.c_str());
    json index;
    try {
      index = json::parse(in);
    } catch (const json::exception& e) {
      SHARDLM_FAIL("%s: not valid JSON: %s", index_s.c_str(), e.what());
    }
    SHARDLM_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
                  "%s: no 'weight_map' object", index_s.c_str());
    weight_map.emplace();
    std::set<std::string> file_names;
    for (const auto& [name, file] : index["weight_map"].items()) {
      SHARDLM_CHECK(file.is_string(), "%s: weight_map['%s'] must be a file name", index_s.c_str(), name.c_str());
      std::string f = file.get<std::string>();
      SHARDLM_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
                    "%s: weight_map['%s'] = '%s' is not a file name in the directory", index_s.c_str(), name.c_str(),
                    f.c_str());
      (*weight_map)[name] = f;
      file_names.insert(f);
    }
    for (const auto& f : file_names) {
      SHARDLM_CHECK(fs::is_regular_file(dir / f), "%s names %s, which does not exist", index_s.c_str(),
                    (dir / f).string().c_str());
      paths.push_back(dir / f);
    }
  } else {
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.is_regular_file() && entry.path().extension() == ".safetensors") paths.push_back(entry.path());
    std::sort(paths.begin(), paths.end());
  }
  SHARDLM_CHECK(!paths.empty(), "no *.safetensors in %s", dir_s.c_str());

  try {
    for (const fs::path& path : paths) {
      const std::string file = path.string();
      OpenFile of;
      of.path = path;
      of.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      SHARDLM_CHECK(of.fd >= 0, "cannot open %s: %s", file.c_str(), std::strerror(errno));
      files_.push_back(of);
      const size_t file_index = files_.size() - 1;
      struct stat st {};
      SHARDLM_CHECK(::fstat(of.fd, &st) == 0, "cannot stat %s: %s", file.c_str(), std::strerror(errno));
      const int64_t size = static_cast<int64_t>(st.st_size);
      files_.back().size_bytes = size;

      SHARDLM_CHECK(size >= 8, "%s is %lld bytes: too short for a safetensors file (truncated?)", file.c_str(),
                    (long long)size);
      unsigned char len_bytes[8];
      pread_all(of.fd, len_bytes, 8, 0, file, "the header length");
      uint64_t header_len = 0;
      for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
      SHARDLM_CHECK(header_len <= uint64_t(size - 8),
                    "%s: header length %llu is larger than the file (%lld bytes): the file is truncated or not "
                    "safetensors", file.c_str(), (unsigned long long)header_len, (long long)size);
      SHARDLM_CHECK(header_len <= uint64_t(kMaxHeaderBytes), "%s: header length %llu exceeds 100 MB: not a safetensors file",
                    file.c_str(), (unsigned long long)header_len);
      std::string header(header_len, '\0');
      pread_all(of.fd, header.data(), static_cast<int64_t>(header_len), 8, file, "the header");
      json h;
      try {
        h = json::parse(header);
      } catch (const json::exception& e) {
        SHARDLM_FAIL("%s: header is not valid JSON (corrupt file?): %s", file.c_str(), e.what());
      }
      SHARDLM_CHECK(h.is_object(), "%s: header is not a JSON object (corrupt file?)", file.c_str());
      const int64_t data_start = 8 + static_cast<int64_t>(header_len);

      std::set<std::string> seen_here;
      struct Span { int64_t begin, end; std::string name; };
      std::vector<Span> spans;  // every tensor's data_offsets: they must tile the data exactly
      for (const auto& [name, t] : h.items()) {
        if (name == "__metadata__") continue;
        const char* n = name.c_str();
        SHARDLM_CHECK(t.is_object() && t.contains("dtype") && t["dtype"].is_string() && t.contains("shape") &&
                          t["shape"].is_array() && t.contains("data_offsets") && t["data_offsets"].is_array() &&
                          t["data_offsets"].size() == 2,
                      "%s: tensor '%s' needs dtype, shape and data_offsets [begin, end] (corrupt header)", file.c_str(), n);
        TensorInfo info;
        info.dtype = t["dtype"].get<std::string>();
        info.file = path;
        for (const auto& d : t["shape"]) {
          int64_t dim;
          SHARDLM_CHECK(as_nonnegative_i64(d, &dim), "%s: tensor '%s' has a bad shape %s", file.c_str(), n,
                        t["shape"].dump().c_str());
          info.shape.push_back(dim);
        }
        int64_t begin, end;
        SHARDLM_CHECK(as_nonnegative_i64(t["data_offsets"][0], &begin) &&
                          as_nonnegative_i64(t["data_offsets"][1], &end) && begin <= end,
                      "%s: tensor '%s' has bad data_offsets %s", file.c_str(), n, t["data_offsets"].dump().c_str());
        const int64_t esize = dtype_bytes(info.dtype);
        SHARDLM_CHECK(esize > 0, "%s: tensor '%s' has unknown dtype '%s' (corrupt header?)", file.c_str(), n,
                      info.dtype.c_str());
        info.numel = checked_numel(info.shape);
        SHARDLM_CHECK(info.numel >= 0 && info.numel <= std::numeric_limits<int64_t>::max() / esize,
                      "%s: tensor '%s' shape %s overflows", file.c_str(), n, shape_string(info.shape).c_str());
        SHARDLM_CHECK(end - begin == info.numel * esize,
                      "%s: tensor '%s' (%s %s) needs %lld bytes but its data_offsets [%lld, %lld] span %lld: the "
                      "header is corrupt", file.c_str(), n, info.dtype.c_str(), shape_string(info.shape).c_str(),
                      (long long)(info.numel * esize), (long long)begin, (long long)end, (long long)(end - begin));
        SHARDLM_CHECK(end <= size - data_start,
                      "%s: tensor '%s' ends at byte %lld but the file has only %lld bytes: the file is truncated",
                      file.c_str(), n, (long long)(data_start + end), (long long)size);
        info.data_offset_bytes = data_start + begin;
        seen_here.insert(name);
        spans.push_back({begin, end, name});

        if (weight_map) {
          auto it = weight_map->find(name);
          if (it == weight_map->end() || it->second != path.filename().string()) continue;  // the index rules
        }
        auto prev = tensors_.find(name);
        SHARDLM_CHECK(prev == tensors_.end(), "tensor '%s' is in both %s and %s", n, prev->second.file.string().c_str(),
                      file.c_str());
        tensors_.emplace(name, std::move(info));
        tensor_file_.emplace(name, file_index);
      }
      check_spans_tile_data(spans, size - data_start, file);
      if (weight_map) {
        for (const auto& [name, f] : *weight_map)
          SHARDLM_CHECK(f != path.filename().string() || seen_here.count(name),
                        "%s maps tensor '%s' to %s, which has no such tensor", index_s.c_str(), name.c_str(),
                        file.c_str());
      }
    }
  } catch (...) {
    close_all();
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() { close_all(); }

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : dir_(std::move(other.dir_)),
      files_(std::exchange(other.files_, {})),
      tensors_(std::exchange(other.tensors_, {})),
      tensor_file_(std::exchange(other.tensor_file_, {})) {}

SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& other) noexcept {
  if (this != &other) {
    close_all();
    dir_ = std::move(other.dir_);
    files_ = std::exchange(other.files_, {});
    tensors_ = std::exchange(other.tensors_, {});
    tensor_file_ = std::exchange(other.tensor_file_, {});
  }
  return *this;
}

void SafetensorsReader::close_all() noexcept {
  for (OpenFile& f : files_)
    if (f.fd >= 0) ::close(f.fd);
  files_.clear();
}

bool SafetensorsReader::has(const std::string& name) const { return tensors_.count(name) != 0; }

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = tensors_.find(name);
  SHARDLM_CHECK(it != tensors_.end(), "tensor '%s' not found in %s (%zu tensors present)", name.c_str(),
                dir_.string().c_str(), tensors_.size());
  return it->second;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) out.push_back(name);
  return out;
}

void SafetensorsReader::read_f32(const std::string& name, int64_t elem_begin, int64_t elem_count, float* out) const {
  const TensorInfo& t = info(name);
  const OpenFile& f = files_[tensor_file_.at(name)];
  const std::string file = f.path.string();
  SHARDLM_CHECK(elem_begin >= 0 && elem_count >= 0 && elem_begin <= t.numel - elem_count,
                "read of elements [%lld, %lld) of tensor '%s' in %s is outside its %lld elements", (long long)elem_begin,
                (long long)(elem_begin + elem_count), name.c_str(), file.c_str(), (long long)t.numel);
  if (elem_count == 0) return;
  const std::string what = "tensor '" + name + "'";
  if (t.dtype == "F32") {
    pread_all(f.fd, out, elem_count * 4, t.data_offset_bytes + elem_begin * 4, file, what);
    return;
  }
  SHARDLM_CHECK(t.dtype == "BF16" || t.dtype == "F16",
                "tensor '%s' in %s has dtype %s; shardlm reads BF16, F16 and F32 only", name.c_str(), file.c_str(),
                t.dtype.c_str());
  const bool is_bf16 = (t.dtype == "BF16");
  std::vector<uint16_t> staging(static_cast<size_t>(std::min(elem_count, kConvertChunkElems)));
  for (int64_t done = 0; done < elem_count;) {
    const int64_t n = std::min(elem_count - done, kConvertChunkElems);
    pread_all(f.fd, staging.data(), n * 2, t.data_offset_bytes + (elem_begin + done) * 2, file, what);
    if (is_bf16)
      for (int64_t i = 0; i < n; ++i) out[done + i] = bf16_to_f32(staging[i]);
    else
      for (int64_t i = 0; i < n; ++i) out[done + i] = f16_to_f32(staging[i]);
    done += n;
  }
}

// ============================================================================
// SafetensorsWriter
// ============================================================================

SafetensorsWriter::SafetensorsWriter(const fs::path& file, const std::vector<TensorSpec>& tensors,
                                     const std::map<std::string, std::string>& metadata, Open open)
    : file_(file), tmp_file_(fs::path(file.string() + ".tmp")) {
  const std::string file_s = file.string();
  std::vector<const TensorSpec*> order;
  for (const TensorSpec& t : tensors) {
    SHARDLM_CHECK(!t.name.empty() && t.name != "__metadata__", "%s: bad tensor name '%s'", file_s.c_str(),
                  t.name.c_str());
    SHARDLM_CHECK(t.dtype == "F32" || t.dtype == "BF16", "%s: tensor '%s' dtype '%s' is not F32 or BF16",
                  file_s.c_str(), t.name.c_str(), t.dtype.c_str());
    const int64_t numel = checked_numel(t.shape);
    SHARDLM_CHECK(numel >= 0 && numel <= std::numeric_limits<int64_t>::max() / 8, "%s: tensor '%s' has a bad shape %s",
                  file_s.c_str(), t.name.c_str(), shape_string(t.shape).c_str());
    auto [it, inserted] = slots_.emplace(t.name, Slot{t.dtype, numel, 0, 0});
    SHARDLM_CHECK(inserted, "%s: tensor '%s' given twice", file_s.c_str(), t.name.c_str());
    order.push_back(&t);
  }
  // Largest element first, then by name: every tensor starts aligned to its
  // element size (the data section starts 8-aligned).
  std::sort(order.begin(), order.end(), [](const TensorSpec* a, const TensorSpec* b) {
    int64_t sa = dtype_bytes(a->dtype), sb = dtype_bytes(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });

  json header = json::object();
  json meta = json::object();
  meta["format"] = "pt";  // transformers refuses safetensors without a known format
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  int64_t offset = 0;
  std::map<std::string, int64_t> begin_of;
  for (const TensorSpec* t : order) {
    const int64_t bytes = slots_[t->name].numel * dtype_bytes(t->dtype);
    header[t->name] = {{"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {offset, offset + bytes}}};
    begin_of[t->name] = offset;
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const int64_t data_start = 8 + static_cast<int64_t>(header_text.size());
  for (auto& [name, slot] : slots_) slot.data_offset_bytes = data_start + begin_of[name];

  const std::string tmp_s = tmp_file_.string();
  if (open == Open::Existing) {
    fd_ = ::open(tmp_s.c_str(), O_WRONLY | O_CLOEXEC);
    SHARDLM_CHECK(fd_ >= 0, "cannot open %s for shared writing: %s", tmp_s.c_str(), std::strerror(errno));
    finished_ = true;  // the creator owns FILE.tmp: never remove it from here
    participant_ = true;
    return;
  }
  fd_ = ::open(tmp_s.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  SHARDLM_CHECK(fd_ >= 0, "cannot create %s: %s", tmp_s.c_str(), std::strerror(errno));
  try {
    unsigned char len_bytes[8];
    uint64_t len = header_text.size();
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
    pwrite_all(fd_, len_bytes, 8, 0, tmp_s);
    pwrite_all(fd_, header_text.data(), static_cast<int64_t>(header_text.size()), 8, tmp_s);
    SHARDLM_CHECK(::ftruncate(fd_, static_cast<off_t>(data_start + offset)) == 0, "cannot size %s to %lld bytes: %s",
                  tmp_s.c_str(), (long long)(data_start + offset), std::strerror(errno));
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    std::error_code ec;
    fs::remove(tmp_file_, ec);
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) {
    std::error_code ec;
    fs::remove(tmp_file_, ec);
  }
}

void SafetensorsWriter::write(const std::string& name, int64_t elem_begin, int64_t elem_count, const float* data) {
  const std::string tmp_s = tmp_file_.string();
  SHARDLM_CHECK(fd_ >= 0 && (!finished_ || participant_), "%s: write after finish()", tmp_s.c_str());
  auto it = slots_.find(name);
  SHARDLM_CHECK(it != slots_.end(), "%s: tensor '%s' is not in the header", file_.string().c_str(), name.c_str());
  Slot& s = it->second;
  SHARDLM_CHECK(elem_begin >= 0 && elem_count >= 0 && elem_begin <= s.numel - elem_count,
                "%s: write of elements [%lld, %lld) of tensor '%s' is outside its %lld elements", file_.string().c_str(),
                (long long)elem_begin, (long long)(elem_begin + elem_count), name.c_str(), (long long)s.numel);
  if (elem_count == 0) return;
  SHARDLM_CHECK(data != nullptr, "%s: tensor '%s' has no data", file_.string().c_str(), name.c_str());
  if (s.dtype == "F32") {
    pwrite_all(fd_, data, elem_count * 4, s.data_offset_bytes + elem_begin * 4, tmp_s);
  } else {  // BF16
    std::vector<uint16_t> staging(static_cast<size_t>(std::min(elem_count, kConvertChunkElems)));
    for (int64_t done = 0; done < elem_count;) {
      const int64_t n = std::min(elem_count - done, kConvertChunkElems);
      for (int64_t i = 0; i < n; ++i) staging[i] = f32_to_bf16_rne(data[done + i]);
      pwrite_all(fd_, staging.data(), n * 2, s.data_offset_bytes + (elem_begin + done) * 2, tmp_s);
      done += n;
    }
  }
  s.elems_written += elem_count;
  SHARDLM_CHECK(s.elems_written <= s.numel, "%s: tensor '%s' written more than once (%lld of %lld elements)",
                file_.string().c_str(), name.c_str(), (long long)s.elems_written, (long long)s.numel);
}

void SafetensorsWriter::close_part() {
  SHARDLM_CHECK(participant_ && fd_ >= 0, "%s: close_part() is for shared-writing participants",
                tmp_file_.string().c_str());
  SHARDLM_CHECK(::fsync(fd_) == 0, "fsync of %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
  const int rc = ::close(fd_);
  fd_ = -1;
  SHARDLM_CHECK(rc == 0, "closing %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
}

void SafetensorsWriter::finish(bool check_complete) {
  const std::string file_s = file_.string();
  SHARDLM_CHECK(fd_ >= 0 && !finished_, "%s: finish() called twice", file_s.c_str());
  for (const auto& [name, s] : slots_)
    SHARDLM_CHECK(!check_complete || s.elems_written == s.numel, "%s: tensor '%s' has %lld of %lld elements written; not finishing",
                  file_s.c_str(), name.c_str(), (long long)s.elems_written, (long long)s.numel);
  SHARDLM_CHECK(::fsync(fd_) == 0, "fsync of %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
  int rc = ::close(fd_);
  fd_ = -1;
  SHARDLM_CHECK(rc == 0, "closing %s failed: %s", tmp_file_.string().c_str(), std::strerror(errno));
  std::error_code ec;
  fs::rename(tmp_file_, file_, ec);
  SHARDLM_CHECK(!ec, "cannot rename %s to %s: %s", tmp_file_.string().c_str(), file_s.c_str(), ec.message().c_str());
  finished_ = true;
  // Make the rename itself durable (best effort: some filesystems refuse).
  fs::path parent = file_.has_parent_path() ? file_.parent_path() : fs::path(".");
  int dir_fd = ::open(parent.string().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    (void)::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void write_safetensors(const fs::path& file, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorToWrite& t : tensors) specs.push_back({t.name, t.shape, t.dtype});
  SafetensorsWriter writer(file, specs, metadata);
  for (const TensorToWrite& t : tensors) writer.write(t.name, 0, checked_numel(t.shape), t.data);
  writer.finish();
}

// ---- the files served beside the weights -----------------------------------

const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {
      "tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
      "chat_template.jinja", "chat_template.json",   "tokenizer.model",         "vocab.json",
      "merges.txt",          "added_tokens.json"};
  return names;
}

std::string copy_tokenizer_files(const fs::path& src_dir, const fs::path& dst_dir) {
  if (src_dir.empty()) return "no tokenizer files: the weights did not come from an HF directory (model.hf is not set)";
  if (!fs::is_directory(src_dir))
    return "no tokenizer files: the source model directory " + src_dir.string() + " is not there";
  std::vector<std::string> copied;
  for (const auto& name : tokenizer_file_names()) {
    const fs::path from = src_dir / name;
    if (!fs::is_regular_file(from)) continue;
    const fs::path to = dst_dir / name, tmp = dst_dir / (name + ".tmp");
    std::error_code ec;
    fs::copy_file(from, tmp, fs::copy_options::overwrite_existing, ec);
    if (!ec) fs::rename(tmp, to, ec);
    if (ec) {
      fs::remove(tmp);
      SHARDLM_FAIL("cannot copy %s to %s: %s", from.c_str(), to.c_str(), ec.message().c_str());
    }
    copied.push_back(name);
  }
  if (copied.empty())
    return "no tokenizer files: " + src_dir.string() + " has none (tokenizer.json, tokenizer_config.json, ...); "
           "add them beside the weights before serving";
  std::string list;
  for (size_t i = 0; i < copied.size(); ++i) list += (i ? ", " : "") + copied[i];
  return "tokenizer files from " + src_dir.string() + ": " + list;
}

}  // namespace shardlm
