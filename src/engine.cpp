// engine.cpp — the sharded unit loop: gather, compute, release, reduce-scatter.
#include "shardlm/engine.hpp"

#include <algorithm>
#include <cstring>

#include "shardlm/cpu_ops.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

int64_t max_padded(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units) n = std::max(n, u.padded_numel);
  return n;
}
int64_t max_shard(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units) n = std::max(n, u.shard_numel);
  return n;
}

// Gathered parameter slots: current + prefetch, plus the embedding that a tied
// head re-gathers; every unit when nothing is resharded after forward.
int param_slot_count(const ModelLayout& layout, bool reshard) {
  return reshard ? 3 : static_cast<int>(layout.units.size());
}
// Gradient slots: one being computed, one being reduced, plus the embedding's
// when the tied head writes into it long before the embedding's own backward.
int grad_slot_count() { return 3; }

}  // namespace

MemoryPlan plan_memory(const ModelConfig& config, int world, const EngineOptions& o, int optim_states) {
  const ModelLayout layout(config, world);
  MemoryPlan plan;
  for (const auto& u : layout.units) plan.param_shards += 4 * u.shard_numel;
  plan.grad_shards = plan.param_shards;
  plan.optim_state = plan.param_shards * optim_states;
  const int64_t N = o.max_tokens, L = config.num_layers, C = config.hidden_size;
  if (world > 1)
    plan.gathered = 4 * (param_slot_count(layout, o.reshard_after_forward) * max_padded(layout) +
                         grad_slot_count() * (max_padded(layout) + max_shard(layout)));
  plan.activations = 4 * (L + 1) * N * C + (o.checkpoint_activations ? 1 : L) * cpu::LayerActs::bytes(config, N) +
                     (o.checkpoint_activations ? 4 * N * C : 0);
  plan.workspace = 4 * N * C + cpu::LayerGradScratch::bytes(config, N) + cpu::HeadScratch::bytes(config, N, o.chunk_tokens);
  return plan;
}

std::string format_memory_plan(const MemoryPlan& p, int world) {
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  std::string out = fmt("memory plan per rank (world %d), host (CPU backend; GPU: none)\n", world);
  const std::pair<const char*, int64_t> rows[] = {
      {"parameter shards", p.param_shards}, {"gradient shards", p.grad_shards}, {"optimizer state", p.optim_state},
      {"gathered units", p.gathered},       {"activations", p.activations},    {"workspace", p.workspace}};
  for (const auto& [name, bytes] : rows) out += fmt("  %-18s %12.3f MiB\n", name, mib(bytes));
  out += fmt("  %-18s %12.3f MiB\n", "total", mib(p.total()));
  return out;
}

Engine::Engine(ShardedModel& model, Comm& comm, const EngineOptions& options)
    : model_(model), comm_(comm), options_(options), config_(model.layout.config), sharded_(comm.size() > 1) {
  SHARDLM_CHECK(comm.size() == model.world, "the communicator has %d ranks but the model is sharded %d ways",
                comm.size(), model.world);
  const ModelLayout& layout = model.layout;
  const int64_t N = options.max_tokens, C = config_.hidden_size, L = config_.num_layers;
  inv_freq_ = cpu::rope_inv_freq(config_.head_dim, config_.rope_theta, config_.rope_scaling);
  if (sharded_) {
    param_slots_.resize(param_slot_count(layout, options.reshard_after_forward));
    for (auto& s : param_slots_) s.full = Buffer<float>(Mem::Gathered, max_padded(layout));
    grad_slots_.resize(grad_slot_count());
    for (auto& s : grad_slots_) {
      s.full = Buffer<float>(Mem::Gathered, max_padded(layout));
      s.recv = Buffer<float>(Mem::Gathered, max_shard(layout));
    }
  }
  for (int64_t l = 0; l <= L; ++l) residual_.emplace_back(Mem::Activations, N * C);
  const int64_t sets = options.checkpoint_activations ? 1 : L;
  for (int64_t l = 0; l < sets; ++l) acts_.emplace_back(config_, N);
  if (options.checkpoint_activations) recompute_out_ = Buffer<float>(Mem::Activations, N * C);
  d_x_ = Buffer<float>(Mem::Workspace, N * C);
  scratch_ = cpu::LayerGradScratch(config_, N);
  head_ = cpu::HeadScratch(config_, N, options.chunk_tokens);
}

// ---------------------------------------------------------------- gathering

void Engine::prefetch(int unit) {
  if (!sharded_) return;
  for (auto& s : param_slots_)
    if (s.unit == unit) return;
  for (auto& s : param_slots_) {
    if (s.unit != -1) continue;
    s.unit = unit;
    s.request = comm_.all_gather(model_.param[unit].data(), s.full.data(), model_.layout.units[unit].shard_numel);
    return;
  }
  // No free slot: the unit is gathered when it is needed instead.
}

const float* Engine::params(int unit) {
  if (!sharded_) return model_.param[unit].data();  // one rank: the shard is the whole unit
  prefetch(unit);
  for (auto& s : param_slots_)
    if (s.unit == unit) {
      s.request.wait();
      return s.full.data();
    }
  SHARDLM_FAIL("internal: no gather slot free for unit %s", model_.layout.units[unit].name.c_str());
}

void Engine::release(int unit) {
  for (auto& s : param_slots_)
    if (s.unit == unit) {
      s.request.wait();
      s.unit = -1;
    }
}

// ---------------------------------------------------------------- gradients

float* Engine::grads(int unit) {
  if (!sharded_) return model_.grad[unit].data();  // accumulate straight into the shard
  for (auto& s : grad_slots_)
    if (s.unit == unit) return s.full.data();
  // Take the oldest slot in turn; a slot still reducing is finished first.
  for (size_t tries = 0; tries < grad_slots_.size(); ++tries) {
    GradSlot& s = grad_slots_[next_grad_slot_];
    next_grad_slot_ = (next_grad_slot_ + 1) % static_cast<int>(grad_slots_.size());
    if (s.unit != -1 && !s.request.pending()) continue;  // held (tied embedding), not reducing
    if (s.unit != -1) finish_grad(s);
    s.unit = unit;
    std::memset(s.full.data(), 0, sizeof(float) * model_.layout.units[unit].padded_numel);
    return s.full.data();
  }
  SHARDLM_FAIL("internal: no gradient slot free for unit %s", model_.layout.units[unit].name.c_str());
}

void Engine::reduce_grads(int unit) {
  if (!sharded_) return;
  for (auto& s : grad_slots_)
    if (s.unit == unit) {
      s.request = comm_.reduce_scatter(s.full.data(), s.recv.data(), model_.layout.units[unit].shard_numel);
      return;
    }
}

void Engine::finish_grad(GradSlot& s) {
  s.request.wait();
  cpu::accumulate(model_.grad[s.unit].data(), s.recv.data(), model_.layout.units[s.unit].shard_numel);
  s.unit = -1;
}

void Engine::finish_all_grads() {
  if (!sharded_) return;
  // In unit order, so the accumulation into each shard is the same every run.
  for (auto& s : grad_slots_)
    if (s.unit != -1) finish_grad(s);
}

// ---------------------------------------------------------------- forward / backward

void Engine::set_inputs(const TokenBatch& b) {
  SHARDLM_CHECK(b.N <= options_.max_tokens, "micro-batch of %lld tokens exceeds the planned %lld", (long long)b.N,
                (long long)options_.max_tokens);
  inputs_.N = b.N;
  inputs_.positions = b.positions;
  inputs_.seq_ids = b.seq_ids;
  inputs_.inv_freq = inv_freq_.data();
}

void Engine::embed_forward(const TokenBatch& b) {
  prefetch(1);  // the first layer's gather overlaps the embedding lookup
  cpu::embedding_forward(residual_[0].data(), b.tokens, params(0), b.N, config_.vocab_size, config_.hidden_size);
  if (options_.reshard_after_forward) release(0);
}

const float* Engine::lm_head_weights() {
  const int head = static_cast<int>(model_.layout.units.size()) - 1;
  if (config_.tie_word_embeddings) return params(0);
  return params(head) + model_.layout.head().param("lm_head.weight").offset;
}

double Engine::forward_backward(const TokenBatch& b, float grad_scale) {
  set_inputs(b);
  const ModelLayout& layout = model_.layout;
  const int L = layout.num_layers(), head = L + 1;
  const int64_t N = b.N;
  auto layer_acts = [&](int l) -> cpu::LayerActs& { return acts_[options_.checkpoint_activations ? 0 : l]; };

  // forward: for u in units: gather(u) [prefetch u+1]; compute; release(u)
  embed_forward(b);
  for (int l = 0; l < L; ++l) {
    const int unit = 1 + l;
    const float* w = params(unit);
    prefetch(unit + 1);
    cpu::layer_forward(config_, layer_weights(layout.units[unit], w), inputs_, residual_[l].data(),
                       residual_[l + 1].data(), layer_acts(l));
    if (options_.reshard_after_forward) release(unit);
  }

  // loss: chunked lm-head + CE, whose backward gives d_x at the last layer's output
  const Unit& hu = layout.head();
  const float* hw = params(head);
  const float* lm_w = lm_head_weights();
  float* hg = grads(head);
  float* lm_g = config_.tie_word_embeddings ? grads(0) : hg + hu.param("lm_head.weight").offset;
  const int64_t norm_off = hu.param("model.norm.weight").offset;
  const double loss = cpu::head_loss_backward(config_, hw + norm_off, lm_w, hg + norm_off, lm_g, residual_[L].data(),
                                              b.targets, b.weights, grad_scale, N, d_x_.data(), head_);
  reduce_grads(head);
  release(head);
  if (config_.tie_word_embeddings && options_.reshard_after_forward) release(0);

  // backward: for u reversed: gather(u); grads; reduce_scatter -> grad shard; release(u)
  for (int l = L - 1; l >= 0; --l) {
    const int unit = 1 + l;
    const float* w = params(unit);
    prefetch(l > 0 ? unit - 1 : 0);
    const auto weights = layer_weights(layout.units[unit], w);
    if (options_.checkpoint_activations)
      cpu::layer_forward(config_, weights, inputs_, residual_[l].data(), recompute_out_.data(), layer_acts(l));
    cpu::layer_backward(config_, weights, layer_weights(layout.units[unit], grads(unit)), inputs_,
                        residual_[l].data(), layer_acts(l), d_x_.data(), scratch_);
    reduce_grads(unit);
    release(unit);
  }
  cpu::embedding_backward(grads(0), d_x_.data(), b.tokens, N, config_.vocab_size, config_.hidden_size);
  reduce_grads(0);
  release(0);
  finish_all_grads();
  return loss;
}

void Engine::forward_logits(const TokenBatch& b, float* logits) {
  set_inputs(b);
  const ModelLayout& layout = model_.layout;
  const int L = layout.num_layers(), head = L + 1;
  embed_forward(b);
  for (int l = 0; l < L; ++l) {
    const int unit = 1 + l;
    const float* w = params(unit);
    prefetch(unit + 1);
    cpu::layer_forward(config_, layer_weights(layout.units[unit], w), inputs_, residual_[l].data(),
                       residual_[l + 1].data(), acts_[options_.checkpoint_activations ? 0 : l]);
    release(unit);
  }
  const float* hw = params(head);
  const float* lm_w = lm_head_weights();
  cpu::head_logits(config_, hw + layout.head().param("model.norm.weight").offset, lm_w, residual_[L].data(), b.N,
                   logits, head_);
  release(head);
  release(0);
}

}  // namespace shardlm
