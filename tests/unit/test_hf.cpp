// test_hf.cpp — config.json and safetensors I/O (model/hf_config.hpp,
// model/safetensors.hpp): round trips, ranged
// reads, sharded directories, the numeric conversions, and every refusal with
// the text of its message.
#include <doctest/doctest.h>

#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/error.hpp"

namespace {

namespace fs = std::filesystem;
using shardlm::Error;

// A fresh directory under the system temp dir, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    std::random_device rd;
    path = fs::temp_directory_path() / ("shardlm_test_hf_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(counter++) + "_" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A safetensors file from a header JSON text and raw data bytes, as a foreign
// writer (or a corruption) would leave it: for dtypes our writer does not write.
void write_raw_safetensors(const fs::path& file, const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  write_text(file, out + header + data);
}

// What a call throws, as text; "<no error>" if it returns.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

void check_same_config(const shardlm::ModelConfig& a, const shardlm::ModelConfig& b) {
  CHECK(a.arch == b.arch);
  CHECK(a.vocab_size == b.vocab_size);
  CHECK(a.hidden_size == b.hidden_size);
  CHECK(a.intermediate_size == b.intermediate_size);
  CHECK(a.num_layers == b.num_layers);
  CHECK(a.num_heads == b.num_heads);
  CHECK(a.num_kv_heads == b.num_kv_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.max_position_embeddings == b.max_position_embeddings);
  CHECK(a.rms_norm_eps == b.rms_norm_eps);
  CHECK(a.rope_theta == b.rope_theta);
  CHECK(a.rope_scaling.type == b.rope_scaling.type);
  if (a.rope_scaling.type == "llama3") {
    CHECK(a.rope_scaling.factor == b.rope_scaling.factor);
    CHECK(a.rope_scaling.low_freq_factor == b.rope_scaling.low_freq_factor);
    CHECK(a.rope_scaling.high_freq_factor == b.rope_scaling.high_freq_factor);
    CHECK(a.rope_scaling.original_max_position_embeddings == b.rope_scaling.original_max_position_embeddings);
  }
  CHECK(a.attention_bias == b.attention_bias);
  CHECK(a.qk_norm == b.qk_norm);
  CHECK(a.tie_word_embeddings == b.tie_word_embeddings);
  CHECK(a.bos_token_id == b.bos_token_id);
  CHECK(a.eos_token_id == b.eos_token_id);
}

// Llama-3.2-1B's config.json as transformers 4.x writes it.
const char* kLlama32Config = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Qwen2.5-0.5B's config.json (no head_dim, no attention_bias key, sliding window off).
const char* kQwen25Config = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_mrope": false,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// Qwen3-0.6B's config.json in the transformers 5.x form (rope_parameters, dtype, layer_types).
const char* kQwen3Config5x = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "dtype": "bfloat16",
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "intermediate_size": 3072,
  "layer_types": ["full_attention", "full_attention"],
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 2,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
  "sliding_window": null,
  "tie_word_embeddings": true,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// tests/fixtures/llama-gqa-tied/config.json exactly as transformers 5.17 wrote it
// (tools/make_fixtures.py): rope_parameters with llama3 scaling, "dtype", null pad id.
const char* kLlamaFixtureConfigTransformers5 = R"({
  "architectures": [
    "LlamaForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 256,
  "dtype": "float32",
  "eos_token_id": 257,
  "head_dim": 16,
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.1,
  "intermediate_size": 160,
  "max_position_embeddings": 256,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 4,
  "num_hidden_layers": 2,
  "num_key_value_heads": 2,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.17.0",
  "use_cache": false,
  "vocab_size": 258
})";

// A small valid llama config.json with one key replaced / removed / added.
std::string llama_config_with(const std::string& key, const std::string& value_json) {
  nlohmann::json j = nlohmann::json::parse(kLlama32Config);
  if (value_json.empty())
    j.erase(key);
  else
    j[key] = nlohmann::json::parse(value_json);
  return j.dump(2);
}

std::string config_error(const std::string& text) {
  TempDir d;
  write_text(d.path / "config.json", text);
  return error_of([&] { shardlm::read_hf_config(d.path); });
}

std::vector<float> iota_floats(size_t n, float scale, float shift) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * scale + shift;
  return v;
}

}  // namespace

TEST_SUITE("hf") {

// ---------------------------------------------------------------------------
// scalar conversions
// ---------------------------------------------------------------------------

TEST_CASE("bf16_to_f32 is the top half of an fp32") {
  CHECK(shardlm::bf16_to_f32(0x3f80) == 1.0f);
  CHECK(shardlm::bf16_to_f32(0xc000) == -2.0f);
  CHECK(shardlm::bf16_to_f32(0x7f80) == std::numeric_limits<float>::infinity());
  CHECK(shardlm::bf16_to_f32(0xff80) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(shardlm::bf16_to_f32(0x7fc0)));
  CHECK(std::bit_cast<uint32_t>(shardlm::bf16_to_f32(0x0001)) == 0x00010000u);  // smallest subnormal
  CHECK(std::signbit(shardlm::bf16_to_f32(0x8000)));
}

TEST_CASE("f32_to_bf16_rne rounds to nearest, ties to even, and keeps NaN a NaN") {
  auto to_bf16 = [](uint32_t bits) { return shardlm::f32_to_bf16_rne(std::bit_cast<float>(bits)); };
  CHECK(to_bf16(0x3f800000u) == 0x3f80);   // 1.0 exact
  CHECK(to_bf16(0x3f808000u) == 0x3f80);   // tie, lsb even: down
  CHECK(to_bf16(0x3f818000u) == 0x3f82);   // tie, lsb odd: up
  CHECK(to_bf16(0x3f808001u) == 0x3f81);   // above tie: up
  CHECK(to_bf16(0x3f807fffu) == 0x3f80);   // below tie: down
  CHECK(to_bf16(0xbf818000u) == 0xbf82);   // negative tie, odd: away from zero
  CHECK(to_bf16(0x00008000u) == 0x0000);   // subnormal tie, even
  CHECK(to_bf16(0x00018000u) == 0x0002);   // subnormal tie, odd
  CHECK(to_bf16(0x007fffffu) == 0x0080);   // largest subnormal rounds up to the smallest normal
  CHECK(to_bf16(0x80000000u) == 0x8000);   // -0 keeps its sign
  CHECK(to_bf16(0x7f800000u) == 0x7f80);   // +inf
  CHECK(to_bf16(0xff800000u) == 0xff80);   // -inf
  CHECK(to_bf16(0x7f7fffffu) == 0x7f80);   // FLT_MAX is past bf16's largest + half ulp: inf
  CHECK(to_bf16(0x7f7f7fffu) == 0x7f7f);   // just below the tie: largest finite bf16
  // NaNs whose payload lives only in the dropped bits must not become inf.
  uint16_t nan_low = to_bf16(0x7f800001u);
  CHECK((nan_low & 0x7f80) == 0x7f80);
  CHECK((nan_low & 0x007f) != 0);
  uint16_t neg_nan = to_bf16(0xffc00000u);
  CHECK((neg_nan & 0x8000) != 0);
  CHECK(std::isnan(shardlm::bf16_to_f32(neg_nan)));
  // Every non-NaN bf16 survives bf16 -> f32 -> bf16.
  int mismatches = 0;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float f = shardlm::bf16_to_f32(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    if (shardlm::f32_to_bf16_rne(f) != b) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("f16_to_f32 is exact for every half value") {
  CHECK(shardlm::f16_to_f32(0x3c00) == 1.0f);
  CHECK(shardlm::f16_to_f32(0xc000) == -2.0f);
  CHECK(shardlm::f16_to_f32(0x7bff) == 65504.0f);
  CHECK(shardlm::f16_to_f32(0x0001) == std::ldexp(1.0f, -24));        // smallest subnormal
  CHECK(shardlm::f16_to_f32(0x03ff) == std::ldexp(1023.0f, -24));     // largest subnormal
  CHECK(shardlm::f16_to_f32(0x0400) == std::ldexp(1.0f, -14));        // smallest normal
  CHECK(shardlm::f16_to_f32(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(shardlm::f16_to_f32(0x7c00) == std::numeric_limits<float>::infinity());
  CHECK(shardlm::f16_to_f32(0xfc00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(shardlm::f16_to_f32(0x7e00)));
  CHECK(std::isnan(shardlm::f16_to_f32(0x7c01)));                     // signalling payload stays NaN
  CHECK(std::signbit(shardlm::f16_to_f32(0x8000)));
  CHECK(shardlm::f16_to_f32(0x8000) == 0.0f);
  // Every finite half against its definition.
  int mismatches = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) continue;
    double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), int(e) - 25);
    if (h & 0x8000) v = -v;
    if (shardlm::f16_to_f32(static_cast<uint16_t>(h)) != static_cast<float>(v)) ++mismatches;
  }
  CHECK(mismatches == 0);
}

// ---------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------

TEST_CASE("read_hf_config reads a Llama 3.2 config (4.x form, llama3 RoPE, eos list)") {
  TempDir d;
  write_text(d.path / "config.json", kLlama32Config);
  shardlm::ModelConfig c = shardlm::read_hf_config(d.path);
  CHECK(c.arch == "llama");
  CHECK(c.vocab_size == 128256);
  CHECK(c.hidden_size == 2048);
  CHECK(c.intermediate_size == 8192);
  CHECK(c.num_layers == 16);
  CHECK(c.num_heads == 32);
  CHECK(c.num_kv_heads == 8);
  CHECK(c.head_dim == 64);
  CHECK(c.max_position_embeddings == 131072);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rope_scaling.type == "llama3");
  CHECK(c.rope_scaling.factor == 32.0);
  CHECK(c.rope_scaling.low_freq_factor == 1.0);
  CHECK(c.rope_scaling.high_freq_factor == 4.0);
  CHECK(c.rope_scaling.original_max_position_embeddings == 8192);
  CHECK(c.tie_word_embeddings);
  CHECK_FALSE(c.attention_bias);
  CHECK_FALSE(c.qk_norm);
  CHECK(c.bos_token_id == 128000);
  CHECK(c.eos_token_id == 128001);
}

TEST_CASE("read_hf_config reads a Qwen2.5 config: implied q/k/v biases, default head_dim") {
  TempDir d;
  write_text(d.path / "config.json", kQwen25Config);
  shardlm::ModelConfig c = shardlm::read_hf_config(d.path);
  CHECK(c.arch == "qwen2");
  CHECK(c.attention_bias);
  CHECK_FALSE(c.qk_norm);
  CHECK(c.head_dim == 64);  // 896 / 14
  CHECK(c.num_kv_heads == 2);
  CHECK(c.rope_theta == 1e6);
  CHECK(c.rope_scaling.type == "none");
  CHECK(c.tie_word_embeddings);
  CHECK(c.rms_norm_eps == 1e-6);
  CHECK(c.eos_token_id == 151643);
}

TEST_CASE("read_hf_config reads a Qwen3 config in the transformers 5.x form") {
  TempDir d;
  write_text(d.path / "config.json", kQwen3Config5x);
  shardlm::ModelConfig c = shardlm::read_hf_config(d.path);
  CHECK(c.arch == "qwen3");
  CHECK(c.qk_norm);
  CHECK_FALSE(c.attention_bias);
  CHECK(c.head_dim == 128);  // not 1024 / 16
  CHECK(c.rope_theta == 1e6);
  CHECK(c.rope_scaling.type == "none");
  CHECK(c.num_layers == 2);
  CHECK(c.eos_token_id == 151645);
}

// The config.json transformers 5.17 saves for a small Qwen3MoeForCausalLM: the
// expert count as num_local_experts (the published checkpoints say num_experts).
constexpr const char* kQwen3MoeConfig5x = R"({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": null, "decoder_sparse_step": 1, "dtype": "float32", "eos_token_id": null,
  "head_dim": 8, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 80,
  "max_position_embeddings": 32768, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 24,
  "norm_topk_prob": true, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": true, "pad_token_id": null,
  "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "router_aux_loss_coef": 0.01, "sliding_window": null, "tie_word_embeddings": false, "transformers_version": "5.17.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 64})";

TEST_CASE("read_hf_config reads Qwen3-MoE's expert count as num_experts or transformers 5's num_local_experts") {
  auto read = [](const nlohmann::json& j) {
    TempDir d;
    write_text(d.path / "config.json", j.dump());
    return shardlm::read_hf_config(d.path);
  };
  nlohmann::json local = nlohmann::json::parse(kQwen3MoeConfig5x);
  shardlm::ModelConfig c = read(local);
  CHECK(c.arch == "qwen3_moe");
  CHECK(c.num_experts == 4);
  CHECK(c.num_experts_per_tok == 2);
  CHECK(c.moe_intermediate_size == 24);
  CHECK(c.norm_topk_prob);
  CHECK(c.router_aux_loss);
  CHECK(c.router_aux_loss_coef == doctest::Approx(0.01));
  nlohmann::json hub = local;
  hub.erase("num_local_experts");
  hub["num_experts"] = 4;
  CHECK(read(hub).num_experts == 4);
  nlohmann::json both = hub;
  both["num_local_experts"] = 8;
  CHECK(config_error(both.dump()).find("'num_experts' 4 and 'num_local_experts' 8 disagree") != std::string::npos);
  both["num_local_experts"] = 4;
  CHECK(read(both).num_experts == 4);
}

TEST_CASE("read_hf_config reads the config.json transformers 5.x wrote for the llama fixture") {
  TempDir d;
  write_text(d.path / "config.json", kLlamaFixtureConfigTransformers5);
  shardlm::ModelConfig c = shardlm::read_hf_config(d.path);
  CHECK(c.arch == "llama");
  CHECK(c.vocab_size == 258);
  CHECK(c.hidden_size == 64);
  CHECK(c.intermediate_size == 160);
  CHECK(c.num_layers == 2);
  CHECK(c.num_heads == 4);
  CHECK(c.num_kv_heads == 2);
  CHECK(c.head_dim == 16);
  CHECK(c.max_position_embeddings == 256);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.rope_theta == 10000.0);
  CHECK(c.rope_scaling.type == "llama3");
  CHECK(c.rope_scaling.factor == 8.0);
  CHECK(c.rope_scaling.low_freq_factor == 1.0);
  CHECK(c.rope_scaling.high_freq_factor == 4.0);
  CHECK(c.rope_scaling.original_max_position_embeddings == 32);
  CHECK(c.tie_word_embeddings);
  CHECK(c.bos_token_id == 256);
  CHECK(c.eos_token_id == 257);
}

TEST_CASE("read_hf_config: 5.x rope_parameters and 4.x rope_theta + rope_scaling give the same config") {
  const std::string v5 = [] {
    nlohmann::json j = nlohmann::json::parse(kLlama32Config);
    j.erase("rope_theta");
    j.erase("rope_scaling");
    j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0},
                            {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 8192}};
    return j.dump();
  }();
  TempDir a, b;
  write_text(a.path / "config.json", kLlama32Config);
  write_text(b.path / "config.json", v5);
  shardlm::ModelConfig c4 = shardlm::read_hf_config(a.path);
  shardlm::ModelConfig c5 = shardlm::read_hf_config(b.path);
  CHECK(c5.rope_scaling.type == "llama3");
  check_same_config(c4, c5);

  // The old "type" spelling, and both forms present and agreeing, are accepted too.
  nlohmann::json both = nlohmann::json::parse(v5);
  both["rope_theta"] = 500000.0;
  both["rope_scaling"] = {{"type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  write_text(b.path / "config.json", both.dump());
  check_same_config(c4, shardlm::read_hf_config(b.path));
  // Disagreeing forms are ambiguous: refused.
  both["rope_scaling"]["factor"] = 16.0;
  CHECK(config_error(both.dump()).find("'rope_parameters' and 'rope_scaling' are both set and disagree") !=
        std::string::npos);
  both = nlohmann::json::parse(v5);
  both["rope_theta"] = 10000.0;
  CHECK(config_error(both.dump()).find("RoPE base given twice with different values (10000 and 500000)") !=
        std::string::npos);
}

TEST_CASE("write_hf_config then read_hf_config gives the same ModelConfig") {
  shardlm::ModelConfig llama;
  llama.arch = "llama";
  llama.vocab_size = 258;
  llama.hidden_size = 64;
  llama.intermediate_size = 160;
  llama.num_layers = 2;
  llama.num_heads = 4;
  llama.num_kv_heads = 2;
  llama.head_dim = 16;
  llama.max_position_embeddings = 256;
  llama.rms_norm_eps = 1e-5;
  llama.rope_theta = 10000.0;
  llama.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 32};
  llama.tie_word_embeddings = true;
  llama.bos_token_id = 256;
  llama.eos_token_id = 257;

  shardlm::ModelConfig qwen2 = llama;
  qwen2.arch = "qwen2";
  qwen2.attention_bias = true;
  qwen2.rope_scaling = {};
  qwen2.rope_theta = 1e6;
  qwen2.rms_norm_eps = 1e-6;
  qwen2.tie_word_embeddings = false;

  shardlm::ModelConfig qwen3 = qwen2;
  qwen3.arch = "qwen3";
  qwen3.attention_bias = false;
  qwen3.qk_norm = true;
  qwen3.head_dim = 32;  // != hidden / heads
  qwen3.bos_token_id = -1;
  qwen3.eos_token_id = -1;

  for (const shardlm::ModelConfig& original : {llama, qwen2, qwen3}) {
    CAPTURE(original.arch);
    TempDir d;
    shardlm::write_hf_config(d.path, original, "bfloat16");
    CHECK_FALSE(fs::exists(d.path / "config.json.tmp"));
    check_same_config(shardlm::read_hf_config(d.path), original);
    nlohmann::json j = nlohmann::json::parse(read_bytes(d.path / "config.json"));
    CHECK(j["torch_dtype"] == "bfloat16");
    CHECK(j["hidden_act"] == "silu");
    CHECK(j["architectures"][0] ==
          (original.arch == "llama" ? "LlamaForCausalLM" : original.arch == "qwen2" ? "Qwen2ForCausalLM"
                                                                                    : "Qwen3ForCausalLM"));
    CHECK(j.contains("bos_token_id") == (original.bos_token_id >= 0));
    if (original.rope_scaling.type == "llama3") {
      CHECK(j["rope_scaling"]["rope_type"] == "llama3");
    } else {
      CHECK(j["rope_scaling"].is_null());
    }
  }
}

TEST_CASE("write_hf_config refuses what the architecture cannot express, and writes nothing") {
  shardlm::ModelConfig c;
  c.arch = "qwen2";
  c.vocab_size = 10;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_layers = 1;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.max_position_embeddings = 16;
  TempDir d;
  CHECK(error_of([&] { shardlm::write_hf_config(d.path, c, "bfloat16"); })
            .find("a qwen2 model always has q/k/v biases; this one has model.attention_bias = false (set it true)") !=
        std::string::npos);
  c.attention_bias = true;
  CHECK(error_of([&] { shardlm::write_hf_config(d.path, c, "fp8"); })
            .find("torch_dtype 'fp8' is not one of float32, bfloat16, float16") != std::string::npos);
  c.qk_norm = true;
  CHECK(error_of([&] { shardlm::write_hf_config(d.path, c, "float32"); })
            .find("qk_norm = true cannot be expressed for arch 'qwen2'") != std::string::npos);
  c.qk_norm = false;
  c.arch = "llama";
  CHECK(error_of([&] { shardlm::write_hf_config(d.path, c, "float32"); })
            .find("llama with model.attention_bias = true") != std::string::npos);
  CHECK(fs::is_empty(d.path));
  CHECK(error_of([&] { shardlm::write_hf_config(d.path / "absent", c, "float32"); })
            .find("is not a directory") != std::string::npos);
}

TEST_CASE("read_hf_config refuses bad configs with the file, key and value") {
  SUBCASE("missing config.json") {
    TempDir d;
    std::string msg = error_of([&] { shardlm::read_hf_config(d.path); });
    CHECK(msg.find((d.path / "config.json").string() + ": cannot open") != std::string::npos);
  }
  SUBCASE("not JSON") { CHECK(config_error("{\"model_type\": ").find("config.json: not valid JSON") != std::string::npos); }
  SUBCASE("unknown model_type") {
    std::string msg = config_error(llama_config_with("model_type", "\"mistral\""));
    CHECK(msg.find("config.json: model_type 'mistral' is not supported (shardlm runs llama, qwen2, qwen3, qwen2_moe and qwen3_moe)") !=
          std::string::npos);
  }
  SUBCASE("architecture that is not the causal LM") {
    std::string msg = config_error(llama_config_with("architectures", "[\"LlamaForSequenceClassification\"]"));
    CHECK(msg.find("architecture 'LlamaForSequenceClassification' is not supported for model_type 'llama' (expected "
                   "'LlamaForCausalLM')") != std::string::npos);
  }
  SUBCASE("yarn RoPE (4.x form)") {
    std::string msg = config_error(llama_config_with(
        "rope_scaling", R"({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})"));
    CHECK(msg.find("'rope_scaling.rope_type' = 'yarn' is not supported") != std::string::npos);
  }
  SUBCASE("linear RoPE with the old 'type' key") {
    std::string msg = config_error(llama_config_with("rope_scaling", R"({"type": "linear", "factor": 2.0})"));
    CHECK(msg.find("'rope_scaling.rope_type' = 'linear' is not supported") != std::string::npos);
  }
  SUBCASE("dynamic RoPE (5.x form)") {
    std::string msg =
        config_error(llama_config_with("rope_parameters", R"({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})"));
    CHECK(msg.find("'rope_parameters.rope_type' = 'dynamic' is not supported") != std::string::npos);
  }
  SUBCASE("llama3 RoPE missing a key") {
    std::string msg = config_error(
        llama_config_with("rope_scaling", R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0})"));
    CHECK(msg.find("'rope_scaling' has rope_type llama3 but no 'high_freq_factor'") != std::string::npos);
  }
  SUBCASE("mlp_bias") {
    CHECK(config_error(llama_config_with("mlp_bias", "true")).find("'mlp_bias' = true is not supported") !=
          std::string::npos);
  }
  SUBCASE("attention_bias on llama (would add an o_proj bias)") {
    CHECK(config_error(llama_config_with("attention_bias", "true"))
              .find("'attention_bias' = true is not supported for llama") != std::string::npos);
  }
  SUBCASE("hidden_act") {
    CHECK(config_error(llama_config_with("hidden_act", "\"gelu\""))
              .find("'hidden_act' = \"gelu\" is not supported") != std::string::npos);
  }
  SUBCASE("sliding window") {
    nlohmann::json j = nlohmann::json::parse(kQwen25Config);
    j["use_sliding_window"] = true;
    CHECK(config_error(j.dump()).find("'use_sliding_window' = true is not supported") != std::string::npos);
    j = nlohmann::json::parse(kQwen3Config5x);
    j["layer_types"] = {"full_attention", "sliding_attention"};
    CHECK(config_error(j.dump()).find("'layer_types' contains \"sliding_attention\"") != std::string::npos);
  }
  SUBCASE("quantized") {
    CHECK(config_error(llama_config_with("quantization_config", R"({"quant_method": "gptq"})"))
              .find("quantized checkpoints are not supported") != std::string::npos);
  }
  SUBCASE("missing required key") {
    CHECK(config_error(llama_config_with("hidden_size", "")).find("config.json: required key 'hidden_size' is missing") !=
          std::string::npos);
    CHECK(config_error(llama_config_with("rms_norm_eps", "")).find("required key 'rms_norm_eps' is missing") !=
          std::string::npos);
    std::string no_theta = [] {
      nlohmann::json j = nlohmann::json::parse(kQwen25Config);
      j.erase("rope_theta");
      return j.dump();
    }();
    CHECK(config_error(no_theta).find("required key 'rope_theta' is missing") != std::string::npos);
  }
  SUBCASE("non-positive and non-integer sizes") {
    CHECK(config_error(llama_config_with("num_hidden_layers", "0")).find("'num_hidden_layers' must be positive, got 0") !=
          std::string::npos);
    CHECK(config_error(llama_config_with("vocab_size", "-5")).find("'vocab_size' must be positive, got -5") !=
          std::string::npos);
    CHECK(config_error(llama_config_with("hidden_size", "\"2048\"")).find("'hidden_size' must be an integer, got \"2048\"") !=
          std::string::npos);
    CHECK(config_error(llama_config_with("intermediate_size", "8192.5"))
              .find("'intermediate_size' must be an integer, got 8192.5") != std::string::npos);
  }
  SUBCASE("sizes past shardlm's bounds, and a parameter count that would overflow") {
    // 10^9 layers are refused before a name is built per parameter (the OOM killer would come first).
    CHECK(config_error(llama_config_with("num_hidden_layers", "1000000000"))
              .find("config.json: 'num_hidden_layers' = 1000000000 is out of range: shardlm accepts 1 to 16384") !=
          std::string::npos);
    CHECK(config_error(llama_config_with("hidden_size", "4611686018427387904"))
              .find("'hidden_size' = 4611686018427387904 is out of range: shardlm accepts 1 to 1048576") !=
          std::string::npos);
    nlohmann::json big = nlohmann::json::parse(kLlama32Config);
    big["vocab_size"] = 16777216;
    big["hidden_size"] = 1048576;
    big["head_dim"] = 64;
    big["tie_word_embeddings"] = false;
    const std::string msg = config_error(big.dump());
    CHECK(msg.find("config.json: the model would have ") != std::string::npos);
    CHECK(msg.find("more than the 35184372088832 shardlm accepts") != std::string::npos);
  }
  SUBCASE("heads not divisible by kv heads") {
    CHECK(config_error(llama_config_with("num_key_value_heads", "5"))
              .find("num_attention_heads 32 is not divisible by num_key_value_heads 5") != std::string::npos);
  }
}

TEST_CASE("read_hf_config defaults: kv heads, head_dim, tie, biases, token ids") {
  nlohmann::json j = nlohmann::json::parse(kLlama32Config);
  for (const char* k : {"num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias",
                        "hidden_act", "bos_token_id", "architectures"})
    j.erase(k);
  j["eos_token_id"] = nullptr;
  TempDir d;
  write_text(d.path / "config.json", j.dump());
  shardlm::ModelConfig c = shardlm::read_hf_config(d.path);
  CHECK(c.num_kv_heads == 32);
  CHECK(c.head_dim == 64);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK_FALSE(c.attention_bias);
  CHECK(c.bos_token_id == -1);
  CHECK(c.eos_token_id == -1);
}

// ---------------------------------------------------------------------------
// safetensors
// ---------------------------------------------------------------------------

TEST_CASE("write_safetensors then SafetensorsReader: F32 exact, BF16 equal to RNE rounding") {
  TempDir d;
  std::vector<float> a = iota_floats(15, 0.1f, -0.7f);   // (3, 5)
  a[3] = std::numeric_limits<float>::infinity();
  a[4] = -0.0f;
  std::vector<float> b = {1.0f, 1.00390625f, 1.01171875f, -3.14159265f, 1e-40f, 3.4e38f, 65504.0f};  // (7,) ties, subnormal, overflow
  std::vector<float> scalar = {42.5f};
  const fs::path file = d.path / "model.safetensors";
  shardlm::write_safetensors(file, {
                                       {"model.a", {3, 5}, "F32", a.data()},
                                       {"model.b", {7}, "BF16", b.data()},
                                       {"model.scalar", {}, "F32", scalar.data()},
                                       {"model.empty", {2, 0}, "BF16", nullptr},
                                   });
  CHECK_FALSE(fs::exists(d.path / "model.safetensors.tmp"));

  // Layout: header length a multiple of 8, format pt, file size exactly header + data.
  std::string bytes = read_bytes(file);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  CHECK(header_len % 8 == 0);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len));
  CHECK(header["__metadata__"]["format"] == "pt");
  CHECK(bytes.size() == 8 + header_len + (15 + 1) * 4 + 7 * 2);

  shardlm::SafetensorsReader r(d.path);
  CHECK(r.names() == std::vector<std::string>{"model.a", "model.b", "model.empty", "model.scalar"});
  CHECK(r.info("model.a").dtype == "F32");
  CHECK(r.info("model.a").shape == std::vector<int64_t>{3, 5});
  CHECK(r.info("model.a").data_offset_bytes % 4 == 0);
  CHECK(r.info("model.b").dtype == "BF16");
  CHECK(r.info("model.scalar").shape.empty());
  CHECK(r.info("model.scalar").numel == 1);
  CHECK(r.info("model.empty").numel == 0);
  CHECK(r.info("model.b").file == file);

  std::vector<float> got_a(15), got_b(7), got_s(1);
  r.read_f32("model.a", 0, 15, got_a.data());
  CHECK(std::memcmp(got_a.data(), a.data(), sizeof(float) * 15) == 0);
  r.read_f32("model.b", 0, 7, got_b.data());
  for (size_t i = 0; i < b.size(); ++i) {
    CAPTURE(i);
    CHECK(std::bit_cast<uint32_t>(got_b[i]) == std::bit_cast<uint32_t>(shardlm::bf16_to_f32(shardlm::f32_to_bf16_rne(b[i]))));
  }
  CHECK(got_b[0] == 1.0f);
  CHECK(got_b[1] == 1.0f);         // tie to even
  CHECK(got_b[2] == 1.015625f);    // tie to even (up)
  CHECK(std::isinf(got_b[5]));     // 3.4e38 rounds past bf16 max
  r.read_f32("model.scalar", 0, 1, got_s.data());
  CHECK(got_s[0] == 42.5f);
  r.read_f32("model.empty", 0, 0, nullptr);
}

TEST_CASE("SafetensorsReader reads any element range, across conversion chunks") {
  TempDir d;
  const size_t n = 70000;  // more than one 65536-element conversion chunk
  std::vector<float> w = iota_floats(n, 1.0f / 64, -100.0f);
  shardlm::write_safetensors(d.path / "model.safetensors",
                             {{"w32", {100, 700}, "F32", w.data()}, {"w16", {100, 700}, "BF16", w.data()}});
  shardlm::SafetensorsReader r(d.path);
  struct Slice {
    int64_t begin, count;
  };
  for (Slice s : {Slice{0, 1}, Slice{123, 456}, Slice{65530, 12}, Slice{1000, 68000}, Slice{int64_t(n) - 1, 1},
                  Slice{0, int64_t(n)}}) {
    CAPTURE(s.begin);
    CAPTURE(s.count);
    std::vector<float> got32(s.count), got16(s.count);
    r.read_f32("w32", s.begin, s.count, got32.data());
    r.read_f32("w16", s.begin, s.count, got16.data());
    int bad32 = 0, bad16 = 0;
    for (int64_t i = 0; i < s.count; ++i) {
      float ref = w[s.begin + i];
      if (got32[i] != ref) ++bad32;
      if (got16[i] != shardlm::bf16_to_f32(shardlm::f32_to_bf16_rne(ref))) ++bad16;
    }
    CHECK(bad32 == 0);
    CHECK(bad16 == 0);
  }
  float one;
  CHECK(error_of([&] { r.read_f32("w32", int64_t(n) - 1, 2, &one); })
            .find("read of elements [69999, 70001) of tensor 'w32'") != std::string::npos);
  CHECK(error_of([&] { r.read_f32("w32", -1, 1, &one); }).find("is outside its 70000 elements") != std::string::npos);
}

TEST_CASE("SafetensorsReader reads F16 written by another tool") {
  TempDir d;
  // (2, 2) F16: 1.0, -2.0, smallest subnormal, inf.
  const uint16_t halves[4] = {0x3c00, 0xc000, 0x0001, 0x7c00};
  std::string data(reinterpret_cast<const char*>(halves), sizeof halves);
  write_raw_safetensors(d.path / "x.safetensors",
                        R"({"h":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}})",
                        data);
  shardlm::SafetensorsReader r(d.path);
  std::vector<float> got(3);
  r.read_f32("h", 1, 3, got.data());
  CHECK(got[0] == -2.0f);
  CHECK(got[1] == std::ldexp(1.0f, -24));
  CHECK(std::isinf(got[2]));
}

TEST_CASE("SafetensorsReader on a sharded directory follows model.safetensors.index.json") {
  TempDir d;
  std::vector<float> q = iota_floats(12, 0.5f, 0.0f), k = iota_floats(6, -1.0f, 3.0f), e = iota_floats(8, 2.0f, 1.0f);
  shardlm::write_safetensors(d.path / "model-00001-of-00002.safetensors",
                             {{"model.embed_tokens.weight", {4, 2}, "F32", e.data()},
                              {"model.layers.0.self_attn.q_proj.weight", {3, 4}, "BF16", q.data()}});
  shardlm::write_safetensors(d.path / "model-00002-of-00002.safetensors",
                             {{"model.layers.0.self_attn.k_proj.weight", {2, 3}, "F32", k.data()}});
  // A stray file the index does not name is not opened (it is not even valid).
  write_text(d.path / "stray.safetensors", "junk");
  write_text(d.path / "model.safetensors.index.json", R"({
    "metadata": {"total_size": 92},
    "weight_map": {
      "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
      "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
      "model.layers.0.self_attn.k_proj.weight": "model-00002-of-00002.safetensors"
    }})");
  shardlm::SafetensorsReader r(d.path);
  CHECK(r.names().size() == 3);
  CHECK(r.has("model.layers.0.self_attn.k_proj.weight"));
  CHECK_FALSE(r.has("lm_head.weight"));
  CHECK(r.info("model.layers.0.self_attn.k_proj.weight").file == d.path / "model-00002-of-00002.safetensors");
  CHECK(r.info("model.layers.0.self_attn.q_proj.weight").dtype == "BF16");
  std::vector<float> got(4);
  r.read_f32("model.layers.0.self_attn.k_proj.weight", 2, 4, got.data());
  CHECK(got == std::vector<float>(k.begin() + 2, k.end()));
  r.read_f32("model.layers.0.self_attn.q_proj.weight", 8, 4, got.data());
  CHECK(got == std::vector<float>(q.begin() + 8, q.end()));  // small halves: exact in bf16

  // A moved-from reader is empty; the moved-to one still reads.
  shardlm::SafetensorsReader moved(std::move(r));
  moved.read_f32("model.embed_tokens.weight", 0, 4, got.data());
  CHECK(got == std::vector<float>(e.begin(), e.begin() + 4));

  SUBCASE("index names a tensor its file does not hold") {
    write_text(d.path / "model.safetensors.index.json",
               R"({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})");
    CHECK(error_of([&] { shardlm::SafetensorsReader bad(d.path); })
              .find("maps tensor 'lm_head.weight' to " + (d.path / "model-00002-of-00002.safetensors").string() +
                    ", which has no such tensor") != std::string::npos);
  }
  SUBCASE("index names a missing file") {
    write_text(d.path / "model.safetensors.index.json",
               R"({"weight_map": {"lm_head.weight": "model-00003-of-00003.safetensors"}})");
    CHECK(error_of([&] { shardlm::SafetensorsReader bad(d.path); })
              .find("names " + (d.path / "model-00003-of-00003.safetensors").string() + ", which does not exist") !=
          std::string::npos);
  }
}

TEST_CASE("SafetensorsReader without an index opens every *.safetensors and refuses duplicates") {
  TempDir d;
  std::vector<float> x = {1, 2, 3};
  shardlm::write_safetensors(d.path / "a.safetensors", {{"x", {3}, "F32", x.data()}});
  shardlm::write_safetensors(d.path / "b.safetensors", {{"y", {3}, "F32", x.data()}});
  CHECK(shardlm::SafetensorsReader(d.path).names() == std::vector<std::string>{"x", "y"});
  shardlm::write_safetensors(d.path / "c.safetensors", {{"x", {3}, "F32", x.data()}});
  std::string msg = error_of([&] { shardlm::SafetensorsReader r(d.path); });
  CHECK(msg.find("tensor 'x' is in both " + (d.path / "a.safetensors").string() + " and " +
                 (d.path / "c.safetensors").string()) != std::string::npos);
}

TEST_CASE("SafetensorsReader refuses damaged files and unknown names with clear messages") {
  TempDir d;
  const fs::path file = d.path / "model.safetensors";
  const std::string file_s = file.string();
  std::vector<float> w = iota_floats(6, 1.0f, 0.0f);

  SUBCASE("no safetensors at all") {
    write_text(d.path / "config.json", "{}");
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }) == "no *.safetensors in " + d.path.string());
  }
  SUBCASE("not a directory") {
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path / "nope"); }).find("is not a directory") !=
          std::string::npos);
  }
  SUBCASE("tensor missing") {
    shardlm::write_safetensors(file, {{"a", {6}, "F32", w.data()}, {"b", {2, 3}, "F32", w.data()}});
    shardlm::SafetensorsReader r(d.path);
    float out;
    CHECK(error_of([&] { r.read_f32("model.layers.0.self_attn.q_proj.weight", 0, 1, &out); }) ==
          "tensor 'model.layers.0.self_attn.q_proj.weight' not found in " + d.path.string() + " (2 tensors present)");
    CHECK(error_of([&] { r.info("lm_head.weight"); }) ==
          "tensor 'lm_head.weight' not found in " + d.path.string() + " (2 tensors present)");
  }
  SUBCASE("truncated data") {
    shardlm::write_safetensors(file, {{"a", {6}, "F32", w.data()}});
    fs::resize_file(file, fs::file_size(file) - 4);
    std::string msg = error_of([&] { shardlm::SafetensorsReader r(d.path); });
    CHECK(msg.find(file_s + ": tensor 'a' ends at byte") != std::string::npos);
    CHECK(msg.find("the file is truncated") != std::string::npos);
  }
  SUBCASE("header length larger than the file") {
    write_raw_safetensors(file, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "abcd");
    std::string bytes = read_bytes(file);
    bytes[0] = '\x00';
    bytes[1] = '\x10';  // header length 4096 + ...
    write_text(file, bytes);
    std::string msg = error_of([&] { shardlm::SafetensorsReader r(d.path); });
    CHECK(msg.find(file_s + ": header length") != std::string::npos);
    CHECK(msg.find("is larger than the file (") != std::string::npos);
  }
  SUBCASE("shorter than the length prefix") {
    write_text(file, "abc");
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }) ==
          file_s + " is 3 bytes: too short for a safetensors file (truncated?)");
  }
  SUBCASE("header not JSON") {
    write_raw_safetensors(file, "{\"a\": [1, 2", "");
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }).find(file_s + ": header is not valid JSON") !=
          std::string::npos);
  }
  SUBCASE("data_offsets inconsistent with dtype x shape") {
    write_raw_safetensors(file, R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", std::string(24, '\0'));
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); })
              .find(file_s + ": tensor 'a' (F32 [2, 3]) needs 24 bytes but its data_offsets [0, 20] span 20") !=
          std::string::npos);
  }
  SUBCASE("negative offsets or shape") {
    write_raw_safetensors(file, R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0'));
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }).find("tensor 'a' has a bad shape [-1]") !=
          std::string::npos);
  }
  SUBCASE("unknown dtype string") {
    write_raw_safetensors(file, R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0'));
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }).find("tensor 'a' has unknown dtype 'Q4'") !=
          std::string::npos);
  }
  // data_offsets must tile the data exactly (the safetensors rule): an overlap
  // would load q_proj from the embedding's bytes and train on it.
  SUBCASE("overlapping data_offsets") {
    write_raw_safetensors(file,
                          R"({"embed":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                          R"("q_proj":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                          std::string(16, '\0'));
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }) ==
          file_s + ": tensor 'q_proj' has data_offsets [8, 16], which overlap tensor 'embed' [0, 16]: the header is "
                   "corrupt (every tensor needs bytes of its own)");
  }
  SUBCASE("data_offsets leaving a hole") {
    write_raw_safetensors(file,
                          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                          std::string(12, '\0'));
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }) ==
          file_s + ": data bytes [4, 8) belong to no tensor (before tensor 'b'): the header is corrupt or the file is "
                   "not safetensors");
  }
  SUBCASE("bytes after the last tensor") {
    write_raw_safetensors(file, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(10, '\0'));
    CHECK(error_of([&] { shardlm::SafetensorsReader r(d.path); }) ==
          file_s + ": the tensors' data ends at byte 4 of the data but the file holds 10 data bytes (last tensor 'a'): "
                   "the header is corrupt or the file has trailing bytes");
  }
  SUBCASE("unsupported dtype I64: listed, but not readable as fp32") {
    write_raw_safetensors(file, R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", std::string(16, '\0'));
    shardlm::SafetensorsReader r(d.path);
    CHECK(r.info("ids").dtype == "I64");
    float out[2];
    CHECK(error_of([&] { r.read_f32("ids", 0, 2, out); }) ==
          "tensor 'ids' in " + file_s + " has dtype I64; shardlm reads BF16, F16 and F32 only");
  }
}

TEST_CASE("SafetensorsWriter streams ranges in any order and is atomic") {
  TempDir d;
  const fs::path file = d.path / "model.safetensors";
  std::vector<float> a = iota_floats(10, 0.25f, -1.0f), b = iota_floats(4, 3.0f, 0.5f);
  const std::vector<shardlm::TensorSpec> specs = {{"a", {2, 5}, "BF16"}, {"b", {4}, "F32"}};

  SUBCASE("ranges in any order") {
    shardlm::SafetensorsWriter w(file, specs, {{"step", "7"}});
    w.write("a", 6, 4, a.data() + 6);
    w.write("b", 0, 4, b.data());
    CHECK_FALSE(fs::exists(file));  // nothing under the final name before finish()
    w.write("a", 0, 6, a.data());
    w.finish();
    CHECK_FALSE(fs::exists(d.path / "model.safetensors.tmp"));
    shardlm::SafetensorsReader r(d.path);
    std::vector<float> got(10);
    r.read_f32("a", 0, 10, got.data());
    CHECK(got == a);  // quarters are exact in bf16
    r.read_f32("b", 0, 4, got.data());
    CHECK(std::vector<float>(got.begin(), got.begin() + 4) == b);
    std::string bytes = read_bytes(file);
    CHECK(bytes.find("\"step\":\"7\"") != std::string::npos);
  }
  SUBCASE("an unfinished writer leaves the old file and no .tmp") {
    write_text(file, "old contents");
    {
      shardlm::SafetensorsWriter w(file, specs);
      w.write("a", 0, 10, a.data());
      CHECK(fs::exists(d.path / "model.safetensors.tmp"));
    }
    CHECK(read_bytes(file) == "old contents");
    CHECK_FALSE(fs::exists(d.path / "model.safetensors.tmp"));
  }
  SUBCASE("finish() refuses a tensor that is not fully written") {
    shardlm::SafetensorsWriter w(file, specs);
    w.write("a", 0, 10, a.data());
    w.write("b", 0, 3, b.data());
    CHECK(error_of([&] { w.finish(); }) == file.string() + ": tensor 'b' has 3 of 4 elements written; not finishing");
    CHECK_FALSE(fs::exists(file));
  }
  SUBCASE("bad writes and specs") {
    shardlm::SafetensorsWriter w(file, specs);
    CHECK(error_of([&] { w.write("c", 0, 1, a.data()); }).find("tensor 'c' is not in the header") != std::string::npos);
    CHECK(error_of([&] { w.write("b", 2, 3, b.data()); }).find("write of elements [2, 5) of tensor 'b'") !=
          std::string::npos);
    w.write("b", 0, 4, b.data());
    CHECK(error_of([&] { w.write("b", 0, 1, b.data()); }).find("tensor 'b' written more than once") !=
          std::string::npos);
    CHECK(error_of([&] { shardlm::SafetensorsWriter bad(d.path / "x.safetensors", {{"a", {1}, "F16"}}); })
              .find("tensor 'a' dtype 'F16' is not F32 or BF16") != std::string::npos);
    CHECK(error_of([&] { shardlm::SafetensorsWriter bad(d.path / "x.safetensors", {{"a", {1}, "F32"}, {"a", {2}, "F32"}}); })
              .find("tensor 'a' given twice") != std::string::npos);
    CHECK_FALSE(fs::exists(d.path / "x.safetensors.tmp"));
  }
}

}  // TEST_SUITE("hf")
