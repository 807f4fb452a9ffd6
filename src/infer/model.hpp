// model.hpp — the whole model held by an inference rank: every weight,
// unsharded, fp32 in host memory (the CPU backend's sampling model).
//
// Owns: InferenceModel (the weights as one world-1 ShardedModel: each unit one
// flat buffer, the same layout and names training uses), loading it from an
// HF directory or from a shardlm checkpoint (through the checkpoint's own
// verified /model reader, checkpoint.hpp's read_checkpoint_model), the stop
// ids the model directory declares, and where its tokenizer lives.
// Must not know: MPI, KV caches, sampling, prompts, output files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/model.hpp"
#include "train/shard.hpp"

namespace shardlm {

struct InferenceModel {
  std::unique_ptr<ShardedModel> weights;  // world 1: unit u whole in weights->param[u]
  std::string source;                     // "HF directory DIR" | "checkpoint FILE (step N)"
  std::filesystem::path tokenizer_dir;    // where tokenizer.json may be ("" = none known)
  std::vector<int32_t> eos_ids;           // config.json's and generation_config.json's eos_token_id(s)

  // DIR/config.json + DIR/*.safetensors. Throws Error naming what is missing or wrong.
  static InferenceModel from_hf(const std::filesystem::path& dir);
  // A step_N.h5 file or a run dir (its latest checkpoint); every checksum verified.
  // The tokenizer is the one of the deck's model.hf, when the deck had one.
  static InferenceModel from_checkpoint(const std::filesystem::path& file);

  // The deck's model with every weight 0, to be filled by load_bf16 (the
  // inference ranks of an RL job, which take the trainers' broadcasts); the
  // tokenizer and EOS of the deck's model.hf when it has one.
  static InferenceModel for_broadcast(const ModelConfig& config, const std::string& hf_dir);
  // One parameter's values as the broadcast carries them (bf16, exact in fp32).
  void load_bf16(const ParamInfo& param, const uint16_t* values);

  const ModelConfig& config() const { return weights->layout.config; }
  const float* embedding() const;                 // (V, C)
  LayerWeights<const float> layer(int l) const;   // views into layer l's unit
  const float* final_norm() const;                // (C)
  const float* lm_head() const;                   // (V, C): the embedding when tied
  int64_t bytes() const;                          // the weights' host memory
};

// eos_token_id of DIR/generation_config.json (an int or a list; absent -> none).
// Throws Error naming the file when it is there and not JSON.
std::vector<int32_t> generation_config_eos(const std::filesystem::path& dir);

}  // namespace shardlm
