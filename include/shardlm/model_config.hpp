// model_config.hpp — the architecture of a decoder-only model (Llama/Qwen family).
//
// Owns: ModelConfig, the sizes and options every other part reads. Filled from
// the deck ([model] section) or from a Hugging Face config.json (hf.hpp). Knows
// nothing about parameters, shards, devices or MPI.
#pragma once

#include <cstdint>
#include <string>

namespace shardlm {

// Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3").
struct RopeScaling {
  std::string type = "none";             // "none" | "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string arch = "llama";            // "llama" | "qwen2" | "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;                  // independent of hidden_size / num_heads
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool attention_bias = false;           // q/k/v projection biases (Qwen2)
  bool qk_norm = false;                  // per-head RMSNorm on q and k (Qwen3)
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
};

}  // namespace shardlm
