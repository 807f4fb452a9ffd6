// model.hpp — the model as units of named parameters, laid out in flat buffers.
//
// Owns: ModelLayout (units embed, layers.0 .. layers.L-1, head; each a table of
// (HF name, shape, offset) into one flat buffer padded to split evenly over the
// ranks; with expert parallelism, each layer of experts' experts in a unit of
// their own after the head), the per-layer weight views, and the seeded
// initial value of every element. Knows nothing about MPI, devices, optimizers or files: sharding uses
// the layout's sizes, HF loading and checkpoints use its names and offsets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/model_config.hpp"

namespace shardlm {

enum class ParamKind { Embedding, Matrix, Norm, Bias };

struct ParamInfo {
  std::string name;              // Hugging Face name, e.g. model.layers.3.self_attn.q_proj.weight
  std::vector<int64_t> shape;
  int64_t offset = 0;            // elements from the start of the unit's flat buffer
  int64_t numel = 0;
  ParamKind kind = ParamKind::Matrix;
  bool weight_decay() const { return kind == ParamKind::Matrix || kind == ParamKind::Embedding; }
};

// Experts: a layer of experts' routed experts under expert parallelism
// (ModelLayout::expert_parallel > 1), expert after expert (each one's
// gate_proj, up_proj, down_proj), so rank r's shard is exactly experts
// [r E / P, (r + 1) E / P): a unit that is never gathered.
enum class UnitKind { Embed, Layer, Head, Experts };

struct Unit {
  std::string name;              // "embed", "layers.3", "head", "layers.3.experts"
  UnitKind kind = UnitKind::Layer;
  int layer = -1;                // for layers and experts
  std::vector<ParamInfo> params;
  int64_t numel = 0;             // sum of the parameters
  int64_t padded_numel = 0;      // numel rounded up to world * kShardAlign
  int64_t shard_numel = 0;       // padded_numel / world: what each rank owns
  // Rank r owns elements [r * shard_numel, (r + 1) * shard_numel) of the flat buffer.
  const ParamInfo& param(const std::string& suffix) const;  // by name suffix ("q_proj.weight")
  const ParamInfo* find_param(const std::string& suffix) const;
};

// Shards start on this many elements (256 B of fp32, 128 B of bf16).
constexpr int64_t kShardAlign = 64;
// The most ranks a model is sharded over (`check --world` accepts as many).
constexpr int kMaxWorld = 1000000;

struct ModelLayout {
  ModelConfig config;
  int world = 1;
  // model.expert_parallel: 1, or the world (each rank holds num_experts / world
  // whole experts of every layer of experts).
  int64_t expert_parallel = 1;
  std::vector<Unit> units;       // embed, layers.0 .. layers.{L-1}, head, then the experts' units
  std::vector<int> experts_unit; // [layer] the unit of its experts under expert parallelism; -1: none

  // Throws Error naming the size when model_size_error(config) is not empty, or
  // when expert_parallel > 1 is not the world or does not split the experts
  // into shards of whole experts (expert_parallel_error).
  ModelLayout(const ModelConfig& config, int world, int64_t expert_parallel = 1);
  const Unit& embed() const { return units.front(); }
  const Unit& head() const { return units[size_t(1 + num_layers())]; }
  const Unit& layer(int i) const { return units[1 + i]; }
  int num_layers() const { return static_cast<int>(config.num_layers); }

  int64_t parameter_count() const;        // logical parameters (tied weights once)
  // Weights a token multiplies by, lm-head included (MFU's N): of the experts,
  // the num_experts_per_tok a token goes to.
  int64_t matmul_parameter_count() const;
  // Every parameter with its unit, in unit order (checkpoints, export, loading).
  struct Located { const Unit* unit; const ParamInfo* param; };
  std::vector<Located> all_params() const;
  const Located find(const std::string& name) const;  // unit == nullptr when absent
};

// Why `config` cannot run with model.expert_parallel = `expert_parallel` at
// `world` training ranks (a sentence naming the numbers); "" when it can.
// Each rank holds num_experts / P whole experts in a shard of its own, so P
// divides num_experts, is the world (experts are not replicated across groups
// of ranks), and a share of experts is a multiple of kShardAlign floats.
std::string expert_parallel_error(const ModelConfig& config, int world, int64_t expert_parallel);

// model.norm_dtype = "fp32": a unit's norm weights (ParamKind::Norm) as the GPU
// backend keeps them in fp32, packed in unit order, each starting on a multiple
// of kShardAlign floats: each one's place, and the floats a unit needs.
struct NormSlot {
  const ParamInfo* param;
  int64_t packed = 0;            // floats from the start of the unit's packed norms
};
std::vector<NormSlot> norm_slots(const Unit& u);
int64_t norm_slot_floats(const Unit& u);

// Pointers to one layer's weights inside a gathered unit buffer (nullptr where
// the architecture has no such parameter).
template <class T>
struct LayerWeights {
  T *input_norm, *wq, *wk, *wv, *bq, *bk, *bv, *wo, *q_norm, *k_norm;
  T *post_norm, *w_gate, *w_up, *w_down;
  // A layer of experts (w_gate, w_up, w_down nullptr): the router (E, C), the
  // experts' stacks (E, I, C), (E, I, C), (E, C, I), and the shared expert's
  // gate, up, down and gate weight (1, C) where there is one. Under expert
  // parallelism the routed experts are in a unit of their own (UnitKind::Experts,
  // expert after expert): layer_weights of that unit fills e_gate, e_up,
  // e_down with its first expert's, expert e + 1's 3 I C floats after expert e's.
  T *router, *e_gate, *e_up, *e_down, *s_gate, *s_up, *s_down, *s_weight;
};
// Floats from one expert's gate_proj to the next one's (also up_proj's,
// down_proj's) in `u`: I C stacked by kind in a layer unit, 3 I C expert after
// expert in an experts unit.
int64_t expert_stride(const Unit& u);
// Views of a layer's parameters (or of gradients laid out like them) inside a
// unit buffer of element type T. w_gate and w_up are adjacent, so w_gate is also
// the start of one (2 I, C) gate|up matrix.
template <class T>
LayerWeights<T> layer_weights(const Unit& u, T* base) {
  auto at = [&](const char* suffix) -> T* {
    const ParamInfo* p = u.find_param(suffix);
    return p ? base + p->offset : nullptr;
  };
  return {at("input_layernorm.weight"), at("q_proj.weight"), at("k_proj.weight"), at("v_proj.weight"),
          at("q_proj.bias"), at("k_proj.bias"), at("v_proj.bias"), at("o_proj.weight"),
          at("q_norm.weight"), at("k_norm.weight"), at("post_attention_layernorm.weight"),
          at("mlp.gate_proj.weight"), at("mlp.up_proj.weight"), at("mlp.down_proj.weight"),
          at("mlp.gate.weight"), at("experts.0.gate_proj.weight"), at("experts.0.up_proj.weight"),
          at("experts.0.down_proj.weight"), at("shared_expert.gate_proj.weight"), at("shared_expert.up_proj.weight"),
          at("shared_expert.down_proj.weight"), at("shared_expert_gate.weight")};
}

// The initial value of element `index` of parameter `p`: a pure function of
// (seed, name, index), so every rank fills its own slice and any world size
// builds the same model. Norm weights 1, biases 0, the rest N(0, std).
float init_value(uint64_t seed, const ParamInfo& p, int64_t index, double std);
// Fills out[0, count) with elements [begin, begin + count) of `p`.
void init_range(uint64_t seed, const ParamInfo& p, int64_t begin, int64_t count, double std, float* out);

}  // namespace shardlm
