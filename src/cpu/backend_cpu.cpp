// backend_cpu.cpp — the CPU backend: fp32 everywhere, the reference the GPU is
// checked against. Holds the residual stream, every layer's saved activations
// (or one set with activation checkpointing) and the backward scratch; with
// model.fp8 its layers' projections are cpu::Fp8Linear's; with
// model.expert_parallel its layers of experts exchange rows (cpu::ExpertParallel).
#include <algorithm>
#include <cstring>
#include <string>
#include <memory>
#include <vector>

#include "shardlm/backend.hpp"
#include "cpu/expert_parallel.hpp"
#include "cpu/fp8_linear.hpp"
#include "cpu/layers.hpp"
#include "cpu/ops.hpp"
#include "cpu/ring_attention.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  bool host_resident() const override { return true; }
  int64_t param_bytes() const override { return 4; }
  void add_grad_to_host(float* host_grad, const void* src, int64_t n, DType type) override {
    accumulate(host_grad, src, n, type);
  }
  // fp32 everywhere: the CPU backend is the reference (model.reduce_dtype = "bf16"
  // is refused for it at validation).
  void accumulate(float* dst, const void* src, int64_t n, DType type) override {
    SHARDLM_CHECK(type == DType::F32, "internal: the CPU backend reduces gradients in fp32 only");
    cpu::accumulate(dst, static_cast<const float*>(src), n);
  }
  void cast_to_bf16(void*, const float*, int64_t) override {
    SHARDLM_FAIL("internal: the CPU backend reduces gradients in fp32 only");
  }
  void attach_shards(const ModelLayout& layout) override { shards_.assign(layout.units.size(), nullptr); }
  // The master shard is the parameter: keep a pointer, copy nothing.
  void set_param_shard(int unit, const float* master, int64_t) override { shards_[unit] = master; }
  const void* param_shard(int unit) const override { return shards_[unit]; }

  void* allocate(Mem category, size_t bytes) override { return mem_alloc(category, bytes); }
  void deallocate(Mem category, void* ptr, size_t bytes) override { mem_free(category, ptr, bytes); }
  void zero(void* ptr, size_t bytes) override { std::memset(ptr, 0, bytes); }

  // The plan sums the table prepare() allocates from (a planner's, never allocated).
  int64_t activation_bytes(const ModelConfig& c, const EngineOptions& o) const override {
    CpuBackend planner;
    return cpu::rows_bytes(planner.buffer_table(c, o), Mem::Activations);
  }
  int64_t workspace_bytes(const ModelConfig& c, const EngineOptions& o) const override {
    CpuBackend planner;
    return cpu::rows_bytes(planner.buffer_table(c, o), Mem::Workspace);
  }

  void prepare(const ModelConfig& c, const EngineOptions& o) override {
    config_ = c;
    options_ = o;
    inv_freq_ = cpu::rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling);
    cpu::allocate_rows(buffer_table(c, o));
  }

  void load_batch(const TokenBatch& b) override {
    SHARDLM_CHECK(b.N <= options_.max_tokens, "micro-batch of %lld tokens exceeds the planned %lld", (long long)b.N,
                  (long long)options_.max_tokens);
    SHARDLM_CHECK(!ring_ || b.token_index, "internal: a context-parallel micro-batch without token indices");
    SHARDLM_CHECK(options_.expert_parallel <= 1 || experts_,
                  "internal: model.expert_parallel = %lld without set_expert_parallel",
                  (long long)options_.expert_parallel);
    batch_ = b;
    inputs_ = {b.N, b.positions, b.seq_ids, inv_freq_.data(), b.token_index, ring_.get(), fp8_.get(), experts_.get()};
    if (config_.moe()) router_aux_.reset(config_.num_experts, b.router_aux_scale);
  }

  void set_context_parallel(Comm& group) override {
    SHARDLM_CHECK(options_.context_parallel == group.size(),
                  "internal: the CPU backend was planned for model.context_parallel = %lld, the group has %d ranks",
                  (long long)options_.context_parallel, group.size());
    ring_ = std::make_unique<cpu::RingAttention>(group, ring_scratch_);
  }

  void set_expert_parallel(Comm& group) override {
    SHARDLM_CHECK(options_.expert_parallel == group.size(),
                  "internal: the CPU backend was planned for model.expert_parallel = %lld, the group has %d ranks",
                  (long long)options_.expert_parallel, group.size());
    experts_ = std::make_unique<cpu::ExpertParallel>(group, config_, ep_scratch_);
  }

  void set_layer_experts(int l, const Unit& unit, const void* shard, float* grads) override {
    SHARDLM_CHECK(experts_ && unit.kind == UnitKind::Experts && unit.layer == l,
                  "internal: unit %s handed in as layer %d's own experts", unit.name.c_str(), l);
    SHARDLM_CHECK(expert_stride(unit) == experts_->expert_stride(), "internal: unit %s is not expert after expert",
                  unit.name.c_str());
    own_experts_ = layer_weights(unit, f32(shard));
    own_expert_grads_ = grads ? layer_weights(unit, grads) : cpu_no_weights<float>();
  }

  void embed_forward(const void* table) override {
    cpu::embedding_forward(residual_[0].data(), batch_.tokens, f32(table), batch_.N, config_.vocab_size,
                           config_.hidden_size);
  }

  void layer_forward(int l, const Unit& unit, const void* params) override {
    SavedAttention slot(*this, l);
    cpu::layer_forward(config_, with_own_experts(l, layer_weights(unit, f32(params)), own_experts_), inputs_,
                       residual_[l].data(), residual_[l + 1].data(), acts(l), /*run_attention=*/true, forced(l),
                       config_.route_width());
    if (config_.moe_layer(l)) router_aux_.add(acts(l), batch_.N, config_.num_experts, config_.num_experts_per_tok);
  }

  LossStats head_loss_backward(const void* norm_weight, const void* lm_head, float* norm_grad, float* lm_head_grad,
                               float grad_scale) override {
    const int L = static_cast<int>(config_.num_layers);
    cpu::RlInputs rl{batch_.rl_inputs(), options_.rl_params};
    if (options_.rl)
      SHARDLM_CHECK(batch_.advantages && batch_.inference_logprobs && batch_.temperatures,
                    "internal: an RL micro-batch without advantages, logprobs or temperatures");
    LossStats stats = cpu::head_loss_backward(config_, f32(norm_weight), f32(lm_head), norm_grad, lm_head_grad,
                                              residual_[L].data(), batch_.targets, batch_.weights, grad_scale, batch_.N,
                                              d_x_.data(), head_, options_.rl ? &rl : nullptr);
    if (config_.moe() && router_aux_.scale != 0) {
      stats.router_aux_sum = router_aux_.loss();
      stats.router_aux_batches = 1;
    }
    return stats;
  }

  void layer_backward(int l, const Unit& unit, const void* params, float* grads) override {
    const auto weights = with_own_experts(l, layer_weights(unit, f32(params)), own_experts_);
    SavedAttention slot(*this, l);
    if (options_.checkpoint_activations)  // recompute this layer's saved tensors (but a saved attention)
      cpu::layer_forward(config_, weights, inputs_, residual_[l].data(), recompute_out_.data(), acts(l),
                         /*run_attention=*/!keeps_attention(l), forced(l), config_.route_width());
    cpu::layer_backward(config_, weights, with_own_experts(l, layer_weights(unit, grads), own_expert_grads_), inputs_,
                        residual_[l].data(), acts(l), d_x_.data(), scratch_,
                        config_.moe_layer(l) ? &router_aux_ : nullptr);
  }

  void embed_backward(float* table_grad) override {
    cpu::embedding_backward(table_grad, d_x_.data(), batch_.tokens, batch_.N, config_.vocab_size,
                            config_.hidden_size);
  }

  LossStats head_loss(const void* norm_weight, const void* lm_head) override {
    const int L = static_cast<int>(config_.num_layers);
    SHARDLM_CHECK(batch_.targets && batch_.weights, "internal: a forward-only loss without targets or weights");
    return cpu::head_loss(config_, f32(norm_weight), f32(lm_head), residual_[L].data(), batch_.targets, batch_.weights,
                          batch_.N, head_);
  }

  void head_token_logprobs(const void* norm_weight, const void* lm_head, float* logprobs) override {
    const int L = static_cast<int>(config_.num_layers);
    SHARDLM_CHECK(batch_.targets && batch_.temperatures, "internal: token logprobs without targets or temperatures");
    cpu::head_token_logprobs(config_, f32(norm_weight), f32(lm_head), residual_[L].data(), batch_.targets,
                             batch_.temperatures, batch_.N, logprobs, head_);
  }

  void head_logits(const void* norm_weight, const void* lm_head, float* logits) override {
    const int L = static_cast<int>(config_.num_layers);
    cpu::head_logits(config_, f32(norm_weight), f32(lm_head), residual_[L].data(), batch_.N, logits, head_);
  }

 private:
  static const float* f32(const void* p) { return static_cast<const float*>(p); }
  template <class T>
  static LayerWeights<T> cpu_no_weights() {
    LayerWeights<T> none{};
    return none;
  }
  // Expert parallelism: a layer of experts' unit holds no routed experts; they
  // are this rank's own, from set_layer_experts.
  template <class T>
  LayerWeights<T> with_own_experts(int l, LayerWeights<T> w, const LayerWeights<T>& own) const {
    if (!experts_ || !config_.moe_layer(l)) return w;
    SHARDLM_CHECK(own.e_gate, "internal: layer %d of experts without its own experts", l);
    w.e_gate = own.e_gate, w.e_up = own.e_up, w.e_down = own.e_down;
    return w;
  }
  // Every buffer of this backend, one row each: where it goes, its fp32 element
  // count, its plan row. Sizes the vectors of buffers so the rows can point into them.
  std::vector<cpu::BufferRow> buffer_table(const ModelConfig& c, const EngineOptions& o) {
    const int64_t N = o.max_tokens, C = c.hidden_size, L = c.num_layers;
    const int64_t kept = o.attention_layers_kept(L);
    const Mem act = Mem::Activations;
    std::vector<cpu::BufferRow> rows;
    residual_.clear();
    residual_.resize(size_t(L + 1));
    for (auto& x : residual_) rows.push_back({"residual", &x, N * C, act});
    acts_.clear();
    acts_.resize(size_t(o.checkpoint_activations ? 1 : L));
    for (auto& a : acts_) a.add_rows(c, N, rows, o.expert_parallel);
    if (o.checkpoint_activations) rows.push_back({"recompute_out", &recompute_out_, N * C, act});
    saved_att_.clear();
    saved_lse_.clear();
    saved_att_.resize(size_t(kept));
    saved_lse_.resize(size_t(kept));
    for (int64_t l = 0; l < kept; ++l) {
      rows.push_back({"saved_att", &saved_att_[size_t(l)], N * c.num_heads * c.head_dim, act});
      rows.push_back({"saved_lse", &saved_lse_[size_t(l)], N * c.num_heads, act});
    }
    rows.push_back({"d_x", &d_x_, N * C, Mem::Workspace});
    scratch_.add_rows(c, N, rows, o.expert_parallel);
    if (o.expert_parallel > 1) ep_scratch_.add_rows(c, N, o.expert_parallel, rows);
    head_.add_rows(c, N, o.chunk_tokens, rows);
    if (o.context_parallel > 1) ring_scratch_.add_rows(c, N, rows);
    fp8_.reset();
    if (o.fp8 != Fp8Mode::None) {
      fp8_ = std::make_unique<cpu::Fp8Linear>(o.fp8);
      fp8_->add_rows(c, N, rows);
    }
    return rows;
  }
  // Selective checkpointing: layer l's own attention output and logsumexp are
  // swapped into the one shared LayerActs for as long as the layer runs.
  struct SavedAttention {
    CpuBackend& b;
    int l;
    SavedAttention(CpuBackend& backend, int layer) : b(backend), l(layer) { swap(); }
    ~SavedAttention() { swap(); }
    void swap() {
      if (!b.keeps_attention(l)) return;
      std::swap(b.acts_[0].att, b.saved_att_[size_t(l)]);
      std::swap(b.acts_[0].lse, b.saved_lse_[size_t(l)]);
    }
  };
  bool keeps_attention(int l) const { return l < int(saved_att_.size()); }
  // Router replay: layer l's K columns of the batch's routes (nullptr: a dense
  // layer, or no routes: the layer's own top-k).
  const int32_t* forced(int l) const {
    return batch_.routes && config_.moe_layer(l) ? batch_.routes + config_.route_offset(l) : nullptr;
  }
  cpu::LayerActs& acts(int l) { return acts_[options_.checkpoint_activations ? 0 : l]; }

  std::vector<const float*> shards_;    // per unit: the master shard
  ModelConfig config_;
  EngineOptions options_;
  std::vector<double> inv_freq_;
  TokenBatch batch_;
  cpu::TokenInputs inputs_;
  std::vector<Buffer<float>> residual_;  // (L + 1) x (N, C): x_0 = embeddings .. x_L
  std::vector<cpu::LayerActs> acts_;     // L sets, or 1 with activation checkpointing
  cpu::RouterAux router_aux_;            // the micro-batch's load-balancing loss (a model of experts)
  Buffer<float> recompute_out_;          // (N, C) with activation checkpointing
  std::vector<Buffer<float>> saved_att_, saved_lse_;  // selective: K x (N, H, D) and K x (N, H), layers [0, K)
  Buffer<float> d_x_;                    // (N, C) gradient flowing down the residual stream
  cpu::LayerGradScratch scratch_;
  cpu::HeadScratch head_;
  cpu::RingScratch ring_scratch_;             // context parallelism: the ring's blocks
  std::unique_ptr<cpu::RingAttention> ring_;  // set by set_context_parallel
  std::unique_ptr<cpu::Fp8Linear> fp8_;       // model.fp8: the layers' projections (nullptr: fp32 GEMMs)
  cpu::ExpertScratch ep_scratch_;                  // expert parallelism: the rows on their way
  std::unique_ptr<cpu::ExpertParallel> experts_;   // set by set_expert_parallel
  // The layer's own experts (and their gradients in a backward), set_layer_experts's.
  LayerWeights<const float> own_experts_{};
  LayerWeights<float> own_expert_grads_{};
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace shardlm
