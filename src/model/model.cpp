// model.cpp — unit layout, parameter tables and the seeded initialisation.
#include "shardlm/model.hpp"

#include <cmath>
#include <optional>

#include "shardlm/checked_math.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void add_param(Unit& u, std::string name, std::vector<int64_t> shape, ParamKind kind) {
  ParamInfo p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = numel_of(p.shape);
  p.offset = u.numel;
  p.kind = kind;
  u.numel += p.numel;
  u.params.push_back(std::move(p));
}

void finish_unit(Unit& u, int world) {
  const int64_t quantum = kShardAlign * world;
  u.padded_numel = (u.numel + quantum - 1) / quantum * quantum;
  u.shard_numel = u.padded_numel / world;
}

// splitmix64: a counter-based generator; mixing (key, index) gives independent
// streams per parameter with no state to carry between ranks.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t name_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the name, then mixed with the seed
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ULL;
  return mix(h ^ mix(seed));
}

}  // namespace

const ParamInfo* Unit::find_param(const std::string& suffix) const {
  for (const auto& p : params)
    if (p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return &p;
  return nullptr;
}

const ParamInfo& Unit::param(const std::string& suffix) const {
  const ParamInfo* p = find_param(suffix);
  SHARDLM_CHECK(p, "unit '%s' has no parameter ending in '%s'", name.c_str(), suffix.c_str());
  return *p;
}

std::string expert_parallel_error(const ModelConfig& c, int world, int64_t P) {
  if (P <= 1) return "";
  if (!c.moe())
    return "model.expert_parallel = " + std::to_string(P) + " splits the experts of a model of experts, but arch " +
           c.arch + " has none (num_experts = 0): set model.expert_parallel = 1";
  if (c.num_experts % P != 0)
    return "model.expert_parallel = " + std::to_string(P) + " does not divide num_experts = " +
           std::to_string(c.num_experts) + ": each rank holds num_experts / model.expert_parallel whole experts";
  if (world != P)
    return "model.expert_parallel = " + std::to_string(P) + " with " + std::to_string(world) +
           " training ranks: it must equal the number of training ranks (each rank holds num_experts / " +
           std::to_string(P) + " experts; experts are not replicated over groups of ranks): run " +
           std::to_string(P) + " ranks or set model.expert_parallel = " + std::to_string(world);
  const int64_t share = c.num_experts / P * 3 * c.moe_intermediate_size * c.hidden_size;
  if (share % kShardAlign != 0)
    return "model.expert_parallel = " + std::to_string(P) + ": a rank's share of a layer's experts (" +
           std::to_string(c.num_experts / P) + " x 3 x " + std::to_string(c.moe_intermediate_size) + " x " +
           std::to_string(c.hidden_size) + " = " + std::to_string(share) + " floats) must be a multiple of " +
           std::to_string(kShardAlign) + " floats, a shard's alignment; set model.expert_parallel = 1";
  return "";
}

int64_t expert_stride(const Unit& u) {
  const ParamInfo& first = u.param("experts.0.gate_proj.weight");
  const ParamInfo* second = u.find_param("experts.1.gate_proj.weight");
  return second ? second->offset - first.offset : first.numel;
}

ModelLayout::ModelLayout(const ModelConfig& c, int world_size, int64_t ep)
    : config(c), world(world_size), expert_parallel(ep) {
  SHARDLM_CHECK(world >= 1 && world <= kMaxWorld, "world size %d is out of range: shardlm runs 1 to %d ranks", world,
                kMaxWorld);
  // Before a name is built per parameter: 10^9 layers must be an error, not an OOM.
  if (std::string e = model_size_error(c); !e.empty()) SHARDLM_FAIL("model: %s", e.c_str());
  if (std::string e = moe_config_error(c); !e.empty()) SHARDLM_FAIL("model: %s", e.c_str());
  if (std::string e = expert_parallel_error(c, world, ep); !e.empty()) SHARDLM_FAIL("%s", e.c_str());
  experts_unit.assign(size_t(c.num_layers), -1);
  std::vector<Unit> experts_units;
  const int64_t C = c.hidden_size, I = c.intermediate_size, D = c.head_dim;
  const int64_t qdim = c.num_heads * D, kvdim = c.num_kv_heads * D;

  Unit embed;
  embed.name = "embed";
  embed.kind = UnitKind::Embed;
  add_param(embed, "model.embed_tokens.weight", {c.vocab_size, C}, ParamKind::Embedding);
  finish_unit(embed, world);
  units.push_back(std::move(embed));

  for (int64_t l = 0; l < c.num_layers; ++l) {
    Unit u;
    u.name = "layers." + std::to_string(l);
    u.kind = UnitKind::Layer;
    u.layer = static_cast<int>(l);
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add_param(u, p + "input_layernorm.weight", {C}, ParamKind::Norm);
    // q, k, v adjacent: together they are one ((H + 2 KV) D, C) matrix, so a
    // backend may run them as a single GEMM.
    add_param(u, p + "self_attn.q_proj.weight", {qdim, C}, ParamKind::Matrix);
    add_param(u, p + "self_attn.k_proj.weight", {kvdim, C}, ParamKind::Matrix);
    add_param(u, p + "self_attn.v_proj.weight", {kvdim, C}, ParamKind::Matrix);
    if (c.attention_bias) {
      add_param(u, p + "self_attn.q_proj.bias", {qdim}, ParamKind::Bias);
      add_param(u, p + "self_attn.k_proj.bias", {kvdim}, ParamKind::Bias);
      add_param(u, p + "self_attn.v_proj.bias", {kvdim}, ParamKind::Bias);
    }
    add_param(u, p + "self_attn.o_proj.weight", {C, qdim}, ParamKind::Matrix);
    if (c.qk_norm) {
      add_param(u, p + "self_attn.q_norm.weight", {D}, ParamKind::Norm);
      add_param(u, p + "self_attn.k_norm.weight", {D}, ParamKind::Norm);
    }
    add_param(u, p + "post_attention_layernorm.weight", {C}, ParamKind::Norm);
    if (c.moe_layer(l)) {
      // The router, then each kind of the experts' weights expert after expert
      // (every gate_proj, every up_proj, every down_proj: (E, I, C), (E, I, C),
      // (E, C, I) stacks), then Qwen2-MoE's shared expert and its gate.
      // Under expert parallelism the experts go to a unit of their own, expert
      // after expert, whose shards are each rank's whole experts (UnitKind::Experts).
      const int64_t E = c.num_experts, Im = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
      add_param(u, p + "mlp.gate.weight", {E, C}, ParamKind::Matrix);
      auto add_expert = [&](Unit& to, int64_t e, const char* proj) {
        add_param(to, p + "mlp.experts." + std::to_string(e) + "." + proj + ".weight",
                  std::string_view(proj) == "down_proj" ? std::vector<int64_t>{C, Im} : std::vector<int64_t>{Im, C},
                  ParamKind::Matrix);
      };
      if (ep > 1) {
        Unit x;
        x.name = "layers." + std::to_string(l) + ".experts";
        x.kind = UnitKind::Experts;
        x.layer = static_cast<int>(l);
        for (int64_t e = 0; e < E; ++e)
          for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) add_expert(x, e, proj);
        // No padding: expert_parallel_error saw that a share is whole aligned floats.
        x.padded_numel = x.numel;
        x.shard_numel = x.numel / world;
        experts_units.push_back(std::move(x));
      } else {
        for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
          for (int64_t e = 0; e < E; ++e) add_expert(u, e, proj);
      }
      if (Is > 0) {
        add_param(u, p + "mlp.shared_expert.gate_proj.weight", {Is, C}, ParamKind::Matrix);
        add_param(u, p + "mlp.shared_expert.up_proj.weight", {Is, C}, ParamKind::Matrix);
        add_param(u, p + "mlp.shared_expert.down_proj.weight", {C, Is}, ParamKind::Matrix);
        add_param(u, p + "mlp.shared_expert_gate.weight", {1, C}, ParamKind::Matrix);
      }
    } else {
      // gate and up adjacent: one (2 I, C) matrix.
      add_param(u, p + "mlp.gate_proj.weight", {I, C}, ParamKind::Matrix);
      add_param(u, p + "mlp.up_proj.weight", {I, C}, ParamKind::Matrix);
      add_param(u, p + "mlp.down_proj.weight", {C, I}, ParamKind::Matrix);
    }
    finish_unit(u, world);
    units.push_back(std::move(u));
  }

  Unit head;
  head.name = "head";
  head.kind = UnitKind::Head;
  add_param(head, "model.norm.weight", {C}, ParamKind::Norm);
  if (!c.tie_word_embeddings) add_param(head, "lm_head.weight", {c.vocab_size, C}, ParamKind::Matrix);
  finish_unit(head, world);
  units.push_back(std::move(head));
  for (Unit& x : experts_units) {
    experts_unit[size_t(x.layer)] = static_cast<int>(units.size());
    units.push_back(std::move(x));
  }
}

int64_t ModelLayout::parameter_count() const {
  int64_t n = 0;
  for (const auto& u : units) n += u.numel;
  return n;
}

int64_t ModelLayout::matmul_parameter_count() const {
  int64_t n = 0, experts = 0;
  for (const auto& u : units)
    for (const auto& p : u.params)
      if (p.kind == ParamKind::Matrix) (p.name.find(".mlp.experts.") != std::string::npos ? experts : n) += p.numel;
  // A token goes through num_experts_per_tok of the num_experts experts.
  if (experts > 0) n += experts / config.num_experts * config.num_experts_per_tok;
  if (config.tie_word_embeddings) n += embed().numel;  // the lm-head matmul uses the embedding
  return n;
}

std::vector<NormSlot> norm_slots(const Unit& u) {
  std::vector<NormSlot> slots;
  int64_t at = 0;
  for (const ParamInfo& p : u.params) {
    if (p.kind != ParamKind::Norm) continue;
    slots.push_back({&p, at});
    at += (p.numel + kShardAlign - 1) / kShardAlign * kShardAlign;
  }
  return slots;
}

int64_t norm_slot_floats(const Unit& u) {
  const std::vector<NormSlot> slots = norm_slots(u);
  if (slots.empty()) return 0;
  const NormSlot& last = slots.back();
  return last.packed + (last.param->numel + kShardAlign - 1) / kShardAlign * kShardAlign;
}

std::vector<ModelLayout::Located> ModelLayout::all_params() const {
  std::vector<Located> out;
  for (const auto& u : units)
    for (const auto& p : u.params) out.push_back({&u, &p});
  return out;
}

const ModelLayout::Located ModelLayout::find(const std::string& name) const {
  for (const auto& u : units)
    for (const auto& p : u.params)
      if (p.name == name) return {&u, &p};
  return {nullptr, nullptr};
}

namespace {

// One element of a parameter's seeded init, its name already hashed into key.
inline float init_keyed(uint64_t key, ParamKind kind, int64_t index, double std) {
  if (kind == ParamKind::Norm) return 1.0f;
  if (kind == ParamKind::Bias) return 0.0f;
  // Box-Muller on two uniforms drawn from (key, 2i) and (key, 2i + 1).
  const uint64_t a = mix(key ^ mix(2 * static_cast<uint64_t>(index)));
  const uint64_t b = mix(key ^ mix(2 * static_cast<uint64_t>(index) + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
  const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  return static_cast<float>(z * std);
}

}  // namespace

float init_value(uint64_t seed, const ParamInfo& p, int64_t index, double std) {
  return init_keyed(name_key(seed, p.name), p.kind, index, std);
}

// The name is hashed once per range: per element it was half of a large model's init time.
void init_range(uint64_t seed, const ParamInfo& p, int64_t begin, int64_t count, double std, float* out) {
  const uint64_t key = name_key(seed, p.name);
  const ParamKind kind = p.kind;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] = init_keyed(key, kind, begin + i, std);
}

}  // namespace shardlm
