// model_config.hpp — the architecture of a decoder-only model (Llama/Qwen family).
//
// Owns: ModelConfig, the sizes and options every other part reads; the table
// of all its members (model_fields: each one's deck key, checkpoint attribute,
// config.json key and form, bound or choices, whether it shapes the weights),
// which the deck's [model] keys, config.json read and write, the checkpoint's
// attributes, the load-mismatch report and `inspect` all walk
// (model_size_fields is its run of sizes); and the one check of the sizes'
// rules (check_model_sizes), all defined in src/model/model_config.cpp.
// Filled from the deck ([model] section) or from a Hugging Face config.json
// (model/hf_config.hpp). Knows nothing about shards, devices or MPI.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

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
  std::string arch = "llama";            // "llama" | "qwen2" | "qwen3" | "qwen2_moe" | "qwen3_moe"
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
  // Mixture of experts (arch qwen3_moe, qwen2_moe; a dense model has 0 experts).
  // A sparse layer's MLP is a router (E, C) and E SwiGLU experts of
  // moe_intermediate_size, each token going to its num_experts_per_tok most
  // probable; qwen2_moe adds a shared expert every token goes through, scaled
  // by sigmoid(shared_expert_gate(x)). Layers l with (l + 1) % decoder_sparse_step
  // != 0 keep the dense MLP of intermediate_size.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe; 0: no shared expert
  int64_t decoder_sparse_step = 1;
  bool norm_topk_prob = false;           // the chosen experts' weights renormalised to sum 1
  // The load-balancing loss (transformers' output_router_logits) joins the
  // training loss, times router_aux_loss_coef.
  bool router_aux_loss = false;
  double router_aux_loss_coef = 0.001;
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;

  bool moe() const { return num_experts > 0; }
  // Whether layer `l`'s MLP is the experts.
  bool moe_layer(int64_t l) const { return num_experts > 0 && (l + 1) % decoder_sparse_step == 0; }
  // Router replay's table (a token's experts at every layer of experts, layer
  // after layer): its width, and where layer l's K experts start in a row.
  int64_t route_width() const { return moe() ? (num_layers / decoder_sparse_step) * num_experts_per_tok : 0; }
  int64_t route_offset(int64_t l) const { return ((l + 1) / decoder_sparse_step - 1) * num_experts_per_tok; }
};

// The largest sizes shardlm accepts, from a deck or a config.json. Each is far
// past any released model's (the largest have a vocabulary of 262144, hidden
// 16384, intermediate 53248, 126 layers, 128 heads of 256), and together they
// keep every size product of the layout and the memory plan inside int64, so
// a typo such as 2^62 is refused by name before anything is built.
constexpr int64_t kMaxVocabSize = int64_t(1) << 24;         // 16777216
constexpr int64_t kMaxHiddenSize = int64_t(1) << 20;        // 1048576
constexpr int64_t kMaxIntermediateSize = int64_t(1) << 22;  // 4194304
constexpr int64_t kMaxLayers = int64_t(1) << 14;            // 16384
constexpr int64_t kMaxHeads = int64_t(1) << 14;             // num_heads, num_kv_heads
constexpr int64_t kMaxHeadDim = int64_t(1) << 14;
constexpr int64_t kMaxExperts = int64_t(1) << 14;           // num_experts, num_experts_per_tok
constexpr int64_t kMaxPositions = 2147483647;               // positions are int32
constexpr int64_t kMaxParameters = int64_t(1) << 45;        // 35e12, with tied weights once
constexpr int64_t kMaxSeqLen = int64_t(1) << 24;            // data.seq_len
constexpr int64_t kMaxTokensPerMicroBatch = 2147483647;     // micro_batch x seq_len: int32 positions, BLAS ints
// Floats of one rank's activations (tokens x layers x layer widths): 2^56, so
// the plan's byte counts (x 4 B, x a few buffers) stay below 2^62.
constexpr int64_t kMaxActivationFloats = int64_t(1) << 56;

// How config.json gives a member (model/hf_config.cpp reads and writes each form).
enum class HfForm {
  ModelType,      // arch: "model_type" (or the model class in "architectures")
  Integer,        // an integer 1 .. max; a `derived` size may be left out
  Number,         // a number > 0, required
  RopeTheta,      // the RoPE base: at the top level, or in "rope_scaling" / "rope_parameters"
  RopeScaling,    // a key of the "rope_scaling" object (4.x; "rope_parameters" in 5.x); null: no scaling
  Flag,           // true or false; absent: false
  AttentionBias,  // implied by qwen2; llama's and qwen3's would add an o_proj bias too, so only false is taken
  QkNorm,         // no key: qwen3 has q/k norms, llama and qwen2 do not
  Moe,            // the experts' members: read for qwen2_moe and qwen3_moe only (see moe_config_error)
  TokenId,        // an id or a list of ids (the first taken); absent or null: -1
};

// One member of ModelConfig with every name and rule it has. The deck's [model]
// keys (and the deck `shardlm check` prints), config.json's read and write, a
// checkpoint's /model attributes, the load-mismatch report and `inspect` all walk
// model_fields(), so a member is named and bounded once. Its default is the
// struct's initialiser above.
struct ModelField {
  template <class T>
  using Member = T& (*)(ModelConfig&);
  using Ref = std::variant<Member<std::string>, Member<int64_t>, Member<double>, Member<bool>>;

  const char* name;               // deck key model.<name>, and its name in messages; nullptr: not a deck key
  const char* attribute;          // its attribute in a checkpoint's /model group
  const char* hf_key;             // config.json's key (RopeScaling: within that object); nullptr: none
  HfForm hf;
  Ref ref;                        // the member
  double max = 0;                 // numbers: accepted > 0 and <= max (config.json's floats: > 0)
  std::span<const char* const> choices = {};  // strings: the accepted values
  // The weights' shape and tensors depend on it: a checkpoint loads only into a
  // model with the same value (the load-mismatch report), `inspect` shows it.
  bool shapes_weights = false;
  // May be left out of a deck or config.json: num_kv_heads (= num_heads, no
  // grouped-query attention) and head_dim (= hidden_size / num_heads).
  bool derived = false;
  // 0 is accepted too (a number >= 0 and <= max): the experts' sizes of a dense model.
  bool zero_ok = false;
  const char* note = nullptr;     // a flag's words in inspect's summary when it is on
};

// Every member of ModelConfig, in the order they are written everywhere (the
// deck, config.json, checkpoint attributes, reports).
std::span<const ModelField> model_fields();
// The row of deck key `name`; nullptr if none.
const ModelField* model_field(std::string_view name);

// `f`'s member of `c` as its type (member_of<int64_t>(f, c)); another type throws
// std::bad_variant_access.
template <class T>
T& member_of(const ModelField& f, ModelConfig& c) {
  return std::get<ModelField::Member<T>>(f.ref)(c);
}
template <class T>
const T& member_of(const ModelField& f, const ModelConfig& c) {
  return std::get<ModelField::Member<T>>(f.ref)(const_cast<ModelConfig&>(c));  // read only
}
template <class T>
bool field_is(const ModelField& f) {
  return std::holds_alternative<ModelField::Member<T>>(f.ref);
}
// fn(member) with `f`'s member of `c`, whatever its type (one of Ref's four).
template <class Fn>
decltype(auto) visit_member(const ModelField& f, ModelConfig& c, Fn&& fn) {
  return std::visit([&](auto member) -> decltype(auto) { return fn(member(c)); }, f.ref);
}
template <class Fn>
decltype(auto) visit_member(const ModelField& f, const ModelConfig& c, Fn&& fn) {
  return std::visit([&](auto member) -> decltype(auto) { return fn(std::as_const(member(const_cast<ModelConfig&>(c)))); },
                    f.ref);
}

// The sizes that shape the weights (integers with shapes_weights): vocab_size,
// hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
// head_dim, a run of model_fields(). max_position_embeddings is not among them:
// it bounds the positions, not the weights (no parameter count, no load
// comparison), and each schema gives it its own default.
using ModelSizeField = ModelField;
std::span<const ModelSizeField> model_size_fields();

// What check_model_sizes found first; each caller words it in its own schema's
// names (the deck's, config.json's, the layout's).
struct ModelSizeProblem {
  enum class Rule {
    None,
    HeadsNotMultipleOfKvHeads,  // num_heads % num_kv_heads != 0 (both > 0)
    OutOfRange,                 // `field`'s `value` is outside 1 .. field->max
    TooManyParameters,          // `parameters` (nullopt: past int64) > kMaxParameters
  } rule = Rule::None;
  const ModelSizeField* field = nullptr;
  int64_t value = 0;
  std::optional<int64_t> parameters;
};

// The sizes' rules, in this order: num_heads a multiple of num_kv_heads (when
// both are positive), every size in its range (table order), the parameter
// count (with tied weights once) at most kMaxParameters, counted with checked
// arithmetic.
ModelSizeProblem check_model_sizes(const ModelConfig& c);

// check_model_sizes's first problem as a sentence in the table's names
// ("num_layers = ... is out of range: shardlm accepts 1 to ..."); "" when the
// sizes keep every rule.
std::string model_size_error(const ModelConfig& c);
// model_size_error, then the activations of `tokens_per_micro_batch` tokens
// (and a logits chunk of `chunk_tokens` x vocab_size) against
// kMaxActivationFloats; "" when they fit.
std::string model_scale_error(const ModelConfig& c, int64_t tokens_per_micro_batch, int64_t chunk_tokens);

// The experts' rules: a qwen2_moe / qwen3_moe model has num_experts >= 2,
// 1 <= num_experts_per_tok <= num_experts, moe_intermediate_size and
// decoder_sparse_step >= 1; qwen2_moe may have a shared expert, qwen3_moe has
// none; other architectures have no experts (every expert member at its
// default). "" when they hold; else a sentence naming the member by its deck key.
std::string moe_config_error(const ModelConfig& c);

// What the architecture's transformers class computes: q/k/v biases in
// qwen2 and qwen2_moe (always), in no other (transformers' attention_bias
// would add an o_proj bias too); q/k norms in qwen3 and qwen3_moe only. ""
// when the config says so; else a sentence naming the deck key. Checked
// before an export (run.export_dir) and by write_hf_config.
std::string hf_attention_error(const ModelConfig& c);

// model.fp8: cuBLASLt's FP8 GEMMs take sizes in multiples of 16, so the linears'
// widths (hidden_size, intermediate_size, num_heads x head_dim, num_kv_heads x
// head_dim) and the tokens of a row on one rank (data.seq_len /
// model.context_parallel; a micro-batch is whole rows of them) must be; "" when
// they are. The CPU emulation takes any size, but a deck must run on both backends.
std::string fp8_shape_error(const ModelConfig& c, int64_t row_tokens);

}  // namespace shardlm
