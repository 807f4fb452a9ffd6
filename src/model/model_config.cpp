// model_config.cpp — the table of the model's sizes and the one check of
// their rules (see shardlm/model_config.hpp).
#include "shardlm/model_config.hpp"

#include <algorithm>

#include "shardlm/checked_math.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

constexpr ModelSizeField kSizeFields[] = {
    {"vocab_size", "vocab_size", &ModelConfig::vocab_size, kMaxVocabSize},
    {"hidden_size", "hidden_size", &ModelConfig::hidden_size, kMaxHiddenSize},
    {"intermediate_size", "intermediate_size", &ModelConfig::intermediate_size, kMaxIntermediateSize},
    {"num_layers", "num_hidden_layers", &ModelConfig::num_layers, kMaxLayers},
    {"num_heads", "num_attention_heads", &ModelConfig::num_heads, kMaxHeads},
    {"num_kv_heads", "num_key_value_heads", &ModelConfig::num_kv_heads, kMaxHeads, /*derived=*/true},
    {"head_dim", "head_dim", &ModelConfig::head_dim, kMaxHeadDim, /*derived=*/true},
};

// Parameters of one decoder layer and of the whole model, as ModelLayout lays
// them out; nullopt when the count leaves int64.
std::optional<int64_t> layer_parameters(const ModelConfig& c) {
  const auto qdim = checked_product({c.num_heads, c.head_dim}), kvdim = checked_product({c.num_kv_heads, c.head_dim});
  if (!qdim || !kvdim) return std::nullopt;
  const auto qkv = checked_sum({*qdim, *kvdim, *kvdim});
  if (!qkv) return std::nullopt;
  const auto attention = checked_product({*qkv + *qdim, c.hidden_size});  // q, k, v and o
  const auto mlp = checked_product({3, c.intermediate_size, c.hidden_size});
  if (!attention || !mlp) return std::nullopt;
  return checked_sum({*attention, *mlp, 2 * c.hidden_size, c.attention_bias ? *qkv : 0, c.qk_norm ? 2 * c.head_dim : 0});
}

std::optional<int64_t> model_parameters(const ModelConfig& c) {
  const auto layer = layer_parameters(c);
  const auto layers = layer ? checked_product({c.num_layers, *layer}) : std::nullopt;
  const auto table = checked_product({c.vocab_size, c.hidden_size});
  if (!layers || !table) return std::nullopt;
  return checked_sum({*table, *layers, c.hidden_size, c.tie_word_embeddings ? 0 : *table});
}


}  // namespace

std::span<const ModelSizeField> model_size_fields() { return kSizeFields; }

ModelSizeProblem check_model_sizes(const ModelConfig& c) {
  using Rule = ModelSizeProblem::Rule;
  ModelSizeProblem p;
  if (c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads != 0) {
    p.rule = Rule::HeadsNotMultipleOfKvHeads;
    return p;
  }
  for (const ModelSizeField& f : kSizeFields)
    if (c.*f.member < 1 || c.*f.member > f.max) {
      p.rule = Rule::OutOfRange, p.field = &f, p.value = c.*f.member;
      return p;
    }
  p.parameters = model_parameters(c);
  if (!p.parameters || *p.parameters > kMaxParameters) p.rule = Rule::TooManyParameters;
  return p;
}

std::string model_size_error(const ModelConfig& c) {
  const ModelSizeProblem p = check_model_sizes(c);
  switch (p.rule) {
    case ModelSizeProblem::Rule::None:
      return "";
    case ModelSizeProblem::Rule::HeadsNotMultipleOfKvHeads:
      return fmt("num_heads = %lld is not a multiple of num_kv_heads = %lld", (long long)c.num_heads,
                 (long long)c.num_kv_heads);
    case ModelSizeProblem::Rule::OutOfRange:
      return fmt("%s = %lld is out of range: shardlm accepts 1 to %lld", p.field->name, (long long)p.value,
                 (long long)p.field->max);
    case ModelSizeProblem::Rule::TooManyParameters:
      return fmt("the model would have %s parameters (vocab_size %lld, hidden_size %lld, intermediate_size %lld, "
                 "num_layers %lld, num_heads %lld x head_dim %lld): more than the %lld shardlm accepts",
                 p.parameters ? std::to_string(*p.parameters).c_str() : "more than 2^63", (long long)c.vocab_size,
                 (long long)c.hidden_size, (long long)c.intermediate_size, (long long)c.num_layers,
                 (long long)c.num_heads, (long long)c.head_dim, (long long)kMaxParameters);
  }
  return "";
}

std::string model_scale_error(const ModelConfig& c, int64_t tokens, int64_t chunk_tokens) {
  if (std::string e = model_size_error(c); !e.empty()) return e;
  if (tokens < 1 || tokens > kMaxTokensPerMicroBatch)
    return fmt("%lld tokens per micro-batch (data.micro_batch x data.seq_len) is out of range: shardlm accepts 1 to "
               "%lld", (long long)tokens, (long long)kMaxTokensPerMicroBatch);
  // A bound on every layer buffer's width in floats per token (the CPU and GPU
  // layers keep at most 3 of each kind): widths x tokens x (layers + 2).
  const auto qdim = checked_product({c.num_heads, c.head_dim}), kvdim = checked_product({c.num_kv_heads, c.head_dim});
  const auto width = qdim && kvdim ? checked_sum({4 * c.hidden_size, 4 * c.intermediate_size, 4 * *qdim, 4 * *kvdim,
                                                  2 * c.num_heads, 2 * c.num_kv_heads, 4})
                                   : std::nullopt;
  const auto floats = width ? checked_product({tokens, c.num_layers + 2, *width}) : std::nullopt;
  const auto logits = checked_product({std::min(std::max<int64_t>(chunk_tokens, 1), tokens), c.vocab_size});
  if (!floats || *floats > kMaxActivationFloats || !logits || *logits > kMaxActivationFloats)
    return fmt("%lld tokens per micro-batch through %lld layers of hidden_size %lld (intermediate_size %lld) would "
               "hold more than 2^56 activation floats per rank: lower data.micro_batch or data.seq_len",
               (long long)tokens, (long long)c.num_layers, (long long)c.hidden_size, (long long)c.intermediate_size);
  return "";
}

std::string fp8_shape_error(const ModelConfig& c, int64_t row_tokens) {
  const struct {
    const char* name;
    int64_t value;
  } sizes[] = {{"hidden_size", c.hidden_size},
               {"intermediate_size", c.intermediate_size},
               {"num_heads x head_dim", c.num_heads * c.head_dim},
               {"num_kv_heads x head_dim", c.num_kv_heads * c.head_dim},
               {"data.seq_len / model.context_parallel (the tokens of a row on one rank)", row_tokens}};
  for (const auto& s : sizes)
    if (s.value % 16 != 0)
      return fmt("model.fp8 needs %s = %lld to be a multiple of 16 (cuBLASLt's FP8 GEMMs take sizes in multiples of "
                 "16); change it or set model.fp8 = \"none\"", s.name, (long long)s.value);
  return "";
}

}  // namespace shardlm
