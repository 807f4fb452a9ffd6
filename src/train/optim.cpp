// optim.cpp — AdamW, SGD and Muon (AdamW group here, matrices in muon.cpp) on shards, lr schedule, global grad norm.
#include "train/optim.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/adamw.hpp"
#include "cpu/ops.hpp"
#include "cuda/newton_schulz.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

double lr_at(const SchedSection& s, double peak, int64_t max_steps, int64_t step) {
  // The floor: sched.min_lr_ratio of this group's peak, else the absolute sched.min_lr.
  const double min_lr = s.min_lr_ratio > 0 ? s.min_lr_ratio * peak : s.min_lr;
  if (s.warmup > 0 && step < s.warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  if (s.name == "constant") return peak;
  const int64_t after = step - s.warmup;
  if (s.name == "linear") {
    const int64_t decay = s.decay > 0 ? s.decay : max_steps - s.warmup;
    const int64_t start = max_steps - decay;
    if (step < start || decay <= 0) return peak;
    const double frac = std::min(1.0, static_cast<double>(step - start + 1) / static_cast<double>(decay));
    return peak + (min_lr - peak) * frac;
  }
  // cosine from peak (first step after warmup) to min_lr (last step)
  const int64_t span = max_steps - s.warmup - 1;
  if (span <= 0) return peak;
  const double frac = std::min(1.0, static_cast<double>(after) / static_cast<double>(span));
  return min_lr + 0.5 * (peak - min_lr) * (1.0 + std::cos(M_PI * frac));
}

namespace {

// buf: the momentum buffer, or nullptr without momentum.
void sgd_update(float* p, const float* g, float* buf, int64_t n, float grad_scale, float wd, float lr, float mu) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i] * grad_scale + wd * p[i];
    if (buf) d = buf[i] = mu * buf[i] + d;
    p[i] -= lr * d;
  }
}

}  // namespace

int optimizer_states(const OptimSection& c) {
  if (c.name == "adamw" || c.name == "muon") return 2;
  return c.momentum > 0 ? 1 : 0;
}

int64_t optimizer_workspace_bytes(const OptimSection& c, const ModelLayout& layout) {
  if (c.name != "muon") return 0;
  return static_cast<int64_t>(sizeof(float)) * muon_workspace_numel(layout, layout.world);
}

NsWorkspaceBytes optimizer_gpu_workspace_bytes(const OptimSection& c, const ModelLayout& layout, bool cuda) {
  NsWorkspaceBytes most;
  if (c.name != "muon" || !cuda) return most;
  const std::vector<MuonMatrix> matrices = assign_muon_owners(layout, layout.world);
  for (int r = 0; r < layout.world; ++r) {
    const NsWorkspaceBytes b = cuda_newton_schulz_bytes(muon_ns_capacity(matrices, r));
    most.device = std::max(most.device, b.device);
    most.pinned_host = std::max(most.pinned_host, b.pinned_host);
  }
  return most;
}

Optimizer::Optimizer(const OptimSection& config, ShardedModel& model, Comm& comm) : config_(config), model_(&model) {
  init(&comm);
}

Optimizer::Optimizer(const OptimSection& config, ShardedModel& model) : config_(config), model_(&model) {
  if (config.name == "muon") {
    SHARDLM_CHECK(model.world == 1,
                  "Muon on %d ranks exchanges matrices between them: construct the Optimizer with the "
                  "trainers' Comm",
                  model.world);
    self_comm_ = make_self_comm();
  }
  init(self_comm_.get());
}

void Optimizer::init(Comm* comm) {
  SHARDLM_CHECK(config_.name == "adamw" || config_.name == "sgd" || config_.name == "muon",
                "optim.name = \"%s\" is not an optimizer (adamw, sgd or muon)", config_.name.c_str());
  for (const auto& u : model_->layout.units) segments_.push_back(model_->segments(u));
  state_.resize(optimizer_states(config_));
  for (auto& s : state_)
    for (size_t u = 0; u < model_->layout.units.size(); ++u) {
      s.emplace_back(Mem::OptimState, model_->layout.units[u].shard_numel);
      zero_shard_first_touch(s.back().data(), segments_[u], model_->layout.units[u].shard_numel);
    }
  if (config_.name == "muon") {
    SHARDLM_CHECK(comm != nullptr, "Muon needs a Comm");
    SHARDLM_CHECK(config_.ns_steps >= 0 && config_.ns_steps <= 100, "optim.ns_steps = %lld is out of range",
                  (long long)config_.ns_steps);
    muon_ = std::make_unique<MuonStep>(*model_, *comm, static_cast<int>(config_.ns_steps));
  }
}

std::string Optimizer::state_name(int i) const {
  if (config_.name == "sgd") return "momentum_buffer";
  return i == 0 ? "exp_avg" : "exp_avg_sq";
}

std::string Optimizer::state_name(int i, const Unit& unit, const ParamInfo& param) const {
  if (config_.name == "muon" && is_muon_param(unit, param)) return i == 0 ? "momentum_buffer" : "";
  return state_name(i);
}

void Optimizer::step(double lr, float grad_scale) {
  begin_step();
  for (size_t ui = 0; ui < model_->layout.units.size(); ++ui) step_unit(static_cast<int>(ui), lr, grad_scale);
  if (config_.name == "muon") muon_->step(lr, config_.weight_decay, config_.muon_momentum, grad_scale, state_[0]);
}

void Optimizer::step_unit(int ui, double lr, float grad_scale, uint16_t* param_bf16, const float* grad,
                          int64_t step) {
  const bool muon = config_.name == "muon";
  SHARDLM_CHECK(!muon || !param_bf16, "internal: Muon updates its matrices in a collective step, not per unit");
  // Muon's AdamW group follows the same schedule, scaled to its own peak lr.
  const double adamw_lr = muon && config_.adamw_lr > 0 ? lr * (config_.adamw_lr / config_.lr) : lr;
  const double adamw_wd = muon && config_.adamw_weight_decay >= 0 ? config_.adamw_weight_decay : config_.weight_decay;
  const cpu::AdamWConsts adamw =
      cpu::adamw_consts(adamw_lr, config_.beta1, config_.beta2, config_.eps, step > 0 ? step : step_);
  const Unit& unit = model_->layout.units[ui];
  float* p = model_->param[ui].data();
  const float* g = grad ? grad : model_->grad[ui].data();
  for (const auto& seg : segments_[ui]) {
    const int64_t o = seg.shard_offset, n = seg.count;
    uint16_t* bf16 = param_bf16 ? param_bf16 + o : nullptr;
    if (config_.name == "sgd") {
      const float wd = seg.param->weight_decay() ? static_cast<float>(config_.weight_decay) : 0.0f;
      float* buf = states() ? state_[0][ui].data() + o : nullptr;
      sgd_update(p + o, g + o, buf, n, grad_scale, wd, static_cast<float>(lr), static_cast<float>(config_.momentum));
      if (bf16) cpu::cast_f32_to_bf16(cpu::adamw_cpu_isa(), bf16, p + o, n);
    } else if (!muon || !is_muon_param(unit, *seg.param)) {  // adamw, or Muon's AdamW group
      const float wd = seg.param->weight_decay() ? static_cast<float>(adamw_wd) : 0.0f;
      cpu::adamw_step(p + o, bf16, g + o, state_[0][ui].data() + o, state_[1][ui].data() + o, n, grad_scale, wd,
                      adamw);
    }
  }
}

}  // namespace shardlm
