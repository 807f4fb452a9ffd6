// hf_config.hpp — a Hugging Face model directory's config.json, read and written.
//
// Owns: read_hf_config / write_hf_config, RoPE in both transformers forms (4.x
// rope_theta + rope_scaling, 5.x rope_parameters) and what shardlm refuses
// (architectures, activations, biases, attention kinds it cannot run exactly).
// Knows nothing about weights, tensors, shards, devices or MPI: it maps
// config.json to ModelConfig and back (through the table of ModelConfig's
// fields in shardlm/model_config.hpp).
#pragma once

#include <filesystem>
#include <string>

#include "shardlm/model_config.hpp"

namespace shardlm {

// ---- config.json -----------------------------------------------------------

// Reads DIR/config.json of a LlamaForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM model, in transformers 4.x (rope_theta + rope_scaling) or 5.x
// (rope_parameters) form. Throws Error naming the file, key and value for
// anything shardlm cannot run exactly (other architectures, RoPE types other
// than default/llama3, MLP biases, activations other than silu, sliding-window
// attention, quantized weights, missing or non-positive sizes, experts' rules
// broken, dense layers placed by mlp_only_layers).
ModelConfig read_hf_config(const std::filesystem::path& dir);

// Writes DIR/config.json (DIR must exist) that transformers 4.x and 5.x and
// vLLM load: rope in the 4.x form (rope_theta + rope_scaling), which 5.x still
// reads. torch_dtype: "float32" | "bfloat16" | "float16". Throws Error for a
// ModelConfig that the named architecture cannot express (Qwen2 without q/k/v
// biases, Qwen3 without q/k norms, q/k norms on Llama or Qwen2). Written as
// config.json.tmp, then renamed.
void write_hf_config(const std::filesystem::path& dir, const ModelConfig& config,
                     const std::string& torch_dtype);

}  // namespace shardlm
