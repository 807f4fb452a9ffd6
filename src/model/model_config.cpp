// model_config.cpp — the rows of ModelConfig's table (every member: deck key,
// checkpoint attribute, config.json form, bounds) and the one check of the
// sizes' rules (see shardlm/model_config.hpp).
#include "shardlm/model_config.hpp"

#include <algorithm>
#include <iterator>

#include "shardlm/checked_math.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

// A row's accessor: the member at `path` of a ModelConfig (rope_scaling.factor too).
#define MEMBER(path) +[](ModelConfig& c) -> auto& { return c.path; }
constexpr const char* kArchs[] = {"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"};
constexpr const char* kRopeTypes[] = {"none", "llama3"};

constexpr ModelField kFields[] = {
    {.name = "arch", .attribute = "arch", .hf_key = "model_type", .hf = HfForm::ModelType, .ref = MEMBER(arch),
     .choices = kArchs, .shapes_weights = true},
    // The sizes: model_size_fields().
    {.name = "vocab_size", .attribute = "vocab_size", .hf_key = "vocab_size", .hf = HfForm::Integer,
     .ref = MEMBER(vocab_size), .max = kMaxVocabSize, .shapes_weights = true},
    {.name = "hidden_size", .attribute = "hidden_size", .hf_key = "hidden_size", .hf = HfForm::Integer,
     .ref = MEMBER(hidden_size), .max = kMaxHiddenSize, .shapes_weights = true},
    {.name = "intermediate_size", .attribute = "intermediate_size", .hf_key = "intermediate_size",
     .hf = HfForm::Integer, .ref = MEMBER(intermediate_size), .max = kMaxIntermediateSize, .shapes_weights = true},
    {.name = "num_layers", .attribute = "num_layers", .hf_key = "num_hidden_layers", .hf = HfForm::Integer,
     .ref = MEMBER(num_layers), .max = kMaxLayers, .shapes_weights = true},
    {.name = "num_heads", .attribute = "num_heads", .hf_key = "num_attention_heads", .hf = HfForm::Integer,
     .ref = MEMBER(num_heads), .max = kMaxHeads, .shapes_weights = true},
    {.name = "num_kv_heads", .attribute = "num_kv_heads", .hf_key = "num_key_value_heads", .hf = HfForm::Integer,
     .ref = MEMBER(num_kv_heads), .max = kMaxHeads, .shapes_weights = true, .derived = true},
    {.name = "head_dim", .attribute = "head_dim", .hf_key = "head_dim", .hf = HfForm::Integer,
     .ref = MEMBER(head_dim), .max = kMaxHeadDim, .shapes_weights = true, .derived = true},
    // Positions and numerics: no tensor depends on them.
    {.name = "max_position_embeddings", .attribute = "max_position_embeddings", .hf_key = "max_position_embeddings",
     .hf = HfForm::Integer, .ref = MEMBER(max_position_embeddings), .max = kMaxPositions},
    {.name = "rms_norm_eps", .attribute = "rms_norm_eps", .hf_key = "rms_norm_eps", .hf = HfForm::Number,
     .ref = MEMBER(rms_norm_eps), .max = 1},
    {.name = "rope_theta", .attribute = "rope_theta", .hf_key = "rope_theta", .hf = HfForm::RopeTheta,
     .ref = MEMBER(rope_theta), .max = 1e15},
    {.name = "rope_scaling", .attribute = "rope_scaling_type", .hf_key = "rope_type", .hf = HfForm::RopeScaling,
     .ref = MEMBER(rope_scaling.type), .choices = kRopeTypes},
    {.name = "rope_factor", .attribute = "rope_scaling_factor", .hf_key = "factor", .hf = HfForm::RopeScaling,
     .ref = MEMBER(rope_scaling.factor), .max = 1e6},
    {.name = "rope_low_freq_factor", .attribute = "rope_scaling_low_freq_factor", .hf_key = "low_freq_factor",
     .hf = HfForm::RopeScaling, .ref = MEMBER(rope_scaling.low_freq_factor), .max = 1e6},
    {.name = "rope_high_freq_factor", .attribute = "rope_scaling_high_freq_factor", .hf_key = "high_freq_factor",
     .hf = HfForm::RopeScaling, .ref = MEMBER(rope_scaling.high_freq_factor), .max = 1e6},
    {.name = "rope_original_max_position_embeddings", .attribute = "rope_scaling_original_max_position_embeddings",
     .hf_key = "original_max_position_embeddings", .hf = HfForm::RopeScaling,
     .ref = MEMBER(rope_scaling.original_max_position_embeddings), .max = kMaxPositions},
    // The options that add or remove tensors.
    {.name = "attention_bias", .attribute = "attention_bias", .hf_key = "attention_bias", .hf = HfForm::AttentionBias,
     .ref = MEMBER(attention_bias), .shapes_weights = true, .note = "qkv bias"},
    {.name = "qk_norm", .attribute = "qk_norm", .hf_key = nullptr, .hf = HfForm::QkNorm, .ref = MEMBER(qk_norm),
     .shapes_weights = true, .note = "qk norm"},
    {.name = "tie_word_embeddings", .attribute = "tie_word_embeddings", .hf_key = "tie_word_embeddings",
     .hf = HfForm::Flag, .ref = MEMBER(tie_word_embeddings), .shapes_weights = true, .note = "tied embeddings"},
    // The experts (qwen2_moe, qwen3_moe; 0 in a dense model): moe_config_error's rules.
    {.name = "num_experts", .attribute = "num_experts", .hf_key = "num_experts", .hf = HfForm::Moe,
     .ref = MEMBER(num_experts), .max = kMaxExperts, .shapes_weights = true, .zero_ok = true},
    {.name = "num_experts_per_tok", .attribute = "num_experts_per_tok", .hf_key = "num_experts_per_tok",
     .hf = HfForm::Moe, .ref = MEMBER(num_experts_per_tok), .max = kMaxExperts, .zero_ok = true},
    {.name = "moe_intermediate_size", .attribute = "moe_intermediate_size", .hf_key = "moe_intermediate_size",
     .hf = HfForm::Moe, .ref = MEMBER(moe_intermediate_size), .max = kMaxIntermediateSize, .shapes_weights = true,
     .zero_ok = true},
    {.name = "shared_expert_intermediate_size", .attribute = "shared_expert_intermediate_size",
     .hf_key = "shared_expert_intermediate_size", .hf = HfForm::Moe, .ref = MEMBER(shared_expert_intermediate_size),
     .max = kMaxIntermediateSize, .shapes_weights = true, .zero_ok = true},
    {.name = "decoder_sparse_step", .attribute = "decoder_sparse_step", .hf_key = "decoder_sparse_step",
     .hf = HfForm::Moe, .ref = MEMBER(decoder_sparse_step), .max = kMaxLayers, .shapes_weights = true},
    {.name = "norm_topk_prob", .attribute = "norm_topk_prob", .hf_key = "norm_topk_prob", .hf = HfForm::Moe,
     .ref = MEMBER(norm_topk_prob), .note = "top-k renormalised"},
    {.name = "router_aux_loss", .attribute = "router_aux_loss", .hf_key = "output_router_logits", .hf = HfForm::Moe,
     .ref = MEMBER(router_aux_loss), .note = "router aux loss"},
    {.name = "router_aux_loss_coef", .attribute = "router_aux_loss_coef", .hf_key = "router_aux_loss_coef",
     .hf = HfForm::Moe, .ref = MEMBER(router_aux_loss_coef), .max = 1e6, .zero_ok = true},
    // The tokenizer's ids, from config.json only (a deck's model has no tokenizer).
    {.name = nullptr, .attribute = "bos_token_id", .hf_key = "bos_token_id", .hf = HfForm::TokenId,
     .ref = MEMBER(bos_token_id)},
    {.name = nullptr, .attribute = "eos_token_id", .hf_key = "eos_token_id", .hf = HfForm::TokenId,
     .ref = MEMBER(eos_token_id)},
};
#undef MEMBER

// The sizes: the run of integers that shape every model's weights, from vocab_size.
constexpr size_t kFirstSize = 1, kSizes = 7;
static_assert([] {
  for (size_t i = 0; i < std::size(kFields); ++i) {
    const bool size = std::holds_alternative<ModelField::Member<int64_t>>(kFields[i].ref) &&
                      kFields[i].shapes_weights && kFields[i].hf == HfForm::Integer;
    if (size != (i >= kFirstSize && i < kFirstSize + kSizes)) return false;
  }
  return true;
}(), "model_size_fields() is the run of integer rows with shapes_weights");

// Parameters of one decoder layer (its MLP the experts when `sparse`) and of
// the whole model, as ModelLayout lays them out; nullopt when the count
// leaves int64.
std::optional<int64_t> layer_parameters(const ModelConfig& c, bool sparse) {
  const auto qdim = checked_product({c.num_heads, c.head_dim}), kvdim = checked_product({c.num_kv_heads, c.head_dim});
  if (!qdim || !kvdim) return std::nullopt;
  const auto qkv = checked_sum({*qdim, *kvdim, *kvdim});
  if (!qkv) return std::nullopt;
  const auto attention = checked_product({*qkv + *qdim, c.hidden_size});  // q, k, v and o
  std::optional<int64_t> mlp = checked_product({3, c.intermediate_size, c.hidden_size});
  if (sparse) {
    const auto experts = checked_product({c.num_experts, 3, c.moe_intermediate_size, c.hidden_size});
    const auto router = checked_product({c.num_experts, c.hidden_size});
    const auto shared = checked_product({3 * c.shared_expert_intermediate_size + 1, c.hidden_size});
    mlp = experts && router && shared
              ? checked_sum({*experts, *router, c.shared_expert_intermediate_size > 0 ? *shared : 0})
              : std::nullopt;
  }
  if (!attention || !mlp) return std::nullopt;
  return checked_sum({*attention, *mlp, 2 * c.hidden_size, c.attention_bias ? *qkv : 0, c.qk_norm ? 2 * c.head_dim : 0});
}

std::optional<int64_t> model_parameters(const ModelConfig& c) {
  const int64_t sparse = c.moe() && c.decoder_sparse_step > 0 ? c.num_layers / c.decoder_sparse_step : 0;
  const auto dense_layer = layer_parameters(c, false), sparse_layer = layer_parameters(c, true);
  const auto dense_layers = dense_layer ? checked_product({c.num_layers - sparse, *dense_layer}) : std::nullopt;
  const auto sparse_layers = sparse_layer ? checked_product({sparse, *sparse_layer}) : std::nullopt;
  const auto layers = dense_layers && sparse_layers ? checked_sum({*dense_layers, *sparse_layers}) : std::nullopt;
  const auto table = checked_product({c.vocab_size, c.hidden_size});
  if (!layers || !table) return std::nullopt;
  return checked_sum({*table, *layers, c.hidden_size, c.tie_word_embeddings ? 0 : *table});
}


}  // namespace

std::span<const ModelField> model_fields() { return kFields; }

const ModelField* model_field(std::string_view name) {
  for (const ModelField& f : kFields)
    if (f.name && name == f.name) return &f;
  return nullptr;
}

std::span<const ModelSizeField> model_size_fields() { return model_fields().subspan(kFirstSize, kSizes); }

ModelSizeProblem check_model_sizes(const ModelConfig& c) {
  using Rule = ModelSizeProblem::Rule;
  ModelSizeProblem p;
  if (c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads != 0) {
    p.rule = Rule::HeadsNotMultipleOfKvHeads;
    return p;
  }
  for (const ModelSizeField& f : model_size_fields())
    if (const int64_t value = member_of<int64_t>(f, c); value < 1 || value > f.max) {
      p.rule = Rule::OutOfRange, p.field = &f, p.value = value;
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

std::string hf_attention_error(const ModelConfig& c) {
  const bool qwen2 = c.arch == "qwen2" || c.arch == "qwen2_moe";
  const bool qwen3 = c.arch == "qwen3" || c.arch == "qwen3_moe";
  if (qwen2 && !c.attention_bias)
    return fmt("a %s model always has q/k/v biases; this one has model.attention_bias = false (set it true)",
               c.arch.c_str());
  if (!qwen2 && c.attention_bias)
    return fmt("%s with model.attention_bias = true would mean an o_proj bias too in transformers; only qwen2 and "
               "qwen2_moe express q/k/v-only biases", c.arch.c_str());
  if (c.qk_norm != qwen3)
    return fmt("model.qk_norm = %s cannot be expressed for arch '%s' (q/k norms exist in qwen3 and qwen3_moe only)",
               c.qk_norm ? "true" : "false", c.arch.c_str());
  return "";
}

std::string moe_config_error(const ModelConfig& c) {
  const bool moe_arch = c.arch == "qwen2_moe" || c.arch == "qwen3_moe";
  if (!moe_arch) {
    const ModelConfig dense;
    for (const ModelField& f : model_fields()) {
      if (f.hf != HfForm::Moe) continue;
      const bool same = visit_member(f, c, [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        return v == member_of<T>(f, dense);
      });
      if (!same)
        return fmt("model.%s is set but arch '%s' has no experts (mixtures of experts are qwen2_moe and qwen3_moe)",
                   f.name, c.arch.c_str());
    }
    return "";
  }
  if (c.num_experts < 2)
    return fmt("model.num_experts = %lld: arch '%s' needs at least 2 experts", (long long)c.num_experts,
               c.arch.c_str());
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts)
    return fmt("model.num_experts_per_tok = %lld must be between 1 and model.num_experts = %lld",
               (long long)c.num_experts_per_tok, (long long)c.num_experts);
  if (c.moe_intermediate_size < 1)
    return fmt("model.moe_intermediate_size = %lld: the experts need a positive width",
               (long long)c.moe_intermediate_size);
  if (c.decoder_sparse_step < 1)
    return fmt("model.decoder_sparse_step = %lld must be at least 1", (long long)c.decoder_sparse_step);
  if (c.arch == "qwen3_moe" && c.shared_expert_intermediate_size != 0)
    return fmt("model.shared_expert_intermediate_size = %lld: qwen3_moe has no shared expert (qwen2_moe has)",
               (long long)c.shared_expert_intermediate_size);
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
